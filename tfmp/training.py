"""A whole training run as plain steps: strategy, seed, precision, data, model, train, evaluate."""

import contextlib
import os
import signal
import sys
import tempfile
import threading
import time

import keras
import numpy as np
import tensorflow as tf
from absl import logging

import models
from tfmp import autotune, callbacks, checkpoint, data, distribute, export, loop, loss_scale, precision, report, seed
from tfmp.config import DEFAULT_DATASETS, LOOPS, Config, choose_loop, validate  # noqa: F401 - re-exported.
from tfmp.errors import Preempted, TrainingError, UsageError
from tfmp.heads import audit


def _check_writable(path):
    """Raises UsageError unless a file can be written in directory `path`.

    Really tries (permissions alone do not tell, e.g. for root or read-only mounts), and
    removes whatever directories the try created: a failed run leaves nothing behind.
    """
    missing, probe = [], os.path.abspath(path)
    while not os.path.exists(probe):
        missing.append(probe)  # Deepest first.
        probe = os.path.dirname(probe)
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise UsageError(f"--model_dir={path} cannot be written ({e.strerror or e})") from e
    finally:
        for directory in missing:
            with contextlib.suppress(OSError):
                os.rmdir(directory)


def _steps_per_epoch(config, ds, plan):
    if config.steps_per_epoch:
        return config.steps_per_epoch
    if ds.source.train_size:
        steps = ds.source.train_size // plan.effective_batch
    else:
        steps = int(ds.make_train().cardinality()) // plan.grad_accum_steps
    if steps < 1:
        raise UsageError(
            f"an epoch of {ds.source.train_size or 'unknown'} examples holds no full update of "
            f"{plan.effective_batch} examples; lower --batch_size or set --steps_per_epoch"
        )
    return steps


@contextlib.contextmanager
def _sigterm_sets(event):
    """While active, SIGTERM sets `event` instead of killing the process (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, lambda *_: event.set())
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _preemption_handler(strategy, checkpointer):
    """TensorFlow's own preemption handling where several hosts must agree on when to save
    (multi-worker, TPU); None elsewhere, where tfmp's SIGTERM handler does it."""
    if checkpointer is None or distribute.strategy_name(strategy) not in ("multi_worker", "tpu"):
        return None

    def exit_fn():
        raise Preempted(f"SIGTERM: checkpoint saved in {checkpointer.directory}; rerun the same command to resume")

    config = tf.distribute.experimental.TerminationConfig(exit_fn=exit_fn)
    return tf.distribute.experimental.PreemptionCheckpointHandler(
        strategy.cluster_resolver, checkpointer.manager, termination_config=config
    )


def _train_fit(model, optimizer, ds, strategy, config, plan, steps, verbose, model_dir):
    throughput = callbacks.Throughput(plan.global_batch, config.warmup_steps)
    monitor = callbacks.Monitor(
        model_dir,
        optimizer,
        plan.global_batch,
        config.log_every,
        grad_norm=callbacks.probe_grad_norm(optimizer, strategy),
        steps_per_call=config.steps_per_execution,
    )
    model.fit(
        ds.distribute(strategy),
        epochs=config.epochs,
        steps_per_epoch=steps,
        verbose=verbose,
        shuffle=False,
        callbacks=[throughput, monitor, callbacks.NonFiniteGuard(optimizer)],
    )
    monitor.flush()
    test_loss, test_accuracy = model.evaluate(ds.test, verbose=0)
    return throughput.examples_per_second, float(test_loss), float(test_accuracy), monitor


