"""tfmp.lockstep: fits in threads take turns of a few steps, one fit at a time, each turn
timed from the moment it comes. Fake fits call the timer as Keras' loops do."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmp
from tfmp.bench import lockstep
from tfmp.bench.lockstep import TurnTimer


class _FakeRunner:
    """Calls a lockstep timer as a fit would (`behind`: as tfmp.fit, each step's end
    handled after the next step is queued), and logs the steps it queues."""

    def __init__(self, name, log, fail_at=None, behind=False):
        self.name, self.log, self.fail_at, self.behind, self.batch_size = name, log, fail_at, behind, 8

    def run(self, steps, timer):
        timer.on_train_begin()
        for step in range(steps + 1):
            timer.on_train_batch_begin(step)
            if step == self.fail_at:
                raise RuntimeError(f"{self.name} failed")
            self.log.append(self.name)
            if not self.behind:
                timer.on_train_batch_end(step)
            elif step:
                timer.on_train_batch_end(step - 1)
        if self.behind:
            timer.on_train_batch_end(steps)
        timer.on_epoch_end(0)
        self.turns = timer.turns
        return timer.examples_per_second


def test_lockstep_fits_take_their_steps_one_at_a_time_in_turn():
    log = []
    rates = lockstep.run([_FakeRunner("b", log), _FakeRunner("a", log)], steps=3, per_turn=1)
    assert log == ["b", "a"] * 4 and min(rates) > 0  # First step untimed, then three each, in turn.


@pytest.mark.parametrize("behind", [False, True], ids=["reads each step", "reads behind"])
def test_a_turn_holds_its_steps_however_the_loop_reads_them(behind):
    log = []
    runners = [_FakeRunner("a", log, behind=behind), _FakeRunner("b", log)]
    lockstep.run(runners, steps=5, per_turn=2)
    # The untimed first step alone, then turns of two steps (the last of one), each fit's in turn.
    assert log == ["a", "b"] + ["a", "a", "b", "b"] * 2 + ["a", "b"]
    assert [steps for _, steps in runners[0].turns] == [steps for _, steps in runners[1].turns] == [1, 2, 2, 1]


def test_lockstep_raises_what_one_fit_raised_and_lets_the_other_finish():
    log = []
    with pytest.raises(RuntimeError, match="a failed"):
        lockstep.run([_FakeRunner("a", log, fail_at=1), _FakeRunner("b", log)], steps=3, per_turn=1)
    assert log == ["a", "b", "b", "b", "b"]  # b goes on alone, never waiting for a turn that cannot come.


def test_turn_timer_leaves_out_the_first_turn_and_weighs_turns_by_their_steps():
    timer = TurnTimer(global_batch=8, baton=lockstep.Baton(1), index=0, steps_per_turn=2)
    timer.turns = [(5.0, 1), (1.0, 2), (0.25, 1)]  # The first step opened an iterator: not timed.
    assert timer.step_times == [0.5, 0.5, 0.25]
    assert timer.examples_per_second == pytest.approx(3 * 8 / 1.25)


def test_a_runner_with_fewer_steps_drops_out_and_the_others_go_on_in_turn():
    log = []
    runners = [_FakeRunner("a", log), _FakeRunner("b", log), _FakeRunner("c", log)]
    lockstep.run(runners, steps=[3, 1, 2], per_turn=1)
    assert log == ["a", "b", "c"] * 2 + ["a", "c", "a"]  # Each first step is untimed.


def test_tfmp_fit_reads_behind_under_the_timer_as_with_its_default_callbacks():
    """The timer is `async_safe`: tfmp.fit queues each update before it handles the last's
    end, as outside the bench, and each turn still counts the updates it queued."""
    events = []

    class Logged(TurnTimer):
        def on_train_batch_begin(self, batch, logs=None):
            events.append(("begin", batch))
            super().on_train_batch_begin(batch, logs)

        def on_train_batch_end(self, batch, logs=None):
            events.append(("end", batch))

    keras.config.set_dtype_policy("float32")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile("sgd", "mse")
    data = tf.data.Dataset.from_tensor_slices((np.ones((8, 4), "float32"), np.ones((8, 2), "float32"))).batch(2)
    timer = Logged(2, lockstep.Baton(1), 0, steps_per_turn=2)
    tfmp.fit(model, data.repeat(), steps_per_epoch=5, jit_compile=False, verbose=0, callbacks=[timer])
    assert events[:4] == [("begin", 0), ("begin", 1), ("end", 0), ("begin", 2)]
    assert [steps for _, steps in timer.turns] == [1, 2, 2] and len(timer.step_times) == 4


def test_with_a_gpu_each_turn_ends_with_the_devices_synced(monkeypatch):
    """A GPU runs a step after its call returns: a turn's end waits for it (one wait a
    turn); on a CPU, where it has run, nothing waits."""
    synced = []
    monkeypatch.setattr(tf.test.experimental, "sync_devices", lambda: synced.append(1))
    lockstep.run([_FakeRunner("a", [])], steps=4, per_turn=2)
    assert synced == []
    real = tf.config.list_physical_devices
    monkeypatch.setattr(tf.config, "list_physical_devices", lambda kind=None: ["gpu"] if kind == "GPU" else real(kind))
    assert lockstep.steps_per_turn() == 5
    runner = _FakeRunner("a", [])
    lockstep.run([runner], steps=4, per_turn=2)
    assert len(synced) == len(runner.turns) == 3
