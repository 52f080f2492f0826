"""`tfmp.fit`: train any compiled Keras model under any tf.distribute strategy, correctly."""

import contextlib
import math
import os
import tempfile
import threading
import typing
import weakref

import keras
import numpy as np
import tensorflow as tf

from tfmp import callbacks as tfmp_callbacks
from tfmp import (
    checkpoint,
    decisions,
    distribute,
    doctor,
    float8,
    guards,
    inputs,
    keras_compat,
    loss_scale,
    precision,
    xla,
)
from tfmp.errors import PeerLost, Preempted, TrainingError, UsageError, first_line
from tfmp.steps import STEP_STATE, Steps

VERBOSE = ("auto", 0, 1, 2)
PROGRESS_ENV = "TFMP_PROGRESS_FILE"  # Where tfmp.launch asks each worker to say how far it got.


def fit(
    model,
    data,
    *,
    epochs=1,
    initial_epoch=0,
    steps_per_epoch=None,
    validation_data=None,
    validation_steps=None,
    validation_freq=1,
    callbacks=None,
    strategy=None,
    grad_accum_steps=1,
    clipnorm=None,
    steps_per_execution=1,
    checkpoint_dir=None,
    checkpoint_every=200,
    log_dir=None,
    log_every=10,
    jit_compile="auto",
    verbose="auto",
):
    """Trains a compiled Keras model like `model.fit`, correct under every strategy.

    What it adds to `model.fit`: under `tf.distribute` the gradients are all-reduced once,
    then clipped by their global norm (`clipnorm`), then applied; an overflow on any
    replica skips the update on all (loss scaling with tfmp's `LossScaleOptimizer`, which
    replaces Keras' own); gradient accumulation and several workers work (both fail in
    Keras 3); checkpoints resume exactly; SIGTERM saves and raises `Preempted`; a
    non-finite loss that no loss scale absorbs raises `TrainingError` naming the culprit.

    Args:
        model: a compiled Keras model, built in `strategy.scope()`. Its compiled loss,
            loss weights, metrics and weighted metrics are used, and its regularization
            losses; losses are means over the GLOBAL batch.
        data: a `tf.data.Dataset` of `(x, y)` or `(x, y, sample_weight)` batches at the
            GLOBAL batch size (x and y may be tuples or dicts), or a callable
            `input_context -> dataset` batched at the per-replica size (then
            `steps_per_epoch` is required). A callable with a `skip` keyword gets the
            global batches a resumed run skips, and skips them itself (cheaply, before
            decoding), returning the whole remaining stream; otherwise tfmp applies
            `Dataset.skip` to what it returns.
        epochs: epochs to train to (counting `initial_epoch`'s).
        initial_epoch: the epoch to start at (a resumed checkpoint overrides it).
        steps_per_epoch: batches per epoch; default: one pass over `data`. A finite
            dataset is repeated, so epochs may span passes.
        validation_data: evaluated at the end of every `validation_freq`-th epoch (a
            dataset or callable like `data`); adds `val_*` to the logs and History.
        validation_steps: batches per validation; default: all of `validation_data`.
        validation_freq: validate every this many epochs.
        callbacks: Keras callbacks (EarlyStopping, ModelCheckpoint, TensorBoard, ...).
            tfmp.fit queues each update before it reads the one before (one copy of its
            outputs), so the device need not wait for the host; a callback with batch
            hooks of its own sees each update end before the next one starts, as under
            `model.fit`, unless it sets `async_safe = True` (Keras' own flag).
        strategy: default: the strategy the model was built under.
        grad_accum_steps: every N consecutive batches make one update, equal to one
            update on their concatenation.
        clipnorm: clip the global norm of the all-reduced, unscaled gradients.
        steps_per_execution: updates per compiled call (TPUs: fewer host round trips).
        checkpoint_dir: save model, optimizer (loss scale included), epoch and input
            position here every `checkpoint_every` batches and at each epoch's end, and
            resume from the latest checkpoint found there. Several workers: the chief
            saves here, the others to a temporary place.
        checkpoint_every: batches between checkpoints (0: only at epoch ends).
        log_dir: TensorBoard scalars (loss, metrics, learning rate, loss scale, skipped
            steps, gradient norm, examples/s, memory) and history.csv go here every
            `log_every` batches. Default: `checkpoint_dir`, if given.
        log_every: batches between TensorBoard writes.
        jit_compile: run each replica's forward and backward passes as one XLA
            computation, under any strategy (the all-reduce, clipping and update stay
            outside it). "auto": a rule, the same every run: on GPUs and TPUs, not on
            CPUs. "autotune" measures both ways before training (alternating rounds, up
            to 15 s, said before they run) and keeps XLA only where it is clearly faster;
            the choice is recorded in the run's directory (`log_dir`, else
            `checkpoint_dir`: its decisions.json) and taken again by a resumed run or a
            rerun there, so that both train alike. A model XLA cannot compile trains
            without it, after one warning line. The choice is in
            `History.params["jit_compile"]` (the reason in "jit_compile_reason").
        verbose: "auto", 0 (silent), 1 (progress bar) or 2 (a line per epoch).

    Returns:
        A `keras.callbacks.History`.

    Raises:
        UsageError: bad arguments, before anything is trained or written.
        TrainingError: a non-finite loss that no loss scale absorbs, or a failed save.
        Preempted: SIGTERM arrived; a checkpoint was saved (with `checkpoint_dir`).

    Example:
        >>> with strategy.scope():
        ...     model = build_model()
        ...     model.compile(tfmp.wrap_optimizer(keras.optimizers.AdamW(1e-3)), "mse")
        >>> history = tfmp.fit(model, train_ds, validation_data=val_ds, epochs=10,
        ...                    grad_accum_steps=4, clipnorm=1.0, checkpoint_dir="runs/mine")
    """
    strategy = _check_arguments(**locals())
    train_input = inputs.Input(data, strategy, steps_per_epoch, grad_accum_steps, "data")
    val_input = None
    if validation_data is not None:
        val_input = inputs.Input(validation_data, strategy, validation_steps, 1, "validation_data", training=False)
    steps = prepare(model, strategy, train_input.element_spec, grad_accum_steps, clipnorm, steps_per_execution)
    log_dir = log_dir or checkpoint_dir  # The run's directory: decisions.json goes here too.
    use, why, chosen_now = xla.resolve_run(
        steps,
        train_input.element_spec,
        jit_compile,
        log_dir,
        per_replica=train_input.fn is not None,
        reuse=distribute.num_workers(strategy) < 2,
        say=(lambda line: print(line, flush=True)) if verbose != 0 else None,
    )
    if verbose != 0 and jit_compile == "autotune":
        print(f"XLA: {'on' if use else 'off'} ({why})", flush=True)
    optimizer = steps.optimizer
    chief = distribute.is_chief(strategy)
    run_dir = log_dir
    if log_dir and not chief:
        log_dir = tempfile.mkdtemp(prefix="tfmp-worker-logs-")
    saver, position, step = None, initial_epoch * (train_input.period or 0), 0
    with contextlib.ExitStack() as cleanup:
        if checkpoint_dir and chief:  # One run at a time in a checkpoint directory.
            cleanup.enter_context(checkpoint.RunLock(checkpoint_dir, "checkpoint_dir"))
        if chosen_now and chief:
            decisions.record(run_dir, "jit_compile", use, why)
        if checkpoint_dir:
            target = checkpoint_dir if chief else tempfile.mkdtemp(prefix="tfmp-worker-")
            saver = checkpoint.Checkpointer(target, model, optimizer, restore_from=checkpoint_dir)
            if saver.restore():
                initial_epoch, position, step = (int(v.numpy()) for v in (saver.epoch, saver.position, saver.step))
        run = _Run(model, steps, train_input, val_input, saver, log_dir, log_every, callbacks, verbose)
        # What was decided, beside what was asked (decisions.json holds it for reruns).
        policy = keras.config.dtype_policy().name
        run.callbacks.set_params({**run.callbacks.params, "jit_compile_reason": why, "dtype_policy": policy})
        try:
            return run.train(initial_epoch, epochs, position, step, validation_freq, checkpoint_every)
        except guards.PEER_ERRORS as e:
            if distribute.num_workers(strategy) < 2:
                raise
            raise PeerLost(guards.peer_message(e, saver)) from e


