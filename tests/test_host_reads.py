"""tfmp.fit leaves the device nothing to wait for: one device-to-host read per update, taken
after the next update is queued; a wait only where a value is due (checkpoint, SIGTERM,
epoch end, a callback that must see each update end)."""

import sys
import time

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.framework import ops

import tfmp
from tfmp import steps as tfmp_steps

rng = np.random.default_rng(0)
X = rng.random((64, 8), dtype=np.float32)
Y = rng.integers(0, 4, 64)


def _model(policy="float32"):
    keras.config.set_dtype_policy(policy)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(4)])
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(keras.optimizers.Adam(1e-3), loss, metrics=["accuracy"])
    return model


def _data():
    return tf.data.Dataset.from_tensor_slices((X, Y)).batch(8).repeat()


@pytest.fixture
def reads(monkeypatch):
    """Counts every read of an eager tensor's value on the host (`.numpy()`, float(),
    np.asarray), except the TensorBoard writer's check of its own host-side record flag."""
    count = [0]
    real = ops._EagerTensorBase._numpy  # noqa: SLF001 - where every eager read ends up.

    def counted(self):
        frame = sys._getframe(1)
        for _ in range(6):
            if frame is None or frame.f_code.co_filename.endswith("summary_ops_v2.py"):
                break
            frame = frame.f_back
        else:
            count[0] += 1
        return real(self)

    monkeypatch.setattr(ops._EagerTensorBase, "_numpy", counted)  # noqa: SLF001
    return count


class _BatchHook(keras.callbacks.Callback):
    """A user's callback with a batch hook: it may change the model between two updates."""

    def on_train_batch_end(self, batch, logs=None):
        pass


@pytest.mark.parametrize("policy", ["float32", "mixed_float16"])
@pytest.mark.parametrize("callbacks", [[], [_BatchHook()]], ids=["no callback", "batch-hook callback"])
def test_one_read_per_update(reads, tmp_path, policy, callbacks):
    model = _model(policy)
    fit = dict(epochs=1, jit_compile=False, verbose=0, callbacks=callbacks, log_dir=str(tmp_path), log_every=5)
    tfmp.fit(model, _data(), steps_per_epoch=4, **fit)  # Traces.
    counts = []
    for steps in (10, 30):
        before = reads[0]
        tfmp.fit(model, _data(), steps_per_epoch=steps, **fit)
        counts.append(reads[0] - before)
    # Whatever a fit costs once (setup, the epoch's end) cancels out: 20 more updates, 20 more reads.
    assert counts[1] - counts[0] == 20, counts


def test_an_update_is_read_after_the_next_is_queued(monkeypatch):
    events = []
    dispatch, read = tfmp_steps.Steps.dispatch, tfmp_steps.Steps.read

    def logged_dispatch(self, *args, **kwargs):
        events.append("queue")
        return dispatch(self, *args, **kwargs)

    def logged_read(self, packed):
        events.append("read")
        return read(self, packed)

    monkeypatch.setattr(tfmp_steps.Steps, "dispatch", logged_dispatch)
    monkeypatch.setattr(tfmp_steps.Steps, "read", logged_read)
    model = _model()
    tfmp.fit(model, _data(), steps_per_epoch=4, epochs=1, jit_compile=False, verbose=0)
    assert events == ["queue", "queue", "read", "queue", "read", "queue", "read", "read"]
    events.clear()
    tfmp.fit(model, _data(), steps_per_epoch=3, epochs=1, jit_compile=False, verbose=0, callbacks=[_BatchHook()])
    assert events == ["queue", "read"] * 3  # A callback with batch hooks sees each update end before the next.


def test_a_lambda_callbacks_batch_hook_stops_training_where_model_fit_stops():
    """A LambdaCallback's hooks are set on the instance, not its class: its batch hook must be seen as one, so that
    each update ends before the next is queued, and a stop it asks for at batch 2 stops after 3 updates, as in
    model.fit (reading behind, a fourth was queued and ran, and the hook saw batch 3)."""
    ends = {}
    for trainer in ("keras", "tfmp"):
        model, seen = _model(), []

        def stop_at_2(batch, logs, model=model, seen=seen):
            seen.append(batch)
            model.stop_training = batch == 2

        stop = keras.callbacks.LambdaCallback(on_train_batch_end=stop_at_2)
        fit = dict(steps_per_epoch=6, epochs=2, verbose=0, callbacks=[stop])
        if trainer == "keras":
            model.fit(_data(), **fit)
        else:
            tfmp.fit(model, _data(), jit_compile=False, **fit)
        ends[trainer] = (seen, int(model.optimizer.iterations.numpy()))
    assert ends["tfmp"] == ends["keras"] == ([0, 1, 2], 3)


def test_a_checkpoint_holds_exactly_the_updates_it_counts(tmp_path, monkeypatch):
    """Reading behind, the loop still stops at a checkpoint: its weights are those after
    its step, not after one more update."""
    model = _model()
    events = []
    dispatch = tfmp_steps.Steps.dispatch
    monkeypatch.setattr(
        tfmp_steps.Steps, "dispatch", lambda self, *a, **kw: events.append("queue") or dispatch(self, *a, **kw)
    )
    from tfmp import checkpoint

    save = checkpoint.Checkpointer.save
    monkeypatch.setattr(
        checkpoint.Checkpointer,
        "save",
        lambda self, step, *a: (
            events.append(("save", step, int(model.optimizer.iterations.numpy()))) or save(self, step, *a)
        ),
    )
    tfmp.fit(model, _data(), steps_per_epoch=6, epochs=1, checkpoint_dir=str(tmp_path), checkpoint_every=2, verbose=0)
    saves = [e for e in events if e != "queue"]
    assert saves == [("save", 2, 2), ("save", 4, 4), ("save", 6, 6)]


class _Sleep(keras.layers.Layer):
    """200 ms of host time in every forward pass; `starts` holds when each began."""

    def __init__(self):
        super().__init__()
        self.starts = []

    def call(self, x):
        def sleep(value):
            self.starts.append(time.perf_counter())
            time.sleep(0.2)
            return value

        return tf.reshape(tf.numpy_function(sleep, [x], tf.float32, stateful=True), tf.shape(x))

    def compute_output_shape(self, input_shape):
        return input_shape


def test_throughput_times_each_step_once_while_reads_lag():
    """Every step sleeps 200 ms in a host call: each timed window holds one step, none two
    and none zero (timing batch ends would, where an update's end is handled a step late).
    Measured against the steps' own spacing, not a fixed time: on a loaded 2-core machine a
    step of this model took its sleep and 30-90 ms more (Keras fit's too)."""
    from tfmp import callbacks

    keras.utils.set_random_seed(0)
    inputs, sleep = keras.Input((8,)), _Sleep()
    model = keras.Model(inputs, keras.layers.Dense(4)(sleep(inputs)))
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    timer = callbacks.Throughput(8, warmup_steps=2)
    tfmp.fit(model, _data(), steps_per_epoch=10, epochs=1, jit_compile=False, verbose=0, callbacks=[timer])
    assert len(timer.step_times) == 8 and len(sleep.starts) == 10
    step = float(np.median(np.diff(sleep.starts)))  # One step, as the sleeps are spaced.
    assert step >= 0.2
    assert all(0.5 * step < t < 1.5 * step for t in timer.step_times), (step, timer.step_times)
