"""Periodic, atomic checkpoints of everything a resumed run needs, and their restore."""

import os

import tensorflow as tf
from absl import logging

from tfmp.errors import TrainingError, UsageError


class Checkpointer:
    """Saves and restores model, optimizer (loss-scale state included), step and epoch.

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
        self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="tfmp_step")
        self.epoch = tf.Variable(0, dtype=tf.int64, trainable=False, name="tfmp_epoch")
        self.position = tf.Variable(0, dtype=tf.int64, trainable=False, name="tfmp_position")
        # Dropout's random state: Keras keeps it in seed generators tf.train does not track.
        rng = [v.value for v in model.variables if v.path.endswith("seed_generator_state")]
        self.checkpoint = tf.train.Checkpoint(
            model=model, optimizer=optimizer, rng=rng, step=self.step, epoch=self.epoch, position=self.position
        )
        self.manager = tf.train.CheckpointManager(self.checkpoint, directory, max_to_keep=max_to_keep)

    def restore(self):
        """Restores the latest checkpoint, if any. Returns the step restored (0 for none).

        Raises:
            UsageError: the latest checkpoint is corrupt or belongs to another model.
        """
        path = tf.train.latest_checkpoint(self.restore_from)
        if not path:
            return 0
        try:
            self.checkpoint.restore(path).assert_existing_objects_matched()
        except Exception as e:  # noqa: BLE001 - a broken or foreign checkpoint fails in many ways.
            first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
            state = tf.train.get_checkpoint_state(self.restore_from)
            older = [os.path.basename(p) for p in state.all_model_checkpoint_paths[:-1]] if state else []
            raise UsageError(
                f"checkpoint {path} does not load into this model ({type(e).__name__}: {first}); "
                f"use a new --model_dir for a different model, or move the broken checkpoint away"
                + (f" to resume from {older[-1]}" if older else "")
            ) from e
        logging.info("Resumed from %s (step %d, epoch %d)", path, int(self.step), int(self.epoch))
        return int(self.step)

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
        try:
            return self.manager.save(checkpoint_number=step)
        except (tf.errors.OpError, OSError) as e:
            latest = self.manager.latest_checkpoint or "none yet"
            first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
            raise TrainingError(
                f"saving a checkpoint in {self.directory} failed ({first}); latest good checkpoint: {latest}"
            ) from e
