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

`divisor` is what Keras divides a mean by where it is not the batch's elements: a masked output's unmasked ones,
or the sample weights' sum (`mean_with_sample_weight`), which each replica and micro-batch counts apart:
tfmp.accumulate weighs the parts by it. Where a mean cannot be weighed so (several losses, or outputs),
`one_per_example` warns.
"""

import contextlib
import weakref

import keras
import tensorflow as tf
from absl import logging

_MEANS = ("sum_over_batch_size", "mean", "mean_with_sample_weight")
_ANY = (*_MEANS, "sum", "none", None)  # Every reduction a Keras loss can have.
_warned = weakref.WeakSet()  # The compiled losses `one_per_example` warned of.


@contextlib.contextmanager
def one_per_example(compiled_loss, y_pred=None, micro_batches=1, sums_times=None, sample_weight=None):
    """While it runs, the compiled loss's own losses of mean reductions give a scalar as one value per example, and
    of "sum", `sums_times` (default `micro_batches`) their value: the micro-batch's loss is weighed by its share of
    the update's examples (1 / micro_batches where they are equal), and a sum counts whole. Where the update is made
    of several replicas' or micro-batches' losses and one of them is a mean over the unmasked elements
    (`masked_mean`), or divides by the `sample_weight`s' sum, which `divisor` cannot weigh, it warns, once a
    compiled loss."""
    replicas = tf.distribute.get_strategy().num_replicas_in_sync
    parts = (replicas > 1 or micro_batches > 1) and compiled_loss not in _warned
    by_weights = sample_weight is not None and _losses_in(compiled_loss, ("mean_with_sample_weight",))
    if parts and by_weights and _divided_by(compiled_loss, y_pred, sample_weight) is None:
        _warned.add(compiled_loss)
        logging.warning(
            "a loss of reduction 'mean_with_sample_weight' divides each of %d replicas x %d accumulated batches by "
            "its own sum of sample weights, and the parts weigh equally: the update weighs each example as one "
            "update on the whole batch would only where every part's weights sum alike. For exact weights, give "
            "it reduction='sum' and a loss weight of 1 / (the sample weights' sum expected in an update)",
            replicas,
            micro_batches,
        )
    if parts and compiled_loss not in _warned and masked_mean(compiled_loss, y_pred, sample_weight):
        _warned.add(compiled_loss)
        logging.warning(
            "a loss is a mean over each batch's unmasked elements (a masked output) that tfmp weighs by them only "
            "as the model's one loss of reduction 'sum_over_batch_size': here each of %d replicas x %d accumulated "
            "batches takes its own mean, and the means weigh equally, so that the update weighs each element as "
            "one update on the whole batch would only where every part has as many unmasked elements. For exact "
            "weights, give it reduction='sum' and a loss weight of 1 / (the unmasked elements expected in an "
            "update)",
            replicas,
            micro_batches,
        )
    losses = [] if replicas == 1 else _losses_in(compiled_loss, _MEANS)
    for loss in losses:
        object.__setattr__(loss, "call", _per_example(loss.call))  # Past Keras' tracking; this call only.
    sums = [] if micro_batches == 1 and sums_times is None else _losses_in(compiled_loss, ("sum",))
    for loss in sums:  # tfmp divides each micro-batch's loss by their number, as a mean needs; a sum counts whole.
        object.__setattr__(loss, "call", _times(loss.call, micro_batches if sums_times is None else sums_times))
    try:
        yield
    finally:
        for loss in losses + sums:
            loss.__dict__.pop("call", None)


def _times(call, factor):
    return lambda y_true, y_pred: call(y_true, y_pred) * factor


def _per_example(call):
    def per_example(y_true, y_pred):
        values = call(y_true, y_pred)
        first = tf.nest.flatten(y_pred)[0]
        if getattr(values, "shape", None) is None or values.shape.rank != 0 or not first.shape.rank:
            return values
        return keras.ops.broadcast_to(values, keras.ops.shape(first)[:1])

    return per_example


def _losses_in(root, reductions):
    """The `keras.losses.Loss` objects `root` (a compiled loss) holds, itself excepted, of one of `reductions`."""
    if root is None:
        return []
    found, seen, stack = [], {id(root)}, list(vars(root).values())
    while stack:
        value = stack.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, keras.losses.Loss):
            if value.reduction in reductions:
                found.append(value)
        elif isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, list | tuple):
            stack.extend(value)
    return found


def masked_mean(compiled_loss, y_pred, sample_weight=None):
    """Whether a compiled loss of a mean reduction meets a masked output (an `Embedding(mask_zero=True)`'s tokens
    through a per-token head), where `divisor` does not apply: Keras' loss is then the mean over the batch's
    unmasked elements, each replica and each accumulated micro-batch divides by its own count, and their means weigh
    equally, where one update on the whole batch (one device's) weighs each element equally."""
    masked = any(getattr(t, "_keras_mask", None) is not None for t in tf.nest.flatten(y_pred))
    means = masked and bool(_losses_in(compiled_loss, _MEANS))
    return means and _divided_by(compiled_loss, y_pred, sample_weight) is None


def mixes_sums(compiled_loss):
    """Whether the compiled loss holds losses reduced by "sum" beside losses of other reductions."""
    reductions = {loss.reduction for loss in _losses_in(compiled_loss, _ANY)}
    return "sum" in reductions and len(reductions) > 1


def divisor(compiled_loss, y_pred, sample_weight=None):
    """(what Keras divides the batch's loss by, the elements it weighs), float32, where the compiled loss is one
    mean over one output and divides by other than its elements; else None. A mean over a masked output
    (`sum_over_batch_size`, Keras' default, or `mean`) divides by its unmasked elements, whatever the sample weights;
    `mean_with_sample_weight` by the sum of the sample weights times the mask, either alone (Keras' `apply_mask`)."""
    summed = _divided_by(compiled_loss, y_pred, sample_weight)
    if summed is None:
        return None
    merged = _merged(*summed)
    return tf.reduce_sum(merged), tf.cast(tf.size(merged), tf.float32)


def _divided_by(compiled_loss, y_pred, sample_weight):
    """(the sample weights or None, the mask or None) whose product `divisor` sums, where it applies, else None:
    the check alone, without building an op (`masked_mean` and the warnings ask only whether it applies)."""
    flat, losses = tf.nest.flatten(y_pred), _losses_in(compiled_loss, _ANY)
    if len(flat) != 1 or len(losses) != 1:
        return None
    mask, reduction = getattr(flat[0], "_keras_mask", None), losses[0].reduction
    weights = [w for w in tf.nest.flatten(sample_weight) if w is not None]  # (None flattens to [None].)
    if mask is not None and reduction in ("sum_over_batch_size", "mean"):
        weights = []  # Keras divides by the unmasked elements, whatever the sample weights.
    elif reduction != "mean_with_sample_weight" or len(weights) > 1 or (mask is None and not weights):
        return None
    return weights[0] if weights else None, mask


def _merged(sample_weight, mask):
    """The sample weights times the mask (either alone), float32, as Keras' `apply_mask` merges them: of ranks one
    apart, the longer loses its last axis where it is 1."""
    if sample_weight is None:
        return tf.cast(mask, tf.float32)
    weights = tf.cast(sample_weight, tf.float32)
    if mask is None:
        return weights
    mask = tf.cast(mask, tf.float32)
    if mask.shape.rank == weights.shape.rank + 1 and mask.shape[-1] == 1:
        mask = tf.squeeze(mask, -1)
    elif weights.shape.rank == mask.shape.rank + 1 and weights.shape[-1] == 1:
        weights = tf.squeeze(weights, -1)
    return mask * weights


def only_sums(compiled_loss):
    """Whether the compiled loss holds losses, all of them reduced by "sum"."""
    losses = _losses_in(compiled_loss, _ANY)
    return bool(losses) and all(loss.reduction == "sum" for loss in losses)
