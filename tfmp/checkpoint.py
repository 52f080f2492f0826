"""Periodic, atomic checkpoints of everything a resumed run needs, and their restore."""

import gc
import os

import keras
import tensorflow as tf
from absl import logging
from google.protobuf import message
from tensorflow.core.protobuf import trackable_object_graph_pb2

from tfmp import bf16, callback_state, distribute, float8, keras_optimizers, optimizer_form
from tfmp.errors import TrainingError, UsageError, first_line
from tfmp.run_directory import flag_for


def _replica_parts(metrics):
    """{name: [each replica's variable]} for the metrics' running sums that a strategy of one worker
    keeps per replica; {} for none, or under several workers (every worker restores the chief's
    checkpoint, whose parts are the chief's replicas only).

    A strategy keeps a metric's sum on each replica, reads it as their total and restores that
    total as total / replicas on each (TensorFlow's SyncOnRead variables). A run resumed within an
    epoch would then add its batches to other partial sums than the unbroken run did: its epoch's
    mean the same value, rounded differently (1 ulp, seen on an AMD Zen 5). Restored part by part,
    the sums are the unbroken run's, to the bit.
    """
    parts = {key: v for key, v in metrics.items() if isinstance(v, tf.distribute.DistributedValues)}
    strategy = next(iter(parts.values())).distribute_strategy if parts else None
    if strategy is None or strategy.num_replicas_in_sync == 1 or distribute.num_workers(strategy) > 1:
        return {}
    return {key: list(strategy.experimental_local_results(v)) for key, v in parts.items()}


