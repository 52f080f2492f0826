"""What crosses replicas in one update, and the gradients rebuilt from it: the dense weight
gradients packed into one float32 vector and summed, the sparse ones (`tf.IndexedSlices`)
all-gathered, float8's state (`tfmp.float8`) as its maximum over replicas; each replica's
share weighed by its examples where the replicas' batches can differ in size."""

import keras
import tensorflow as tf

from tfmp import gradients


class Crossing:
    """Packs, all-reduces and unpacks the gradients of one model's trained variables.

    The positions are among the applied gradients: those of `applied`, the indices of the
    variables that got one (known when the step traces).

    Args:
        is_state: per trainable variable, whether it is float8 state (set, not learnt).
    """

    def __init__(self, is_state):
        self._state = is_state
        self._traced = None  # The gradients last packed: their shapes, dtypes and kinds.

    def weights(self, applied):
        """Positions of the weights' gradients (float8 state is no gradient)."""
        return [k for k, i in enumerate(applied) if not self._state[i]]

    def _kinds(self, grads, applied):
        """Positions in `grads` of: dense weight gradients (summed over replicas as one
        packed vector), sparse ones (all-gathered) and float8 state (the maximum)."""
        state = [k for k, i in enumerate(applied) if self._state[i]]
        weights = self.weights(applied)
        sparse = [k for k in weights if isinstance(grads[k], tf.IndexedSlices)]
        return [k for k in weights if k not in sparse], sparse, state

    def pack(self, grads, applied):
        """(one float32 vector of the dense gradients, one of the float8 state, the sparse
        gradients): what crosses replicas. Called while tracing."""
        self._traced = grads
        dense, sparse, state = self._kinds(grads, applied)

        def flat(positions):
            parts = [tf.reshape(tf.cast(grads[k], tf.float32), [-1]) for k in positions]
            return tf.concat(parts, 0) if parts else tf.zeros([0])

        return flat(dense), flat(state), [grads[k] for k in sparse]

    @staticmethod
    def all_reduce(dense_flat, state_flat, sparse):
        """The sum over replicas of the dense and sparse gradients (IndexedSlices are
        all-gathered, not densified); the maximum of the float8 state. In replica context."""
        context = tf.distribute.get_replica_context()
        if dense_flat.shape[0]:  # An empty collective crashes some implementations.
            dense_flat = context.all_reduce(tf.distribute.ReduceOp.SUM, dense_flat)
        if sparse:
            sparse = context.all_reduce(tf.distribute.ReduceOp.SUM, sparse)
        if state_flat.shape[0]:
            state_flat = tf.reduce_max(context.all_gather(state_flat[tf.newaxis], axis=0), axis=0)
        return dense_flat, state_flat, sparse

    def unpack(self, dense_flat, state_flat, sparse, applied):
        """The gradient list `pack` packed (its shapes and dtypes as traced)."""
        traced = self._traced
        grads = [None] * len(applied)
        dense, sparse_at, state = self._kinds(traced, applied)
        for positions, flat in ((dense, dense_flat), (state, state_flat)):
            sizes = [traced[k].shape.num_elements() for k in positions]
            for k, part in zip(positions, tf.split(flat, sizes) if sizes else [], strict=True):
                grads[k] = tf.cast(tf.reshape(part, traced[k].shape), traced[k].dtype)
        for k, g in zip(sparse_at, sparse, strict=True):
            grads[k] = g
        return grads


def examples(x):
    """The number of examples in inputs `x` (float32): the first input's leading dimension."""
    return tf.cast(tf.shape(_first(x))[0], tf.float32)


def _first(x):
    return next(t for t in tf.nest.flatten(x) if t is not None)


def examples_in(batches):
    """The examples of each of `batches` (float32; see `examples`)."""
    return [examples(keras.utils.unpack_x_y_sample_weight(batch)[0]) for batch in batches]


def share_of(count, replicas):
    """This replica's `count` x replicas / the sum of every replica's (1.0 where they are equal). In replica context."""
    total = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, count)
    return tf.math.divide_no_nan(count * replicas, total)


def sizes_vary(batches):
    """Whether `batches`' sizes are not all static: they can differ (the last of an epoch, or a replica's share)."""
    return any(_first(keras.utils.unpack_x_y_sample_weight(batch)[0]).shape[0] is None for batch in batches)


def weigh_by_share(batches, dense_flat, state_flat, sparse, loss, divisor, replicas, summed=False, share=None):
    """What `Crossing.pack` gave (and the loss) weighed by this replica's share of the global batch, where the
    replicas' batches can differ in size. Keras' loss, each replica's mean over its own examples divided by the
    replicas, weighs a replica's examples by how few it got (a last global batch of 1 example on 2 replicas: half
    its gradient; 33 as 17 and 16: each of the 16 more). Weighed by its examples x replicas / all examples (1.0
    where the split is even), the sum over replicas is the mean over the global batch, as on one device. Batches
    of a static size are equal on every replica: nothing to weigh. In replica context; `batches`: this replica's
    (micro-)batches, whose examples it counts; or, where the loss is a mean by a `divisor` (a masked output's
    unmasked elements, the sample weights' sum: `tfmp.accumulate`), the replica's, which weighs it even where the
    sizes are equal.
    `summed`: the losses are all sums, whose replicas' parts add up to the global sum as they are. `share`: the
    weight, where it was counted before the losses (`tfmp.accumulate.replica_share`)."""
    if share is None and (summed or (divisor is None and not sizes_vary(batches))):
        return dense_flat, state_flat, sparse, loss
    weight = share
    if weight is None:
        weight = share_of(divisor if divisor is not None else tf.add_n(examples_in(batches)), replicas)
    sparse = [gradients.scale(g, weight) for g in sparse]
    return dense_flat * weight, state_flat, sparse, loss * tf.cast(weight, loss.dtype)  # (float8 state: a maximum.)