def prepare(model, strategy, element_spec, grad_accum_steps=1, clipnorm=None, steps_per_execution=1):
    """Checks the data's structure, builds the model, its compiled loss and metrics and its
    optimizer (tfmp's loss-scale wrapper where float16 needs one), and returns its `Steps`."""
    if precision.float8_enabled() and not float8.quantized_layers(model):
        float8.quantize(model)  # Before the optimizer is built: it must know the float8 state.
    inputs.build_for(model, strategy, element_spec)
    loss_scale.for_model(model, strategy)
    # Compiled steps are kept with the model, as Keras keeps `model.train_function`: a
    # second fit (or evaluate) with the same setup traces and compiles nothing again.
    key = (strategy, model.optimizer, *keras_compat.compiled(model))
    # The layers' compute dtypes too: `tfmp.keep_float32(model, ...)` may change them between fits.
    dtypes = tuple((layer.compute_dtype, layer.quantization_mode) for layer in keras_compat.sublayers(model))
    settings = (grad_accum_steps, clipnorm, steps_per_execution, dtypes)
    kept = _STEPS.get(model)
    if kept and all(a is b for a, b in zip(kept[0], key, strict=True)) and kept[1] == settings:
        return kept[2]
    steps = Steps(model, strategy, grad_accum_steps, clipnorm, steps_per_execution)
    _STEPS[model] = key, settings, steps
    return steps


