"""Turn a source's examples into batched, prefetched (inputs, label) datasets."""

import dataclasses
import functools
import typing

import keras
import tensorflow as tf

from tfmp.data import sources

AUTOTUNE = tf.data.AUTOTUNE


@dataclasses.dataclass
class Data:
    """Batched datasets and what a model needs to know about them.

    Attributes:
        source: the `sources.Source` description.
        global_batch: examples per step over all replicas.
        make_train: `make_train(input_context=None, skip=0)` returns the training
            dataset of one input pipeline: its shard of the examples, shuffled, batched
            at its part of the global batch, `skip` global batches in. Without a context:
            the whole data at the global batch. In-memory data skips in O(1): it walks
            a stream of example indices, one stateless permutation per epoch.
        test: (inputs, label) batches at the global batch size, in order, every example.
        vectorizer: for text, the adapted `TextVectorization` layer (keep it with the
            model to accept raw strings); None for images.
    """

    source: sources.Source
    global_batch: int
    make_train: typing.Callable
    test: tf.data.Dataset
    vectorizer: keras.layers.TextVectorization | None = None  # A `Vectorizer`.

    @functools.cached_property
    def train(self):
        """The training batches at the global batch size, for one process."""
        return self.make_train()


def _augment(image, seed):
    """Random 4-pixel-padded crop and horizontal flip, for 32x32 colour images."""
    height, width, channels = image.shape
    padded = tf.image.pad_to_bounding_box(image, 4, 4, height + 8, width + 8)
    seeds = tf.random.experimental.stateless_split(seed, 2)
    image = tf.image.stateless_random_crop(padded, (height, width, channels), seed=seeds[0])
    return tf.image.stateless_random_flip_left_right(image, seed=seeds[1])


@keras.saving.register_keras_serializable(package="tfmp")
class Vectorizer(keras.layers.TextVectorization):
    """`TextVectorization` (int ids, right-padded with 0) under which no text is empty:
    a text with no token (empty, or only punctuation, like SST-2's ")") reads as one
    unknown word, `[UNK]`, instead of a row of padding.

    A row of padding is fully masked to a `mask_zero` embedding, and cuDNN's RNN kernel
    (Keras' LSTM and GRU on a GPU) refuses a batch holding one ("You are passing a RNN
    mask that does not correspond to right-padded sequences"). Training, evaluation and
    an exported model that takes raw strings all vectorize through this layer, so none
    meets it.
    """

    OOV_ID = 1  # TextVectorization's ids: 0 is padding, 1 the out-of-vocabulary token.

    def call(self, inputs):
        ids = super().call(inputs)
        if self._output_mode != "int":  # Counts and multi-hot have no padding.
            return ids
        empty = tf.reduce_all(tf.equal(ids, 0), axis=-1, keepdims=True)
        first = tf.equal(tf.range(tf.shape(ids)[-1]), 0)
        return tf.where(tf.logical_and(empty, first), tf.constant(self.OOV_ID, ids.dtype), ids)


def make_vectorizer(texts, vocab_size, sequence_length):
    """A `Vectorizer` adapted on `texts` (a dataset of strings)."""
    vectorizer = Vectorizer(max_tokens=vocab_size, output_sequence_length=sequence_length, name="vectorizer")
    vectorizer.adapt(texts.batch(1024))
    return vectorizer


