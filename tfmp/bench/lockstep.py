"""Fits that train at once, a few steps of each in turn, so that their step times compare
steps that ran one after the other (the benchmark's tfmp.fit against Keras `model.fit`).

On a shared machine whole turns of a few seconds, one after the other, differ by 25% or
more; neighbouring steps do not. Each fit runs in its own thread and hands a baton on at
the batch begin that ends its turn; a `TurnTimer` times its turns from the moment each comes.
"""

import threading
import time

import keras
import tensorflow as tf

from tfmp import callbacks


class Baton:
    """Lets fits running in threads take their turns one at a time."""

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
    """Times a fit in lockstep, in turns of `steps_per_turn` steps, each from the moment its
    turn comes to the batch begin that ends it (the last turn: the epoch's end), where the
    devices are synced: the turn's steps and everything their loop does around them, none of
    another fit's work.

    Begins, not ends, as `callbacks.Throughput` times: tfmp.fit handles an update's end after
    queuing the next (this timer is `async_safe`, as its default callbacks are), so that on a
    GPU its host reads one update while the device runs the next. Turns of several steps keep
    that overlap on a GPU; the sync at a turn's end leaves none of a turn's device work to the
    next fit's turn. The first step (a new iterator, callbacks set up) is a turn of its own,
    not timed.
    """

    async_safe = True

    def __init__(self, global_batch, baton, index, steps_per_turn=1):
        super().__init__()
        self.global_batch, self.baton, self.index, self.steps_per_turn = global_batch, baton, index, steps_per_turn
        self.turns = []  # (seconds, steps) of each turn, the untimed first one included.
        self._start, self._steps = None, 0
        # On a CPU an op has run when its call returns: nothing to wait for.
        self._sync = tf.test.experimental.sync_devices if tf.config.list_physical_devices("GPU") else (lambda: None)

    def on_train_begin(self, logs=None):
        self._take()

    def on_train_batch_begin(self, batch, logs=None):
        if self._start is None:
            self._take()
        elif self._steps >= (1 if not self.turns else self.steps_per_turn):
            self._end()
            self._take()
        self._steps += 1

    def on_epoch_end(self, epoch, logs=None):
        if self._start is not None and self._steps:
            self._end()

    def _take(self):
        self.baton.take(self.index)
        self._start, self._steps = time.perf_counter(), 0

    def _end(self):
        self._sync()
        self.turns.append((time.perf_counter() - self._start, self._steps))
        self._start = None
        self.baton.pass_on(self.index)

    @property
    def step_times(self):
        """Seconds a step, each timed step its turn's mean."""
        return [seconds / steps for seconds, steps in self.turns[1:] for _ in range(steps)]

    @property
    def examples_per_second(self):
        return callbacks.examples_per_second(self.step_times, self.global_batch)


def steps_per_turn():
    """Steps a fit takes a turn by default: one on a CPU, where a shared machine's slow
    spells would fall on one fit's whole turn; five with a GPU, whose loop overlaps a step's
    host work with the device's last step (see `TurnTimer`)."""
    return 5 if tf.config.list_physical_devices("GPU") else 1


def run(runners, steps, per_turn=None):
    """Trains every runner (`.run(steps, timer)`, `.batch_size`) its timed steps at once,
    each in its own thread, taking turns of `per_turn` steps (in the given order): a slow
    spell of this machine falls on neighbouring steps of all of them, not on one runner's
    whole round. A runner whose steps are done drops out; the others go on in turn.

    Args:
        runners: the fits to run.
        steps: timed steps for every runner, or a list of them, one per runner.
        per_turn: steps a turn (default: `steps_per_turn()`).

    Returns:
        Each runner's examples/second. An error in one is raised again here, after the
        others have finished alone.
    """
    steps = [steps] * len(runners) if isinstance(steps, int) else list(steps)
    baton, per_turn = Baton(len(runners)), per_turn or steps_per_turn()
    rates, errors = [0.0] * len(runners), []

    def train(index):
        try:
            timer = TurnTimer(runners[index].batch_size, baton, index, per_turn)
            rates[index] = runners[index].run(steps[index], timer)
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