_STEPS = weakref.WeakKeyDictionary()  # model -> (what its steps were built for, the steps)


def evaluate(model, data, *, steps=None, strategy=None, jit_compile=False):
    """The model's compiled loss and metrics over `data`, under its strategy.

    Args:
        model: a compiled Keras model.
        data: a `tf.data.Dataset` of global batches, or a callable `input_context ->
            dataset` (then `steps` is required).
        steps: batches to evaluate; default: all.
        strategy: default: the strategy the model was built under.
        jit_compile: run each replica's forward pass with XLA (True, False or "auto").

    Returns:
        A dict of floats: `loss` and each metric.
    """
    strategy = strategy or model.distribute_strategy
    if not getattr(model, "compiled", False):
        raise UsageError("tfmp.evaluate needs a compiled model: call model.compile(optimizer, loss, metrics) first")
    xla.check(jit_compile)
    source = inputs.Input(data, strategy, steps, 1, "data", training=False)
    compiled = prepare(model, strategy, source.element_spec)
    xla.resolve(compiled, source.element_spec, jit_compile, per_replica=source.fn is not None)
    return compiled.evaluate(source.once(), steps)


def _check_arguments(model, strategy, epochs, initial_epoch, steps_per_epoch, grad_accum_steps, clipnorm, **kw):
    """Raises UsageError for anything wrong before touching the model; returns the strategy."""
    if not isinstance(model, keras.Model):
        raise UsageError(f"tfmp.fit takes a keras.Model, got {type(model).__name__}")
    if not getattr(model, "compiled", False) or model.optimizer is None:
        raise UsageError("tfmp.fit needs a compiled model: call model.compile(optimizer, loss, metrics) first")
    if type(model).train_step is not keras.Model.train_step:
        raise UsageError(
            f"{type(model).__name__} overrides train_step, which tfmp.fit replaces with its own; override "
            "compute_loss / compute_metrics instead, or train it with model.fit"
        )
    for name, value, low in (
        ("epochs", epochs, 0),
        ("initial_epoch", initial_epoch, 0),
        ("grad_accum_steps", grad_accum_steps, 1),
        ("steps_per_execution", kw["steps_per_execution"], 1),
        ("checkpoint_every", kw["checkpoint_every"], 0),
        ("log_every", kw["log_every"], 1),
        ("validation_freq", kw["validation_freq"], 1),
    ):
        if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < low:
            raise UsageError(f"{name} must be an integer >= {low}, got {value!r}")
    for name, value in (("steps_per_epoch", steps_per_epoch), ("validation_steps", kw["validation_steps"])):
        if value is not None and (not isinstance(value, int | np.integer) or value < 1):
            raise UsageError(f"{name} must be None or an integer >= 1, got {value!r}")
    if steps_per_epoch and steps_per_epoch % grad_accum_steps:
        raise UsageError(
            f"steps_per_epoch={steps_per_epoch} counts batches and must be a multiple of "
            f"grad_accum_steps={grad_accum_steps} (every {grad_accum_steps} batches make one update)"
        )
    if clipnorm is not None and not (isinstance(clipnorm, int | float) and 0 < clipnorm < math.inf):
        raise UsageError(f"clipnorm must be a positive finite number, got {clipnorm!r}")
    for name in ("checkpoint_dir", "log_dir"):
        if kw[name]:
            checkpoint.check_writable(kw[name], name)
    xla.check(kw["jit_compile"])
    if kw["verbose"] not in VERBOSE:
        raise UsageError(f"verbose must be one of {', '.join(map(str, VERBOSE))}, got {kw['verbose']!r}")
    built_under = model.distribute_strategy
    strategy = strategy or built_under
    variables = model.weights
    if variables and not strategy.extended.variable_created_in_scope(variables[0].value):
        raise UsageError(
            f"the model was built outside the scope of the {distribute.strategy_name(strategy)} strategy it is "
            "trained under: build and compile it inside `with strategy.scope():`"
        )
    return strategy


