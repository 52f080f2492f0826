"""One call of `tfmp.fit`, once its arguments are checked and its steps compiled: the epoch
loop, reading each update's results one update behind, callbacks, checkpoints, monitoring
and guards."""

import os
import typing

import keras
import tensorflow as tf
from absl import logging

from tfmp import callbacks as tfmp_callbacks
from tfmp import checkpoint, distribute, doctor, guards, keras_compat, launch, loss_scale, packed, pydata
from tfmp.errors import TrainingError, first_line
from tfmp.steps import FELL_BACK, STEP_STATE


def evaluated_nothing(model):
    """Whether the model's last evaluation saw no batch: its loss is a mean over none."""
    tracker = keras_compat.loss_tracker(model)
    return tracker is not None and float(tracker.count.numpy()) == 0  # (Summed over this worker's replicas.)


def validates(epoch, validation_freq):
    """Whether epoch `epoch` (from 0) ends with validation: every `validation_freq`-th, or
    each epoch a list of them names (from 1), as in Keras fit."""
    if isinstance(validation_freq, list | tuple):
        return epoch + 1 in validation_freq
    return (epoch + 1) % validation_freq == 0


def first_non_finite_gradient(steps, finite):
    """The path of the first variable whose reduced gradient `steps` found non-finite (`finite`, per variable it
    applied), or None."""
    return next((steps.variables[i].path for i, ok in zip(steps.applied, finite, strict=True) if not ok), None)


def runs_once(steps_arg, generator=True):
    """What to do where an input gave a pass no batch, or a stream (`steps_arg` given) ended: `steps_arg` names
    the argument that bounds a generator without end (steps_per_epoch, validation_steps, steps). Not a
    `generator`: a dataset, which tfmp repeats, whose next pass was empty."""
    if generator:
        return f"a generator runs once: give a dataset, a PyDataset, arrays, or a generator without end and {steps_arg}"
    return (
        "the dataset's next pass held nothing, as one made of a generator object does: give from_generator a "
        f"function that makes the generator anew, or fewer {steps_arg} x epochs"
    )


class _Update(typing.NamedTuple):
    """A queued update: its packed outputs, the batches done in the epoch and in all once it
    is applied, its input position, its batches and updates."""

    packed: tf.Tensor
    done: int
    step: int
    position: int
    batches: int
    updates: int


_ALONE = ", without its validation or on_epoch_end: a worker cannot tell whether the others ran out too"
_HOOKS = ("on_batch_begin", "on_batch_end", "on_train_batch_begin", "on_train_batch_end")


