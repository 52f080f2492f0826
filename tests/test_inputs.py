"""tfmp.inputs: what tfmp.fit accepts as data, the one clear error for what it does not, the
exact input position a resumed run continues from, and the batch a NaN guard's replay reads."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmp
from tfmp import distribute, inputs, pydata
from tfmp.errors import UsageError

ONE = tf.distribute.get_strategy


def numbered(n=10, batch=2):
    """Batches (of a static size) whose first element is their batch index."""
    x = np.repeat(np.arange(n, dtype=np.float32), batch)[:, None]
    return tf.data.Dataset.from_tensor_slices((x, x)).batch(batch, drop_remainder=True)


def first(batch):
    return int(batch[0].numpy()[0, 0])


@pytest.mark.parametrize(
    "data, steps, words",
    [
        (numbered().take(0), None, "data is empty"),
        (numbered().repeat(), None, "repeats without end: give steps_per_epoch"),
        (lambda context: numbered(), None, "data as a callable needs steps_per_epoch"),
        (lambda context: np.ones(3), 4, "must return a tf.data.Dataset, got ndarray"),
        ("data.csv", 4, r"dataset, a keras.utils.PyDataset or a generator, got str \(arrays go as"),
    ],
)
def test_what_fit_refuses(data, steps, words):
    with pytest.raises(UsageError, match=words):
        inputs.Input(data, ONE(), steps, 1, "data")


def test_a_batch_that_does_not_divide_by_the_replicas(mirrored):
    with pytest.raises(UsageError, match="data's global batch size 3 does not divide by the 2 replicas.*2 or 4"):
        inputs.Input(numbered(batch=3), mirrored, None, 1, "data")


def test_epochs_are_one_repeated_stream_and_a_resume_continues_at_its_position():
    source = inputs.Input(numbered(10), ONE(), None, 2, "data")
    assert source.period == 10 and source.steps == 10 and source.streamed
    stream = source.stream(0)
    drawn = [first(next(stream)) for _ in range(13)]  # An epoch and three batches more.
    assert drawn == [*range(10), 0, 1, 2]
    resumed = source.stream(13)
    assert [first(next(resumed)) for _ in range(3)] == [3, 4, 5]
    longer = inputs.Input(numbered(10), ONE(), 13, 1, "data")  # steps_per_epoch past the data's end: round it.
    second_epoch = longer.stream(13)
    assert longer.period == longer.steps == 13 and [first(next(second_epoch)) for _ in range(2)] == [3, 4]


def test_an_odd_epoch_under_accumulation_keeps_whole_updates():
    source = inputs.Input(numbered(9), ONE(), None, 2, "data")
    assert source.period == 9 and source.steps == 8  # 4 updates of 2 batches; the 9th is left over.
    with pytest.raises(UsageError, match="fewer than grad_accum_steps=2; the largest grad_accum_steps it fills is 1"):
        inputs.Input(numbered(1), ONE(), None, 2, "data")


def test_a_callable_that_skips_by_itself_gets_the_position():
    seen = []

    def fn(context, skip=0):
        seen.append(skip)
        return numbered().repeat().skip(skip)

    source = inputs.Input(fn, ONE(), 5, 1, "data")
    assert first(next(source.stream(7))) == 7 and seen[-1] == 7


def test_build_for_checks_the_structure_against_the_model():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    wrong = tf.data.Dataset.from_tensor_slices((np.ones((4, 5), "float32"), np.ones((4, 1), "float32"))).batch(2)
    # The input by its place, not by the name Keras made up for it (keras_tensor_N).
    with pytest.raises(UsageError, match=r"^the model's input takes shape \(None, 3\) but the data gives \(None, 5\)$"):
        inputs.build_for(model, ONE(), wrong.element_spec)
    pair = [keras.Input((3,)), keras.Input((2,))]
    two = keras.Model(pair, keras.layers.Dense(1)(keras.layers.Concatenate()(pair)))
    two.compile("sgd", "mse")
    with pytest.raises(UsageError, match=r"^input 1 takes shape \(None, 2\) but the data gives \(None, 5\)$"):
        inputs.build_for(
            two,
            ONE(),
            tf.data.Dataset.from_tensor_slices(((np.ones((4, 3)), np.ones((4, 5))), np.ones(4))).batch(2).element_spec,
        )
    with pytest.raises(UsageError, match=r"^the model takes 2 input\(s\) but the data's elements hold 1"):
        inputs.build_for(two, ONE(), wrong.element_spec)
    unbatched = tf.data.Dataset.from_tensor_slices((np.ones((4, 3), "float32"), np.ones((4, 1), "float32")))
    with pytest.raises(UsageError, match=r"gives \(3,\); its elements are single examples: batch the dataset"):
        inputs.build_for(model, ONE(), unbatched.element_spec)
    no_targets = tf.data.Dataset.from_tensor_slices(np.ones((4, 3), "float32")).batch(2)
    with pytest.raises(UsageError, match="the data gives no targets"):
        inputs.build_for(model, ONE(), no_targets.element_spec)
    # Batched data of one axis too few (arrays of shape (4,)): no hint to batch what is batched already.
    flat = tf.data.Dataset.from_tensor_slices((np.ones(4, "float32"), np.ones((4, 1), "float32"))).batch(2)
    with pytest.raises(UsageError, match=r"gives \(None,\)$"):
        inputs.build_for(model, ONE(), flat.element_spec)
    words = tf.data.Dataset.from_tensor_slices((np.array(["a b"] * 4), np.ones((4, 1), "float32"))).batch(2)
    with pytest.raises(UsageError, match="takes float32 but the data gives string"):  # Keras: "Invalid dtype: str32".
        inputs.build_for(model, ONE(), words.element_spec)


def test_build_for_takes_what_a_keras_model_takes_and_checks_dict_inputs_too():
    """A Keras model adds or drops a last axis of 1 to make its input's rank (1-D values for `Input((1,))`, a
    pandas column say): model.fit trains on them, and tfmp refused them. Dict inputs get the same checks as a
    tuple's, where a string reached the step as "Cast string to float is not supported"."""

    def model(shape):
        inputs = keras.Input(shape, name="a")
        built = keras.Model({"a": inputs}, keras.layers.Dense(1)(keras.layers.Flatten()(inputs)))
        built.compile("sgd", "mse")
        return built

    def spec(x, named=False):
        x = {"a": x} if named else x
        return tf.data.Dataset.from_tensor_slices((x, np.ones((4, 1), "float32"))).batch(2).element_spec

    for shape, x in (((1,), np.ones(4, "float32")), ((3,), np.ones((4, 3, 1), "float32"))):
        for named in (False, True):
            inputs.build_for(model(shape), ONE(), spec(x, named))
    import tfmp

    history = tfmp.fit(model((1,)), np.arange(8, dtype="float32"), np.ones((8, 1), "float32"), batch_size=4, verbose=0)
    assert np.isfinite(history.history["loss"][0])  # Trains, as under model.fit.
    with pytest.raises(UsageError, match=r"input 'a' takes shape \(None, 3\) but the data gives \(None,\)$"):
        inputs.build_for(model((3,)), ONE(), spec(np.ones(4, "float32"), named=True))
    with pytest.raises(UsageError, match="input 'a' takes float32 but the data gives string"):
        inputs.build_for(model((3,)), ONE(), spec(np.array([["x"] * 3] * 4), named=True))


