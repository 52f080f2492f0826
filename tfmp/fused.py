"""Fused optimizer updates: one kernel per variable in place of Keras' chain of element-wise ops.

Keras 3's Adam updates each variable with about ten element-wise ops, every one a pass
over the variable's memory (its SGD with momentum, four). TensorFlow's training kernels
(`ResourceApplyAdam`, `ResourceApplyKerasMomentum`, `ResourceApplyGradientDescent`)
compute the same formulas, on the same slot variables, in one pass: on a 2-core AMD EPYC a
BERT-base Adam update takes 101 ms fused against 262 ms (see README, Performance).

tfmp's steps use them for the float32 variables of `keras.optimizers.SGD`, and of
`keras.optimizers.Adam` (and AdamW, whose weight decay Keras applies before the update)
only where the kernel gives Keras' own bits (see `update_step`): tfmp.fit's weights equal
model.fit's. (Without XLA, SGD's kernels take Keras' own product of gradient and learning
rate, an op more a variable: TensorFlow's graph optimizer rewrites that product.) An
embedding's sparse gradient is made dense first, as Keras' own update does, except for SGD
without momentum, whose update touches only the rows looked up.
Anything else keeps Keras' own update: other optimizers, subclasses that change the
update, amsgrad, variables that are not float32. The optimizer's variables, checkpoints and results are
unchanged. Adafactor's update is Keras' own with one repair (`tfmp.adafactor`), whether fused or not.
"""

import functools

import keras
import numpy as np
import tensorflow as tf

from tfmp import adafactor, keras_optimizers


def _float(value):
    return tf.cast(value, tf.float32)


def _adam(optimizer, gradient, variable, learning_rate):
    # Keras: alpha = lr * sqrt(1 - b2^t) / (1 - b1^t); m += (g - m)(1 - b1);
    # v += (g^2 - v)(1 - b2); var -= alpha * m / (sqrt(v) + epsilon), t = iterations + 1.
    step = _float(optimizer.iterations + 1)
    beta_1, beta_2 = _float(optimizer.beta_1), _float(optimizer.beta_2)
    tf.raw_ops.ResourceApplyAdam(
        var=variable.handle,
        m=keras_optimizers.slot(optimizer, "momentums", variable).handle,
        v=keras_optimizers.slot(optimizer, "velocities", variable).handle,
        beta1_power=tf.pow(beta_1, step),
        beta2_power=tf.pow(beta_2, step),
        lr=_float(learning_rate),
        beta1=beta_1,
        beta2=beta_2,
        epsilon=_float(optimizer.epsilon),
        grad=_float(gradient),
    )


def _sgd(optimizer, gradient, variable, learning_rate, keras_product=True):
    # Keras: m = m * momentum - g * lr; var += m (nesterov: var += m * momentum - g * lr);
    # without momentum var -= g * lr. With `keras_product`, g * lr is Keras' own op and the
    # kernels' lr 1 (x * 1 is x): TensorFlow's graph optimizer reorders a chain of products (a
    # BatchNormalization's gamma gradient times lr) in Keras' update and in this one alike.
    lr, grad = _float(learning_rate), _float(gradient)
    if keras_product:
        lr, grad = tf.constant(1.0), tf.multiply(grad, lr)
    if optimizer.momentum == 0:
        tf.raw_ops.ResourceApplyGradientDescent(var=variable.handle, alpha=lr, delta=grad)
        return
    tf.raw_ops.ResourceApplyKerasMomentum(
        var=variable.handle,
        accum=keras_optimizers.slot(optimizer, "momentums", variable).handle,
        lr=lr,
        grad=grad,
        momentum=_float(optimizer.momentum),
        use_nesterov=bool(optimizer.nesterov),
    )


def _same_as_keras(beta):
    """Whether TensorFlow's Adam kernel rounds `1 - beta` as Keras does: the kernel
    computes it in float32 from float32 beta, Keras in Python and rounds once. For the
    defaults they differ (0.9: 0.100000024 against 0.1; 0.999: 0.0009999871 against 0.001,
    1.3e-5 apart), and the weights drift from model.fit's over a few dozen steps."""
    beta = float(beta)
    return np.float32(1.0 - beta) == np.float32(1.0) - np.float32(beta)


# Keras updates whose first arithmetic on the gradient makes an IndexedSlices dense: a
# moment that decays on every row (Keras' sparse ops densify a sum of sparse and dense).
_DENSE_UPDATES = ("Adam", "Adamax", "Nadam", "Lion", "Adafactor", "RMSprop")


