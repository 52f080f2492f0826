"""An update's first stage on each replica: its micro-batches forward and backward, their gradients summed.

Each micro-batch's loss is weighed by its share of the examples (1/their number where the sizes are static), so
that the sum is the mean over their concatenation (a loss reduced by "sum" counts whole: tfmp.scalar_losses). A
mean over a masked output's elements (padded sequences' tokens; Keras divides by the batch's count of unmasked
ones), or of reduction `mean_with_sample_weight` (divided by the sample weights' sum), has a divisor each
micro-batch and each replica counts apart, and their means would weigh equally whatever their divisors. Where the
compiled loss is that one mean (`scalar_losses.divisor`), each micro-batch's loss is weighed by its divisor, and
the sum by the replica's: its gradients are the mean over all its elements as Keras weighs them, and
`tfmp.crossing.weigh_by_share` weighs the replicas by their divisors, so that each element weighs as in one
update on the whole global batch. One micro-batch on one replica is left as Keras computes it.
"""

import keras
import tensorflow as tf

from tfmp import crossing, gradients, keras_compat, rng, scalar_losses


def replica_gradients(steps, batches, replica_share=None):
    """Forward and backward passes over this replica's `batches` (`steps`: a `tfmp.steps.Steps`); `replica_share`:
    what `crossing.weigh_by_share` will weigh them by, counted before (`replica_share`), which the sums undo.

    Returns:
        (gradients per trainable variable (None where it gets none; embeddings' IndexedSlices stay sparse),
        each batch's loss, each batch's predictions, this replica's divisor (`scalar_losses.divisor`: its unmasked
        elements, or its sample weights' sum) where the loss is a mean by one and the update has several parts,
        else None).
    """
    model, n = steps.model, len(batches)
    parts = n > 1 or steps.strategy.num_replicas_in_sync > 1
    grads, losses, preds, counts, reference = None, [], [], [], None
    for batch, share in zip(batches, shares(batches), strict=True):  # Unrolled: n is small.
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(batch)
        whole = share if replica_share is None else share * replica_share  # What weighs a sum, undone first.
        sums_times = None if isinstance(whole, float) else tf.math.divide_no_nan(1.0, whole)  # None: n.
        with tf.GradientTape() as tape, rng.per_replica(steps.strategy):  # Dropout: a mask per replica.
            y_pred = keras_compat.call(model, x, training=True)
            # A mean over the global batch (Keras divides a replica's mean by the replicas); regularization once.
            loss = keras_compat.compute_loss(model, x, y, y_pred, sample_weight, True, n, sums_times, replica_share)
            divisor = scalar_losses.divisor(keras_compat.compiled(model)[0], y_pred, sample_weight) if parts else None
            if divisor is not None:  # Weighed by its divisor over the first batch's: 1 for one batch, else near it.
                reference = reference if counts else tf.where(divisor[0] > 0, divisor[0], divisor[1])  # Never 0.
                counts.append(divisor[0])
                weighed = loss * tf.cast(divisor[0] / reference, loss.dtype) / n
            elif isinstance(share, float):  # Batches of one size.
                weighed = loss / n if n > 1 else loss
            else:  # Weighed by its share of the examples; kept as one of n losses whose mean is the update's.
                weighed, loss = loss * tf.cast(share, loss.dtype), loss * tf.cast(share * n, loss.dtype)
            scaled = steps.optimizer.scale_loss(weighed)
        new = gradients.shaped(tape.gradient(scaled, steps.variables), steps.variables)
        # A bfloat16 weight's gradient is summed, all-reduced and clipped in float32.
        new = [gradients.to_float32(g) if low else g for g, low in zip(new, steps._bf16, strict=True)]  # noqa: SLF001
        if grads is None:
            grads = new
        else:  # float8 state: the largest amax of the micro-batches, not their sum.
            grads = [
                (tf.maximum(a, b) if state and a is not None else gradients.add(a, b))
                for a, b, state in zip(grads, new, steps._state, strict=True)  # noqa: SLF001
            ]
        losses.append(loss)
        preds.append(y_pred)
    if not counts:
        return grads, losses, preds, None
    total = tf.add_n(counts)
    return (*_mean_over_elements(steps, grads, losses, counts, reference, total), preds, total)


def shares(batches):
    """Each micro-batch's share of the examples `batches` hold, which weighs its mean loss (a sum's counts whole): 1/n
    each where their sizes are static, else its examples over all (a last one of 2 examples beside one of 4 weighs
    a third, where 1/2 weighed each of its examples twice as much as the others)."""
    if len(batches) == 1 or not crossing.sizes_vary(batches):
        return [1.0 / len(batches)] * len(batches)
    counts = crossing.examples_in(batches)
    total = tf.add_n(counts)
    return [tf.math.divide_no_nan(count, total) for count in counts]


