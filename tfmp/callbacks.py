"""Keras callbacks that show what a training run is doing."""

import collections
import csv
import functools
import os
import resource
import time
import weakref

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from tfmp import launch, tf_compat
from tfmp.steps import STEP_STATE


def examples_per_second(step_times, global_batch):
    """Examples/second over steps of `global_batch` examples that took `step_times` seconds
    (0.0 with none)."""
    return len(step_times) * global_batch / sum(step_times) if step_times else 0.0


class Throughput(keras.callbacks.Callback):
    """Measures training examples/second from the end of the warm-up steps to the last step.

    Each window runs from one batch's begin to the next's (the last to the end of
    training), so it holds everything a step costs: input waits, the step itself and every
    callback. Begins, not ends: tfmp.fit handles an update's end after queuing the next
    one, and on a CPU that runs it, so its batch ends lag a step behind; its batch begins
    do not, nor do Keras fit's.

    Args:
        global_batch: examples per training step over all replicas.
        warmup_steps: steps at the start of training not timed (tracing, allocation).
    """

    def __init__(self, global_batch, warmup_steps=3):
        super().__init__()
        self.global_batch = global_batch
        self.warmup_steps = warmup_steps
        self.step_begins = []
        self._end = None

    def on_train_batch_begin(self, batch, logs=None):
        self.step_begins.append(time.perf_counter())

    def on_train_end(self, logs=None):
        self._end = time.perf_counter()

    @property
    def step_times(self):
        """Seconds of each timed step (after warm-up); with fewer steps, all but the first."""
        stamps = self.step_begins + ([self._end] if self._end is not None else [])
        times = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
        return times[self.warmup_steps :] if len(times) > self.warmup_steps + 1 else times[1:]

    @property
    def examples_per_second(self):
        """Examples/second over the timed steps; 0.0 before any step was timed."""
        return examples_per_second(self.step_times, self.global_batch)


def peak_memory_mb():
    """Peak GPU memory of GPU:0 where there is one, else this process's peak resident memory."""
    if tf.config.list_physical_devices("GPU"):
        return tf.config.experimental.get_memory_info("GPU:0")["peak"] / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB.


class Heartbeat(keras.callbacks.Callback):
    """Renews a worker's progress file (python -m tfmp.launch's) at each validation batch: its
    time, not its count, which stays the training's batches. A validation pass longer than the
    launcher's `--stall_timeout` is then no stall, where a hung collective in it still is. As the
    fit ends, marks the file done: the launcher stops watching the worker (its script may save,
    evaluate or exit as slowly as it needs: TensorFlow's exit alone can wait 20 s for a peer)."""

    async_safe = True

    def __init__(self, path):
        super().__init__()
        self.path = path

    def on_test_batch_begin(self, batch, logs=None):
        try:
            os.utime(self.path)
        except OSError:  # No step yet in this process: the launcher's start-up limit still applies.
            pass

    on_test_batch_end = on_test_batch_begin

    def on_train_end(self, logs=None):
        progress = launch.read_progress(self.path)
        launch.write_progress(self.path, progress[0] if progress else 0, done=True)


def overrides(callbacks, hook, ignore=()):
    """Whether one of `callbacks` (Keras callbacks), not of the types `ignore`, has a `hook` of its own: by its
    class, or set on the callback itself (a LambdaCallback's hooks are)."""
    base = getattr(keras.callbacks.Callback, hook)
    own = (c for c in callbacks if not isinstance(c, ignore))
    return any(hook in getattr(c, "__dict__", {}) or getattr(type(c), hook) is not base for c in own)


# Keras' and tfmp's own callbacks whose batch hooks only show or time what happened.
BEHIND_SAFE = (keras.callbacks.ProgbarLogger, keras.callbacks.History, Throughput, Heartbeat)
# Those whose batch hooks never stop training (these exactly, not a subclass).
_NEVER_STOP = (
    *BEHIND_SAFE,
    keras.callbacks.ModelCheckpoint,
    keras.callbacks.TensorBoard,
    keras.callbacks.BackupAndRestore,
)


