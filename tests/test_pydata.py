"""tfmp.fit and tfmp.evaluate on Keras PyDatasets and Python generators, as model.fit takes
them: model.fit's weights where the order is the same, a seeded batch order that a resumed
run repeats, the epoch hooks between epochs' loads, and clear errors."""

import itertools
import time
import types
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import assert_same, regression, regression_arrays, weights

import tfmp
from tfmp import pydata
from tfmp.errors import UsageError

X, Y = regression_arrays()  # 256 examples: 8 batches of 32.


class Batches(keras.utils.PyDataset):
    """conftest's regression examples in batches of 32; `log` records each load and hook."""

    def __init__(self, weights=None, **kwargs):
        super().__init__(**kwargs)
        self.weights, self.log = weights, []

    def __len__(self):
        return len(X) // 32

    def __getitem__(self, index):
        self.log.append(int(index))
        at = slice(index * 32, (index + 1) * 32)
        return (X[at], Y[at]) if self.weights is None else (X[at], Y[at], self.weights[at])


class Hooked(Batches):
    def on_epoch_begin(self):
        self.log.append("begin")

    def on_epoch_end(self):
        time.sleep(0.3)  # A slow hook: the pipeline's thread is still in it as the last update ends.
        self.log.append("end")


def generator():
    for index in range(len(X) // 32):
        yield X[index * 32 : (index + 1) * 32], Y[index * 32 : (index + 1) * 32]


def test_a_py_dataset_and_a_generator_train_as_model_fit_does(mirrored):
    run = {"shuffle": False, "verbose": 0}
    same = {**run, "jit_compile": False}  # Not "auto": XLA, where its timing picks it, rounds otherwise.
    theirs = regression()
    keras_history = theirs.fit(Batches(), epochs=2, validation_data=Batches(), **run)
    ours = regression()
    history = tfmp.fit(ours, Batches(), epochs=2, validation_data=Batches(), **same)
    assert_same(weights(ours), weights(theirs))
    for key, values in keras_history.history.items():
        np.testing.assert_allclose(history.history[key], values, rtol=1e-5)
    two = regression(mirrored)
    tfmp.fit(two, Batches(), epochs=2, validation_data=Batches(), **same)
    assert_same(weights(two), weights(theirs))
    from_generator, theirs = regression(), regression()
    theirs.fit(generator(), epochs=1, verbose=0)
    tfmp.fit(from_generator, generator(), epochs=1, verbose=0, jit_compile=False)
    assert_same(weights(from_generator), weights(theirs))
    w = np.linspace(0.5, 1.5, len(X), dtype=np.float32)  # (x, y, sample_weight) batches.
    weighted, theirs = regression(), regression()
    theirs.fit(Batches(w), **run)
    tfmp.fit(weighted, Batches(w), **same)
    assert_same(weights(weighted), weights(theirs))
    expected = theirs.evaluate(Batches(), verbose=0, return_dict=True)
    result = tfmp.evaluate(theirs, Batches(), return_dict=True)
    np.testing.assert_allclose([result[k] for k in expected], list(expected.values()), rtol=1e-5)


def test_the_batch_order_is_set_by_the_seed_and_a_resumed_run_repeats_it(tmp_path):
    run = {"epochs": 3, "verbose": 0}
    straight, again, unshuffled = regression(), regression(), regression()
    tfmp.fit(straight, Batches(), **run)
    tfmp.fit(again, Batches(workers=3), **run)  # Loaded on 3 threads: the same order.
    tfmp.fit(unshuffled, Batches(), shuffle=False, **run)
    assert_same(weights(again), weights(straight), atol=0)
    assert max(np.abs(a - b).max() for a, b in zip(weights(unshuffled), weights(straight), strict=True)) > 1e-4
    halves = regression()  # Stopped after the first epoch, then resumed: the orders go on.
    tfmp.fit(halves, Batches(), **{**run, "epochs": 1}, checkpoint_dir=str(tmp_path))
    tfmp.fit(halves, Batches(), **run, checkpoint_dir=str(tmp_path))
    assert_same(weights(halves), weights(straight), atol=0)


def test_epoch_hooks_run_between_the_epochs_loads():
    data = Hooked(workers=4)  # Hooks of its own: loaded in order, one at a time.
    history = tfmp.fit(regression(), data, epochs=2, verbose=0)
    assert history.params["steps"] == len(data)  # Its length known, the hooks' places left out.
    assert data.log.count("end") == 2  # The last epoch's end hook too, before tfmp.fit returned, as in Keras.
    log = data.log[data.log.index("begin") :]  # After the first batches' shapes were read.
    epoch = len(data) + 2
    for k in range(2):
        begin, *loads, end = log[k * epoch : (k + 1) * epoch]
        assert (begin, end) == ("begin", "end") and sorted(loads) == list(range(len(data)))
    assert log[2 * epoch : 2 * epoch + 1] in ([], ["begin"])  # What was read ahead starts the next epoch.
    assert log[1 : epoch - 1] != log[epoch + 1 : 2 * epoch - 1]  # Shuffled each epoch.


def test_an_endless_py_dataset_and_a_generator_go_on_across_epochs():
    class Endless(Batches):
        @property
        def num_batches(self):
            return None

        def __getitem__(self, index):
            return super().__getitem__(index % 8)

    model = regression()
    tfmp.fit(model, Endless(), epochs=2, steps_per_epoch=5, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 10
    with pytest.raises(UsageError, match="repeats without end: give steps_per_epoch"):
        tfmp.fit(regression(), Endless(), verbose=0)
    model = regression()
    tfmp.fit(model, generator(), epochs=2, steps_per_epoch=3, verbose=0)  # One generator, 6 of its 8 batches.
    assert int(model.optimizer.iterations.numpy()) == 6


@pytest.mark.parametrize("jit_compile", [False, True])
@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("steps_per_epoch", [3, 4])
def test_a_generator_that_runs_out_ends_training_at_its_last_batch(
    mirrored, caplog, steps_per_epoch, replicas, jit_compile
):
    """A generator of 8 batches with steps_per_epoch: with 3, epochs of 3, 3 and 2 batches (the third ends, its
    logs kept, and training stops with one warning, as Keras fit's "Your input ran out of data"); with 4, two epochs,
    the third gets none. Either way exactly 8 updates, counted so (the failed read updates nothing, not even the
    count), the weights those of one epoch over the 8 batches."""
    strategy = mirrored if replicas == 2 else tf.distribute.get_strategy()
    expected = regression(strategy)
    tfmp.fit(expected, generator(), epochs=1, verbose=0, jit_compile=jit_compile)
    model = regression(strategy)
    with caplog.at_level("WARNING"):
        history = tfmp.fit(
            model, generator(), epochs=4, steps_per_epoch=steps_per_epoch, verbose=0, jit_compile=jit_compile
        )
    assert int(model.optimizer.iterations.numpy()) == 8
    assert_same(weights(model), weights(expected), atol=1e-6)
    (line,) = [r.getMessage() for r in caplog.records if "ran out" in r.getMessage()]
    if steps_per_epoch == 3:
        assert history.epoch == [0, 1, 2] and len(history.history["loss"]) == 3
        assert line.startswith("data ran out: epoch 3 got 2 of its 3 batches; training stops after it")
    else:
        assert history.epoch == [0, 1]
        assert line.startswith("data ran out: epoch 3 got no batch; training stops")


def test_a_dataset_of_one_generator_object_that_runs_out_within_an_epoch_ends_training_there(caplog):
    """The user's own dataset made of one generator object (tfmp repeats it; its next pass is empty): 6 batches at
    steps_per_epoch=4 end the second epoch after 2, with advice for a dataset, not for a generator."""
    batches = itertools.islice(generator(), 6)
    spec = (tf.TensorSpec((None, 8), tf.float32), tf.TensorSpec((None, 1), tf.float32))
    data = tf.data.Dataset.from_generator(lambda: batches, output_signature=spec)
    expected = regression()
    tfmp.fit(expected, generator(), epochs=1, steps_per_epoch=6, verbose=0, jit_compile=False)
    model = regression()
    with caplog.at_level("WARNING"):
        history = tfmp.fit(model, data, epochs=3, steps_per_epoch=4, verbose=0, jit_compile=False)
    assert history.epoch == [0, 1]
    assert_same(weights(model), weights(expected), atol=1e-6)
    (line,) = [r.getMessage() for r in caplog.records if "ran out" in r.getMessage()]
    assert "epoch 2 got 2 of its 4 batches" in line and "give from_generator a function that makes" in line


def test_batches_of_a_list_of_inputs_train_as_arrays_do():
    """[x1, x2], a two-input model's inputs, from a PyDataset or a generator (model.fit
    fails on both: tf.data takes a list for one tensor to stack)."""

    def two_inputs():
        keras.utils.set_random_seed(0)
        halves = [keras.Input((4,)), keras.Input((4,))]
        model = keras.Model(halves, keras.layers.Dense(1)(keras.layers.Concatenate()(halves)))
        model.compile(keras.optimizers.Adam(1e-2), "mse")
        return model

    class Pairs(keras.utils.PyDataset):
        def __len__(self):
            return len(X) // 32

        def __getitem__(self, index):
            at = slice(index * 32, (index + 1) * 32)
            return [X[at, :4], X[at, 4:]], Y[at]

    theirs = two_inputs()
    theirs.fit([X[:, :4], X[:, 4:]], Y, batch_size=32, shuffle=False, verbose=0)
    for data in (Pairs(), (Pairs()[i] for i in range(len(X) // 32))):
        ours = two_inputs()
        tfmp.fit(ours, data, shuffle=False if isinstance(data, Pairs) else None, jit_compile=False, verbose=0)
        assert_same(weights(ours), weights(theirs))


def test_only_a_shuffled_py_dataset_without_epoch_hooks_is_made_again_for_a_refused_first_step():
    """Made again (`pydata.again`: a first step XLA refused reads its batches again alike, no probe up front),
    a PyDataset's epoch hooks would run twice; unshuffled, any new iterator reads alike; a generator runs once."""
    made = {
        name: pydata.made_again(pydata.to_dataset(data, shuffle, seed=0))
        for name, data, shuffle in [
            ("shuffled", Batches(), True),
            ("hooked", Hooked(), True),
            ("in order", Batches(), False),
            ("generator", generator(), None),
        ]
    }
    assert callable(made.pop("shuffled")) and made == {"hooked": None, "in order": None, "generator": None}


def firsts(iterator, n):
    """The first input value of each of `iterator`'s next `n` batches."""
    return [float(next(iterator)[0][0, 0]) for _ in range(n)]


def test_a_training_generators_batches_are_read_again_from_the_first_until_its_first_update_ran():
    """Kept (`keep`, training's) until `settle`: a dataset made again reads what the one before had read (or
    read ahead) from the first, then the generator on; the one before reads no more. Settled, the batches read
    ahead are still read once each, none lost, none twice. Validation's and evaluation's keep none."""
    numbered = ((np.full((1, 1), i, np.float32), np.zeros((1, 1), np.float32)) for i in range(40))
    first = pydata.to_dataset(numbered, None, seed=0, keep=True)
    before = iter(first)
    assert firsts(before, 3) == [0, 1, 2]
    again = pydata.made_again(first)()
    assert pydata.runs_once(again)
    after = iter(again)
    assert firsts(after, 2) == [0, 1]
    pydata.settle(again)
    assert pydata.made_again(again) is None
    # The kept ones (to the last that `before` read ahead), then the generator's: each once.
    assert [float(batch[0][0, 0]) for batch in after] == list(range(2, 40))
    assert len(list(before)) < 37  # What it had read ahead, at most: it reads no more.
    assert pydata.made_again(pydata.to_dataset(generator(), None, seed=0)) is None  # Not training's: not kept.


def test_settled_the_kept_batches_read_ahead_before_are_each_read_once():
    """Deterministically, by the datasets' generators themselves (tf.data's reads ahead vary): the dataset made
    before had read 5, the one made again 2 when the first update ran; it reads the other 3 kept, then the
    generator's, and lets the kept go."""
    source = pydata._Once(iter(range(40)), tf.TensorSpec([], tf.int64), keep=True)  # noqa: SLF001
    source.dataset()
    before = source._read(1)  # noqa: SLF001 - what tf.data calls for an iterator of the first dataset.
    assert list(itertools.islice(before, 5)) == [0, 1, 2, 3, 4]
    source.dataset()
    after = source._read(2)  # noqa: SLF001
    assert list(itertools.islice(after, 2)) == [0, 1]
    assert next(before, None) is None  # Made again: the one before reads no more.
    source.settle()
    assert next(after) == 2 and source._kept == [3, 4]  # noqa: SLF001 - what it read, let go.
    assert list(after) == list(range(3, 40))


def test_a_generators_non_finite_batch_is_not_replayed_from_the_batches_after_it():
    """The replay read a new iterator of the generator, which goes on: the batches after (here none were left,
    "StopIteration"); it could have named another batch's cause."""

    def batches():
        for i in range(8):
            x = np.ones((8, 4), np.float32)
            x[2, 1] = np.nan if i == 3 else 1.0
            yield x, np.ones((8, 1), np.float32)

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.01), "mse")
    with pytest.raises(tfmp.TrainingError, match="at step 4;") as raised:
        tfmp.fit(model, batches(), verbose=0, jit_compile=False)
    assert str(raised.value).endswith(
        "Replay of the failing batch: not possible: a generator's batches are read once "
        "(a dataset, a PyDataset or arrays are not)"
    )


def test_a_py_dataset_loaded_on_one_thread_warns_nothing():
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # tf.data's, of a map told deterministic= on one thread.
        tfmp.fit(regression(), Batches(), verbose=0)


def test_a_generator_that_ran_out_ends_training_and_validation_with_a_warning(caplog):
    """A generator runs once: a second epoch, or a second validation pass, gets no batch.
    Training stops there and validation reports nothing, each with one warning, where they
    reported a loss and metrics of 0.0 over no batch; tfmp.evaluate refuses data that gave none."""
    model = regression()
    with caplog.at_level("WARNING"):
        history = tfmp.fit(model, generator(), epochs=3, validation_data=generator(), verbose=0)
    assert history.epoch == [0] and int(model.optimizer.iterations.numpy()) == 8
    assert len(history.history["val_loss"]) == 1 and history.history["val_loss"][0] > 0
    (line,) = [r.getMessage() for r in caplog.records if "ran out" in r.getMessage()]
    assert line.startswith("data ran out: epoch 2 got no batch; training stops (a generator runs once")
    caplog.clear()
    with caplog.at_level("WARNING"):
        history = tfmp.fit(model, Batches(), epochs=3, validation_data=generator(), verbose=0)
    assert history.epoch == [0, 1, 2] and len(history.history["val_loss"]) == 1
    (line,) = [r.getMessage() for r in caplog.records if "ran out" in r.getMessage()]
    assert line.startswith("validation_data ran out at epoch 2: no val_ metrics from there (a generator runs once")
    nothing = tf.data.Dataset.from_tensor_slices((X, Y)).batch(32).filter(lambda x, y: False)  # Of unknown length.
    with pytest.raises(UsageError, match="data gave no batch to evaluate"):
        tfmp.evaluate(model, nothing)


@pytest.mark.parametrize(
    ("data", "kwargs", "match"),
    [
        (generator, {"shuffle": True}, "generator, whose batches come in the order it yields them"),
        (Batches, {"y": Y}, "y= is for arrays, and data is a PyDataset"),
        (Batches, {"validation_split": 0.2}, "validation_split= is for arrays, and data is a PyDataset"),
        (lambda: (b for b in [[X[:4], Y[:4], Y[:4], Y[:4]]]), {}, r"must be \(x,\), \(x, y\) or"),
        (lambda: (b for b in []), {}, "generator that yields nothing"),
        (lambda: types.SimpleNamespace(), {}, "a keras.utils.PyDataset or a generator, got SimpleNamespace"),
    ],
    ids=["shuffled generator", "y", "validation_split", "bad batch", "empty", "other"],
)
def test_bad_python_data_is_a_usage_error(data, kwargs, match):
    with pytest.raises(UsageError, match=match):
        tfmp.fit(regression(), data(), verbose=0, **kwargs)


def test_batches_are_copies_never_views_of_the_users_arrays():
    """TensorFlow takes a loaded array's memory as its tensor's and may write into it (a
    MirroredStrategy's run overwrote a PyDataset's labels so, now and then): each batch
    loaded is a copy."""
    from tfmp import pydata

    data = Batches()
    loader = pydata._Loader(data, pydata._spec([data[0]]), "data", len(data))  # noqa: SLF001
    is_batch, x, y = loader(np.int64(1))
    assert is_batch and np.array_equal(x, X[32:64]) and np.array_equal(y, Y[32:64])
    assert not np.shares_memory(x, X) and not np.shares_memory(y, Y)


def test_a_generator_of_sequences_of_varying_length_trains_as_model_fit_reads_it():
    """Its first two batches set the spec, as Keras' do: None where they differ (the spec had been the first
    batch's alone, and the second batch, a token longer, failed in tf.data). A later batch that does not fit a
    dimension the first two fixed is named with both shapes, in a UsageError (raised in the input pipeline, it had
    come out inside TensorFlow's InvalidArgumentError)."""

    def sequences(lengths):
        rng = np.random.default_rng(0)
        for length in lengths:
            yield rng.integers(1, 20, size=(4, length)), rng.normal(size=(4, 1)).astype("float32")

    def model():
        keras.utils.set_random_seed(0)
        tokens = keras.Input((None,), dtype="int32")
        pooled = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(20, 4)(tokens))
        built = keras.Model(tokens, keras.layers.Dense(1)(pooled))
        built.compile(keras.optimizers.SGD(0.1), "mse")
        return built

    ours, theirs = model(), model()
    history = tfmp.fit(ours, sequences([5, 6, 7, 5]), verbose=0)
    expected = theirs.fit(sequences([5, 6, 7, 5]), verbose=0, shuffle=False)
    assert int(ours.optimizer.iterations.numpy()) == 4
    np.testing.assert_allclose(history.history["loss"], expected.history["loss"], rtol=1e-6)
    with pytest.raises(UsageError, match=r"^a batch's shapes \[\(4, 7\), \(4, 1\)\] do not fit the first two "):
        tfmp.fit(model(), sequences([5, 5, 7]), verbose=0)
    with pytest.raises(UsageError, match=r"^a batch's shapes \[\(4, 7\), \(4, 1\)\]"):  # Not TensorFlow's error.
        tfmp.evaluate(model(), sequences([5, 5, 7]), verbose=0)