def _mean_over_elements(steps, grads, losses, counts, reference, total):
    """The gradients and losses of micro-batches weighed by their divisors (`total` of them: unmasked elements, or
    sample weights), as their mean over all of them."""
    # The gradients: sum of (count / reference) x gradient / n; each batch's weight is count / total.
    factor = tf.math.divide_no_nan(reference * len(counts), total)
    grads = [
        g if g is None or state else gradients.scale(g, factor)
        for g, state in zip(grads, steps._state, strict=True)  # noqa: SLF001
    ]
    # Each loss x its count x n / total: their mean is the mean over the elements.
    weights = [tf.math.divide_no_nan(c * len(counts), total) for c in counts]
    return grads, [loss * tf.cast(w, loss.dtype) for loss, w in zip(losses, weights, strict=True)]


def summed(model):
    """Whether the model's compiled losses are all reduced by "sum": the sum of its replicas' parts is the global
    sum, however the batch splits, and nothing weighs them (`tfmp.crossing.weigh_by_share`)."""
    return scalar_losses.only_sums(keras_compat.compiled(model)[0])


def divisor_on_replicas(model, y_pred, sample_weight, strategy):
    """This replica's divisor where the loss is a mean by one (`scalar_losses.divisor`: its unmasked elements, or its
    sample weights' sum) on several replicas, else None: what weighs its evaluation loss (`as_global`)."""
    if strategy.num_replicas_in_sync == 1:
        return None
    counts = scalar_losses.divisor(keras_compat.compiled(model)[0], y_pred, sample_weight)
    return None if counts is None else counts[0]


def replica_share(model, batches, replicas, by_shapes=True):
    """This replica's examples x replicas / the global batch's (1 where the split is even), where the compiled losses
    mix "sum" and mean reductions, or are several (each logged, as `a_loss`) and not all sums, and the batches can
    split unevenly, else None. `crossing.weigh_by_share` weighs the whole loss by it, which makes each replica's
    mean part of the global mean; counted before the losses, it lets each sum be divided by it first, so that it
    counts whole (weighed after, the sums of a last batch split 2 and 1 were off: weights 3.3e-3 from one device's
    after 2 epochs), and weighs each replica's per-output losses in their logs (each replica's weighed alike, the
    last batch's 2 and 1 put `a_loss` 0.7-6% off one device's). `by_shapes` False: even where the sizes are static
    (an evaluation step can be traced with one replica's batch static and another's not)."""
    compiled_loss = keras_compat.compiled(model)[0]
    weighed = scalar_losses.mixes_sums(compiled_loss)
    weighed = weighed or (keras_compat.logs_per_output(model) and not scalar_losses.only_sums(compiled_loss))
    if replicas == 1 or not weighed or (by_shapes and not crossing.sizes_vary(batches)):
        return None
    return crossing.share_of(tf.add_n(crossing.examples_in(batches)), replicas)


def logged_once(model, divisor, replicas):
    """Whether each replica's loss is logged once for its batches, as its share of the global batch's (`as_global`),
    not batch by batch by its own examples: on several replicas, where the loss is a mean by a `divisor` (masked
    elements, sample weights) or all sums. One device weighs a batch's sum by all its examples; each replica's by
    its own, the sums of a last batch split 2 and 1 were 1-2% off in the epoch's loss. (Decided by the model and
    the data's structure, not by the batches' static shapes: a test step can be traced with one replica's static
    and another's not.)"""
    return replicas > 1 and (divisor is not None or summed(model))


def as_global(loss, examples, divisor, replicas):
    """(loss, examples) for the loss tracker (`packed.track_loss`) from this replica's share of the global loss as
    Keras computes it and its `examples`, weighed by all the global batch's examples, as one device tracks it. A mean
    by a `divisor` (this replica's own mean, divided by the replicas) is weighed by its divisor too, so that the
    replicas' sum is the global batch's mean by all of theirs; a sum (`divisor` None) adds up as it is."""
    counts = tf.stack([examples, examples if divisor is None else divisor])
    reduced = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, counts)
    total, divisors = tf.unstack(reduced)
    if divisor is not None:
        loss = loss * tf.cast(tf.math.divide_no_nan(divisor * replicas, divisors), loss.dtype)
    return loss, total / replicas