def _train_custom(model, optimizer, ds, strategy, config, plan, steps, verbose, model_dir, checkpointer, start):
    runner = loop.Loop(
        model,
        optimizer,
        strategy,
        plan.global_batch,
        plan.grad_accum_steps,
        config.clipnorm,
        config.steps_per_execution,
    )
    spe = config.steps_per_execution
    monitor = callbacks.Monitor(model_dir, optimizer, plan.effective_batch, config.log_every, start_step=start)
    throughput = callbacks.Throughput(plan.effective_batch * spe, max(1, config.warmup_steps // spe))
    iterator = iter(ds.distribute(strategy, skip_steps=start))
    step, total, stop = start, steps * config.epochs, threading.Event()

    def save():
        if checkpointer is None:
            return
        culprit = callbacks.first_non_finite(model.weights)
        if culprit:  # Never let a non-finite state become the latest checkpoint.
            raise TrainingError(f"non-finite weight {culprit} at step {step}; not checkpointed, training stopped")
        checkpointer.save(step, step // steps)
        monitor.flush()

    handler = _preemption_handler(strategy, checkpointer)
    throughput.on_train_begin()
    with contextlib.nullcontext() if handler else _sigterm_sets(stop):
        while step < total:
            epoch = step // steps
            if step % steps == 0 and verbose:
                print(f"Epoch {epoch + 1}/{config.epochs}", flush=True)
            progress = keras.utils.Progbar(steps, verbose=verbose, stateful_metrics=["loss", "accuracy", "grad_norm"])
            seen, totals = 0, {"loss": 0.0, "accuracy": 0.0}
            while step < (epoch + 1) * steps:
                # Whole executions while they fit in the epoch, then single steps.
                step_fn, n = (runner.train_steps, spe) if (epoch + 1) * steps - step >= spe else (runner.train_step, 1)
                logs = step_fn(iterator)
                step, seen = step + n, seen + n
                logs = {k: v.numpy() for k, v in logs.items()}
                monitor.on_train_batch_end(step, {**logs, "steps": n})
                if n == spe:
                    throughput.on_train_batch_end(step)
                message = callbacks.non_finite_message(
                    logs["loss"], optimizer, model, runner.first_non_finite_gradient(logs), step
                )
                if message:
                    raise TrainingError(message)
                for key in totals:
                    totals[key] += float(logs[key]) * n
                progress.update(
                    step - epoch * steps,
                    [(k, v / seen) for k, v in totals.items()] + [("grad_norm", float(logs["grad_norm"]))],
                )
                if handler is not None:  # Saves and raises Preempted when any worker got SIGTERM.
                    checkpointer.step.assign(step)
                    checkpointer.epoch.assign(step // steps)
                    handler.save_checkpoint_if_preempted(checkpoint_number=step)
                if stop.is_set():
                    save()
                    raise Preempted(
                        f"SIGTERM at step {step}: checkpoint saved in {checkpointer.directory}; "
                        "rerun the same command to resume"
                        if checkpointer
                        else f"SIGTERM at step {step}; --checkpoint_every=0, so nothing was saved"
                    )
                if config.checkpoint_every and step % config.checkpoint_every < n:
                    save()
    save()
    monitor.flush()
    test_loss, test_accuracy = runner.evaluate(ds.test)
    return throughput.examples_per_second, test_loss, test_accuracy, monitor


def train_and_evaluate(config, out=sys.stdout):
    """Trains `config.model` (or resumes it), evaluates it, and writes the run's files.

    Into `config.model_dir` (the chief only): metrics.json, history.csv, training.png,
    tensorboard/ and checkpoints/; into `config.export_dir`: model.keras and saved_model/.

    Args:
        config: a `Config`.
        out: where the summary and final line are printed.

    Returns:
        The metrics dict.

    Raises:
        UsageError: for a bad setting, before training starts.
        TrainingError: training had to stop (non-finite values, a failed save).
        Preempted: SIGTERM arrived; a checkpoint was saved.
    """
    validate(config)
    entry = models.MODELS[config.model]

    # 1. Strategy first: multi-worker and TPU strategies must exist before TensorFlow
    # starts its runtime, which listing devices for the precision choice would do.
    strategy = distribute.get_strategy(config.strategy, config.tpu)
    # 2. Seed.
    seed.set_seed(config.seed, config.deterministic)
    # 3. Precision: decided once, here; everything after reads the global policy. (Autotune
    # needs the data and the model, so it decides in step 5.)
    trial = precision.auto_trial_candidates() if config.precision == "auto" else None
    if config.precision != precision.AUTOTUNE and not trial:
        decision = precision.resolve_policy(config.precision)
        precision.apply_policy(decision)
    # 4. The loop that is correct under the strategy, and the batch split.
    loop_name = choose_loop(config, strategy)
    chief = distribute.is_chief(strategy)
    # Only the chief writes to --model_dir; other workers write to a temporary place.
    model_dir = config.model_dir if chief else tempfile.mkdtemp(prefix="tfmp-worker-")
    _check_writable(model_dir)
    plan = distribute.plan_batch(
        config.batch_size,
        strategy.num_replicas_in_sync,
        config.learning_rate,
        config.lr_scaling,
        config.base_batch_size,
        grad_accum_steps=config.grad_accum_steps,
        workers=distribute.num_workers(strategy),
    )
    # 5. Data: each replica's batch holds grad_accum_steps micro-batches.
    dataset = config.dataset or DEFAULT_DATASETS[entry.kind]
    ds = data.load(
        dataset,
        plan.effective_batch,
        config.data_dir,
        kind=entry.kind,
        download=config.download,
        seed=config.seed,
        deterministic=config.deterministic,
        augment=config.augment,
        repeat=True,
        drop_remainder=True,
        static_eval=distribute.strategy_name(strategy) == "tpu",
        vocab_size=config.vocab_size,
        sequence_length=config.sequence_length,
    )
    if ds.source.kind != entry.kind:
        raise UsageError(
            f"model {config.model!r} takes {entry.kind} input but dataset {dataset!r} is {ds.source.kind}; pick a "
            f"{ds.source.kind} model ({', '.join(n for n, e in models.MODELS.items() if e.kind == ds.source.kind)})"
        )
    steps = _steps_per_epoch(config, ds, plan)

    def build_model():
        if entry.kind == "image":
            return entry.build(ds.source.num_classes, input_shape=ds.source.image_shape)
        return entry.build(
            ds.source.num_classes, vocab_size=ds.vectorizer.vocabulary_size(), sequence_length=config.sequence_length
        )

    if config.precision == precision.AUTOTUNE or trial:
        if plan.workers > 1 and not trial:
            raise UsageError("--precision=autotune times one host; on several workers pick a policy or use auto")
        key = f"{config.model}|{ds.source.name}|batch={plan.effective_batch}|{distribute.strategy_name(strategy)}"
        if trial and plan.workers > 1:  # Workers could measure differently: keep the hardware rule.
            decision = precision.resolve_policy("auto")
        elif trial:
            decision = autotune.autotune(key, build_model, ds, strategy, plan.effective_batch, model_dir, trial)
            how = decision.reason[len("autotune, ") :]
            reason = f"auto: CPU with bfloat16 support, whose gain depends on the model; {how}"
            decision = decision._replace(reason=reason)
        else:
            decision = autotune.autotune(key, build_model, ds, strategy, plan.effective_batch, model_dir)
        precision.apply_policy(decision)
    # 6. Model and optimizer, built inside the strategy's scope; resume from a checkpoint.
    with strategy.scope():
        model = build_model()
        inner = keras.optimizers.Adam(plan.learning_rate, global_clipnorm=config.clipnorm)
        optimizer = loss_scale.wrap_optimizer(inner, config.loss_scale_initial, config.loss_scale_growth_steps)
        if loop_name == "fit":
            model.compile(
                optimizer=optimizer,
                loss=keras.losses.SparseCategoricalCrossentropy(),
                metrics=["accuracy"],
                steps_per_execution=config.steps_per_execution,
            )
        else:
            optimizer.build(model.trainable_variables)
    problems = audit(model)
    if problems:
        logging.warning("Low-precision outputs: %s", "; ".join(problems))
    checkpointer, start = None, 0
    if loop_name == "custom" and config.checkpoint_every:
        checkpointer = checkpoint.Checkpointer(
            os.path.join(model_dir, "checkpoints"),
            model,
            optimizer,
            restore_from=os.path.join(config.model_dir, "checkpoints"),
        )
        start = min(checkpointer.restore(), steps * config.epochs)
    print(
        report.summary(config, decision, strategy, plan, ds.source, model, loop_name, steps, start),
        file=out,
        flush=True,
    )

    # 7. Train; 8. evaluate on every test example.
    verbose = config.verbose if config.verbose is not None else (1 if out.isatty() else 2)
    begin = time.perf_counter()
    if loop_name == "fit":
        rate, test_loss, test_accuracy, monitor = _train_fit(
            model, optimizer, ds, strategy, config, plan, steps, verbose, model_dir
        )
    else:
        rate, test_loss, test_accuracy, monitor = _train_custom(
            model, optimizer, ds, strategy, config, plan, steps, verbose, model_dir, checkpointer, start
        )
    train_seconds = time.perf_counter() - begin
    # 9. Record: metrics.json, training.png; export.
    metrics = {
        "model": config.model,
        "dataset": ds.source.name,
        "test_split": ds.source.test_split,
        "test_accuracy": test_accuracy,
        "test_loss": test_loss,
        "policy": decision.policy,
        "policy_reason": decision.reason,
        "strategy": distribute.strategy_name(strategy),
        "loop": loop_name,
        "replicas": strategy.num_replicas_in_sync,
        "workers": plan.workers,
        "global_batch_size": plan.global_batch,
        "per_replica_batch_size": plan.per_replica,
        "grad_accum_steps": plan.grad_accum_steps,
        "effective_batch_size": plan.effective_batch,
        "learning_rate": plan.learning_rate,
        "examples_per_second": rate,
        "train_seconds": train_seconds,
        "epochs": config.epochs,
        "steps_per_epoch": steps,
        "resumed_from_step": start,
        "steps": int(optimizer.iterations.numpy()),
        "skipped_steps": monitor.skipped,
        "final_loss_scale": loss_scale.loss_scale_of(optimizer),
        "peak_memory_mb": callbacks.peak_memory_mb(),
        "seed": config.seed,
        "weights_sha256": report.weights_fingerprint(model),
    }
    if os.path.exists(monitor.history_path):
        metrics["plot"] = report.plot_history(monitor.history_path, os.path.join(model_dir, "training.png"))
    if config.export_dir and chief:
        sample = next(iter(ds.test))[0][:8] if entry.kind == "image" else tf.constant(["a fine film", "dull"])
        metrics["export"] = export.export(
            model, config.export_dir, np.asarray(sample) if entry.kind == "image" else sample, ds.vectorizer
        )
    path = os.path.join(model_dir, "metrics.json")
    report.write_json_atomically(path, metrics)
    print(
        f"test accuracy {test_accuracy:.4f}  test loss {test_loss:.4f}  ({rate:,.0f} train examples/s; "
        f"{monitor.skipped} skipped steps; weights {metrics['weights_sha256'][:12]}; metrics in {path})",
        file=out,
        flush=True,
    )
    return metrics


@contextlib.contextmanager
def user_errors(prog):
    """Ends the process with one line on stderr, no traceback, for the errors a user can act
    on: `UsageError` (exit 2), `TrainingError` (exit 1), `Preempted` (exit 75: rerun)."""
    try:
        yield
    except UsageError as e:
        print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    except TrainingError as e:
        print(f"{prog}: training stopped: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
    except Preempted as e:
        print(f"{prog}: preempted: {e}", file=sys.stderr, flush=True)
        sys.exit(75)
