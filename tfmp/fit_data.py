"""`model.fit`'s data arguments (arrays, PyDatasets, generators; batch size, shuffle,
sample weights, validation split) as the datasets `tfmp.fit` trains on."""

import keras
import numpy as np
import tensorflow as tf

from tfmp import distribute, keras_compat, pydata
from tfmp.errors import UsageError, is_count
from tfmp.inputs import batch_dim

# model.fit's arguments for arrays, and what to do with a dataset instead.
_FOR_ARRAYS = {
    "y": "a dataset holds its targets: give (x, y) elements",
    "batch_size": "batch the dataset: `data.batch(N)`, N the global batch",
    "shuffle": "shuffle the dataset before batching: `data.shuffle(buffer, seed=...)`",
    "validation_split": "split the dataset: `data.take(n)` for validation_data, `data.skip(n)` to train on",
    "sample_weight": "give (x, y, sample_weight) elements in the dataset",
}


def datasets(
    data,
    y=None,
    *,
    strategy,
    sample_weight=None,
    validation_data=None,
    validation_split=0,
    batch_size=None,
    shuffle=None,
    training=True,
    steps=None,
    validation_steps=None,
    validation_batch_size=None,
    targets=True,
    statistics=None,
):
    """(training data, validation data) as datasets (or callables), from arrays, PyDatasets
    or generators as `model.fit` takes them (arrays and PyDatasets shuffled by default where
    `training`); a dataset as it is, where no argument for arrays is given. Without
    `targets` (a model with no compiled loss: its layers add theirs), arrays may be inputs
    alone, `x` or `(x,)`, as `model.fit(x)` takes them. `statistics`: the model's layer that
    computes statistics over each replica's batch (`distribute.batch_statistics`). Arrays without a
    batch size are batched as Keras batches them: in `steps` batches where `steps` is given
    (`validation_steps` for validation arrays, after `validation_batch_size`), else 32."""
    data, y, sample_weight, validation_data = (numpy_leaves(a) for a in (data, y, sample_weight, validation_data))
    _no_python_numbers(data=data, y=y, sample_weight=sample_weight, validation_data=validation_data)
    if not (shuffle is None or isinstance(shuffle, (bool, np.bool_)) or shuffle == "batch"):
        raise UsageError(f'shuffle must be True, False or "batch" (as in model.fit), got {shuffle!r}')
    seed = keras_compat.global_seed() or 0
    kind = "dataset" if isinstance(data, tf.data.Dataset) else type(data).__name__
    if pydata.is_python_data(data):
        kind = "PyDataset" if isinstance(data, keras.utils.PyDataset) else "generator"
        data, shuffle = pydata.to_dataset(data, shuffle, seed, default_shuffle=training, keep=training), None
    if pydata.is_python_data(validation_data):
        validation_data = pydata.to_dataset(validation_data, False, seed, "validation_data")
    if targets:
        _check_tuple_length("validation_data", validation_data)
    if is_array_structure(validation_data) and not is_arrays(validation_data):  # x alone, as model.fit takes it.
        if targets:
            raise UsageError("validation_data holds inputs only: give the targets too, (x_val, y_val)")
        validation_data = (validation_data,)
    given = {"y": y, "batch_size": batch_size, "shuffle": shuffle, "sample_weight": sample_weight}
    given["validation_split"] = validation_split or None
    arrays = None
    if y is None and targets:  # (Without a compiled loss, a list of arrays may be x alone: several inputs.)
        _check_tuple_length("data", data)
    if y is not None and is_array_structure(data):
        arrays = (data, y)  # tfmp.fit(model, x, y), as model.fit(x, y).
    elif is_arrays(data):
        arrays = data
    elif is_array_structure(data) and targets:
        raise UsageError("data holds inputs only: give the targets too, as y or in (x, y) as data")
    elif is_array_structure(data):
        arrays = (data,)
    tpu = distribute.strategy_name(strategy) == "tpu"  # Static shapes: whole batches only.
    if arrays is None:
        for name, value in given.items():
            if value is not None:
                raise UsageError(f"{name}= is for arrays, and data is a {kind}: {_FOR_ARRAYS[name]}")
        _check_validation_batch(validation_batch_size, validation_data)
        if is_arrays(validation_data):  # Batched as the training data is.
            batch = batch_dim(data.element_spec) if isinstance(data, tf.data.Dataset) else None
            batch = validation_batch_size or batch or keras_batch(validation_data, validation_steps)
            validation_data = from_arrays(validation_data, batch, drop_remainder=tpu)
        return data, validation_data
    if sample_weight is not None:
        if len(arrays) == 1:
            raise UsageError("sample_weight weighs the compiled loss against targets, and there are neither")
        if len(arrays) == 3:
            raise UsageError("sample_weight is given twice: in the data tuple and as sample_weight")
        arrays = (*arrays, sample_weight)
    _check_batch("batch_size", batch_size)
    if validation_split:
        if not 0 < validation_split < 1:
            raise UsageError(f"validation_split must be in [0, 1), got {validation_split!r}")
        if validation_data is not None:
            raise UsageError("give validation_data or validation_split, not both")
        arrays, validation_data = split_arrays(arrays, validation_split)
    _check_validation_batch(validation_batch_size, validation_data)
    order = training if shuffle is None else shuffle
    batch = batch_size or keras_batch(arrays, steps)
    drop = tpu or distribute.leaves_a_replica_none(num_examples(arrays), batch, strategy, statistics)
    train = from_arrays(arrays, batch, order, seed, drop_remainder=drop)
    if is_arrays(validation_data):
        batch = validation_batch_size or batch_size or keras_batch(validation_data, validation_steps)
        validation_data = from_arrays(validation_data, batch, drop_remainder=tpu)
    return train, validation_data


