"""Keras callbacks that show what a training run is doing."""

import time

import keras


class Throughput(keras.callbacks.Callback):
    """Measures training examples/second from the end of the warm-up steps to the last step.

    The window runs from one batch end to the next, so it holds everything a step costs:
    input waits, the step itself and every callback.

    Args:
        global_batch: examples per training step over all replicas.
        warmup_steps: steps at the start of training not timed (tracing, allocation).
        budget_seconds: if set, stop training once this much wall time has passed since
            training began (benchmarks use it to cut off very slow candidates).
    """

    def __init__(self, global_batch, warmup_steps=3, budget_seconds=None):
        super().__init__()
        self.global_batch = global_batch
        self.warmup_steps = warmup_steps
        self.budget_seconds = budget_seconds
        self.step_ends = []
        self.cut_off = False
        self._begin = None

    def on_train_begin(self, logs=None):
        self._begin = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        now = time.perf_counter()
        self.step_ends.append(now)
        if self.budget_seconds is not None and now - self._begin > self.budget_seconds:
            self.cut_off = True
            self.model.stop_training = True

    @property
    def step_times(self):
        """Seconds of each timed step (after warm-up); with fewer steps, all but the first."""
        ends = [self._begin, *self.step_ends]
        times = [b - a for a, b in zip(ends, ends[1:], strict=False)]
        return times[self.warmup_steps :] if len(times) > self.warmup_steps + 1 else times[1:]

    @property
    def examples_per_second(self):
        """Examples/second over the timed steps; 0.0 before any step was timed."""
        times = self.step_times
        return len(times) * self.global_batch / sum(times) if times else 0.0
