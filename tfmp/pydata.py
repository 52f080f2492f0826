"""Keras `PyDataset`s and Python generators as tf.data datasets, so that `tfmp.fit` takes
them as `model.fit` does.

A PyDataset's batches come in an order drawn from the run's seed (shuffled each epoch where
`shuffle`, as `model.fit` does by default), so that a resumed run, which skips the batches
trained, reads the same batches on. They load on the PyDataset's `workers` threads, except
where it has epoch hooks of its own (`on_epoch_begin`, `on_epoch_end`): then one at a time,
so that each hook runs between the epochs' loads. A generator's batches come as it yields
them, each once: one epoch after another continues the same generator. Training's keeps
those read before its first update has run (`settle`), so that a dataset made again reads
them from the first, as a dataset does: the update XLA refused at its first step read them.

The hooks run on the pipeline's thread, which reads ahead of training: `tfmp.fit` waits,
before it returns, for the end hook of every pass it drew whole (`end_hooks_ran`), so that
each has run when it returns, as with Keras.
"""

import itertools
import threading
import types
import weakref

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from tfmp.errors import UsageError

_BEGIN, _END = -1, -2  # An epoch's hooks, as indices among a PyDataset's batches.
_warned = set()
END_HOOK_SECONDS = 60.0  # How long `tfmp.fit` waits for the last end hook (`end_hooks_ran`).
_HOOKED = weakref.WeakKeyDictionary()  # A dataset made here -> its PyDataset's `_Loader`, where it has hooks.
_ONCE = weakref.WeakSet()  # The datasets made here of generators: they end, repeated or not.
_AGAIN = weakref.WeakKeyDictionary()  # A shuffled dataset tfmp made (of a PyDataset, or arrays) -> its `again`.
_KEEPING = weakref.WeakKeyDictionary()  # A training generator's dataset -> its `_Once`, until `settle`.
_RAN_OUT = object()  # What `next` gives at a generator's end.


def is_python_data(data):
    """Whether `data` is a Keras PyDataset (or `keras.utils.Sequence`) or a Python generator."""
    return isinstance(data, keras.utils.PyDataset | types.GeneratorType)


def to_dataset(data, shuffle, seed, name="data", default_shuffle=False, keep=False):
    """A dataset of `data`'s batches (see the module's docstring).

    Args:
        data: a PyDataset or a generator, each batch `x`, `(x,)`, `(x, y)` or
            `(x, y, sample_weight)`, or a dict.
        shuffle: a new batch order each epoch (a PyDataset of known length only); None:
            `default_shuffle` for a PyDataset, no shuffle for a generator.
        seed: the seed of the batch orders.
        name: the argument's name, for errors.
        default_shuffle: what None means for a PyDataset (True when training, as in
            `model.fit`).
        keep: a generator's batches are kept until `settle`, to be read again (training's).

    Raises:
        UsageError: `shuffle` asked of a generator, an empty input, or a batch of another form.
    """
    if isinstance(data, types.GeneratorType):
        if shuffle:
            raise UsageError(f"{name} is a generator, whose batches come in the order it yields them: shuffle there")
        # Its first two batches (Keras' count, NUM_BATCHES_FOR_TENSOR_SPEC) set the spec: None where they differ.
        peeked = list(itertools.islice(data, 2))
        if not peeked:
            raise UsageError(f"{name} is a generator that yields nothing")
        spec = _spec([_standard(b, name) for b in peeked])
        batches = itertools.chain(peeked, data)  # One generator: every pass continues it.
        source = _Once((tuple(_flat(_standard(b, name), spec)) for b in batches), spec, keep)
        return source.dataset()
    return _from_py_dataset(data, default_shuffle if shuffle is None else shuffle, seed, name)