def test_features_the_model_does_not_take_are_left_unread_as_model_fit_leaves_them(caplog):
    """A dataset with a feature no input takes (an id, a column for another model) trains as under model.fit,
    with a warning naming it; a feature missing is refused. Before, the extra one was refused too."""
    import tfmp

    rng = np.random.default_rng(0)
    features = {"a": rng.normal(size=(32, 3)), "b": rng.normal(size=(32, 2)), "id": np.arange(32)}
    data = tf.data.Dataset.from_tensor_slices((features, rng.normal(size=(32, 1)))).batch(8)

    def model():
        keras.utils.set_random_seed(0)
        a, b = keras.Input((3,), name="a"), keras.Input((2,), name="b")
        built = keras.Model({"a": a, "b": b}, keras.layers.Dense(1)(keras.layers.Concatenate()([a, b])))
        built.compile(keras.optimizers.SGD(0.1), "mse")
        return built

    theirs, ours = model(), model()
    theirs.fit(data, epochs=2, verbose=0)
    with caplog.at_level("WARNING"):
        tfmp.fit(ours, data, epochs=2, verbose=0, jit_compile=False)
    assert "the data's ['id'] are none of the model's inputs ['a', 'b']: left unread" in caplog.text
    for mine, keras_own in zip(ours.weights, theirs.weights, strict=True):
        np.testing.assert_array_equal(mine.numpy(), keras_own.numpy())
    with pytest.raises(UsageError, match=r"the data's inputs are \['a', 'id'\] but the model takes \['a', 'b'\]"):
        tfmp.fit(model(), data.map(lambda x, y: ({"a": x["a"], "id": x["id"]}, y)), verbose=0)