def keras_batch(arrays, steps):
    """The batch Keras gives arrays without a batch size: all of them in `steps` batches
    where `steps` is given (`model.fit(x, y, steps_per_epoch=4)` trains on batches of
    ceil(n / 4)), else 32. A bad `steps` is left to its own check."""
    if is_count(steps, 1):
        return -(-num_examples(arrays) // int(steps))
    return 32


def _check_tuple_length(name, data):
    """UsageError for a tuple or list of arrays longer than (x, y, sample_weight), for a model with a compiled loss
    (several inputs go in x as a tuple of their own, or a dict); `model.fit` refuses such validation_data too."""
    if isinstance(data, tuple | list) and len(data) > 3 and is_array_structure(data):
        raise UsageError(
            f"{name} is a {type(data).__name__} of {len(data)} arrays: give (x, y) or (x, y, sample_weight), "
            "x a tuple or dict of its own for several inputs"
        )


def _check_batch(name, batch):
    """UsageError for a batch size that is not an integer >= 1."""
    if batch is not None and not is_count(batch, 1):
        raise UsageError(f"{name} must be an integer >= 1, got {batch!r}")


def _check_validation_batch(batch, validation_data):
    """`_check_batch`, and UsageError for a batch size given to validation data that is batched already."""
    _check_batch("validation_batch_size", batch)
    if batch is not None and validation_data is not None and not is_arrays(validation_data):
        raise UsageError(
            "validation_batch_size batches validation arrays; validation_data is not arrays: batch it yourself"
        )


def numpy_leaves(data):
    """`data` with each array-like in it (a pandas DataFrame or Series, a JAX array: what
    has `__array__` and a `shape`) as a numpy array, as `model.fit` takes them."""

    def leaf(value):
        if isinstance(value, np.ndarray | tf.Tensor | tf.data.Dataset) or not hasattr(value, "__array__"):
            return value
        return np.asarray(value) if hasattr(value, "shape") else value

    return tf.nest.map_structure(leaf, data) if isinstance(data, tuple | list | dict) else leaf(data)


def _no_python_numbers(**given):
    for name, value in given.items():
        if isinstance(value, tuple | list | dict) and any(isinstance(a, int | float) for a in tf.nest.flatten(value)):
            raise UsageError(f"{name} holds Python numbers where arrays go (numpy arrays or tensors): np.asarray it")


def is_array_structure(data):
    """Whether `data` is a numpy array or tensor, or a tuple, list or dict of them (None for an optional input, as
    `model.fit` takes it, beside one at least)."""
    if not isinstance(data, np.ndarray | tf.Tensor | tuple | list | dict):
        return False
    arrays = [a for a in tf.nest.flatten(data) if a is not None]
    return bool(arrays) and all(isinstance(a, np.ndarray | tf.Tensor) for a in arrays)


def is_arrays(data):
    """Whether `data` is `model.fit`'s arrays: a tuple (x, y) or (x, y, sample_weight), or
    (x,) for a model with no compiled loss, of numpy arrays or tensors (x and y may be
    tuples, lists or dicts of them)."""
    return isinstance(data, tuple | list) and len(data) in (1, 2, 3) and is_array_structure(data)


def split_arrays(arrays, validation_split):
    """(training, validation) arrays: the last `validation_split` of the examples, before any
    shuffling, held out for validation, as `model.fit` does."""
    n = num_examples(arrays)
    at = int(n * (1 - validation_split))
    if not 0 < at < n:
        raise UsageError(f"validation_split={validation_split} of {n} examples leaves no training or validation data")
    return tuple(_each(lambda a, s=s: a[s], arrays) for s in (slice(None, at), slice(at, None)))


def _each(fn, arrays):
    """`fn` of each array in `arrays`; a None (an optional input's) stays None."""
    return tf.nest.map_structure(lambda a: None if a is None else fn(a), arrays)


def num_examples(arrays):
    lengths = {int(a.shape[0]) if len(a.shape) else 0 for a in tf.nest.flatten(pydata.tuples(arrays)) if a is not None}
    if len(lengths) != 1 or 0 in lengths:
        raise UsageError(f"the arrays must hold the same number (> 0) of examples; their lengths are {sorted(lengths)}")
    return lengths.pop()


def _tensors(arrays):
    with tf.device("CPU:0"):  # Where the input pipeline reads them, whatever the accelerator.
        return _each(tf.convert_to_tensor, pydata.tuples(arrays))


def from_arrays(arrays, batch_size, shuffle=False, seed=0, drop_remainder=False):
    """A dataset of `batch_size` batches of `arrays` ((x, y) or (x, y, sample_weight)), the
    examples in a new order each pass where `shuffle` (`"batch"`, as in `model.fit`: each batch's
    examples, consecutive, in a new order within it): the same orders for the same `seed`,
    so that a resumed run, which skips the batches trained, reads the same batches on.
    The shuffle buffer holds the examples' indices, not copies of the examples. Where every
    batch is whole, their size is static, as in `model.fit` (TensorFlow's graph optimizer then
    multiplies by 1 / N where a mean's gradient divides by N: a BatchNormalization trains to
    model.fit's bits)."""
    n, tensors = num_examples(arrays), _tensors(arrays)
    drop_remainder = drop_remainder or n % batch_size == 0  # Drops nothing: a static batch size.
    order = tf.data.Dataset.range(n)
    if shuffle:
        order = order.shuffle(n, seed=seed, reshuffle_each_iteration=True)
    batches = order.batch(batch_size, drop_remainder=drop_remainder)
    if shuffle == "batch":  # As model.fit: each batch the same consecutive examples, in a new order each pass,
        # drawn from the seeded permutation above (each batch's part of it ranks its examples).
        keys, batches = batches, tf.data.Dataset.range(n).batch(batch_size, drop_remainder=drop_remainder)
        batches = tf.data.Dataset.zip(batches, keys).map(lambda indices, key: tf.gather(indices, tf.argsort(key)))
    gather = lambda indices: _each(lambda t: tf.gather(t, indices), tensors)  # noqa: E731
    dataset = batches.map(gather).prefetch(tf.data.AUTOTUNE)
    if not shuffle:  # Read alike by every iterator.
        return dataset
    return pydata.again(dataset, lambda: from_arrays(tensors, batch_size, shuffle, seed, drop_remainder))
