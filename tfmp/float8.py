"""float8 training on Keras' own float8 layers, correct under tf.distribute.

`tfmp.configure_precision("float8")` computes in bfloat16 and runs the matmuls of the
model's Dense and EinsumDense layers in float8 (Keras' `quantize("float8")`: E4M3 for
inputs and kernels, E5M2 for the output gradients, delayed scaling from an amax history).
tfmp.fit quantizes the model when it first trains it; `quantize(model)` does it by hand,
and tfmp.fit keeps that choice (an `exclude` that leaves no layer in float8 too).

Keras keeps each float8 layer's scales and amax histories in variables that the optimizer
overwrites with their "gradients" (`overwrite_with_gradient`). Under a strategy Keras takes
replica 0's new values, so the other replicas' activations and gradients are scaled by a
history that never saw them. tfmp's steps take the maximum over replicas (and over the
micro-batches of an accumulated update) instead: after every update the state is the same
on every replica and equal to that of one replica that saw the whole global batch. It is
no gradient: it is neither clipped nor counted in the gradient norm, and a skipped update
leaves it untouched.
"""

import re
import weakref

import keras
import numpy as np
from absl import logging

from tfmp import heads, keras_compat, precision
from tfmp.errors import UsageError, some_of

POLICY = "float8"
E4M3_MAX = 448.0  # float8_e4m3fn: inputs and kernels.
E5M2_MAX = 57344.0  # float8_e5m2: output gradients.
E4M3_SMALLEST = 2.0**-9  # Its smallest subnormal: anything smaller (after scaling) flushes to zero.
E5M2_SMALLEST = 2.0**-16
_QUANTIZABLE = (keras.layers.Dense, keras.layers.EinsumDense)


def is_state(variable):
    """Whether `variable` is float8 state (a scale or an amax history), not a weight."""
    return bool(getattr(variable, "overwrite_with_gradient", False))


_decided = weakref.WeakSet()  # The models `quantize` ran on: their float8 layers are decided.


def decided(model):
    """Whether `model`'s float8 layers are decided, which tfmp.fit then leaves be: `quantize` ran on it (with an
    `exclude` that left none, too), or some of its layers run in float8 (a loaded model's)."""
    return model in _decided or bool(quantized_layers(model))


def quantized_layers(model):
    """The layers of `model` whose matmuls run in float8."""
    return [layer for layer in keras_compat.sublayers(model) if getattr(layer, "quantization_mode", None) == "float8"]


def warn_frozen(model):
    """One warning naming `model`'s float8 layers that are frozen (their scales no longer move), if any; one if no
    float8 layer is called in training (`model`'s call takes no `training`): their inputs' and kernels' scales never
    move either."""
    layers = quantized_layers(model)
    frozen = [layer.path or layer.name for layer in layers if not layer.trainable]
    if frozen:
        logging.warning(
            "float8 layers %s are frozen (trainable=False), and a float8 layer's scales move only as it trains: "
            "theirs stay as they are (at 1.0 where never trained, and inputs beyond E4M3's 448 saturate); freeze "
            "a layer before its model is quantized (float8 leaves frozen layers in 16 bits), or exclude it "
            "(float8_exclude; train.py: --float8_exclude)",
            some_of(frozen),
        )
    if layers and not keras_compat.takes_training(model):
        logging.warning(
            "%s's call takes no `training` argument, so it is trained as Keras' train step calls it, without one: "
            "its float8 layers never record their inputs' and kernels' amax, and those scales stay at 1.0 (inputs "
            "beyond E4M3's 448 saturate; its Dropout and BatchNormalization layers, if any, run as in inference); "
            "give its call a `training=None` argument (Keras hands it on to every layer inside)",
            model.name,
        )


def _heads(model):
    """Layers that make a model output (through weightless layers such as a softmax), and
    those inside a `tfmp.ClassificationHead`."""
    found = {id(layer) for layer in keras_compat.output_layers(model)}
    for layer in keras_compat.sublayers(model):
        if isinstance(layer, heads.ClassificationHead):
            found.update(id(sub) for sub in keras_compat.sublayers(layer))
    return found


def candidates(model, exclude=()):
    """The layers `quantize` would run in float8: every Dense and EinsumDense (their exact
    classes, as Keras quantizes) computing in 16 bits, except heads (the layers making the
    model's outputs, and those in a `tfmp.ClassificationHead`), frozen layers (Keras updates
    float8 scales as gradients: a frozen layer's stay at 1, and its inputs beyond E4M3's 448
    saturate), layers with LoRA enabled (Keras' float8 call has none) and those matching
    `exclude`."""
    patterns = [exclude] if isinstance(exclude, str) else list(exclude)
    skip = _heads(model)
    chosen = []
    for layer in keras_compat.sublayers(model):
        if type(layer) not in _QUANTIZABLE or getattr(layer, "quantization_mode", None):
            continue
        name = layer.path or layer.name
        if layer.compute_dtype == "float32" or id(layer) in skip:
            continue
        if not layer.trainable or getattr(layer, "lora_enabled", False):  # Frozen, or LoRA: see above.
            continue
        if any(re.fullmatch(p, name) or re.fullmatch(p, layer.name) for p in patterns):
            continue
        chosen.append(layer)
    return chosen