def _sgd_update(optimizer):
    """Whether `optimizer` updates with Keras' own SGD update (a subclass may change it)."""
    return type(optimizer).update_step is keras.optimizers.SGD.update_step


def keras_densifies(optimizer):
    """Whether `optimizer`'s update (Keras' or the fused one) makes an embedding's sparse
    gradient dense anyway: Adam and AdamW, Adamax, Nadam, Lion, Adafactor, RMSprop and SGD
    with momentum. Not plain SGD, which updates the rows looked up only, nor any other
    (Adagrad, say, scatters its rows; a subclass may change the update)."""
    if _sgd_update(optimizer):
        return optimizer.momentum != 0
    return any(type(optimizer).update_step is getattr(keras.optimizers, name).update_step for name in _DENSE_UPDATES)


def sums_rows_itself(optimizer):
    """Whether `optimizer`'s update takes an embedding's sparse gradient with an id's rows
    apart as it would take their sum: plain SGD's scatter (Keras' own update, model.fit's
    bits), where the optimizer neither clips (its norm would count the rows apart) nor
    accumulates gradients of its own."""
    if not _sgd_update(optimizer) or optimizer.momentum != 0:
        return False
    own = ("clipnorm", "clipvalue", "global_clipnorm", "gradient_accumulation_steps")
    return not any(getattr(optimizer, name, None) for name in own)


def sparse_plan(optimizers, bfloat16, alone, sparse, norm):
    """For each variable, given its optimizer, whether its weight is bfloat16 (`tfmp.bf16`), whether
    the step runs on one replica, keeps gradients `sparse` and computes their `norm`: (its
    gradient made dense before the all-reduce, an id's rows of its sparse gradient summed).

    Dense: all of them where not `sparse`; on one replica (nothing to all-reduce), those the
    update makes dense anyway (Adam's moments decay on every row; a bfloat16 weight's update
    reads its gradient whole): once dense, they need no summing. Summed (`gradients.deduplicate`):
    for the norm, which must be the dense gradient's, and for every update but plain SGD's."""
    dense = [not sparse or (alone and (keras_densifies(o) or b)) for o, b in zip(optimizers, bfloat16, strict=True)]
    return dense, [norm or not sums_rows_itself(o) for o in optimizers]


def update_step(optimizer, exact=True, fuse=True, graph_optimized=lambda: True):
    """A replacement for `optimizer.update_step(gradient, variable, learning_rate)`: a fused
    one (with `fuse`), falling back to Keras' own for what it does not cover; Keras'
    Adafactor update without its 0 / 0 (`tfmp.adafactor`), fused or not; None for other
    optimizers.

    With `exact`, only where the kernel gives Keras' own bits: SGD (with or without
    momentum) always, Adam and AdamW only for betas whose `1 - beta` the kernel rounds
    as Keras does (not the defaults). `exact=False` fuses Adam anyway (the benchmark's
    update timing). `graph_optimized()`, asked as the update traces: whether TensorFlow's
    graph optimizer will rewrite it (not under XLA), so that SGD's kernels take Keras' own
    product g * lr, one op more a variable (under XLA the kernel's product is the same)."""
    if adafactor.is_keras(optimizer):
        return functools.partial(adafactor.update_step, optimizer)
    if not fuse:
        return None
    kind = type(optimizer)
    adam = kind.update_step is keras.optimizers.Adam.update_step and not optimizer.amsgrad
    if adam and (not exact or (_same_as_keras(optimizer.beta_1) and _same_as_keras(optimizer.beta_2))):
        fused = _adam
    elif _sgd_update(optimizer):
        fused = _sgd
    else:
        return None
    keras_update = optimizer.update_step
    dense = keras_densifies(optimizer)  # Else the update touches the rows looked up only.

    def step(gradient, variable, learning_rate):
        if tf.as_dtype(variable.dtype) != tf.float32:
            return keras_update(gradient, variable, learning_rate)
        if isinstance(gradient, tf.IndexedSlices):
            if not dense:
                return keras_update(gradient, variable, learning_rate)
            # Adam's moments and momentum decay on every row: Keras' update makes the
            # gradient dense for them anyway (its first subtraction does).
            gradient = tf.convert_to_tensor(gradient)
        if fused is _sgd:
            return _sgd(optimizer, gradient, variable, learning_rate, graph_optimized())
        return fused(optimizer, gradient, variable, learning_rate)

    return step