class Checkpointer:
    """Saves and restores model, optimizer (loss-scale state included), step, epoch and the
    state of Keras' stateful callbacks (`tfmp.callback_state`).

    TensorFlow writes each checkpoint's files under temporary names and renames them,
    then rewrites the `checkpoint` state file atomically: an interrupted save never
    becomes the latest, and the previous checkpoint stays loadable. `position` counts
    the batches drawn from the input stream: a resumed run skips that many, so it sees
    exactly the batches an unbroken run would.

    Args:
        directory: where checkpoints go (`MODEL_DIR/checkpoints`).
        model, optimizer: the Keras objects to save.
        max_to_keep: how many recent checkpoints to keep.
        restore_from: where to resume from, if not `directory`: workers other than the
            chief save to a temporary place but resume from the chief's checkpoints (a
            filesystem all workers see), so that every worker restores the same state.
    """

    def __init__(self, directory, model, optimizer, max_to_keep=3, restore_from=None):
        self.directory = directory
        self.restore_from = restore_from or directory
        self._model, self._optimizer = model, optimizer
        self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="tfmp_step")
        self.epoch = tf.Variable(0, dtype=tf.int64, trainable=False, name="tfmp_epoch")
        self.position = tf.Variable(0, dtype=tf.int64, trainable=False, name="tfmp_position")
        # Dropout's random state: Keras keeps it in seed generators tf.train does not track.
        rng = [v.value for v in model.variables if v.path.endswith("seed_generator_state")]
        # A MultiOptimizer's state is its optimizers', which tf.train does not reach from it.
        parts = keras_optimizers.optimizer_parts(optimizer)
        self.checkpoint = tf.train.Checkpoint(
            model=model,
            optimizer=optimizer,
            rng=rng,
            step=self.step,
            epoch=self.epoch,
            position=self.position,
            **({"optimizers": parts} if parts else {}),
        )
        self.manager = tf.train.CheckpointManager(self.checkpoint, directory, max_to_keep=max_to_keep)
        self.callbacks = callback_state.CallbackState()
        # The metrics' running sums, so that a run resumed within an epoch logs its means over all its batches;
        # by name, so that a metric added or removed since the checkpoint does not stop the run resuming.
        metrics = {}
        for v in model.metrics_variables:
            metrics[f"{v.path}:{sum(key.startswith(v.path + ':') for key in metrics)}"] = v.value
        # The input's shape when saved, (batches an epoch, examples a batch), 0 where unknown: a run resumed with
        # other batches goes on at the same point of its epoch (`resume_position`). None: not in the checkpoint.
        self.geometry = tf.Variable([0, 0], dtype=tf.int64, trainable=False, name="tfmp_geometry")
        self.saved_geometry = None
        # The learning rate the optimizer began this run with, before the restore (the checkpoint's own is the rate
        # as it stood): a rerun begun with another is told which goes on. -1: a schedule.
        self._rate = learning_rate_variable(optimizer)
        self._begun = float(self._rate.numpy()) if self._rate is not None else -1.0
        self.begun_rate = tf.Variable(self._begun, dtype=tf.float64, trainable=False, name="tfmp_begun_rate")
        # In the checkpoint from the first save or restore on (an older tfmp's checkpoints lack them).
        self._optional = {
            "callbacks": self.callbacks,
            "metrics": metrics,
            "geometry": self.geometry,
            "begun_rate": self.begun_rate,
            "optimizer_form": optimizer_form.OptimizerForm(model, optimizer),
        }
        self._kahan = [b.value for b in bf16.buffers(optimizer)]  # Not the optimizer's: see tfmp.bf16.Compensation.
        if self._kahan:
            self._optional["kahan"] = self._kahan
        # Each replica's part of those sums too, where a strategy keeps them apart (`_replica_parts`): the group's
        # name holds the count of parts, so only a run with as many restores them.
        parts = _replica_parts(metrics)
        if parts:
            self._optional[f"metrics_{len(next(iter(parts.values())))}_replicas"] = parts

    def _attach(self):
        for name, value in self._optional.items():
            setattr(self.checkpoint, name, value)

    def restore(self):
        """Restores the latest checkpoint, if any. Returns the step restored (0 for none).

        Raises:
            UsageError: the latest checkpoint is corrupt or belongs to another model.
        """
        path = tf.train.latest_checkpoint(self.restore_from)
        if not path:
            self._attach()
            return 0
        optimizer_form.check(path, self._model, self._optimizer, flag_for(self.restore_from))
        try:
            held = {name.split("/")[0] for name, _ in tf.train.list_variables(path)}
            if "callbacks" in held:
                self.checkpoint.callbacks = self.callbacks
            if "kahan" in held and self._kahan:
                self.checkpoint.kahan = self._kahan
            for name in ("geometry", "begun_rate"):
                if name in held:
                    setattr(self.checkpoint, name, self._optional[name])
            status = self.checkpoint.restore(path)
            status.expect_partial()  # What does not match raises below, once, not again when Python frees it.
            status.assert_existing_objects_matched()
            if "geometry" in held:
                self.saved_geometry = tuple(int(v) for v in self.geometry.numpy())
            if "begun_rate" in held:
                self._say_rate(path, float(self.begun_rate.numpy()))
            if "kahan" not in held:  # Saved with another rounding, or by an older tfmp (as optimizer variables).
                for buffer in self._kahan:
                    buffer.assign(tf.zeros(buffer.shape, buffer.dtype))
            if "metrics" in held:  # Those it has; one added since starts at zero.
                tf.train.Checkpoint(metrics=self._optional["metrics"]).restore(path).expect_partial()
            for name in held & self._optional.keys():  # Each replica's part, over its share of the sum.
                if name.startswith("metrics_"):
                    tf.train.Checkpoint(**{name: self._optional[name]}).restore(path).expect_partial()
            self._attach()  # In every checkpoint from here.
        except Exception as e:  # noqa: BLE001 - a broken or foreign checkpoint fails in many ways.
            failed = f"{type(e).__name__}: {first_line(e)}"
        else:
            logging.info("Resumed from %s (step %d, epoch %d)", path, int(self.step), int(self.epoch))
            return int(self.step)
        _quiet_failed_restore(path)
        flag = flag_for(self.restore_from)
        saved, now = _precision_form(path, self._model, self._optimizer)
        if saved != now:
            ways = ["--precision", "--float8_exclude"] if flag == "--model_dir" else ["tfmp.configure_precision"]
            ways = ways if "float8 on" in saved + now else ways[:1]  # float8 on other layers: its exclude.
            raise UsageError(
                f"checkpoint {path} was saved with {saved}, and this run trains with {now}: an optimizer's state "
                f"does not carry over between these precisions; resume under the precision it was saved with "
                f"({', '.join(ways)}), or use a new {flag}"
            )
        state = tf.train.get_checkpoint_state(self.restore_from)
        older = [os.path.basename(p) for p in state.all_model_checkpoint_paths[:-1]] if state else []
        raise UsageError(
            f"checkpoint {path} does not load into this model ({failed}); "
            f"use a new {flag} for a different model, or move the broken checkpoint away"
            + (f" to resume from {older[-1]}" if older else "")
        )

    def _say_rate(self, path, saved):
        """Warns where this run's optimizer began with another learning rate than the run that saved `path`: the
        checkpoint's rate goes on, as an exact resume needs, not the one the script now gives."""
        self.begun_rate.assign(self._begun)  # This run's, in the checkpoints it saves.
        if min(saved, self._begun) < 0 or abs(saved - self._begun) <= 1e-6 * abs(saved):
            return
        logging.warning(
            "this run's optimizer began with learning rate %g, the run that saved %s with %g: the checkpoint's "
            "rate, %g, goes on; to train on at another, set it in a callback's on_train_begin, or use a new %s",
            self._begun,
            path,
            saved,
            float(self._rate.numpy()),
            flag_for(self.restore_from),
        )

    def go_on_at(self, epoch, position, now, multiple=1):
        """This run's position in its input from the restored checkpoint's (`resume_position`), logged where the
        input's shape changed since; the checkpoints this run saves hold `now`, its own."""
        position, note, exact = resume_position(epoch, position, self.saved_geometry, now, multiple)
        self.geometry.assign(now)
        if note:
            (logging.info if exact else logging.warning)("%s", note)
        return position

    def save(self, step, epoch, position=None):
        """Writes a checkpoint for `step` (batches trained), `epoch` (the epoch to resume in)
        and `position` (batches drawn from the input; default `step`). Returns its path.

        Raises:
            TrainingError: the write failed (full disk, lost permission); the previous
                checkpoint is still the latest.
        """
        self.step.assign(step)
        self.epoch.assign(epoch)
        self.position.assign(step if position is None else position)
        self._attach()
        try:
            return self.manager.save(checkpoint_number=step)
        except (tf.errors.OpError, OSError) as e:
            latest = self.manager.latest_checkpoint or "none yet"
            first = first_line(e)
            raise TrainingError(
                f"saving a checkpoint in {self.directory} failed ({first}); latest good checkpoint: {latest}"
            ) from e