def build(
    source,
    train,
    test,
    global_batch,
    seed=0,
    augment=False,
    repeat=False,
    drop_remainder=False,
    vocab_size=20000,
    sequence_length=64,
    deterministic=True,
    static_eval=False,
):
    """Builds the input pipeline for one dataset.

    Args:
        source, train, test: what `sources.load_source` returned.
        global_batch: the batch size summed over all replicas.
        seed: the shuffle and augmentation seed.
        augment: random crop and flip (meant for 32x32 colour data).
        repeat: repeat the training data without end (steps_per_epoch sets epochs).
        drop_remainder: static training batch shapes (TPUs need them). The test split
            keeps its last, partial batch so every example is evaluated.
        vocab_size, sequence_length: for text, the vectorizer's settings.
        static_eval: drop the test split's last partial batch too (TPUs compile for one
            batch shape); otherwise every test example is evaluated.
        deterministic: keep element order fixed through parallel maps (a little
            slower); False lets tf.data hand out whichever element is ready first.

    Returns:
        A `Data`.
    """
    feature, vectorizer = source.feature, None
    if source.kind == "image":

        def to_inputs(ex):
            return tf.cast(ex[feature], tf.float32) / 255.0  # The model casts to the policy.
    else:
        vectorizer = make_vectorizer(train.map(lambda ex: ex[feature]), vocab_size, sequence_length)

        def to_inputs(ex):
            # One string at a time as a batch of one: the padded length stays static.
            return vectorizer(ex[feature][None])[0]

    def prepare(ds):
        return ds.map(lambda ex: (to_inputs(ex), ex["label"]), num_parallel_calls=AUTOTUNE)

    options = tf.data.Options()
    options.deterministic = deterministic
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF  # Sharded below.
    buffer = min(source.train_size or 10_000, 10_000)

    def make_streamed(input_context=None, skip=0):
        """In-memory data as a stream of example indices: epoch e is the permutation
        stateless_shuffle(range(n), (seed, e)), so a resumed run jumps to its epoch and
        skips integers within it: the cost does not grow with the step reached."""
        nonlocal table
        if table is None:  # Every example, prepared once: (inputs, labels) tensors.
            examples = train.batch(2**31 - 1).get_single_element()
            inputs = (
                tf.cast(examples[feature], tf.float32) / 255.0
                if source.kind == "image"
                else vectorizer(examples[feature])
            )
            table = (inputs, examples["label"])
        n, batch, shards, index = int(table[1].shape[0]), global_batch, 1, 0
        if input_context is not None:
            shards, index = input_context.num_input_pipelines, input_context.input_pipeline_id
            batch = input_context.get_per_replica_batch_size(global_batch)
        first_epoch, offset = divmod(skip * global_batch, n)

        def epoch_order(epoch):
            return tf.data.Dataset.from_tensor_slices(
                tf.random.experimental.stateless_shuffle(
                    tf.range(n, dtype=tf.int64), seed=tf.stack([tf.constant(seed, tf.int64), epoch])
                )
            )

        epochs = tf.data.Dataset.range(first_epoch, first_epoch + 2**40) if repeat else tf.data.Dataset.range(1)
        ds = epochs.flat_map(epoch_order).skip(offset)
        if shards > 1:  # Every worker walks the same order and keeps every n-th example.
            ds = ds.shard(shards, index)
        ds = ds.batch(batch, drop_remainder=drop_remainder)
        ds = ds.map(lambda i: (tf.gather(table[0], i), tf.gather(table[1], i)), num_parallel_calls=AUTOTUNE)
        return ds.prefetch(AUTOTUNE).with_options(options)

    def make_decoded(input_context=None, skip=0):
        ds, batch, shards, index = train, global_batch, 1, 0
        if input_context is not None:
            shards, index = input_context.num_input_pipelines, input_context.input_pipeline_id
            batch = input_context.get_per_replica_batch_size(global_batch)
        if shards > 1 and not source.in_memory:
            ds = ds.shard(shards, index)  # Large data: this worker reads and keeps only its part.
        ds = prepare(ds).cache().shuffle(buffer, seed=seed, reshuffle_each_iteration=True)
        if repeat:
            ds = ds.repeat()
        if shards > 1 and source.in_memory:
            # Small data: every worker walks the same seeded order and keeps every n-th
            # example, so each global batch holds the examples a single device would see.
            ds = ds.shard(shards, index)
        if augment and source.kind == "image":
            ds = tf.data.Dataset.zip((ds, tf.data.Dataset.random(seed=seed).batch(2))).map(
                lambda xy, s: (_augment(xy[0], s), xy[1]), num_parallel_calls=AUTOTUNE
            )
        ds = ds.batch(batch, drop_remainder=drop_remainder)
        if skip:  # Decodes what it skips: the cost grows with the step (record-file datasets).
            ds = ds.skip(skip * (input_context.num_replicas_in_sync // shards if input_context else 1))
        return ds.prefetch(AUTOTUNE).with_options(options)

    table = None
    make_train = make_streamed if source.in_memory and source.train_size and not augment else make_decoded

    test = prepare(test).cache().batch(global_batch, drop_remainder=static_eval).prefetch(AUTOTUNE)
    test = test.with_options(options)
    return Data(source, global_batch, make_train, test, vectorizer)
