"""Fits that train at once, a step of each in turn, so that their step times compare steps
that ran one after the other (the benchmark's tfmp.fit against Keras `model.fit`).

On a shared machine whole turns of a few seconds, one after the other, differ by 25% or
more; neighbouring steps do not. Each fit runs in its own thread and hands a baton on at
each batch end; a `TurnTimer` times its steps from the moment its turn comes.
"""

import threading
import time

import keras

from tfmp import callbacks


class Baton:
    """Lets fits running in threads take their steps one at a time, in turn."""

    def __init__(self, count):
        self._turn, self._count, self._done = 0, count, set()
        self._changed = threading.Condition()

    def _next(self, index):
        for i in range(1, self._count + 1):
            if (index + i) % self._count not in self._done:
                return (index + i) % self._count
        return index

    def take(self, index):
        """Waits until it is `index`'s turn (or every other fit has ended)."""
        with self._changed:
            self._changed.wait_for(lambda: self._turn == index or len(self._done) >= self._count - 1)

    def pass_on(self, index):
        """Gives the turn to the next fit still running."""
        with self._changed:
            self._turn = self._next(index)
            self._changed.notify_all()

    def finish(self, index):
        """`index` takes no more turns."""
        with self._changed:
            self._done.add(index)
            if self._turn == index:
                self._turn = self._next(index)
            self._changed.notify_all()


class TurnTimer(keras.callbacks.Callback):
    """Times each step of a fit in lockstep from the moment its turn comes to its batch end:
    the step and everything its loop does around it, none of the other fit's work."""

    def __init__(self, global_batch, baton, index):
        super().__init__()
        self.global_batch, self.baton, self.index = global_batch, baton, index
        self.times, self._start = [], None

    def on_train_begin(self, logs=None):
        self.baton.take(self.index)
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.times.append(time.perf_counter() - self._start)
        self.baton.pass_on(self.index)
        self.baton.take(self.index)
        self._start = time.perf_counter()

    @property
    def step_times(self):
        return self.times[1:]  # The first step opens a new iterator and calls on_train_begin.

    @property
    def examples_per_second(self):
        return callbacks.examples_per_second(self.step_times, self.global_batch)


def run(runners, steps):
    """Trains every runner (`.run(steps, timer)`, `.batch_size`) its timed steps at once,
    each in its own thread, taking their steps one at a time in turn (in the given order): a
    slow spell of this machine falls on neighbouring steps of all of them, not on one
    runner's whole turn. A runner whose steps are done drops out; the others go on in turn.

    Args:
        runners: the fits to run.
        steps: timed steps for every runner, or a list of them, one per runner.

    Returns:
        Each runner's examples/second. An error in one is raised again here, after the
        others have finished alone.
    """
    steps = [steps] * len(runners) if isinstance(steps, int) else list(steps)
    baton = Baton(len(runners))
    rates, errors = [0.0] * len(runners), []

    def train(index):
        try:
            rates[index] = runners[index].run(steps[index], TurnTimer(runners[index].batch_size, baton, index))
        except BaseException as e:  # noqa: BLE001 - raised again in the calling thread.
            errors.append(e)
        finally:
            baton.finish(index)

    threads = [threading.Thread(target=train, args=(i,), daemon=True) for i in range(len(runners))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return rates
