"""Keras callbacks that show what a training run is doing."""

import time

import keras


class Throughput(keras.callbacks.Callback):
    """Measures training examples/second, leaving out the first steps (tracing, warm-up).

    Args:
        global_batch: examples per training step over all replicas.
        warmup_steps: steps at the start of training not timed.
    """

    def __init__(self, global_batch, warmup_steps=3):
        super().__init__()
        self.global_batch = global_batch
        self.warmup_steps = warmup_steps
        self.steps = 0
        self.timed_steps = 0
        self.timed_seconds = 0.0
        self._start = None

    def on_train_batch_begin(self, batch, logs=None):
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1
        if self.steps > self.warmup_steps:
            self.timed_steps += 1
            self.timed_seconds += time.perf_counter() - self._start

    @property
    def examples_per_second(self):
        """Examples/second over the timed steps; 0.0 before any step was timed."""
        if not self.timed_seconds:
            return 0.0
        return self.timed_steps * self.global_batch / self.timed_seconds
