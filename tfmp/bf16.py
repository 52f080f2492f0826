"""Pure bfloat16 training: weights and optimizer state stored in bfloat16, each update
computed in float32 and written back with compensation.

Keras' `bfloat16` policy stores the weights and the optimizer's slots in bfloat16 and
computes the update there too: Adam's beta_2 = 0.999 rounds to 1.0, and any change smaller
than half a bfloat16 step of its weight (2^-9 of it) rounds away, weight decay included.
tfmp's update for a bfloat16 variable instead runs the optimizer's own `update_step`
(Keras' code, unchanged) on float32 copies of the weight and its slots, hyperparameters in
float32, with weight decay applied there first; then writes the results back:

- `kahan` (the default): each weight has a bfloat16 compensation buffer holding what the
  last rounding lost, so weight + buffer carries about 16 significant bits; the update is
  applied to their float32 sum and the new residual is kept (Kahan summation, as in
  optimi). Adam: 8 bytes a parameter.
- `stochastic`: rounded up or down with probability proportional to the distance, so an
  update is kept on average however small (torchao's bf16 stochastic rounding). The random
  bits come from (seed, step, variable): every replica and worker rounds identically, and a
  resumed run as the unbroken one would. Adam: 6 bytes a parameter.
- `nearest`: round to nearest, what Keras does; kept for comparison.

The slots have no buffer: under `kahan` and `stochastic` they are rounded stochastically
(unbiased: Adam's second moment, which moves by 0.1% a step, would otherwise stall),
under `nearest` to nearest.
"""

import warnings

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from tfmp import adafactor, keras_compat, keras_optimizers
from tfmp.choices import ROUNDINGS  # noqa: F401 - re-exported: named where TensorFlow need not load.
from tfmp.errors import UsageError, some_of

NEAREST_WARNING = (
    "bfloat16 with rounding='nearest' (Keras' behaviour) drops every update smaller than half a bfloat16 step of "
    "its weight (2^-9 of it): small learning rates, late training and weight decay stall; use rounding='kahan' "
    "(--bf16_rounding=kahan) or 'stochastic'."
)

SUPPORTED = "SGD (with or without momentum), Adam, AdamW, Lion, Adafactor"
_BUFFERS = "_tfmp_kahan"  # The optimizer's attribute holding the compensation buffers.


def is_bfloat16(variable):
    """Whether `variable` (a Keras or TensorFlow variable) is stored in bfloat16."""
    return tf.as_dtype(variable.dtype) == tf.bfloat16


@keras.saving.register_keras_serializable(package="tfmp")
class Orthogonal(keras.initializers.Orthogonal):
    """Keras' orthogonal initializer (an LSTM's recurrent kernel), computed in float32 and
    cast: Keras' own calls a QR decomposition, which TensorFlow has no bfloat16 kernel for,
    so a bfloat16 LSTM fails to build with it. The same values as Keras' for float32."""

    def __call__(self, shape, dtype=None):
        return keras.ops.cast(super().__call__(shape, dtype="float32"), dtype or keras.config.floatx())


def check_supported(optimizer):
    """Raises a UsageError naming `optimizer` if its update has no bfloat16 path here."""
    if type(optimizer).update_step not in keras_optimizers.UPDATE_SLOTS:
        raise UsageError(
            f"bfloat16 weights: tfmp computes the updates of {SUPPORTED} in float32 and compensates their "
            f"rounding; {type(optimizer).__name__} is none of them (a subclass that changes update_step is "
            'not either). Use one of those, or mixed_bfloat16 (float32 weights: configure_precision("mixed_bfloat16"), '
            "train.py --precision=mixed_bfloat16)."
        )
    if getattr(optimizer, "use_ema", False) or getattr(optimizer, "gradient_accumulation_steps", None):
        raise UsageError(
            f"bfloat16 weights: {type(optimizer).__name__}(use_ema=...) and Keras' gradient_accumulation_steps "
            "are not compensated; leave them out (tfmp.fit's grad_accum_steps accumulates in float32)"
        )


def holds_bfloat16(model):
    """Whether any trainable weight of `model` is stored in bfloat16."""
    return any(is_bfloat16(v) for v in model.trainable_variables)