def test_a_stream_prefetched_to_a_device_draws_as_from_host_memory_where_it_applies(monkeypatch):
    """`inputs.PREFETCH_TO` (a device, None by default: off until a GPU measures it) reads a training stream 2
    batches ahead onto that device; here the CPU itself. The batches and a resumed position are the same; strings,
    counted reads and a generator's stream stay in host memory."""
    monkeypatch.setattr(inputs, "PREFETCH_TO", "/cpu:0")
    source = inputs.Input(numbered(10), ONE(), None, 1, "data")
    ds = numbered(10).repeat()
    assert source._on_device(ds) is not ds  # noqa: SLF001 - which streams it applies to.
    assert first(next(source.stream(0))) == 0
    resumed = source.stream(13)
    assert [first(next(resumed)) for _ in range(3)] == [3, 4, 5]
    words = tf.data.Dataset.from_tensor_slices((np.array(["a"] * 4), np.ones((4, 1), "float32"))).batch(2)
    assert inputs.Input(words, ONE(), None, 1, "data")._on_device(words) is words  # noqa: SLF001
    unknown = numbered(10).filter(lambda x, y: True)  # Unknown length under accumulation: its reads are counted.
    counted = inputs.Input(unknown, ONE(), None, 2, "data")
    assert counted._on_device(counted.data) is counted.data  # noqa: SLF001
    batches = ((np.ones((2, 1), "float32"), np.ones((2, 1), "float32")) for _ in range(8))
    generated = inputs.Input(pydata.to_dataset(batches, shuffle=False, seed=0), ONE(), 4, 1, "data")
    assert generated._on_device(generated.data) is generated.data  # noqa: SLF001


def test_a_one_device_strategy_on_a_gpu_prefetches_the_stream_there_as_its_own_dataset_does():
    """Under a OneDeviceStrategy on a GPU the training stream goes there 2 batches ahead, as the strategy's
    `experimental_distribute_dataset` does for Keras fit (tests/test_gpu.py reads a batch there); a CPU's
    batches are in host memory already. (Made here without a GPU: a dataset is not run until read.)"""
    on_gpu = tf.distribute.OneDeviceStrategy("/gpu:0")
    assert distribute.input_device(on_gpu) == "/job:localhost/replica:0/task:0/device:GPU:0"
    on_second_cpu = tf.distribute.OneDeviceStrategy("/cpu:1")
    for strategy in (tf.distribute.OneDeviceStrategy("/cpu:0"), on_second_cpu, ONE()):
        assert distribute.input_device(strategy) is None
    ds = numbered(10).repeat()
    prefetched = inputs.Input(numbered(10), on_gpu, None, 1, "data")._on_device(ds)  # noqa: SLF001
    assert prefetched is not ds and prefetched.element_spec == ds.element_spec
    assert inputs.Input(numbered(10), on_second_cpu, None, 1, "data")._on_device(ds) is ds  # noqa: SLF001


@pytest.mark.parametrize("jit_compile", [False, True], ids=["no_xla", "xla"])
def test_a_fit_from_a_stream_prefetched_to_a_device_trains_the_same_weights(monkeypatch, jit_compile):
    import tfmp

    def fit(prefetch_to):
        monkeypatch.setattr(inputs, "PREFETCH_TO", prefetch_to)
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(1)])
        model.compile(keras.optimizers.Adam(0.01), "mse")
        tfmp.fit(model, numbered(10), epochs=2, validation_data=numbered(4), verbose=0, jit_compile=jit_compile)
        return [w.numpy() for w in model.weights]

    for ours, host in zip(fit("/cpu:0"), fit(None), strict=True):
        np.testing.assert_array_equal(ours, host)


@pytest.mark.parametrize("given", ["shuffled arrays", "a pipeline reshuffling each pass"])
def test_the_nan_guard_replays_the_failing_batch_as_the_run_read_it(given):
    """The replay read a new iterator of the input, which draws the next order: for shuffled arrays (model.fit's
    default) it ran another batch and blamed the weights. tfmp's shuffled arrays are made again, their orders
    drawn from the first; a pipeline of the user's that reshuffles cannot be read alike: the replay says so."""
    x, y = np.ones((64, 4), np.float32), np.ones((64, 1), np.float32)
    x[37, 2] = np.nan
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.01), "mse")
    with pytest.raises(tfmp.TrainingError) as raised:
        if given == "shuffled arrays":
            tfmp.fit(model, x, y, batch_size=8, epochs=2, verbose=0, jit_compile=False)
        else:
            data = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(64, seed=0).batch(8)
            tfmp.fit(model, data, epochs=2, verbose=0, jit_compile=False)
    replay = str(raised.value).split("Replay of the failing batch: ")[1]
    if given == "shuffled arrays":
        assert replay.startswith("the batch itself holds non-finite values (1 in its inputs)")
    else:
        assert replay == (
            "not possible: a new iterator of this input draws another order (a shuffle that reshuffles each pass)"
        )
