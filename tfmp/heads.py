"""float32-output classification heads, and an audit that finds low-precision outputs."""

import keras
from absl import logging

from tfmp import keras_compat
from tfmp.errors import UsageError, column_width, is_count, some_of

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
        if not is_count(num_classes, 2):
            raise UsageError(f"num_classes must be an integer >= 2, got {num_classes!r}")
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


class Audit(list):
    """The problems `audit` found (a list of strings: empty when there are none), and
    `layers`: every layer's path, class, compute dtype and variable dtype."""

    def __init__(self, problems, layers, outputs_checked):
        super().__init__(problems)
        self.layers = layers
        self.outputs_checked = outputs_checked

    def table(self):
        """Each layer and the dtype it computes in, then the problems."""
        width = column_width([r["path"] for r in self.layers], 32)
        lines = [f"{'layer':{width}s} {'class':22s} {'compute':9s} {'variables':9s} matmul"]
        lines += [
            f"{r['path']:{width}s} {r['class'][:22]:22s} {r['compute_dtype']:9s} {r['variable_dtype']:9s} "
            f"{'float8' if r['float8'] else '-'}"
            for r in self.layers
        ]
        if not self.outputs_checked:
            lines.append("outputs not checked: the model has no functional graph (subclassed, or not built yet)")
        lines += [f"problem: {p}" for p in self] or (
            ["no problems: every output is float32"] if self.outputs_checked else []
        )
        return "\n".join(lines)


def made_before_policy(model):
    """Why `model` would not train in the global policy, or None: no layer of it with weights follows the policy
    (computes in its dtype and stores its weights in its dtype, or in float16: `float16_weights`), as layers made
    before the policy was set do (a layer takes the policy in force when made). None under float32, the default,
    where a model made or loaded in another precision trains in its own."""
    policy = keras.config.dtype_policy()
    weighted = [layer for layer in keras_compat.sublayers(model) if layer.weights]
    follows = [
        layer.compute_dtype == policy.compute_dtype and layer.variable_dtype in (policy.variable_dtype, "float16")
        for layer in weighted
    ]
    if policy.name == "float32" or not weighted or any(follows):
        return None
    # float32 layers are the rule's exceptions (a head, `keep_float32`): said only where every layer is one.
    kinds = sorted({(layer.compute_dtype, layer.variable_dtype) for layer in weighted if layer.compute_dtype in _LOW})
    plain = policy.variable_dtype == "float32"  # Else the weights' dtype is what differs, said for each.
    does = " or ".join(
        f"computes in {c}" + ("" if v == "float32" and plain else f" with {v} weights") for c, v in kinds
    )
    return (
        f"the policy is {policy.name}, but every {'16-bit ' if kinds else ''}layer of {model.name} "
        f"{does or 'computes in float32'}: a layer takes the policy "
        "in force when it is made, and these were made before it; set the policy first (tfmp.configure_precision) "
        "and build the model after it (a model loaded from a file keeps the dtypes it was saved with)"
    )


def float16_weights(model):
    """Why `model`'s float16 trainable weights would train badly, or None where it has none: the optimizer
    updates them in float16 (Keras' own does, as tfmp's: only bfloat16 weights get compensated updates)."""
    held = [v.path for v in model.trainable_variables if keras.backend.standardize_dtype(v.dtype) == "float16"]
    if not held:
        return None
    return (
        f"{len(held)} trainable weight{'s' if len(held) > 1 else ''} of {model.name} stored in float16 "
        f"({some_of(held, 3)}): "
        "the optimizer updates them in float16, where a change smaller than half a float16 step of its weight "
        "(2^-12 of it) rounds away and Adam's second moment flushes to zero for gradients under 2.4e-4; give "
        "their layers dtype='mixed_float16' (float32 weights, float16 compute; for every layer, the "
        "mixed_float16 policy: tfmp.configure_precision('mixed_float16'))"
    )


def warn_before_training(model):
    """Logs `made_before_policy`'s and `float16_weights`' warnings, if any."""
    for why in (made_before_policy(model), float16_weights(model)):
        if why:
            logging.warning("%s", why)


def audit(model):
    """Each layer's compute dtype, and every model output that is not float32 or that is
    squashed (softmax/sigmoid) in 16 bits.

    Args:
        model: a built Keras model (outputs are checked where it has a functional graph:
            functional and Sequential models).

    Returns:
        An `Audit`: a list of human-readable problems, empty when every output is float32
        and none is squashed in float16/bfloat16; its `layers` and `table()` show each
        layer's compute dtype (after `tfmp.keep_float32(model, ...)` too).
    """
    if not isinstance(model, keras.layers.Layer):
        raise UsageError(f"audit takes a Keras model (or layer), got {type(model).__name__}")
    layers = [
        {
            "path": layer.path or layer.name,
            "class": type(layer).__name__,
            "compute_dtype": layer.compute_dtype,
            "variable_dtype": layer.variable_dtype,
            "float8": layer.quantization_mode == "float8",  # Its matmul runs in float8 (tfmp.float8).
        }
        for layer in keras_compat.sublayers(model)
    ]
    problems = [why for why in (made_before_policy(model), float16_weights(model)) if why]
    outputs = getattr(model, "outputs", None) or []  # A subclassed model has no graph to read them from.
    for i, output in enumerate(outputs):
        layer = keras_compat.producer(output)
        # A layer made float32 after the graph was built outputs float32, whatever the graph says.
        dtype = "float32" if getattr(layer, "compute_dtype", None) == "float32" else output.dtype
        fix = f"keep it float32: tfmp.keep_float32(model, {layer.name!r}) (train.py: --keep_float32={layer.name})"
        if dtype != "float32":
            problems.append(f"output {i} ({layer.name}) is {dtype}, not float32; {fix}")
        squash = _squashes_in_low_precision(layer)
        if squash:
            problems.append(f"output {i}: {squash}; {fix}")
    return Audit(problems, layers, outputs_checked=bool(outputs))