def applier_hooks(optimizer, variables, strategy, rounding, seed, update=None):
    """(update_step, weight_decay_filter) for tfmp's applier of `optimizer`: where any of
    `variables` is bfloat16, the compensated `update_step` (falling back to `update`, else
    Keras' own, for the others) and the filter keeping Keras' bfloat16 weight decay off,
    after checking the optimizer and building its buffers; else (`update`, None)."""
    if not any(is_bfloat16(v) for v in variables):
        return update, None
    check_supported(optimizer)
    with strategy.scope():
        build(optimizer, variables, rounding)
    return update_step(optimizer, rounding, seed, update or optimizer.update_step), weight_decay_filter


def build(optimizer, variables, rounding):
    """Makes `optimizer`'s Kahan compensation buffers (a `Compensation`) when `rounding` is
    kahan; no-op otherwise or when they exist."""
    if rounding != "kahan" or getattr(optimizer, _BUFFERS, None) is not None:
        return
    buffers = [_buffer(optimizer, v) if is_bfloat16(v) else None for v in variables]
    object.__setattr__(optimizer, _BUFFERS, Compensation(buffers))  # Past Keras' and tf.train's tracking.


def _buffer(optimizer, weight):
    """A zero variable like `weight`, made where and as Keras makes an optimizer's slot
    (`add_variable_from_reference`), but not one of the optimizer's variables."""
    own = weight.value if isinstance(weight, keras.Variable) else weight  # A tf.Variable, which has no path.
    name = getattr(weight, "path", weight.name).replace("/", "_").replace(":", "_") + "_kahan"
    place = tf.distribute.get_strategy().extended.colocate_vars_with(own)
    with place, keras.name_scope(optimizer.name, caller=optimizer):
        return keras.Variable(
            keras.initializers.Zeros(), shape=weight.shape, dtype=weight.dtype, trainable=False, name=name
        )


