"""Keras' Adafactor update without its 0 / 0.

Keras 3's Adafactor (3.10 to 3.15) makes a matrix's second moment the product of its factors,
`v = r / mean(r) x c`, and divides by its root: `u = g / sqrt(v)`. Where a row and a column of a
kernel's gradient are both zero (a ReLU unit dead for the whole batch at the layer's input meets
one at its output), r and c there are epsilon_1 = 1e-30, their product underflows float32 to 0,
and u = 0 / 0 is NaN; the RMS of u that clips the update is then NaN, and so is the whole kernel
after one step, silently under `model.fit` (a 3-layer ReLU MLP on random data does it at its
first steps).

tfmp's update is Keras' own, op for op, except where v is 0: there u is
`g * rsqrt(r / mean(r)) * rsqrt(c)`, the same quantity without the product that underflows (the
form of the Adafactor paper's code and of Optax), and 0 where g is 0. Wherever Keras' update is
finite, its weights and slots are Keras' to the bit.
"""

import keras
import tensorflow as tf
from keras import ops

from tfmp import keras_optimizers


def is_keras(optimizer):
    """Whether `optimizer` updates with Keras' own Adafactor update (not a subclass's)."""
    return type(optimizer).update_step is keras.optimizers.Adafactor.update_step


def _rms(x):
    return ops.sqrt(ops.mean(ops.square(x)))  # Keras' `Adafactor._rms`.


def update_step(optimizer, gradient, variable, learning_rate):
    """Keras' `Adafactor.update_step(gradient, variable, learning_rate)` of `optimizer`, with
    u finite where Keras' divides 0 by 0 (see the module). A sparse gradient is made dense first
    (Keras' update makes it dense at its first addition anyway)."""
    if isinstance(gradient, tf.IndexedSlices):
        gradient = tf.convert_to_tensor(gradient)
    lr = ops.cast(learning_rate, variable.dtype)
    gradient = ops.cast(gradient, variable.dtype)
    epsilon_2 = ops.cast(optimizer.epsilon_2, variable.dtype)
    one = ops.cast(1.0, variable.dtype)
    local_step = ops.cast(optimizer.iterations + 1, variable.dtype)
    # Keras first caps a fixed rate at 1 / sqrt(step) (relative_step); rho_t's cap below gives the same bits.
    slots = keras_optimizers.slots_of(optimizer, keras_optimizers.variable_index(optimizer, variable))
    r, c, v = slots["_r"], slots["_c"], slots["_v"]

    rho_t = ops.minimum(lr, 1 / ops.sqrt(local_step))
    alpha_t = ops.maximum(epsilon_2, _rms(variable)) * rho_t
    regulated_grad_square = ops.add(ops.square(gradient), optimizer.epsilon_1)
    beta_2_t = ops.subtract(1, ops.power(local_step, optimizer.beta_2_decay))

    if len(variable.shape) >= 2:
        # r: the mean over the last axis, c: over the one before it.
        for moment, axis in ((r, -1), (c, -2)):
            mean_square = ops.mean(regulated_grad_square, axis=axis)
            decayed = ops.add(ops.multiply(beta_2_t, moment), ops.multiply(ops.subtract(1, beta_2_t), mean_square))
            optimizer.assign(moment, decayed)
        rows = ops.divide(r, ops.mean(r, axis=-1, keepdims=True))
        optimizer.assign(v, ops.multiply(ops.expand_dims(rows, axis=-1), ops.expand_dims(c, -2)))
        # Where v underflowed to 0: each factor's root on its own, 0 where the gradient is.
        apart = ops.multiply(ops.expand_dims(ops.rsqrt(rows), -1), ops.expand_dims(ops.rsqrt(c), -2))
        stored = ops.convert_to_tensor(v)
        u_t = tf.where(stored > 0, ops.divide(gradient, ops.sqrt(stored)), tf.math.multiply_no_nan(apart, gradient))
    else:
        optimizer.assign(
            v, ops.add(ops.multiply(beta_2_t, v), ops.multiply(ops.subtract(1, beta_2_t), regulated_grad_square))
        )
        u_t = ops.divide(gradient, ops.sqrt(v))

    u_t_hat = ops.divide(u_t, ops.maximum(one, ops.divide(_rms(u_t), optimizer.clip_threshold)))
    optimizer.assign_sub(variable, ops.multiply(alpha_t, u_t_hat))
