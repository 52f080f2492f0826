"""`tfmp.fit`: train any compiled Keras model under any tf.distribute strategy, correctly."""

import contextlib
import tempfile

import keras
from absl import logging

from tfmp import (
    agree,
    arguments,
    bf16,
    checkpoint,
    cudnn,
    data_check,
    decisions,
    distribute,
    fit_data,
    float8,
    guards,
    heads,
    inputs,
    keras_compat,
    loss_scale,
    precision,
    run_directory,
    worker_files,
    xla,
)
from tfmp.errors import PeerLost, TrainingError, usage_error_inside
from tfmp.run import Run
from tfmp.steps import Steps, computes_norm


def fit(
    model,
    data=None,
    y=None,
    *,
    x=None,
    batch_size=None,
    epochs=1,
    initial_epoch=0,
    steps_per_epoch=None,
    validation_data=None,
    validation_split=0.0,
    validation_steps=None,
    validation_batch_size=None,
    validation_freq=1,
    shuffle=None,
    class_weight=None,
    sample_weight=None,
    callbacks=None,
    strategy=None,
    grad_accum_steps=1,
    clipnorm=None,
    steps_per_execution=None,
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
    Keras 3); checkpoints resume exactly; SIGTERM and Ctrl-C save after the update under
    way and raise `Preempted` and `Interrupted` (a second Ctrl-C stops at once); a
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
            `Dataset.skip` to what it returns. Or, as `model.fit` takes them, arrays
            (numpy, tensors, pandas DataFrames and Series): `x` here and `y` next, or a tuple `(x, y)` or `(x, y,
            sample_weight)`, or `x` alone for a model with no compiled loss (its layers
            add it); then `batch_size`, `shuffle`, `validation_split` and `sample_weight`
            apply.
        y: the targets, where `data` is the arrays `x`.
        x: `data` by `model.fit`'s name (`tfmp.fit(model, x=x, y=y)`); give one of the two.
        batch_size: the GLOBAL batch of arrays; default, as in `model.fit`: the arrays in
            `steps_per_epoch` batches where it is given, else 32. A dataset is batched already.
        epochs: epochs to train to (counting `initial_epoch`'s).
        initial_epoch: the epoch to start at (a resumed checkpoint overrides it).
        steps_per_epoch: batches per epoch; default: one pass over `data`. A finite
            dataset is repeated, so epochs may span passes.
        validation_data: evaluated at the end of every `validation_freq`-th epoch (a
            dataset or callable like `data`); adds `val_*` to the logs and History.
        validation_split: with arrays, the fraction of the examples held out for
            validation (the last ones, before shuffling, as `model.fit` does).
        validation_steps: batches per validation; default: all of `validation_data`.
        validation_batch_size: the batch of validation arrays; default `batch_size`, else
            (as in `model.fit`) the arrays in `validation_steps` batches, else 32 (beside a
            dataset: its batch).
        validation_freq: validate every this many epochs, or, as in `model.fit`, at the end
            of the epochs a list names (counted from 1).
        shuffle: with arrays (default True): the examples in a new order each epoch ("batch":
            each batch's consecutive examples, within it, as in `model.fit`), the orders set by
            `tfmp.set_seed`'s seed (0 without one), so that a resumed run reads the batches the
            interrupted one would have. A dataset shuffles itself.
        class_weight: {class index: weight}, as in `model.fit`: each training example's
            loss is weighted by its label's class (one output; its labels class indices or
            one-hot; a class left out weighs 1). Not with sample weights in `data`.
        sample_weight: with arrays, each example's weight (as in `model.fit`).
        callbacks: Keras callbacks (EarlyStopping, ModelCheckpoint, TensorBoard, ...).
            tfmp.fit queues each update before it reads the one before (one copy of its
            outputs), so the device need not wait for the host; a callback with batch
            hooks of its own sees each update end before the next one starts, as under
            `model.fit`, unless it sets `async_safe = True` (Keras' own flag).
        strategy: default: the strategy the model was built under.
        grad_accum_steps: every N consecutive batches make one update, equal to one
            update on their concatenation (batches of different sizes, a summed loss, and a mean over a
            masked output's elements, weighed by them where it is the model's one loss; elsewhere a
            warning says). An epoch's batches past its last whole update are left out, with a warning.
        clipnorm: clip the global norm of the all-reduced, unscaled gradients.
        steps_per_execution: updates per compiled call (TPUs: fewer host round trips);
            default: the model's, as model.fit takes it (`compile(steps_per_execution=N)`, 1).
        checkpoint_dir: save model, optimizer (loss scale included), epoch and input
            position here every `checkpoint_every` batches and at each epoch's end, and
            resume from the latest checkpoint found there. Several workers: the chief
            saves here, the others to a temporary place.
        checkpoint_every: batches between checkpoints (0: only at epoch ends).
        log_dir: TensorBoard scalars (loss, metrics, learning rate, loss scale, skipped
            steps, gradient norm, examples/s, memory) and history.csv go here every
            `log_every` batches. Default: `checkpoint_dir`, if given.
        log_every: batches between TensorBoard writes.
        jit_compile: run the whole update as one XLA computation on one device
            (forward, backward, loss scaling, the finite check, clipping, the optimizer,
            metrics); under a strategy, two per replica around the all-reduce of one
            packed gradient vector. "auto": where the model's `compile(jit_compile=...)`
            chose otherwise than Keras' own "auto" would, that choice, as `model.fit`
            takes it; else a rule, the same every run: on GPUs and TPUs; on CPUs only
            for float16 compute or emulated bfloat16 (measured: BENCHMARKS.md).
            "autotune" measures both ways before training (alternating rounds, up to
            15 s, said before they run) and keeps XLA only where it is clearly faster;
            the choice is recorded in the run's directory (`log_dir`, else
            `checkpoint_dir`: its decisions.json) and taken again by a resumed run or a
            rerun there, so that both train alike. A model XLA cannot compile trains
            without it, after one warning line. The choice is in
            `History.params["jit_compile"]` (the reason in "jit_compile_reason").
        verbose: "auto", 0 (silent), 1 (progress bar) or 2 (a line per epoch).

    Returns:
        A `keras.callbacks.History`.

    Raises:
        UsageError: bad arguments, before anything is trained or written (the array
            arguments with a dataset among them, with what to do with it instead).
        TrainingError: a non-finite loss that no loss scale absorbs (with a
            `keras.callbacks.TerminateOnNaN`, a warning naming the culprit, and the run ends
            as model.fit's does), or a failed save.
        Preempted: SIGTERM arrived; a checkpoint was saved (with `checkpoint_dir`).
        Interrupted: Ctrl-C (a `KeyboardInterrupt`); a checkpoint was saved (with
            `checkpoint_dir`; without one, Ctrl-C raises Python's own KeyboardInterrupt).

    Example:
        >>> with strategy.scope():
        ...     model = build_model()
        ...     model.compile(tfmp.wrap_optimizer(keras.optimizers.AdamW(1e-3)), "mse")
        >>> history = tfmp.fit(model, train_ds, validation_data=val_ds, epochs=10,
        ...                    grad_accum_steps=4, clipnorm=1.0, checkpoint_dir="runs/mine")
    """
    data = arguments.given_data(data, x, "tfmp.fit")
    if steps_per_execution is None:
        steps_per_execution = getattr(model, "steps_per_execution", 1)
    strategy, callbacks = arguments.check_fit(**locals())
    data, validation_data = fit_data.datasets(
        data,
        y,
        strategy=strategy,
        sample_weight=sample_weight,
        validation_data=validation_data,
        validation_split=validation_split,
        batch_size=batch_size,
        shuffle=shuffle,
        steps=steps_per_epoch,
        validation_steps=validation_steps,
        validation_batch_size=validation_batch_size,
        targets=data_check.needs_targets(model),
        statistics=distribute.batch_statistics(model),
    )
    train_input = inputs.Input(data, strategy, steps_per_epoch, grad_accum_steps, "data", class_weight=class_weight)
    val_input = None
    if validation_data is not None:
        val_input = inputs.Input(validation_data, strategy, validation_steps, 1, "validation_data", training=False)
        data_check.check(model, val_input.element_spec, "validation_data")  # Before training, not after an epoch.
    log_dir = log_dir or checkpoint_dir  # The run's directory: decisions.json goes here too.
    # Without a log_dir nothing reads the gradients' norm: the step leaves it out where nothing else needs it.
    steps = prepare(
        model, strategy, train_input.element_spec, grad_accum_steps, clipnorm, steps_per_execution, bool(log_dir)
    )
    use, why, chosen_now = xla.resolve_run(
        steps,
        train_input.element_spec,
        jit_compile,
        log_dir,
        per_replica=train_input.fn is not None,
        reuse=distribute.num_workers(strategy) < 2,
        say=(lambda line: print(line, flush=True)) if verbose != 0 else None,
        refuses_late=train_input.read_alike,  # (`run._fell_back`)
    )
    agree.check(  # Before any collective of training: the choices each worker made by its hardware, the arguments.
        strategy,
        {"the precision policy": keras.config.dtype_policy().name, "XLA": "on" if use else "off"},
        "tfmp.configure_precision and fit's jit_compile; train.py: --precision and --jit_compile",
        given=lambda: agree.settings(steps, epochs, steps_per_epoch),
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
            cleanup.enter_context(run_directory.RunLock(checkpoint_dir, "checkpoint_dir"))
        if chosen_now and chief:
            decisions.record(run_dir, "jit_compile", use, why)
        if checkpoint_dir:
            target = checkpoint_dir if chief else tempfile.mkdtemp(prefix="tfmp-worker-")
            saver = checkpoint.Checkpointer(target, model, optimizer, restore_from=checkpoint_dir)
            model.reset_metrics()  # What a checkpoint without them leaves (an older tfmp's).
            if saver.restore():
                initial_epoch, position, step = (int(v.numpy()) for v in (saver.epoch, saver.position, saver.step))
                checkpoint.say_if_trained(checkpoint_dir, initial_epoch, epochs, verbose)
            now = (train_input.period or 0, train_input.global_batch or 0)  # The input's shape: resume_position.
            position = saver.go_on_at(initial_epoch, position, now, grad_accum_steps)
        cleanup.enter_context(worker_files.apart(callbacks, chief))  # Before Run: the callbacks' set_model.
        run = Run(model, steps, train_input, val_input, saver, log_dir, log_every, callbacks, verbose)
        # What was decided, beside what was asked (decisions.json holds it for reruns).
        policy = keras.config.dtype_policy().name
        run.callbacks.set_params({**run.callbacks.params, "jit_compile_reason": why, "dtype_policy": policy})
        if model.run_eagerly:  # Keras fit would run train_step eagerly, each op as Python reaches it.
            logging.warning("tfmp.fit traces its step: compile(run_eagerly=True) does not apply (model.fit's does)")
        for warn in (cudnn.warn_before_training, bf16.warn_bfloat16_statistics, heads.warn_before_training):
            warn(model)
        float8.warn_frozen(model)
        try:
            return run.train(initial_epoch, epochs, position, step, validation_freq, checkpoint_every)
        except cudnn.ERROR as e:  # (As is a UsageError raised in the input pipeline.)
            if not cudnn.is_mask_error(e):
                raise usage_error_inside(e) or e  # noqa: B904 - e itself, or the UsageError it carries (caused by e).
            raise TrainingError(cudnn.advice(cudnn.masked_cudnn_layers(model) or ["an RNN"])) from e
        except guards.PEER_ERRORS as e:
            if distribute.num_workers(strategy) < 2:
                raise
            raise PeerLost(guards.peer_message(e, saver)) from e
        finally:  # The fit's iterators end with it, error or not, as Keras fit's do, each deleted on a thread of
            run.iterator = None  # its own (`calls.let_go`: deleting one may wait up to a minute); none is left to
            steps.release()  # an error's traceback, which a notebook keeps, with its prefetched batches.


def prepare(
    model,
    strategy,
    element_spec,
    grad_accum_steps=1,
    clipnorm=None,
    steps_per_execution=1,
    grad_norm=True,
    evaluating=False,
):
    """Checks the data's structure, builds the model, its compiled loss and metrics and its
    optimizer (tfmp's loss-scale wrapper where float16 needs one), and returns its `Steps`.
    With `evaluating=True`, the steps kept for the model are taken whatever they train with
    (as `model.evaluate` leaves `model.train_function` be): no compiled update is lost."""
    # float8 quantizes built layers before the optimizer is built: it must know their float8 state.
    quantize = float8.quantize if precision.float8_enabled() and not float8.decided(model) else None
    data_check.build_for(model, strategy, element_spec, before_optimizer=quantize)
    loss_scale.for_model(model, strategy)
    # Compiled steps are kept with the model, as Keras keeps `model.train_function`: a
    # second fit (or evaluate) with the same setup traces and compiles nothing again.
    key = (strategy, model.optimizer, *keras_compat.compiled(model))
    # The layers' compute dtypes too: `tfmp.keep_float32(model, ...)` may change them between fits.
    dtypes = tuple((layer.compute_dtype, layer.quantization_mode) for layer in keras_compat.sublayers(model))
    rounding, seed = precision.bf16_rounding()
    # The norm as the step would compute it: a loss-scaled or clipped step has it with a log_dir or without.
    grad_norm = computes_norm(model.optimizer, clipnorm, grad_norm)
    settings = ((dtypes, rounding, seed), (grad_accum_steps, clipnorm, steps_per_execution, grad_norm))
    kept = getattr(model, _KEPT, None)
    if kept and all(a is b for a, b in zip(kept[0], key, strict=True)) and kept[1][0] == settings[0]:
        if kept[1][1] == settings[1] or evaluating:
            return kept[2]
    steps = Steps(
        model,
        strategy,
        grad_accum_steps,
        clipnorm,
        steps_per_execution,
        bf16_rounding=rounding,
        seed=seed,
        grad_norm=grad_norm,
    )
    object.__setattr__(model, _KEPT, (key, settings, steps))  # (Past Keras' attribute tracking: no state of its.)
    return steps


# On the model, as Keras keeps `model.train_function`: freed with it. (Kept in a dictionary keyed weakly by the
# model, they held it, through their functions, and no model tfmp.fit had trained was ever freed: a sweep's
# models stayed in memory, each with its optimizer's state.)
_KEPT = "_tfmp_steps"


def kept_steps(model):
    """The `Steps` `tfmp.fit` or `tfmp.evaluate` last built for `model`, or None."""
    kept = getattr(model, _KEPT, None)
    return kept[2] if kept else None