def learning_rate_variable(optimizer):
    """The variable holding `optimizer`'s learning rate, which a checkpoint restores; None for a schedule or a
    MultiOptimizer."""
    rate = keras_optimizers.learning_rate(optimizer)
    return rate if isinstance(rate, keras.Variable) else None


def _precision_form(path, model, optimizer):
    """In words, what the checkpoint `path` and this model and optimizer hold that a change of precision
    changes: loss scaling (mixed_float16), bfloat16 weights (pure bfloat16) and float8 layers' scales and
    histories (float8); alike where it cannot be read."""
    try:
        reader = tf.train.load_checkpoint(path)
        dtypes = reader.get_variable_to_dtype_map()
        graph = trackable_object_graph_pb2.TrackableObjectGraph()
        graph.ParseFromString(reader.get_tensor("_CHECKPOINTABLE_OBJECT_GRAPH"))
    except (tf.errors.OpError, ValueError, OSError, IndexError, message.DecodeError):  # Corrupt: the caller says so.
        return None, None
    names = [attribute.full_name for node in graph.nodes for attribute in node.attributes]  # The variables' own.
    saved = (
        any(name.startswith("optimizer/dynamic_scale/") for name in dtypes),
        any(dtype == tf.bfloat16 for dtype in dtypes.values()),
        sum("amax_history" in name for name in names) // 3,  # Keras' float8 layers: 3 each (of 3 tensors).
    )
    now = (
        isinstance(optimizer, keras.optimizers.LossScaleOptimizer),
        any(w.dtype == "bfloat16" for w in model.weights),
        len(float8.quantized_layers(model)),
    )

    def words(scaled, bfloat16, float8_layers):
        weights = "bfloat16 weights" if bfloat16 else "float32 weights"
        if float8_layers:  # Another number: `float8_exclude` changed.
            layers = f"{float8_layers} layer{'s' if float8_layers > 1 else ''}"
            return f"{weights}, {'a' if scaled else 'no'} loss scale and float8 on {layers}"
        return f"{weights} and {'a' if scaled else 'no'} loss scale"

    return words(*saved), words(*now)