def may_stop_within(callbacks, hooks):
    """Whether one of `callbacks` has batch `hooks` of its own that may set `model.stop_training`."""
    may_stop = [c for c in callbacks if type(c) not in _NEVER_STOP]
    return any(overrides(may_stop, hook) for hook in hooks)


def hidden_non_finite_message(epoch, model):
    """Why training stops after `epoch` (from 0) where a weight is no longer finite although no loss was."""
    return (
        f"after epoch {epoch + 1}: non-finite weight {first_non_finite(model.weights)} although the loss stayed "
        "finite: NaN or inf reached the weights through their gradients (data holding NaN or inf, say, that a ReLU "
        "or a max hid from the loss) or the optimizer's own arithmetic; training stopped"
    )


def first_non_finite(variables):
    """The path of the first variable holding a NaN or inf, or None. Each in its own dtype (bfloat16 and
    float8 too): in float32 a float64 beyond its range would read as inf."""
    for v in variables:
        if not np.isfinite(v.numpy()).all():
            return v.path
    return None


def finiteness(variables):
    """A function that says whether every floating-point one of `variables` is finite: one read of one
    compiled check of their sums, or where that cannot run (on a device without its ops), a read of each.

    A NaN or inf makes its variable's sum non-finite, so finite sums clear every value; a sum that is not
    finite (a NaN, or finite values that overflow it) is decided by a read of each. One reduction a
    variable, where checking each value takes two and a boolean copy: on 300 float32 variables (an Intel
    Xeon), 1.06 ms a check against 1.21 (39M weights: 9.7 ms against 16), and 0.38 s to trace against 0.47."""
    floats = [v for v in variables if keras.backend.is_float_dtype(v.dtype)]
    failed = []

    @tf_compat.function(autograph=False)
    def sums_finite():
        sums = {}  # dtype -> its variables' sums (float16's in float32: its range overflows sooner).
        for v in floats:
            value = v.value
            value = tf.cast(value, tf.float32) if value.dtype == tf.float16 else value
            sums.setdefault(value.dtype, []).append(tf.reduce_sum(value))
        return tf.reduce_all(tf.stack([tf.math.is_finite(tf.add_n(each)) for each in sums.values()]))

    def check():
        if floats and not failed:
            try:
                if bool(sums_finite()):
                    return True
            except (tf.errors.OpError, TypeError, ValueError):
                failed.append(True)
        return first_non_finite(floats) is None

    return check


_CHECKS = weakref.WeakKeyDictionary()  # model -> (its weights' ids, their `finiteness`).


def weights_finiteness(model):
    """`finiteness(model.weights)`, kept for the model while its weights are the same ones: traced once, not in
    every fit (the bench times each fit's last step to its end)."""
    ids = tuple(id(v) for v in model.weights)
    kept = _CHECKS.get(model)
    if kept is None or kept[0] != ids:
        kept = _CHECKS[model] = (ids, finiteness(model.weights))
    return kept[1]


_ROWS_HELD = 1000  # Steps the Monitor holds before appending them to history.csv (a row is about 700 bytes).
HISTORY_FIELDS = ("step", "loss", "accuracy", "loss_scale", "learning_rate", "grad_norm", "skipped_steps")
_NOT_METRICS = {*STEP_STATE, "steps", "updates"}  # tfmp.fit's step state and call sizes.


