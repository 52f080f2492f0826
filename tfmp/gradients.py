"""Gradient arithmetic that keeps an embedding's `tf.IndexedSlices` sparse.

An embedding lookup's gradient touches only the rows looked up; tfmp sums, all-reduces,
checks and clips it in that form instead of as a dense (vocabulary x width) tensor.
"""

import contextlib

import tensorflow as tf


def shaped(grads, variables):
    """Each gradient with its variable's static shape where tracing lost it (the gradient of
    a matmul that broadcasts, say, whose shape is computed as it runs): packing the
    gradients for the all-reduce and grouping their squares by shape need it."""
    return [
        g if g is None or isinstance(g, tf.IndexedSlices) or g.shape.is_fully_defined() else tf.ensure_shape(g, v.shape)
        for g, v in zip(grads, variables, strict=True)
    ]


def add(a, b):
    """a + b; two IndexedSlices are concatenated (their rows are summed when deduplicated)."""
    if a is None:
        return None
    if isinstance(a, tf.IndexedSlices) and isinstance(b, tf.IndexedSlices):
        return tf.IndexedSlices(tf.concat([a.values, b.values], 0), tf.concat([a.indices, b.indices], 0), a.dense_shape)
    return tf.convert_to_tensor(a) + tf.convert_to_tensor(b)


def to_float32(g):
    """A 16-bit gradient in float32 (sparse stays sparse); others as they are."""
    if g is None or tf.as_dtype(g.dtype) not in (tf.bfloat16, tf.float16):
        return g
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(tf.cast(g.values, tf.float32), g.indices, g.dense_shape)
    return tf.cast(g, tf.float32)


def deduplicate(g):
    """IndexedSlices with each index's rows summed into its first row, other gradients as
    they are. The shapes do not depend on the values: the rows stay as many as `g` has,
    with the same indices, and a repeated index's later rows become zero. Zero rows change
    no sum, norm or zero-preserving update (Keras' sparse ops are).

    Each row goes to the first row of its index, found by a scatter-minimum of row
    numbers over the table's rows. Not `tf.unique`: XLA compiles that to a loop over every
    index (16,384 iterations for a 256 x 64 batch of token ids, slower than the model's
    whole step). Nor sorting: XLA's lowering of `tf.argsort` makes the module dynamic, and
    its dynamic padder then inlines the random-number generators of dropout into every
    consumer (a transformer's step 7x slower on a CPU). Nor a count of the distinct indices
    as the number of rows: under XLA the token ids become a compile-time constant, and the
    step is compiled again for every new batch."""
    if not isinstance(g, tf.IndexedSlices):
        return g
    rows = tf.shape(g.indices, out_type=g.indices.dtype)[0]
    numbers = tf.range(rows)
    table_rows = tf.cast(g.dense_shape[0], g.indices.dtype)
    first = tf.tensor_scatter_nd_min(tf.fill([table_rows], rows), g.indices[:, tf.newaxis], numbers)
    values = tf.math.unsorted_segment_sum(g.values, tf.gather(first, g.indices), rows)
    return tf.IndexedSlices(values, g.indices, g.dense_shape)


def values(g):
    """The numbers a gradient holds: an IndexedSlices' rows, or the tensor itself."""
    return g.values if isinstance(g, tf.IndexedSlices) else g


def half_squares(g):
    """Half the sum of the squares of a gradient's numbers, in float32 (IndexedSlices
    deduplicated first): `l2_loss`, one fused pass over it. BERT-base's 110M gradients take
    16 ms on a 2-core CPU, against 28 ms squared and then summed."""
    return tf.nn.l2_loss(tf.cast(values(g), tf.float32))


# Whether `half_squares_all` groups by shape: None follows `Steps`' rule (under XLA on a GPU, without on a CPU);
# True or False forces it (`python -m tfmp.bench.gpu_report --grouped_norm`).
GROUPED = None
# The largest gradient grouped (numbers). Should XLA copy a stack, the copy moves its bytes
# twice: for 2^18 float32 (1 MB) about 0.7 us at ~3 TB/s, a fraction of the launch of a few
# microseconds that grouping saves; from about 2^20 on, the copy would cost more than that.
GROUP_MOST = 1 << 18


@contextlib.contextmanager
def forced_grouping(grouped):
    """`GROUPED` set to `grouped` for the steps compiled inside the block (the benches' variants), then as before."""
    global GROUPED
    before, GROUPED = GROUPED, grouped
    try:
        yield
    finally:
        GROUPED = before


def half_squares_all(grads, grouped):
    """[`half_squares`(g) for g in grads], as one vector. Grouped, the dense gradients of one
    shape and dtype are stacked and reduced together: one reduction per shape instead of one
    per gradient, each a kernel on a GPU (an op to dispatch without XLA). Only gradients of
    at most `GROUP_MOST` numbers: the launches saved are the small ones', and a large stack's
    copy would cost more. Either way each gradient's sum is its own, so which one is not
    finite stays known."""
    if not grouped:
        return tf.stack([half_squares(g) for g in grads])
    groups = {}
    for k, g in enumerate(grads):
        small = g.shape.is_fully_defined() and g.shape.num_elements() <= GROUP_MOST
        whole = small and not isinstance(g, tf.IndexedSlices)
        groups.setdefault((tuple(g.shape), g.dtype) if whole else k, []).append(k)
    parts, order = [], []
    for key, members in groups.items():
        if len(members) == 1:
            parts.append(half_squares(grads[members[0]])[tf.newaxis])
        else:
            stacked = tf.stack([tf.cast(grads[k], tf.float32) for k in members])
            parts.append(0.5 * tf.reduce_sum(tf.square(stacked), axis=list(range(1, len(key[0]) + 1))))
        order += members
    where = [0] * len(order)
    for position, k in enumerate(order):
        where[k] = position
    return tf.gather(tf.concat(parts, 0), where)


def scale(g, factor):
    """g * factor, sparse stays sparse."""
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(g.values * tf.cast(factor, g.values.dtype), g.indices, g.dense_shape)
    return g * tf.cast(factor, g.dtype)
