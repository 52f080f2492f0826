"""tfmp.fit's step called with its inputs flattened once (`tfmp.calls.Direct`): taken on one
device and under a strategy, with XLA and without, to the same bits as the ordinary call."""

import gc
import threading
import weakref

import keras
import numpy as np
import pytest
import tensorflow as tf
import tiny

import tfmp
from tfmp import calls


def _train(strategy, jit_compile):
    """tiny's weights after 6 updates under mixed_float16 (loss scaling, its cond and its
    variables too), and whether the kept calls were direct."""
    model, compiled = tiny.steps_after(strategy, jit_compile, 6, "mixed_float16")
    kept = [call.direct for call in compiled._concrete.values()]  # noqa: SLF001
    return [w.numpy() for w in model.weights], kept


@pytest.mark.parametrize("jit_compile", [False, True], ids=["no_xla", "xla"])
@pytest.mark.parametrize("replicas", [1, 2])
def test_the_step_called_directly_trains_to_the_same_bits(
    replicas, jit_compile, mirrored, monkeypatch, deterministic_gpu
):
    strategy = mirrored if replicas == 2 else tf.distribute.get_strategy()
    direct, kept = _train(strategy, jit_compile)
    assert kept == [True]
    monkeypatch.setattr(calls, "_flat_inputs", lambda *_: None)
    ordinary, kept = _train(strategy, jit_compile)
    assert kept == [False]
    for a, b in zip(direct, ordinary, strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_call_a_gradient_tape_may_record_goes_through_tf_function():
    scale = tf.Variable(3.0)
    step = tf.function(lambda iterator: tf.stop_gradient(next(iterator)) * scale)
    iterator = iter(tf.data.Dataset.range(10).map(lambda i: tf.cast(i, tf.float32)))
    call = calls.Direct(step.get_concrete_function(iterator), iterator)
    assert call.direct
    ordinary = []
    concrete = call.concrete
    call.concrete = lambda it: ordinary.append(it) or concrete(it)
    assert float(call()) == 0.0
    with tf.GradientTape() as tape:
        value = call()
    assert float(value) == 3.0 and ordinary == [iterator]
    assert float(tape.gradient(value, scale)) == 1.0  # The tape saw the variable's read.
    assert float(call()) == 6.0 and len(ordinary) == 1


@pytest.mark.parametrize("jit_compile", [False, True], ids=["no_xla", "xla"])
@pytest.mark.parametrize("replicas", [1, 2])
def test_an_evaluation_called_directly_gives_the_same_bits(replicas, jit_compile, mirrored, monkeypatch):
    """37 examples in batches of 8 (the last of 5, split 3 and 2 on 2 replicas): tfmp.evaluate's step called on
    each batch's flattened tensors (`calls.OfBatches`) gives the logs the ordinary call gives, to the bit."""
    strategy = mirrored if replicas == 2 else tf.distribute.get_strategy()
    x = np.random.default_rng(0).random((37, 8), dtype=np.float32)
    made = []

    class Recorded(calls.OfBatches):
        def __init__(self, *args):
            super().__init__(*args)
            made.append(self)

    monkeypatch.setattr(calls, "OfBatches", Recorded)

    def evaluate():
        with strategy.scope():
            keras.utils.set_random_seed(0)
            layers = [keras.Input((8,)), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(1)]
            model = keras.Sequential(layers)
            model.compile("sgd", "mse", metrics=["mae"])
        made.clear()
        logs = tfmp.evaluate(
            model, x, x[:, :1], batch_size=8, strategy=strategy, jit_compile=jit_compile, return_dict=True, verbose=0
        )
        return logs, [call.direct for call in made]

    direct, kept = evaluate()
    assert kept == [True]
    monkeypatch.setattr(calls, "_flat_inputs", lambda *_: None)
    ordinary, kept = evaluate()
    assert kept == [False]
    assert direct == ordinary


@pytest.fixture
def collector_where_called():
    """Python's collector runs only where the test calls it, after a collection of what earlier tests left: in a
    worker that had run hundreds of tests, a collection set off by allocations on the main thread once deleted one
    of a test's iterators there, which the test saw as tfmp's doing."""
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    yield
    if was:
        gc.enable()


def _follow_iterators(monkeypatch, kinds=None):
    """A list to which the name of the thread that deletes each iterator made from now on is appended (and to
    `kinds`, each one's type name as it is made)."""
    from tensorflow.python.distribute import input_lib

    deleted_on = []

    def followed(make):
        def made(self):
            iterator = make(self)
            if kinds is not None:
                kinds.append(type(iterator).__name__)
            weakref.finalize(iterator, lambda: deleted_on.append(threading.current_thread().name))
            return iterator

        return made

    for cls in (tf.data.Dataset, input_lib.DistributedDataset, input_lib.DistributedDatasetsFromFunction):
        monkeypatch.setattr(cls, "__iter__", followed(cls.__iter__))
    return deleted_on


def _let_go_threads_end():
    for thread in threading.enumerate():
        if thread.name == calls.LET_GO:
            thread.join()


@pytest.mark.usefixtures("collector_where_called")
@pytest.mark.parametrize("replicas", [1, 2])
def test_a_fit_and_an_evaluation_delete_their_iterators_off_the_main_thread(replicas, mirrored, monkeypatch):
    """Deleting the iterator of a dataset tf.data tunes may wait out its tuning thread's sleep, up to a minute
    (`calls.let_go`); Keras fit waits so at its end. Every iterator made in a fit with validation and in an
    evaluation is followed to its deletion: each on a thread of its own, none on the main thread."""
    strategy = mirrored if replicas == 2 else tf.distribute.get_strategy()
    deleted_on = _follow_iterators(monkeypatch)
    x = np.random.default_rng(0).random((64, 8), dtype=np.float32)
    data = tf.data.Dataset.from_tensor_slices((x, x[:, :1])).batch(8).prefetch(tf.data.AUTOTUNE)
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
    tfmp.fit(model, data, epochs=2, validation_data=data, strategy=strategy, verbose=0)
    tfmp.evaluate(model, data, strategy=strategy, verbose=0)
    _let_go_threads_end()
    gc.collect()
    assert len(deleted_on) >= 4  # Two epochs', two validations', an evaluation's.
    assert set(deleted_on) == {calls.LET_GO}


@pytest.mark.usefixtures("collector_where_called")
@pytest.mark.parametrize("replicas", [1, 2])
def test_steps_dropped_without_release_delete_their_iterators_off_the_main_thread(replicas, mirrored, monkeypatch):
    """`Steps` driven directly and dropped without `release` are a reference cycle (their traced functions hold
    them), freed whenever and wherever Python's collector runs next: their iterators still go on threads of their
    own, and the steps and model are freed."""
    strategy = mirrored if replicas == 2 else tf.distribute.get_strategy()
    deleted_on = _follow_iterators(monkeypatch)
    model, compiled = tiny.steps_after(strategy, False, 2)
    dropped = weakref.ref(compiled), weakref.ref(model)
    del model, compiled
    gc.collect()
    _let_go_threads_end()
    gc.collect()
    assert [ref() for ref in dropped] == [None, None]
    assert deleted_on and set(deleted_on) == {calls.LET_GO}


class _FailsAtBatch1(keras.callbacks.Callback):
    def __init__(self, hook):
        super().__init__()
        setattr(self, hook, self.fail)

    def fail(self, batch, logs=None):
        if batch == 1:
            raise RuntimeError("a callback's error")


@pytest.mark.usefixtures("collector_where_called")
@pytest.mark.parametrize("hook", ["on_train_batch_end", "on_test_batch_end"], ids=["training", "validation"])
@pytest.mark.parametrize("replicas", [1, 2])
def test_an_error_out_of_a_fit_leaves_its_iterators_in_no_frame_of_its_traceback(replicas, hook, mirrored, monkeypatch):
    """An error out of tfmp.fit (here a callback's, in training or in validation; Ctrl-C's Interrupted comes from
    the same loops) keeps the frames it passed in its traceback, and a notebook keeps that traceback: the fit's
    iterators are in none of them, so that they are deleted as the fit ends, on threads of their own, while the
    error is still held (not later, wherever the traceback is freed, waiting out tf.data's tuning thread there)."""
    strategy = mirrored if replicas == 2 else tf.distribute.get_strategy()
    made = []
    deleted_on = _follow_iterators(monkeypatch, made)
    x = np.random.default_rng(0).random((64, 8), dtype=np.float32)
    data = tf.data.Dataset.from_tensor_slices((x, x[:, :1])).batch(8).prefetch(tf.data.AUTOTUNE)
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
    with pytest.raises(RuntimeError, match="a callback's error") as raised:
        tfmp.fit(
            model, data, epochs=2, validation_data=data, strategy=strategy, callbacks=[_FailsAtBatch1(hook)], verbose=0
        )
    _let_go_threads_end()
    assert raised.value.__traceback__ is not None  # Held, with every frame it passed.
    assert made and deleted_on == [calls.LET_GO] * len(made), made
