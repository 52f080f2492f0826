"""tfmp.lockstep: fits in threads take their steps one at a time, in turn, and are timed
from the moment their turn comes. Fake fits call the timer as Keras' loops do."""

import pytest

from tfmp.bench import lockstep


class _FakeRunner:
    """Calls a lockstep timer as a fit would, and logs its steps."""

    def __init__(self, name, log, fail_at=None):
        self.name, self.log, self.fail_at, self.batch_size = name, log, fail_at, 8

    def run(self, steps, timer):
        timer.on_train_begin()
        for step in range(steps + 1):
            if step == self.fail_at:
                raise RuntimeError(f"{self.name} failed")
            self.log.append(self.name)
            timer.on_train_batch_end(step)
        return timer.examples_per_second


def test_lockstep_fits_take_their_steps_one_at_a_time_in_turn():
    log = []
    rates = lockstep.run([_FakeRunner("b", log), _FakeRunner("a", log)], steps=3)
    assert log == ["b", "a"] * 4 and min(rates) > 0  # First step untimed, then three each, in turn.


def test_lockstep_raises_what_one_fit_raised_and_lets_the_other_finish():
    log = []
    with pytest.raises(RuntimeError, match="a failed"):
        lockstep.run([_FakeRunner("a", log, fail_at=1), _FakeRunner("b", log)], steps=3)
    assert log == ["a", "b", "b", "b", "b"]  # b goes on alone, never waiting for a turn that cannot come.


def test_turn_timer_leaves_out_the_first_step():
    timer = lockstep.TurnTimer(global_batch=8, baton=lockstep.Baton(1), index=0)
    timer.times = [5.0, 0.5, 0.5]  # The first step opened an iterator: not timed.
    assert timer.step_times == [0.5, 0.5]
    assert timer.examples_per_second == pytest.approx(16.0)


def test_a_runner_with_fewer_steps_drops_out_and_the_others_go_on_in_turn():
    log = []
    runners = [_FakeRunner("a", log), _FakeRunner("b", log), _FakeRunner("c", log)]
    lockstep.run(runners, steps=[3, 1, 2])
    assert log == ["a", "b", "c"] * 2 + ["a", "c", "a"]  # Each first step is untimed.