def buffers(optimizer):
    """The Kahan buffers tfmp made for `optimizer` (a wrapper's inner one, a MultiOptimizer's
    optimizers), in order: tfmp's checkpoints hold them beside the optimizer's variables."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    parts = keras_optimizers.optimizer_parts(inner) or [inner]
    return [v for part in parts for v in getattr(getattr(part, _BUFFERS, None), "variables", [])]


class Compensation(keras_compat.Saveable):
    """One optimizer's Kahan buffers, one per bfloat16 weight (None for the others).

    Not among the optimizer's variables: `keras.models.load_model` builds the optimizer
    without them, and Keras restores an optimizer's state only into one with as many
    variables as the file holds (otherwise it warns and restores none of it). So a `.keras`
    file's optimizer is the one Keras builds (step count, moments), and this object, an
    attribute of it, is saved beside it (`optimizer/_tfmp_kahan`) and restored where the
    loading optimizer has it (`model.load_weights` into a model tfmp.fit trained, a
    `BackupAndRestore`). A file without them sets them to zero, as a plain reload's are: each
    weight gives up at most half a bfloat16 step once, one rounding to nearest."""

    def __init__(self, buffers):
        self.buffers = buffers

    @property
    def variables(self):
        return [b for b in self.buffers if b is not None]

    def _obj_type(self):  # One Keras knows; as a metric's, its variables are not walked again.
        return "Metric"

    def save_own_variables(self, store):
        for i, buffer in enumerate(self.variables):
            store[str(i)] = buffer.numpy()

    def load_own_variables(self, store):
        held = len(store.keys())
        if held and held != len(self.variables):  # Another model's file: as Keras does for the optimizer beside.
            counts = f"the file holds {held}, this optimizer {len(self.variables)}"
            warnings.warn(f"Kahan buffers set to zero: {counts}", stacklevel=2)
            held = 0
        for i, buffer in enumerate(self.variables):
            buffer.assign(store[str(i)] if held else tf.zeros(buffer.shape, buffer.dtype))


class _View:
    """A float32 stand-in for a bfloat16 variable inside Keras' `update_step`: reads give
    its current value, assigns replace it (nothing is written until the end)."""

    dtype = tf.float32

    def __init__(self, value):
        self.initial = self.value = tf.cast(value, tf.float32)

    @property
    def shape(self):
        return self.value.shape

    @property
    def changed(self):
        return self.value is not self.initial

    def assign(self, value):
        self.value = tf.cast(value, tf.float32)

    def assign_add(self, value):
        self.value = self.value + tf.cast(value, tf.float32)

    def assign_sub(self, value):
        self.value = self.value - tf.cast(value, tf.float32)


tf.register_tensor_conversion_function(
    _View, lambda view, dtype=None, name=None, as_ref=False: tf.convert_to_tensor(view.value, dtype=dtype, name=name)
)


def round_nearest(x):
    """float32 -> bfloat16, to nearest (even)."""
    return tf.cast(x, tf.bfloat16)


def nearest_value(x):
    """float32 `x` rounded to the nearest bfloat16 (ties to even), as a float32 tensor.

    By integer ops on the bits, not a cast to bfloat16 and back: XLA's GPU compiler drops
    such a pair (it allows excess precision, `--xla_allow_excess_precision`, on by default),
    and a Kahan buffer computed as `x - that` was zero under XLA on a GPU, its training
    that of round-to-nearest. NaN stays NaN."""
    x = tf.cast(x, tf.float32)
    bits = tf.bitcast(x, tf.int32)
    odd = tf.bitwise.bitwise_and(tf.bitwise.right_shift(bits, 16), 1)  # Ties go to the even one.
    kept = tf.bitwise.bitwise_and(bits + (0x7FFF + odd), tf.constant(-(1 << 16), tf.int32))
    return tf.where(tf.math.is_nan(x), x, tf.bitcast(kept, tf.float32))


def _mix(h):
    """A 32-bit integer hash with full avalanche (Wellons' lowbias32) on uint32 tensors."""
    h = tf.bitwise.bitwise_xor(h, tf.bitwise.right_shift(h, 16)) * tf.constant(0x21F0AAAD, tf.uint32)
    h = tf.bitwise.bitwise_xor(h, tf.bitwise.right_shift(h, 15)) * tf.constant(0x735A2D97, tf.uint32)
    return tf.bitwise.bitwise_xor(h, tf.bitwise.right_shift(h, 15))


def random_bits(shape, seed):
    """32 random bits per element of `shape`: a hash of the element's index and `seed` (a
    shape [2] integer tensor), counter-based like tf.random's stateless ops.

    Not tf.random.stateless_uniform: XLA's CPU backend draws those about 60 times slower
    than TensorFlow's kernel (176 ms for a million, measured), which made a bfloat16
    embedding's update cost more than the model's step; these are a few integer ops an
    element on every backend."""
    words = [tf.cast(tf.bitwise.right_shift(tf.cast(part, tf.int64), shift), tf.uint32)  # Low, then high word.
             for part in tf.unstack(tf.cast(seed, tf.int64)) for shift in (0, 32)]  # fmt: skip
    key = tf.constant(0, tf.uint32)
    for word in words:
        key = _mix(tf.bitwise.bitwise_xor(key, word) + tf.constant(0x9E3779B9, tf.uint32))
    index = tf.cast(tf.range(tf.reduce_prod(shape)), tf.uint32)
    return tf.reshape(_mix(index * tf.constant(0x9E3779B1, tf.uint32) + key), shape)


def round_stochastic(x, seed):
    """float32 -> bfloat16, up or down with probability proportional to the distance.

    Adds 16 random bits below the 16 that bfloat16 keeps, then truncates: the carry into
    the kept bits happens with probability (dropped bits) / 2^16. `seed`: a shape [2]
    integer tensor, the same on every replica (`random_bits`)."""
    bits = tf.bitcast(tf.cast(x, tf.float32), tf.int32)
    noise = tf.cast(tf.bitwise.right_shift(random_bits(tf.shape(bits), seed), 16), tf.int32)
    kept = tf.bitwise.bitwise_and(bits + noise, tf.constant(-(1 << 16), tf.int32))
    return tf.cast(tf.bitcast(kept, tf.float32), tf.bfloat16)


def _seed(seed, step, index, part):
    """The stateless seed of one variable's (`part` 0) or slot's rounding at `step`."""
    base = np.int64(seed) * 1_000_003 + index * 16 + part
    return tf.stack([tf.constant(base, tf.int64), tf.cast(step, tf.int64)])


def update_step(optimizer, rounding, seed, fallback):
    """tfmp's `update_step(gradient, variable, learning_rate)` for `optimizer`: compensated
    float32 updates for bfloat16 variables (see the module), `fallback` for the others.

    Args:
        optimizer: a built Keras optimizer `check_supported` accepts (`build` already run).
        rounding: one of `ROUNDINGS`.
        seed: an integer, for stochastic rounding.
        fallback: the update for float32 variables (Keras' own, or tfmp.fused's).
    """
    method = adafactor.update_step if adafactor.is_keras(optimizer) else type(optimizer).update_step

    def step(gradient, variable, learning_rate):
        if not is_bfloat16(variable):
            return fallback(gradient, variable, learning_rate)
        index = keras_optimizers.variable_index(optimizer, variable)
        step_count = optimizer.iterations
        buffer = getattr(optimizer, _BUFFERS, None)
        buffer = buffer.buffers[index] if buffer is not None else None
        weight = _View(variable)
        if buffer is not None:
            weight = _View(tf.cast(variable, tf.float32) + tf.cast(buffer, tf.float32))
        lr = tf.cast(learning_rate, tf.float32)
        if keras_optimizers.decays(optimizer, variable):
            weight.assign_sub(weight.value * tf.cast(optimizer.weight_decay, tf.float32) * lr)
        slots = {name: (slot, _View(slot)) for name, slot in keras_optimizers.slots_of(optimizer, index).items()}
        shadow = keras_optimizers.with_slots(optimizer, index, {name: view for name, (_, view) in slots.items()})
        method(shadow, tf.cast(tf.convert_to_tensor(gradient), tf.float32), weight, lr)
        _write(variable, buffer, weight.value, rounding, _seed(seed, step_count, index, 0))
        for part, (slot, view) in enumerate(slots.values(), 1):
            if not view.changed:
                continue
            if not is_bfloat16(slot):  # A float32 slot (an optimizer that makes its own): as computed.
                slot.assign(view.value)
            elif rounding == "nearest":
                slot.assign(round_nearest(view.value))
            else:
                slot.assign(round_stochastic(view.value, _seed(seed, step_count, index, part)))

    return step


def _write(variable, buffer, value, rounding, seed):
    """Stores float32 `value` into bfloat16 `variable` with `rounding` (Kahan: the rest in
    `buffer`)."""
    if rounding == "kahan":
        kept = nearest_value(value)
        variable.assign(round_nearest(kept))  # Exact: kept is a bfloat16 value.
        buffer.assign(round_nearest(value - kept))
    elif rounding == "stochastic":
        variable.assign(round_stochastic(value, seed))
    else:
        variable.assign(round_nearest(value))


def weight_decay_filter(variable):
    """Whether Keras' own weight decay may touch `variable`: not a bfloat16 one, decayed in
    float32 by `update_step`."""
    return not is_bfloat16(variable)


def state_bytes(model, optimizer=None):
    """Bytes of the trainable weights and the optimizer's variables (its scalars, the step
    count and learning rate, left out)."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    state = [v for v in [*inner.variables, *buffers(inner)] if len(v.shape)] if inner is not None else []
    return sum(int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size for v in [*model.trainable_variables, *state])


def bytes_per_parameter(model, optimizer=None):
    """`state_bytes` per trainable parameter."""
    params = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    return state_bytes(model, optimizer) / max(params, 1)


def statistics_policy():
    """The dtype policy for a BatchNormalization layer under the global policy: where that
    stores variables in bfloat16, mixed_bfloat16 (float32 moving statistics, bfloat16
    compute); else None, the global one. Its moving mean and variance are assigned in its
    call, not by the optimizer, so nothing compensates them, and at momentum 0.99 a move of
    1% of the gap rounds away in bfloat16 until the gap is ~40% of the statistic."""
    return "mixed_bfloat16" if keras.config.dtype_policy().variable_dtype == "bfloat16" else None


def warn_bfloat16_statistics(model):
    """One warning naming `model`'s BatchNormalization layers whose moving statistics are
    bfloat16 (see `statistics_policy`); returns their paths."""
    stuck = [
        layer.path or layer.name
        for layer in keras_compat.sublayers(model)
        if isinstance(layer, keras.layers.BatchNormalization) and is_bfloat16(layer.moving_mean)
    ]
    if stuck:
        logging.warning(
            "BatchNormalization %s keep their moving statistics in bfloat16, where their updates round away "
            "(nothing compensates them: they are not trained by the optimizer); build them with "
            "dtype=tfmp.bf16.statistics_policy() (float32 statistics) or dtype='float32'.",
            some_of(stuck),
        )
    return stuck


def warn_if_nearest(rounding):
    if rounding == "nearest":
        logging.warning(NEAREST_WARNING)