class _Update(typing.NamedTuple):
    """A queued update: its packed outputs, the batches done in the epoch and in all once it
    is applied, its input position, its batches and updates."""

    packed: tf.Tensor
    done: int
    step: int
    position: int
    batches: int
    updates: int


_HOOKS = ("on_batch_begin", "on_batch_end", "on_train_batch_begin", "on_train_batch_end")
# Keras' and tfmp's own callbacks whose batch hooks only show or time what happened.
_BEHIND_SAFE = (keras.callbacks.ProgbarLogger, keras.callbacks.History, tfmp_callbacks.Throughput)


class _Run:
    """One call of `fit`: the epoch loop, callbacks, checkpoints, monitoring and guards."""

    def __init__(self, model, steps, train_input, val_input, saver, log_dir, log_every, callbacks, verbose):
        self.model, self.steps, self.input, self.val_input, self.saver = model, steps, train_input, val_input, saver
        self.n = steps.grad_accum_steps
        self.callbacks = keras.callbacks.CallbackList(
            callbacks,
            add_history=True,
            add_progbar=verbose != 0,
            verbose=verbose,
            epochs=None,  # Set in train().
            steps=train_input.steps,
            model=model,
        )
        self.callbacks.set_params({**self.callbacks.params, "jit_compile": steps.jit_compile})
        self.log_dir, self.log_every = log_dir, log_every
        self.progress_path = os.environ.get(PROGRESS_ENV)  # Set by python -m tfmp.launch.
        self.monitor = None
        self.step = 0  # Batches trained, over all epochs.

    def _monitor(self, start_step):
        if not self.log_dir:
            return None
        batch = inputs.batch_dim(self.input.element_spec)
        if batch is not None and self.input.fn is not None:
            batch *= self.steps.strategy.num_replicas_in_sync  # The callable's batches are per replica.
        return tfmp_callbacks.Monitor(self.log_dir, self.steps.optimizer, batch, self.log_every, start_step=start_step)

    def train(self, epoch, epochs, position, step, validation_freq, checkpoint_every):
        """Trains from `epoch`, `position` batches into the input (a resumed run), with
        `step` batches trained before. Returns the History."""
        model, steps, source = self.model, self.steps, self.input
        self.callbacks.set_params({**self.callbacks.params, "epochs": epochs})
        offset = position - epoch * source.period if source.streamed else position
        self.step = step
        self.monitor = self._monitor(step)
        iterator = source.stream(epoch * source.period + offset) if source.streamed else None
        stop, handler = threading.Event(), guards.preemption_handler(steps.strategy, self.saver)
        model.stop_training = False
        self.callbacks.on_train_begin()
        epoch_logs = {}
        with guards.sigterm_sets(stop, self.saver is not None and handler is None):
            while epoch < epochs and not model.stop_training:
                model.reset_metrics()
                self.callbacks.on_epoch_begin(epoch)
                if not source.streamed:
                    iterator = source.epoch(offset)
                logs, done = self._train_epoch(iterator, epoch, offset, stop, handler, checkpoint_every)
                if source.streamed and not model.stop_training:
                    # Batches past the last whole update (a length that grad_accum_steps
                    # does not divide) are drawn and left out: every epoch starts on time.
                    for _ in range(source.period - done):
                        next(iterator)
                epoch_logs = dict(logs or steps.results())
                if self.val_input is not None and (epoch + 1) % validation_freq == 0:
                    self.callbacks.on_test_begin()
                    val_logs = steps.evaluate(self.val_input.once(), self.val_input.steps, self.callbacks)
                    self.callbacks.on_test_end(val_logs)
                    epoch_logs.update({f"val_{k}": v for k, v in val_logs.items()})
                epoch, offset = epoch + 1, 0
                if self.saver is not None and not model.stop_training:
                    self._save(epoch, epoch * source.period if source.streamed else 0)
                self.callbacks.on_epoch_end(epoch - 1, epoch_logs)
        if self.monitor is not None:
            self.monitor.flush()
        self.callbacks.on_train_end(epoch_logs)
        return model.history

    def _train_epoch(self, iterator, epoch, offset, stop, handler, checkpoint_every):
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
        behind = self._reads_behind(handler)
        done, logs, pending = offset, None, None
        while total is None or done < total:
            updates = k if total is not None and total - done >= k * n else 1
            self.callbacks.on_train_batch_begin(done)
            try:
                packed = steps.dispatch(iterator, updates)
            except (tf.errors.OutOfRangeError, StopIteration):
                break  # Unknown length: the epoch ended.
            batches = updates * n
            done, self.step = done + batches, self.step + batches
            position = epoch * self.input.period + done if self.input.streamed else done
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
            if stop.is_set():
                self._save(epoch, position)
                raise Preempted(
                    f"SIGTERM at batch {self.step}: checkpoint saved in {self.saver.directory}; rerun the same "
                    "command to resume"
                )
            if due:
                self._save(epoch, position)
            if model.stop_training:
                break
        if pending is not None:
            logs = self._finish(pending)
        return logs, done

    def _reads_behind(self, handler):
        """Whether an update's end may be handled after the next update is queued: not for
        multi-worker preemption (whose checkpoint must hold exactly the updates it counts),
        nor for a callback with batch hooks of its own, which may change the model or the
        optimizer between two updates, as under `model.fit` (unless it says `async_safe`,
        as Keras lets a callback say)."""
        if handler is not None:
            return False
        for callback in self.callbacks.callbacks:
            if getattr(callback, "async_safe", False) or isinstance(callback, _BEHIND_SAFE):
                continue
            if any(getattr(type(callback), hook) is not getattr(keras.callbacks.Callback, hook) for hook in _HOOKS):
                return False
        return True

    def _finish(self, update):
        """An update's end: one read of its outputs, the guards, the monitor, the callbacks."""
        out = self.steps.read(update.packed)
        if self.progress_path:
            with open(self.progress_path, "w") as f:
                f.write(str(update.step))
        logs = self._logs(out)
        if self.monitor is not None:
            self.monitor.record(update.step, {**out, **logs, "steps": update.batches, "updates": update.updates})
        message = tfmp_callbacks.non_finite_message(
            out["step_loss"],
            self.steps.optimizer,
            self.model,
            self.steps.first_non_finite_gradient(out["finite"]),
            update.step,
            loss_scale=float(out["loss_scale"]) if self.steps.scaled else None,
        )
        if message:
            replay = self._replay(update.position - update.batches)
            raise TrainingError(f"{message}. Replay of the failing batch: {replay}")
        self.callbacks.on_train_batch_end(update.done - 1, logs)
        return logs

    def _replay(self, position):
        """Where the non-finite values of the update that began at `position` came from."""
        source = self.input
        try:
            ds = source.data if source.fn is None else source.fn(tf.distribute.InputContext())
            ds = (ds.repeat() if source.streamed else ds).skip(position).take(1)
            scale = loss_scale.loss_scale_of(self.steps.optimizer)
            return doctor.localize_non_finite(self.model, next(iter(ds)), scale)
        except Exception as e:  # noqa: BLE001 - a diagnosis must not hide the error it explains.
            return f"not possible ({type(e).__name__}: {first_line(e, 120, default='')})"

    def _logs(self, out):
        """What callbacks see after a call: the model's metrics (running means over the
        epoch), and the loss scale where there is one."""
        logs = {key: float(value) for key, value in out.items() if key not in STEP_STATE}
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
