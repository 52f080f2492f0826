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
