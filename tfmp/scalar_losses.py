"""A compiled loss whose function returns one number for the whole batch, under a strategy.

Keras scales each compiled loss by 1/replicas, so that a replica's mean over its own batch
becomes its share of the global mean and the gradients summed over replicas are one device's.
It leaves out a loss whose function already returns a scalar (`reduce_values` in
keras/src/losses/loss.py returns a scalar as it is): `keras.ops.mean(...)` written in a custom
loss, as tutorials write it. Under R replicas `model.fit` then trains with R times the gradient
of one device and reports R times the loss. While tfmp computes the loss, such a function's
scalar is given to Keras as that value for each example of the batch, whose mean Keras takes
and scales as any other: one device's loss and gradients exactly. A loss reduced by "sum" is
left alone (a sum over replicas is the global sum), as is everything on one replica.
"""

import contextlib

import keras
import tensorflow as tf

_MEANS = ("sum_over_batch_size", "mean", "mean_with_sample_weight")


@contextlib.contextmanager
def one_per_example(compiled_loss):
    """While it runs, the compiled loss's own losses of mean reductions give a scalar as one value per example."""
    losses = [] if tf.distribute.get_strategy().num_replicas_in_sync == 1 else _means_in(compiled_loss)
    for loss in losses:
        object.__setattr__(loss, "call", _per_example(loss.call))  # Past Keras' tracking; this call only.
    try:
        yield
    finally:
        for loss in losses:
            loss.__dict__.pop("call", None)


def _per_example(call):
    def per_example(y_true, y_pred):
        values = call(y_true, y_pred)
        first = tf.nest.flatten(y_pred)[0]
        if getattr(values, "shape", None) is None or values.shape.rank != 0 or not first.shape.rank:
            return values
        return keras.ops.broadcast_to(values, keras.ops.shape(first)[:1])

    return per_example


def _means_in(root):
    """The `keras.losses.Loss` objects `root` (a compiled loss) holds, itself excepted, of a mean reduction."""
    if root is None:
        return []
    found, seen, stack = [], {id(root)}, list(vars(root).values())
    while stack:
        value = stack.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, keras.losses.Loss):
            if value.reduction in _MEANS:
                found.append(value)
        elif isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, list | tuple):
            stack.extend(value)
    return found