def _quiet_failed_restore(path):
    """Marks what a restore of `path` that raised left behind as partial: freed later (with the objects it
    reached), TensorFlow's record of it would warn of each value it had not restored, a screen of warnings
    after the one-line error. Found by its type's name: TensorFlow hands it out only on success."""
    for record in gc.get_objects():
        if type(record).__name__ == "_CheckpointRestoreCoordinator" and record.save_path_string == path:
            record.expect_partial = True


def say_if_trained(directory, trained, epochs, verbose):
    """Says why a fit resumed from `directory` trains nothing, where its checkpoint has trained `epochs` or more
    (train.py says it in its own words)."""
    if trained < epochs or flag_for(directory) != "checkpoint_dir":
        return
    if trained > epochs:
        logging.warning(
            "checkpoint_dir=%s holds a run that trained %d epochs, more than epochs=%d: nothing trained (give more "
            "epochs to train on, or another checkpoint_dir)",
            directory,
            trained,
            epochs,
        )
    elif verbose != 0:
        print(f"checkpoint_dir={directory}: its {epochs} epochs are trained, nothing left (more train on)")


def resume_position(epoch, position, saved, now, multiple=1):
    """Where a resumed run goes on in its input, and what to say of it.

    Args:
        epoch, position: the epoch the checkpoint resumes in and the batches its run drew from the input.
        saved, now: (batches an epoch, examples a batch) of the run that saved and of this one, 0 where
            unknown (an input of unknown length is read afresh each epoch: its position is within the
            epoch); `saved` None for a checkpoint without them (an older tfmp's): taken as this run's.
        multiple: batches an update takes (`grad_accum_steps`).

    Returns:
        (the position in this run's batches, a sentence for the log or None, whether the resume is
        exact). Where the batches differ, an epoch's start stays its start (exact); a point within an
        epoch goes on at the same share of this run's epoch, rounded down to a whole update (not exact),
        as does one that is no whole number of this run's updates.
    """
    saved = tuple(now if saved is None else saved)
    (was_period, was_batch), (period, batch) = saved, now
    offset = position - epoch * was_period
    if saved == tuple(now) and offset % multiple == 0:
        return position, None, True
    shape = f"epochs of {_batches(was_period, was_batch)} when saved, of {_batches(period, batch)} now"
    if offset == 0:
        return epoch * period, f"{shape}: epoch {epoch + 1} starts at its first batch", True
    if saved == tuple(now):
        moved = offset - offset % multiple
        note = f"saved {offset} batches into epoch {epoch + 1}, no whole number of this run's {multiple}-batch updates"
        return epoch * period + moved, f"not an exact resume: {note}; it goes on {moved} batches in", False
    if was_period and period:
        moved = offset * period // was_period
    elif was_batch and batch:
        moved = offset * was_batch // batch
    else:
        moved = offset
    moved -= moved % multiple
    note = (
        f"not an exact resume: {shape}; epoch {epoch + 1}, saved {offset} batches in, goes on at the same share of "
        f"it, {moved} batches in (resume with the batches it was saved with to go on exactly)"
    )
    return epoch * period + moved, note, False


def _batches(period, batch):
    count = f"{period} batches" if period else "batches of unknown count"
    return f"{count} of {batch}" if batch else count


def latest(directory):
    """The latest checkpoint's path in `directory`, or None.

    Raises:
        UsageError: the directory's `checkpoint` state file is unreadable (garbage, a
            half-copied file): say which, and how to go on.
    """
    if not directory or not os.path.exists(os.path.join(directory, "checkpoint")):
        return None
    try:
        return tf.train.latest_checkpoint(directory)
    except Exception as e:  # noqa: BLE001 - UnicodeDecodeError, protobuf parse errors, OpError...
        raise UsageError(
            f"{os.path.join(directory, 'checkpoint')} is unreadable ({type(e).__name__}); move it away to start "
            "over, or restore it from a backup"
        ) from e


def step_of(path):
    """The batch count saved in checkpoint `path` (0 for None)."""
    if not path:
        return 0
    try:
        return int(tf.train.load_variable(path, "step/.ATTRIBUTES/VARIABLE_VALUE"))
    except (tf.errors.OpError, ValueError) as e:
        raise UsageError(f"checkpoint {path} is unreadable ({type(e).__name__}); move it away to start over") from e