def quantize(model, exclude=(), *, named="float8 exclude"):
    """Runs the matmuls of `model`'s eligible layers (`candidates`) in float8, in place.

    Args:
        model: a built Keras model whose optimizer is not built yet (it must be built
            with the float8 state variables).
        exclude: layer names or full-match regular expressions to leave in 16 bits.
        named: what a message calls `exclude` (train.py: its flag).

    Returns:
        The paths of the layers now running in float8.

    Raises:
        UsageError: `model` is not a built Keras model, or its optimizer has already trained it.
    """
    if not isinstance(model, keras.Model):
        raise UsageError(f"float8.quantize takes a keras.Model, got {type(model).__name__}")
    if not model.built:
        raise UsageError(f"float8: build {model.name} first (call it on a batch) so that its layers can be quantized")
    # A typo would leave its layer in float8.
    precision.require_matches(model, [exclude] if isinstance(exclude, str) else exclude, named)
    chosen = candidates(model, exclude)
    optimizer = getattr(model, "optimizer", None)
    if chosen and optimizer is not None and optimizer.built:
        raise UsageError(
            f"float8: the optimizer of {model.name} was built for its variables before float8 added its own; "
            "quantize the model before it first trains (tfmp.fit does so when the policy is float8), or compile "
            "it again with a new optimizer"
        )
    if chosen:
        with model.distribute_strategy.scope():  # Mirrored state for a mirrored model.
            keras_compat.quantize(model, chosen, "float8")
        _reloadable(model)
    _decided.add(model)
    return [layer.path or layer.name for layer in chosen]


def _reloadable(model):
    """Keras saves each layer's own dtype policy, not those of the sublayers a layer makes in its `build`
    (MultiHeadAttention's query, key, value and output projections): reloaded, they were built in 16 bits, without
    the float8 variables saved for them, and `keras.models.load_model` failed ("expected 2 variables, but received
    0", Keras 3.15). Each such parent gets a `DTypePolicyMap` from those sublayers' paths to their policies, which
    Keras saves with it and its `build` hands down. (A model's layers are saved each with its own.)"""
    for layer in keras_compat.sublayers(model):
        if isinstance(layer, keras.Model) or not quantized_layers(layer):
            continue
        own = keras_compat.own_policy(layer)
        differ = {
            sub.path: policy
            for sub in keras_compat.sublayers(layer)
            if sub.path and (policy := keras_compat.own_policy(sub)).name != own.name
        }
        keras_compat.set_policy(layer, keras.dtype_policies.DTypePolicyMap(own, differ))


def matmul_layers(model):
    """The layers running in float8 now, or that `quantize` would run in float8."""
    return quantized_layers(model) + candidates(model)


FLUSH_LIMIT = 0.01  # A layer losing more of a tensor's non-zero values than this stays in bfloat16.
SATURATION_LIMIT = 0.01  # Likewise for values clipped at the format's maximum.


class DelayedScaling:
    """What Keras' delayed scaling does to one tensor over steps: its scale is the largest
    amax of the steps before divided by the format's maximum (1 at the first step, whose
    history is empty); a value beyond the maximum after scaling saturates, one below half
    the smallest subnormal flushes to zero. Fractions count the steps after the first.

    Args:
        fmt_max: the format's largest value (E4M3_MAX or E5M2_MAX).
        smallest: its smallest subnormal (E4M3_SMALLEST or E5M2_SMALLEST).
    """

    def __init__(self, fmt_max, smallest):
        self.fmt_max, self.smallest = fmt_max, smallest
        self.amax, self.steps = 0.0, 0
        self.values = self.flushed = self.saturated = 0

    def add(self, values):
        magnitudes = np.abs(np.asarray(values, np.float64)).ravel()
        scale = self.amax / self.fmt_max if self.amax > 0 else 1.0
        if self.steps:
            scaled = magnitudes[magnitudes > 0] / scale
            self.values += scaled.size
            self.flushed += int(np.count_nonzero(scaled < self.smallest / 2))
            self.saturated += int(np.count_nonzero(scaled > self.fmt_max))
        self.amax = max(self.amax, float(magnitudes.max(initial=0.0)))
        self.steps += 1

    def record(self):
        return {
            "amax": self.amax,
            "flushed": self.flushed / self.values if self.values else 0.0,
            "saturated": self.saturated / self.values if self.values else 0.0,
        }


def layer_report(name, inputs, kernel, gradients):
    """A float8 layer's record for the doctor, from the `DelayedScaling` of its inputs and
    kernel (E4M3) and of its output gradients (E5M2); `keep_bfloat16` when any loses more
    than `FLUSH_LIMIT` of its values to zero or saturates more than `SATURATION_LIMIT`."""
    record = {"name": name}
    for key, tracked in (("inputs", inputs), ("kernel", kernel), ("output_gradients", gradients)):
        record.update({f"{key}_{k}": v for k, v in tracked.record().items()})
    lost = [record[f"{key}_flushed"] for key in ("inputs", "kernel", "output_gradients")]
    clipped = [record[f"{key}_saturated"] for key in ("inputs", "kernel", "output_gradients")]
    record["keep_bfloat16"] = max(lost) > FLUSH_LIMIT or max(clipped) > SATURATION_LIMIT
    return record