class Run:
    """One call of `fit`: the epoch loop, callbacks, checkpoints, monitoring and guards."""

    def __init__(self, model, steps, train_input, val_input, saver, log_dir, log_every, callbacks, verbose):
        self.model, self.steps, self.input, self.val_input, self.saver = model, steps, train_input, val_input, saver
        self.n = steps.grad_accum_steps
        self.progress_path = os.environ.get(launch.PROGRESS_ENV)  # Set by python -m tfmp.launch: how far it got.
        heartbeat = [tfmp_callbacks.Heartbeat(self.progress_path)] if self.progress_path else []
        self.callbacks = keras.callbacks.CallbackList(
            [*heartbeat, *callbacks],
            add_history=True,
            add_progbar=verbose != 0,
            verbose=verbose,
            epochs=None,  # Set in train().
            steps=train_input.steps,
            model=model,
        )
        self.callbacks.set_params({**self.callbacks.params, "jit_compile": steps.jit_compile})
        self.log_dir, self.log_every = log_dir, log_every
        self.monitor = None
        # The training input's iterator: an attribute, not a local, so that an error's traceback (Ctrl-C's
        # Interrupted kept by a notebook) holds no frame that holds it; tfmp.fit drops it as it ends (`let_go`).
        self.iterator = None
        self.step = 0  # Batches trained, over all epochs.
        self.validation_ran_out = False
        # Several workers agree on a stop (`_stops`): after each update where a callback has batch hooks.
        self.several = distribute.num_workers(steps.strategy) > 1
        self.vote = distribute.worker_vote(steps.strategy)
        self.agree_each_batch = self.several and tfmp_callbacks.may_stop_within(self.callbacks.callbacks, _HOOKS)
        self.weights_finite = tfmp_callbacks.weights_finiteness(model)
        self.weights_finite()  # Traced now, before any step is timed, not in the first epoch's last step.
        # A non-finite loss raises TrainingError; with keras.callbacks.TerminateOnNaN it ends the run, as in Keras fit.
        self.nan_ends = any(
            isinstance(c, keras.callbacks.TerminateOnNaN) and not getattr(c, "raise_error", False)
            for c in self.callbacks.callbacks
        )

    def _monitor(self, start_step):
        if not self.log_dir:
            return None
        batch = self.input.global_batch
        return tfmp_callbacks.Monitor(self.log_dir, self.steps.optimizer, batch, self.log_every, start_step=start_step)

    def train(self, epoch, epochs, position, step, validation_freq, checkpoint_every):
        """Trains from `epoch`, `position` batches into the input (a resumed run), with
        `step` batches trained before. Returns the History."""
        model, steps, source = self.model, self.steps, self.input
        self._begin(epochs, step)
        restored = keras_compat.backup_epoch(model)
        if restored:  # A keras.callbacks.BackupAndRestore loaded its weights: on from its epoch, as Keras fit goes.
            epoch, position = restored, source.position(restored, 0)
        first = epoch
        offset = position - source.position(epoch, 0)  # Batches into this epoch.
        self.step = step
        self.monitor = self._monitor(step)
        self.iterator = source.stream(source.position(epoch, offset)) if source.streamed else None
        stop, handler = guards.Stop(), guards.preemption_handler(steps.strategy, self.saver)
        epoch_logs = {}
        with guards.signals_set(stop, self.saver is not None and handler is None):
            while epoch < epochs and not model.stop_training:
                self._begin_epoch(epoch, offset)
                if not source.streamed:
                    self.iterator = source.epoch(offset)
                logs, done = self._train_epoch(epoch, offset, stop, handler, checkpoint_every)
                # Loss-scaled, the update was skipped and nothing else shows it. (One worker: all stop alike.)
                starved = not self.several and distribute.starved_statistics(model, steps.strategy)
                if starved:
                    raise TrainingError(f"after epoch {epoch + 1}: {starved}; training stopped")
                self._check_weights(epoch)
                ended = not model.stop_training and not (source.streamed and done >= source.steps)  # It ran out.
                if ended:
                    source.say_left_out(epoch, source.position(epoch, done))
                if done == 0 and ended:  # Not one batch: the data ran out (a generator). A run
                    # resumed at its epoch's end (SIGTERM at the last batch) has done == offset > 0: the next epoch.
                    advice = runs_once("steps_per_epoch", source.generator or not source.streamed)
                    logging.warning("data ran out: epoch %d got no batch; training stops (%s)", epoch + 1, advice)
                    break
                ran_out = source.streamed and ended
                if ran_out:  # A stream that ends (a generator's) ended within the epoch: it ends there, as in Keras.
                    logging.warning(
                        "data ran out: epoch %d got %d of its %d batches; training stops after it%s (%s)",
                        epoch + 1,
                        done,
                        source.steps,
                        _ALONE if self.several else "",
                        runs_once("steps_per_epoch", source.generator),
                    )
                    if self.several:  # No collective (validation, a vote) that a worker still training would not join.
                        break
                elif source.streamed and not model.stop_training:
                    # Batches past the last whole update (a length that grad_accum_steps
                    # does not divide) are drawn and left out: every epoch starts on time.
                    for _ in range(source.period - done):
                        if next(self.iterator, None) is None:  # (The next epoch then gets none.)
                            break
                epoch_logs = dict(logs or steps.results())
                if self.val_input is not None and validates(epoch, validation_freq):
                    epoch_logs.update(self._validate(epoch))
                epoch, offset = epoch + 1, 0
                self._end_epoch(epoch - 1, epoch_logs, save=not ran_out)  # (Its position is no epoch's start.)
                if ran_out:
                    break
                if stop.is_set() and not model.stop_training:  # It came after the epoch's updates: saved at its end.
                    raise stop.error(self.step, self.saver.directory)
        self._end(epochs, epoch > first and epoch == epochs, epoch_logs)
        return model.history

    def _begin(self, epochs, step):
        """The callbacks' on_train_begin, and their state put back where a checkpoint has it."""
        model = self.model
        self.callbacks.set_params({**self.callbacks.params, "epochs": epochs})
        model.stop_training = False
        # Resumed, a CSVLogger adds the epochs' rows to those of the run before, which its on_train_begin would wipe.
        rows = [c for c in self.callbacks.callbacks if isinstance(c, keras.callbacks.CSVLogger) and not c.append]
        for csv_logger in rows if step else ():
            csv_logger.append = True
        self.callbacks.on_train_begin()
        for csv_logger in rows:
            csv_logger.append = False  # As it was given.
        ended = self.saver.callbacks.apply(self.callbacks.callbacks) if self.saver is not None else None
        if ended is not None:  # A callback ended the run checkpointed (EarlyStopping): it trains no further.
            where = self.saver.restore_from
            logging.warning(
                "a callback ended the run in %s at epoch %d: nothing left to train there (another checkpoint_dir "
                "trains anew)",
                where,
                ended + 1,
            )
            model.stop_training = True
        self._stops()

    def _check_weights(self, epoch):
        """After an epoch, a weight that is no longer finite although no loss was (the per-update guard saw
        none): TrainingError, or with TerminateOnNaN the run's end. One read."""
        if self.model.stop_training or self.weights_finite():
            return
        message = tfmp_callbacks.hidden_non_finite_message(epoch, self.model)
        if not self.nan_ends:
            raise TrainingError(message)
        logging.warning("%s", message)
        self.model.stop_training = True

    def _stops(self, batch=False):
        """Whether training stops here (`model.stop_training`), agreed by every worker where there are
        several: a stop one worker's callback asks for (a time limit, say) stops all after the same update,
        where alone it would leave the others waiting in the next all-reduce. After an update (`batch`), only
        where a callback has batch hooks; the others agree at the run's and each epoch's begin and end."""
        if self.agree_each_batch or not batch:  # (One worker: its own flag.)
            self.model.stop_training = self.vote(self.model.stop_training)
        return self.model.stop_training

    def _begin_epoch(self, epoch, offset):
        """The metrics reset and the callbacks' on_epoch_begin; resumed within the epoch (`offset` batches in),
        the running means go on from the checkpoint's and the learning rate stays the checkpoint's."""
        if not offset:
            self.model.reset_metrics()
        held = checkpoint.learning_rate_variable(self.steps.optimizer) if offset else None
        kept = None if held is None else held.numpy()
        self.callbacks.on_epoch_begin(epoch)
        if kept is not None:  # Its on_epoch_begin had run before the checkpoint: a LearningRateScheduler
            held.assign(kept)  # that halves the rate each epoch must not halve it twice.
        self._stops()

    def _end_epoch(self, epoch, logs, save=True):
        """The callbacks' on_epoch_end, then the epoch's checkpoint (unless it was stopped within)."""
        stopped = self.model.stop_training or not save  # Stopped during the epoch: no save.
        self.callbacks.on_epoch_end(epoch, logs)
        self._stops()
        if self.saver is not None and not stopped:  # After the callbacks: what they changed (the learning
            # rate), their state, and whether one ended the run.
            self.saver.callbacks.stopped = epoch if self.model.stop_training else None
            source = self.input
            self._save(epoch + 1, source.position(epoch + 1, 0))

    def _end(self, epochs, trained_to_the_end, logs):
        """As Keras fit ends: the EMA weights, a PyDataset's last end hook, the callbacks' on_train_end."""
        if self.monitor is not None:
            self.monitor.flush()
        if epochs > 0:  # As Keras fit ends: an optimizer with use_ema=True leaves its averages as the weights.
            self.steps.optimizer.finalize_variable_values(self.model.trainable_weights)
        # A PyDataset's hooks run on its pipeline, ahead of training: its last end hook, as in Keras, before returning.
        if trained_to_the_end and not self.model.stop_training and not self.input.end_hooks_ran(epochs):
            logging.warning(
                "%s's on_epoch_end had not run after %g s; tfmp.fit returns without it",
                self.input.name,
                pydata.END_HOOK_SECONDS,
            )
        self.callbacks.on_train_end(logs)

    def _validate(self, epoch):
        """The validation pass: its val_ logs; none, and one warning a fit, where it saw no batch."""
        self.callbacks.on_test_begin()
        # Their running logs for a callback that reads test batches (in fit, Keras' progress bar does not).
        batch_logs = tfmp_callbacks.overrides(self.callbacks.callbacks, "on_test_batch_end", tfmp_callbacks.BEHIND_SAFE)
        logs = self.steps.evaluate(self.val_input.once(), self.val_input.steps, self.callbacks, batch_logs)
        if evaluated_nothing(self.model):
            if not self.validation_ran_out:
                once = runs_once("validation_steps")
                logging.warning("validation_data ran out at epoch %d: no val_ metrics from there (%s)", epoch + 1, once)
            logs, self.validation_ran_out = {}, True
        self.callbacks.on_test_end(logs)
        return {f"val_{k}": v for k, v in logs.items()}

    def _train_epoch(self, epoch, offset, stop, handler, checkpoint_every):
        """Trains one epoch from batch `offset`; returns the last logs and the batches done.

        The device is never left waiting for the host: an update's outputs are read (one
        copy) only after the next update is queued, while it runs, and the guards, the
        monitor and the callbacks see them then. The loop waits for the update it just
        queued only where a value is due at that point: a checkpoint, SIGTERM, the end of
        the epoch, a stop asked for, or a callback that must see every update's end before
        the next begins (`_reads_behind`).
        """
        model, steps, n = self.model, self.steps, self.n
        k, total = steps.steps_per_execution, self.input.steps  # total None: until the input runs out.
        behind, may_end = self._reads_behind(handler), self.input.may_end
        done, logs, pending = offset, None, None
        while total is None or done < total:
            # One update a call where a read may end the input: the updates before it in the call would be lost.
            updates = k if total is not None and total - done >= k * n and not may_end else 1
            self.callbacks.on_train_batch_begin(done)
            try:
                packed = steps.dispatch(self.iterator, updates, gated=may_end, retry=False)
                if packed is FELL_BACK:  # XLA failed at the first step.
                    packed = self._fell_back(epoch, done, updates, may_end)
                if done == offset:  # An epoch's first update, the run's among them: the batches of a generator
                    self.input.settle()  # kept for a refusal of that (`_fell_back`) are let go.
            except (tf.errors.OutOfRangeError, StopIteration):
                break  # Unknown length: the epoch ended.
            batches = updates * n
            done, self.step = done + batches, self.step + batches
            position = self.input.position(epoch, done)
            queued = _Update(packed, done, self.step, position, batches, updates)
            if pending is not None:  # The update before, done or nearly: read while this one runs.
                logs = self._finish(pending)
            pending = queued
            due = self.saver is not None and checkpoint_every and self.step % checkpoint_every < batches
            due = due and not (total is not None and done >= total)  # An epoch's end saves as the next's start.
            if behind and not (due or stop.is_set() or model.stop_training):  # (No handler when behind.)
                continue
            logs, pending = self._finish(pending), None
            if handler is not None:  # Saves and raises Preempted when any worker got SIGTERM.
                self.saver.step.assign(self.step)
                self.saver.epoch.assign(epoch)
                self.saver.position.assign(position)
                handler.save_checkpoint_if_preempted(checkpoint_number=self.step)
            if stop.is_set():  # SIGTERM or Ctrl-C.
                self._save(epoch, position)
                raise stop.error(self.step, self.saver.directory)
            if due:
                self._save(epoch, position)
            if self._stops(batch=True):
                break
        if pending is not None:
            logs = self._finish(pending)
        return logs, done

    def _fell_back(self, epoch, done, updates, may_end):
        """The update XLA refused, without XLA, on its batches: its input read again from `done`, as a resume reads
        it (a generator's, from the batches it kept: `pydata.settle`)."""
        why = f"XLA cannot compile this model: {self.steps.fallback}"
        self.callbacks.set_params({**self.callbacks.params, "jit_compile": False, "jit_compile_reason": why})
        self.iterator = self.input.reread(epoch, done)
        return self.steps.dispatch(self.iterator, updates, gated=may_end)

    def _reads_behind(self, handler):
        """Whether an update's end may be handled after the next update is queued: not for
        multi-worker preemption (whose checkpoint must hold exactly the updates it counts),
        nor for a callback with batch hooks of its own, which may change the model or the
        optimizer between two updates, as under `model.fit` (unless it says `async_safe`,
        as Keras lets a callback say), nor where the workers vote on a stop after each update."""
        if handler is not None or self.agree_each_batch:
            return False
        unsafe = [c for c in self.callbacks.callbacks if not getattr(c, "async_safe", False)]
        return not any(tfmp_callbacks.overrides(unsafe, hook, tfmp_callbacks.BEHIND_SAFE) for hook in _HOOKS)

    def _finish(self, update):
        """An update's end: one read of its outputs, the guards, the monitor, the callbacks."""
        out = self.steps.read(update.packed)
        if self.progress_path:
            launch.write_progress(self.progress_path, update.step)
        logs = self._logs(out)
        if self.monitor is not None:
            self.monitor.record(update.step, {**out, **logs, "steps": update.batches, "updates": update.updates})
        message = tfmp_callbacks.non_finite_message(
            out["step_loss"],
            self.steps.optimizer,
            self.model,
            first_non_finite_gradient(self.steps, out["finite"]),
            update.step,
            loss_scale=float(out["loss_scale"]) if self.steps.scaled else None,
            checked=self.steps.grad_norm,
            checkpoint=self.saver is not None and checkpoint.latest(self.saver.restore_from),
        )
        if message:
            starved = distribute.starved_statistics(self.model, self.steps.strategy)
            cause = starved or f"Replay of the failing batch: {self._replay(update.position - update.batches)}"
            message = f"{message}. {cause}"
            if not self.nan_ends:
                raise TrainingError(message)
            logging.warning("%s", message)
            # What TerminateOnNaN reads, and the epoch's loss in the History, as in Keras fit (tfmp's running mean
            # leaves out a non-finite loss: a step skipped for overflow must not make the epoch's mean inf).
            logs = {**logs, "loss": float(out["step_loss"])}
        self.callbacks.on_train_batch_end(update.done - 1, logs)
        return logs

    def _replay(self, position):
        """Where the non-finite values of the update that began at `position` came from."""
        source = self.input
        try:
            ds, why_not = source.replayable()  # What the run read, or None where a new iterator reads otherwise.
            if ds is None:
                return f"not possible: {why_not}"
            ds = (ds.repeat() if source.streamed else ds).skip(position).take(1)
            scale = loss_scale.loss_scale_of(self.steps.optimizer)
            return doctor.localize_non_finite(self.model, next(iter(ds)), scale)
        except Exception as e:  # noqa: BLE001 - a diagnosis must not hide the error it explains.
            return f"not possible ({type(e).__name__}: {first_line(e, 120, default='')})"

    def _logs(self, out):
        """What callbacks see after a call: the model's metrics (running means over the
        epoch), and the loss scale where there is one."""
        logs = {key: packed.as_log(value) for key, value in out.items() if key not in STEP_STATE}
        if self.steps.scaled:
            logs["loss_scale"] = float(out["loss_scale"])
        return logs

    def _save(self, epoch, position):
        culprit = tfmp_callbacks.first_non_finite(self.model.weights)
        if culprit:  # Never let a non-finite state become the latest checkpoint.
            raise TrainingError(f"non-finite weight {culprit} at batch {self.step}; not checkpointed, training stopped")
        self.saver.save(self.step, epoch, position)
        if self.monitor is not None:
            self.monitor.flush()
