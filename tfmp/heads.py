"""float32-output classification heads, and an audit that finds low-precision outputs."""

import keras

_LOW = ("float16", "bfloat16")
_SQUASHERS = ("softmax", "sigmoid")


@keras.saving.register_keras_serializable(package="tfmp")
class ClassificationHead(keras.layers.Layer):
    """Logits in the policy's compute dtype, probabilities in float32.

    The Dense layer runs in the global policy (float16/bfloat16 matmul under mixed
    precision); the softmax is an explicit float32 exception, because its exp and sum
    lose the small probabilities in 16 bits and the loss then sees zeros.

    Args:
        num_classes: number of output classes (>= 2).
        **kwargs: standard layer arguments (`name`, `dtype`).

    Example:
        >>> probs = ClassificationHead(10, name="head")(features)  # float32
    """

    def __init__(self, num_classes, **kwargs):
        super().__init__(**kwargs)
        if num_classes < 2:
            raise ValueError(f"num_classes must be >= 2, got {num_classes}")
        self.num_classes = num_classes
        self.logits = keras.layers.Dense(num_classes, dtype=self.dtype_policy, name="logits")
        self.softmax = keras.layers.Activation("softmax", dtype="float32", name="softmax")

    def build(self, input_shape):
        self.logits.build(input_shape)

    def call(self, inputs):
        return self.softmax(self.logits(inputs))

    def get_config(self):
        return {**super().get_config(), "num_classes": self.num_classes}


def classification_head(num_classes, name="head"):
    """Returns a `ClassificationHead`: policy-dtype logits, float32 softmax output."""
    return ClassificationHead(num_classes, name=name)


def _squashes_in_low_precision(layer):
    """The name of a softmax/sigmoid computed in 16 bits at `layer`'s output, or None."""
    if isinstance(layer, ClassificationHead):
        return _squashes_in_low_precision(layer.softmax)
    activation = getattr(layer, "activation", None)
    name = getattr(activation, "__name__", "")
    if isinstance(layer, keras.layers.Softmax):
        name = "softmax"
    if name in _SQUASHERS and layer.compute_dtype in _LOW:
        return f"{layer.name} computes {name} in {layer.compute_dtype}"
    if isinstance(layer, keras.Sequential) and layer.layers:
        return _squashes_in_low_precision(layer.layers[-1])
    return None


def audit(model):
    """Names every model output that is not float32, and every 16-bit softmax/sigmoid at one.

    Args:
        model: a built functional or Sequential Keras model.

    Returns:
        A list of human-readable problems; empty when every output is float32 and no
        output is squashed in float16/bfloat16.
    """
    problems = []
    for i, output in enumerate(model.outputs):
        layer = output._keras_history.operation
        if output.dtype != "float32":
            problems.append(f"output {i} ({layer.name}) is {output.dtype}, not float32")
        squash = _squashes_in_low_precision(layer)
        if squash:
            problems.append(f"output {i}: {squash}")
    return problems