class Monitor:
    """What mixed precision is doing, step by step: TensorBoard scalars, warnings, history.

    `tfmp.fit` hands it each update's outputs (`record`). Every `log_every` steps it writes,
    under `MODEL_DIR/tensorboard`: loss, accuracy, learning rate, loss scale, skipped steps
    (count and rate), gradient global norm, examples/second, step time and peak memory.
    It warns once when the loss scale falls below 1 or more than `skip_warning` of the
    recent steps were skipped. Each step's figures also go to `history.csv`.

    Args:
        model_dir: the run's directory (only the chief passes the real one).
        optimizer: the optimizer being used (its iterations count applied updates).
        examples_per_step: examples per training step, for examples/second.
        log_every: steps between TensorBoard writes.
        start_step: the step training resumes from.
        skip_warning: the fraction of skipped steps (over the last 100) that warns.
    """

    def __init__(self, model_dir, optimizer, examples_per_step, log_every=10, start_step=0, skip_warning=0.05):
        self.scaled = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
        self.examples_per_step = examples_per_step
        self.log_every = log_every
        self.step = start_step
        self.skip_warning = skip_warning
        self.history_path = os.path.join(model_dir, "history.csv")
        self.writer = tf.summary.create_file_writer(os.path.join(model_dir, "tensorboard"))
        self.skipped = _keep_history_to(self.history_path, start_step)
        self.rows = []  # Steps not yet in history.csv: appended every _ROWS_HELD steps, at checkpoints and at the end.
        self.recent = collections.deque(maxlen=100)  # 1 for a skipped step.
        self.warned = set()
        self.metrics = {}
        self._applied = int(optimizer.iterations.numpy())
        self._last = time.perf_counter()
        self._writes = {}  # Scalar tags -> the compiled write of their values.

    def record(self, step, logs):
        """One call's outputs from tfmp.fit's steps: `steps` (batches) and `updates` in it,
        `iterations` (updates applied so far), `loss_scale`, `learning_rate`, `grad_norm`
        and the model's metrics."""
        now = time.perf_counter()
        step_time, self._last = now - self._last, now
        steps, updates = int(logs["steps"]), int(logs["updates"])  # Fewer updates under accumulation.
        self.step += steps
        applied = int(logs["iterations"])
        skipped = updates - (applied - self._applied)
        self._applied = applied
        self.skipped += skipped
        self.recent.extend([1] * skipped + [0] * (updates - skipped))
        self.metrics = {k: float(v) for k, v in logs.items() if k not in _NOT_METRICS and np.ndim(v) == 0}
        row = {
            "step": self.step,
            "loss": float(logs.get("loss", np.nan)),
            "accuracy": float(logs.get("accuracy", np.nan)),
            "loss_scale": float(logs["loss_scale"]) if self.scaled else None,
            "learning_rate": float(logs["learning_rate"]) if "learning_rate" in logs else None,  # Not a MultiOptimizer.
            "grad_norm": float(logs["grad_norm"]),
            "skipped_steps": self.skipped,
        }
        self.rows.append(row)
        if len(self.rows) >= _ROWS_HELD:
            self._append_rows()
        self._warn(row)
        if self.step % self.log_every < steps or not self._writes:  # The first too: its trace in the warm-up.
            self._write(row, step_time / steps)

    def _write(self, row, step_time):
        scalars = dict(self.metrics)  # The model's own: loss, accuracy, per-output losses...
        scalars.update({key: row[key] for key in ("learning_rate", "grad_norm", "loss_scale") if row[key] is not None})
        scalars["skipped_steps"] = row["skipped_steps"]
        scalars["skipped_rate"] = sum(self.recent) / len(self.recent)
        if self.examples_per_step:
            scalars["examples_per_second"] = self.examples_per_step / max(step_time, 1e-9)
        scalars["step_time_ms"] = 1e3 * step_time
        scalars["peak_memory_mb"] = peak_memory_mb()
        tags = tuple(scalars)
        if tags not in self._writes:
            self._writes[tags] = tf_compat.function(functools.partial(_scalars, self.writer, tags), autograph=False)
        # Numpy values, one call: TensorFlow keeps memory for each Python number an eager op converts (about 0.7 KB a
        # distinct value, never freed), and for each eager tf.summary.scalar too.
        self._writes[tags](np.asarray(list(scalars.values()), np.float32), np.int64(self.step))

    def _warn(self, row):
        scale = row["loss_scale"]
        if scale is not None and scale < 1 and "scale" not in self.warned:
            self.warned.add("scale")
            logging.warning(
                "Loss scale fell to %g at step %d: float16 gradients keep overflowing. Likely causes: a "
                "layer whose output overflows float16 (tfmp.diagnose(model, data) names it; keep it float32 "
                "with tfmp.keep_float32 or train.py's --keep_float32), a too-high learning rate "
                "(the optimizer's learning_rate; train.py's --learning_rate), or bad input data (NaN/inf).",
                scale,
                row["step"],
            )
        rate = sum(self.recent) / len(self.recent)
        if len(self.recent) >= 20 and rate > self.skip_warning and "skips" not in self.warned:
            self.warned.add("skips")
            logging.warning(
                "%.0f%% of the last %d steps were skipped for non-finite gradients. Likely causes: an initial "
                "loss scale far too high (wrap_optimizer's initial_scale; train.py's --loss_scale_initial), float16 "
                "overflow in a layer, or a learning rate that diverges.",
                100 * rate,
                len(self.recent),
            )

    def flush(self):
        """Writes out TensorBoard events and appends the steps recorded since the last flush to
        history.csv (call at checkpoints and at the end)."""
        self.writer.flush()
        self._append_rows()

    def _append_rows(self):
        if not self.rows:
            return
        new = not os.path.exists(self.history_path)
        with open(self.history_path, "a", newline="") as f:
            writer = csv.DictWriter(f, HISTORY_FIELDS)
            if new:
                writer.writeheader()
            writer.writerows(self.rows)
        self.rows = []