def _from_py_dataset(data, shuffle, seed, name):
    n = data.num_batches  # None: without end.
    if n == 0:
        raise UsageError(f"{name} is a PyDataset of length 0")
    spec = _spec([_standard(data[i], name) for i in range(2 if n is None else min(2, n))])
    # Epochs bracketed by their hooks (a PyDataset without end has no epochs of its own).
    hooks = n is not None and (_overrides(data, "on_epoch_begin") or _overrides(data, "on_epoch_end"))
    if data.use_multiprocessing and type(data) not in _warned:
        _warned.add(type(data))
        logging.warning("tfmp.fit loads %s's batches on threads: use_multiprocessing is not used", type(data).__name__)
    order = tf.data.Dataset.range(n) if n is not None else tf.data.Dataset.counter()
    if shuffle and n is not None:
        order = order.shuffle(n, seed=seed, reshuffle_each_iteration=True)
    if hooks:  # Each epoch: its begin hook, its batches, its end hook.
        order = tf.data.Dataset.from_tensors(tf.constant(_BEGIN, tf.int64)).concatenate(order)
        order = order.concatenate(tf.data.Dataset.from_tensors(tf.constant(_END, tf.int64)))
    loader = _Loader(data, spec, name, n)
    dtypes = [s.dtype for s in tf.nest.flatten(spec)]

    def load(index):
        leaves = tf.numpy_function(loader, [index], [tf.bool, *dtypes], stateful=True)
        for leaf, s in zip(leaves[1:], tf.nest.flatten(spec), strict=True):
            leaf.set_shape(s.shape)
        return leaves[0], tf.nest.pack_sequence_as(spec, leaves[1:])

    parallel = None if hooks or data.workers <= 1 else data.workers  # In order, where hooks run between.
    ds = order.map(load, num_parallel_calls=parallel, deterministic=True) if parallel else order.map(load)
    if hooks:  # The hooks' places left out: n batches an epoch again.
        ds = ds.filter(lambda is_batch, batch: is_batch).apply(tf.data.experimental.assert_cardinality(n))
    ds = ds.map(lambda is_batch, batch: batch).prefetch(tf.data.AUTOTUNE)
    if hooks:
        _HOOKED[ds] = loader
    # Shuffled, made again where a refused first step reads it again (with hooks, not: a hook would run twice).
    return again(ds, lambda: _from_py_dataset(data, shuffle, seed, name)) if shuffle and not hooks else ds


class _Once:
    """A generator's batches as datasets read them, each once. Where `keep`, until `settle`, every batch pulled
    from the generator is kept, and a dataset made again (`again`) reads them from the first, then goes on with
    the generator; a dataset made before it reads no more (its pipeline, left behind, may still be reading
    ahead). After `settle`, the kept batches that the last dataset had not read yet are read, then let go."""

    def __init__(self, batches, spec, keep):
        self._batches, self._spec, self._lock = batches, spec, threading.Lock()
        self._kept = [] if keep else None
        self._at = 0  # The kept batches the last dataset's first iterator has read.
        self._made, self._started, self._settled = 0, set(), False

    def dataset(self):
        self._made += 1
        made, spec = self._made, self._spec
        ds = tf.data.Dataset.from_generator(lambda: self._read(made), output_signature=tuple(tf.nest.flatten(spec)))
        ds = ds.map(lambda *leaves: tf.nest.pack_sequence_as(spec, leaves)).prefetch(tf.data.AUTOTUNE)
        _ONCE.add(ds)
        if self._kept is not None:
            _KEEPING[ds] = self
            again(ds, self.dataset)
        return ds

    def _read(self, made):
        """tf.data's generator for an iterator of the dataset `made`: its first, the kept batches, then the
        generator's next ones; another (a new epoch's) the generator's next ones."""
        with self._lock:
            first = made not in self._started
            self._started.add(made)
            if first:
                self._at = 0
        while True:
            with self._lock:
                if made != self._made:
                    return
                keeping = first and self._kept is not None
                if keeping and self._at < len(self._kept):
                    batch = self._kept[self._at]
                else:
                    batch = next(self._batches, _RAN_OUT)
                    if batch is _RAN_OUT:
                        return
                    if keeping and not self._settled:
                        self._kept.append(batch)
                if keeping:
                    self._at += 1
                    if self._settled:  # What it read is let go.
                        del self._kept[: self._at]
                        self._at = 0
            yield batch

    def settle(self):
        with self._lock:
            self._settled = True


def settle(dataset):
    """`dataset`'s first update has run: a training generator's batches are no longer kept (`to_dataset`'s `keep`),
    nor is `dataset` made again."""
    if isinstance(dataset, tf.data.Dataset) and dataset in _KEEPING:
        _KEEPING.pop(dataset).settle()
        _AGAIN.pop(dataset, None)


def runs_once(dataset):
    """Whether `dataset` was made here of a generator: its stream ends, however often it is repeated."""
    return isinstance(dataset, tf.data.Dataset) and dataset in _ONCE


def again(dataset, make):
    """`dataset`, whose `make()` makes it again: its shuffle's orders drawn anew from the first (each new iterator
    of `dataset` itself draws the next), so that a refused first step reads what it read (`Input.reread`)."""
    _AGAIN[dataset] = make
    return dataset


def made_again(dataset):
    """The function making `dataset` again (`again`), or None."""
    return _AGAIN.get(dataset) if isinstance(dataset, tf.data.Dataset) else None


def has_hooks(dataset):
    """Whether `dataset` was made here of a PyDataset with epoch hooks (`on_epoch_begin`, `on_epoch_end`)."""
    return isinstance(dataset, tf.data.Dataset) and dataset in _HOOKED