def _scalars(writer, tags, values, step):
    with writer.as_default(step=step):
        for i, tag in enumerate(tags):
            tf.summary.scalar(tag, values[i])


def skipped_steps(history_csv):
    """Updates skipped for overflow over the whole run, from its history.csv (0 without one)."""
    last = collections.deque(_history_rows(history_csv), maxlen=1)
    return last[0][1] if last else 0


def _history_rows(path):
    """(step, skipped steps, row) for each row of history.csv, a row at a time (a long run's holds millions), none
    where there is no file; a row cut short (the process killed while appending it) is left out."""
    if not os.path.exists(path):
        return
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            try:
                yield float(row["step"]), int(float(row["skipped_steps"])), row
            except (TypeError, ValueError):
                continue


def _keep_history_to(path, up_to_step):
    """Cuts an earlier run's history.csv to its steps up to `up_to_step` (those past the checkpoint will be redone);
    returns the skipped steps its last kept row counts (0 without)."""
    if not os.path.exists(path):
        return 0
    skipped, kept = 0, path + ".part"
    with open(kept, "w", newline="") as out:
        writer = csv.DictWriter(out, HISTORY_FIELDS)
        writer.writeheader()
        for step, row_skipped, row in _history_rows(path):
            if step <= up_to_step:
                writer.writerow(row)
                skipped = row_skipped
    os.replace(kept, path)
    return skipped


def non_finite_message(
    loss, optimizer, model, bad_gradient=None, step=None, loss_scale=None, checked=True, checkpoint=False
):
    """Why training must stop, or None when it may go on. `loss_scale`: the scale after the
    update that gave `loss` (default: the optimizer's now); `checked`: whether the gradients
    were checked (where not, `bad_gradient` is None and says nothing of them); `checkpoint`: the
    run's last checkpoint (its weights finite: none is saved after a non-finite loss), None where
    the run has a checkpoint directory but saved nothing yet, False where it has none."""
    if np.isfinite(float(loss)):
        return None
    scale = None
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        scale = float(optimizer.dynamic_scale.numpy()) if loss_scale is None else loss_scale
        if scale >= 1.0:
            return None  # Skipped; the scale halves. Monitor warns if this keeps happening.
    where = f" at step {step}" if step is not None else ""
    culprit = first_non_finite(model.weights)
    if culprit:
        detail = f"first non-finite weight: {culprit}"
    elif bad_gradient:
        detail = f"weights still finite; first non-finite gradient: {bad_gradient}"
    elif not checked:
        detail = "weights still finite; gradients not checked (tfmp.fit checks them with a log_dir)"
    else:
        detail = "weights still finite: the loss itself overflowed"
    scale_note = f" with the loss scale down to {scale:g}" if scale is not None else ""
    if checkpoint:
        kept = f"the last checkpoint, {checkpoint}, holds finite weights"
    elif checkpoint is None:
        kept = "it had saved no checkpoint yet"
    else:
        kept = "no checkpoint was kept (tfmp.fit keeps them with a checkpoint_dir)"
    return f"non-finite loss ({float(loss)}){where}{scale_note}; {detail}. Training stopped; {kept}"