def end_hooks_ran(dataset, batches, timeout):
    """Waits until the end hook of every pass of `dataset`'s PyDataset that its first
    `batches` batches make whole has run (at most `timeout` seconds); returns whether it
    has. True at once for a dataset not made here or without hooks."""
    loader = _HOOKED.get(dataset) if isinstance(dataset, tf.data.Dataset) else None
    if loader is None:
        return True
    passes = batches // loader.batches
    with loader.ended:
        return loader.ended.wait_for(lambda: loader.ends >= passes, timeout)


class _Loader:
    """Loads a PyDataset's batch `index` as (True, its leaves); runs an epoch's hook for
    `_BEGIN` or `_END`, as (False, empty leaves), and counts the end hooks run (`ends`,
    `ended` notified after each)."""

    def __init__(self, data, spec, name, batches):
        self.data, self.spec, self.name, self.batches = data, spec, name, batches
        self.ends, self.ended = 0, threading.Condition()

    def __call__(self, index):
        index = int(index)
        if index in (_BEGIN, _END):
            (self.data.on_epoch_begin if index == _BEGIN else self.data.on_epoch_end)()
            if index == _END:
                with self.ended:
                    self.ends += 1
                    self.ended.notify_all()
            leaves = tf.nest.flatten(self.spec)
            return [np.bool_(False), *(np.zeros([d or 0 for d in s.shape], s.dtype.as_numpy_dtype) for s in leaves)]
        return [np.bool_(True), *_flat(_standard(self.data[index], self.name), self.spec)]


def _overrides(data, method):
    return getattr(type(data), method) is not getattr(keras.utils.PyDataset, method)


def _standard(batch, name):
    """A batch as `model.fit` reads it: a tuple of 1 to 3 (x, y, sample_weight), or a dict;
    lists as tuples at every depth (tf.data would take `[x1, x2]`, a model's two inputs,
    for one tensor to stack)."""
    batch = tuples(batch)
    if isinstance(batch, dict):
        return batch
    if isinstance(batch, np.ndarray):
        return (batch,)
    if not isinstance(batch, tuple) or len(batch) not in (1, 2, 3):
        raise UsageError(
            f"{name}'s batches must be (x,), (x, y) or (x, y, sample_weight), or a dict; got "
            f"{type(batch).__name__} {str(batch)[:80]}"
        )
    return batch


def tuples(structure):
    """Lists made tuples, at every depth (tf.data reads a list as one tensor to stack)."""
    if isinstance(structure, list | tuple):
        return tuple(tuples(s) for s in structure)
    if isinstance(structure, dict):
        return {k: tuples(v) for k, v in structure.items()}
    return structure


def _spec(batches):
    """The structure of `batches` as TensorSpecs: any batch size, and None in each dimension
    where the batches differ."""

    def leaf(*values):
        arrays = [np.asarray(v) for v in values]
        if any(a.ndim != arrays[0].ndim for a in arrays):
            raise UsageError(f"batches of one input differ in rank: shapes {[a.shape for a in arrays]}")
        shape = [None] + [
            d if all(a.shape[k + 1] == d for a in arrays) else None for k, d in enumerate(arrays[0].shape[1:])
        ]
        return tf.TensorSpec(shape, tf.as_dtype(arrays[0].dtype))

    return tf.nest.map_structure(leaf, *batches)


def _flat(batch, spec):
    """`batch`'s leaves as new numpy arrays of `spec`'s dtypes, checked against its structure.

    Copies, never views: TensorFlow takes a returned array's memory as its tensor's, and an
    op that reuses its input's buffer then writes into it. A view of the user's arrays (a
    PyDataset's `y[at]`) had its labels overwritten so under a MirroredStrategy, now and
    then: a run trained on other targets, and every run after it in the process too."""
    try:
        tf.nest.assert_same_structure(batch, spec)
    except (ValueError, TypeError) as e:
        raise UsageError(f"a batch's structure differs from the first batches': {e}") from None
    specs = tf.nest.flatten(spec)
    leaves = [
        np.array(v, s.dtype.as_numpy_dtype, copy=True) for v, s in zip(tf.nest.flatten(batch), specs, strict=True)
    ]
    if not all(s.shape.is_compatible_with(v.shape) for v, s in zip(leaves, specs, strict=True)):
        raise UsageError(
            f"a batch's shapes {[v.shape for v in leaves]} do not fit the first two batches' "
            f"{[tuple(s.shape) for s in specs]}, which fix each dimension they agree on, as model.fit's do (None: "
            "they differ); pad the batches to one length, or give the first two of different lengths"
        )
    return leaves
