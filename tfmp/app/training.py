"""A whole training run as plain steps: strategy, seed, precision, data, model, train, evaluate."""

import contextlib
import json
import os
import sys
import tempfile
import time

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from tfmp import (
    bf16,
    callbacks,
    checkpoint,
    data,
    decisions,
    distribute,
    doctor,
    evaluation,
    files,
    float8,
    loop,
    loss_scale,
    precision,
    run_directory,
    seed,
)
from tfmp.app import autotune, export, models, report
from tfmp.app.checks import check_batch_memory, no_full_update, validate, without_effect
from tfmp.app.config import JIT_COMPILE, RESUME, Config  # noqa: F401 - Config, RESUME: re-exported.
from tfmp.errors import TrainingError, UsageError, first_line
from tfmp.heads import audit


def _steps_per_epoch(config, ds, plan):
    if config.steps_per_epoch:
        return config.steps_per_epoch
    size = ds.source.train_size
    batches = size // plan.global_batch if size else int(ds.make_train().cardinality())  # Full global batches.
    steps = batches // plan.grad_accum_steps
    if steps < 1:
        raise UsageError(no_full_update(config, size, batches, plan))
    return steps


def _diagnose(config, build_model, strategy, ds, out):
    """--diagnose: the numerics doctor on the run's model and data, instead of training."""
    if config.precision in ("auto", precision.AUTOTUNE):
        precision.apply_policy(precision.resolve_policy("auto"))
    seed.set_seed(config.seed, config.deterministic)
    with strategy.scope():
        model = models.compile(build_model(), keras.optimizers.Adam(config.learning_rate))
    diagnosis = doctor.diagnose(model, ds.make_train(), steps=8)
    json_path, png_path = diagnosis.save(os.path.join(config.model_dir, "doctor"))
    print(f"{diagnosis.table()}\nwrote {json_path} and {png_path}", file=out, flush=True)
    return diagnosis.to_dict()


def train_and_evaluate(config, out=None):
    """See `_train_and_evaluate`; holds the run directory's lock while it runs. `out`: sys.stdout as it is
    at the call (redirected, captured), unless given."""
    with contextlib.ExitStack() as cleanup:
        return _train_and_evaluate(config, sys.stdout if out is None else out, cleanup)


class _Setup:
    """What a run settled before building the model: strategy, where it writes, the batch
    split, data, epoch length, resume point and precision."""

    def __init__(self, config, cleanup):
        self.entry = models.MODELS[config.model]
        # 1. Strategy first: multi-worker and TPU strategies must exist before TensorFlow
        # starts its runtime, which listing devices for the precision choice would do.
        self.strategy = strategy = distribute.get_strategy(config.strategy, config.tpu, verbose=False, flags=True)
        # 2. Seed (stochastic rounding of bfloat16 weights draws from it too).
        seed.set_seed(config.seed, config.deterministic)
        precision.set_bf16_rounding(config.bf16_rounding, config.seed)
        # 3. Precision: decided once, here; everything after reads the global policy (a
        # timed trial needs the data and the model: `decide_precision`).
        self.chief = distribute.is_chief(strategy)
        # Only the chief writes to --model_dir; other workers write to a temporary place.
        self.model_dir = config.model_dir if self.chief else tempfile.mkdtemp(prefix="tfmp-worker-")
        one_host = distribute.num_workers(strategy) == 1
        self.decision, self.trial, self.recorded = autotune.before_data(config, self.model_dir, one_host)
        # 4. The batch split.
        self.plan = plan = distribute.plan_batch(
            config.batch_size,
            strategy.num_replicas_in_sync,
            config.learning_rate,
            config.lr_scaling,
            config.base_batch_size,
            grad_accum_steps=config.grad_accum_steps,
            workers=distribute.num_workers(strategy),
            batch_name="--batch_size",
        )
        # 5. Data, in global batches; every grad_accum_steps of them make one update.
        self.dataset, self.ds = _load_data(config, self.entry, plan, strategy)
        self.steps = _steps_per_epoch(config, self.ds, plan)
        self.batches = config.epochs * self.steps * plan.grad_accum_steps  # Every epoch's, every update's.
        check_batch_memory(plan, self.ds.source, config)
        self.checkpoint_dir = os.path.join(config.model_dir, "checkpoints") if config.checkpoint_every else None
        latest = checkpoint.latest(self.checkpoint_dir)
        self.start = checkpoint.step_of(latest)
        # Everything checked: from here on the run writes, and owns --model_dir while it does.
        if self.chief:
            cleanup.enter_context(run_directory.RunLock(config.model_dir))
        settings = _settings(config, self.dataset, plan, strategy, self.steps)
        forced = run_directory.check_settings(config.model_dir, settings, latest, force=config.resume == "force")
        # run.json describes the checkpoints: a forced resume writes it as training begins, once restored.
        save = lambda logs=None: run_directory.save_settings(config.model_dir, settings)  # noqa: E731
        self.on_restored = [keras.callbacks.LambdaCallback(on_train_begin=save)] if self.chief and forced else []
        if self.chief and not forced:
            save()

    def decide_precision(self, config, build_model, say):
        """The precision, decided (by a trial on the model where needed) and recorded."""
        if self.decision is None:  # Timed on the model itself.
            self.decision = autotune.by_trial(
                config, self.trial, build_model, self.ds, self.strategy, self.plan, self.model_dir, say
            )
        decisions.say_if_different(self.model_dir, "precision", self.recorded, self.decision.policy)
        if self.chief and self.recorded is None and config.precision in ("auto", precision.AUTOTUNE):
            decisions.record(self.model_dir, "precision", self.decision.policy, self.decision.reason)


def _train_and_evaluate(config, out, cleanup):
    """Trains `config.model` (or resumes it), evaluates it, and writes the run's files.

    Into `config.model_dir` (the chief only): metrics.json, history.csv, training.png,
    tensorboard/, checkpoints/, run.json and decisions.json; into `config.export_dir`:
    model.keras and saved_model/.

    Args:
        config: a `Config`.
        out: where the summary and final line are printed.

    Returns:
        The metrics dict.

    Raises:
        UsageError: for a bad setting, before training starts.
        TrainingError: training had to stop (non-finite values, a failed save).
        Preempted: SIGTERM arrived; a checkpoint was saved.
        Interrupted: Ctrl-C while training; a checkpoint was saved.
    """
    validate(config)
    say = lambda line: print(line, file=out, flush=True)  # noqa: E731
    run = _Setup(config, cleanup)  # Steps 1-5: strategy, seed, precision, batch split, data.
    build_model = _model_builder(config, run.entry, run.ds)
    if config.diagnose:
        return _diagnose(config, build_model, run.strategy, run.ds, out)
    run.decide_precision(config, build_model, say)
    for line in without_effect(config, run.decision.policy, distribute.strategy_name(run.strategy)):
        logging.warning("%s", line)
    # 6. Model and optimizer, built and compiled inside the strategy's scope. Seeded again
    # first: a precision trial (measured, cached or none) must not change the weights.
    seed.set_seed(config.seed, config.deterministic)
    with run.strategy.scope():
        model = build_model()
        adam = keras.optimizers.Adam(_learning_rate(config, run))
        optimizer = loss_scale.wrap_optimizer(adam, config.loss_scale_initial, config.loss_scale_growth_steps)
        models.compile(model, optimizer)
    problems = audit(model)
    if problems:
        logging.warning("Precision audit: %s", "; ".join(problems))
    # 7. Train with tfmp.fit (resuming from the latest checkpoint; the summary prints as
    # training begins, with what fit decided), 8. evaluate on every test example.
    summary = report.Summary(
        say, config, run.decision, run.strategy, run.plan, run.ds.source, model, run.steps, run.start, run.batches
    )
    fitted = _train_and_test(config, run, model, summary, out)
    # 9. Record: metrics.json, training.png; export.
    return _record(config, run, model, fitted, say)


def _learning_rate(config, run):
    """--lr_schedule: the plan's learning rate, constant, or decayed to 0 over every update of the run (cosine: at
    a constant rate the resnet's moving statistics lag its weights, and its test score swung between 0.86 and 0.99
    from one step to another late in the run; DECISIONS.md, "train.py's learning-rate schedule")."""
    if config.lr_schedule == "constant":
        return run.plan.learning_rate
    return keras.optimizers.schedules.CosineDecay(run.plan.learning_rate, decay_steps=config.epochs * run.steps)


def _record(config, run, model, fitted, say):
    """Writes metrics.json (and training.png, the export) and prints the final line."""
    rate, seconds, test, params = fitted
    ds, optimizer = run.ds, model.optimizer
    history_path = os.path.join(run.model_dir, "history.csv")
    metrics = {
        "model": config.model,
        "dataset": ds.source.name,
        "test_split": ds.source.test_split,
        "test_accuracy": test["accuracy"],
        "test_loss": test["loss"],
        "policy": run.decision.policy,
        "policy_reason": run.decision.reason,
        "jit_compile": params["jit_compile"],
        "jit_compile_reason": params["jit_compile_reason"],
        **_plan_metrics(run.strategy, run.plan),
        "lr_schedule": config.lr_schedule,
        "examples_per_second": rate or None,  # None: too few steps to time (the first is not).
        "train_seconds": seconds,
        "epochs": config.epochs,
        "steps_per_epoch": run.steps,
        "resumed_from_step": run.start,
        "steps": int(optimizer.iterations.numpy()),
        "skipped_steps": callbacks.skipped_steps(history_path),
        "final_loss_scale": loss_scale.loss_scale_of(optimizer),
        "peak_memory_mb": callbacks.peak_memory_mb(),
        "bytes_per_parameter": bf16.bytes_per_parameter(model, optimizer),  # Weights and optimizer state.
        "bf16_rounding": config.bf16_rounding if bf16.holds_bfloat16(model) else None,
        "seed": config.seed,
        "weights_sha256": report.weights_fingerprint(model),
    }
    if os.path.exists(history_path):
        metrics["plot"] = report.plot_history(history_path, os.path.join(run.model_dir, "training.png"))
    path = os.path.join(run.model_dir, "metrics.json")
    trained = f"{rate:,.0f} train examples/s" if rate else "too few steps to time the throughput"
    if run.start >= run.batches:  # A finished run, evaluated again.
        metrics.update(_training_figures(path))
        trained = f"nothing left to train: its {run.start} batches ran before"
    files.write_json(path, metrics)
    say(
        f"test accuracy {test['accuracy']:.4f}  test loss {test['loss']:.4f}  ({trained}; "
        f"{metrics['skipped_steps']} skipped steps; weights {metrics['weights_sha256'][:12]}; metrics in {path})"
    )
    if config.export_dir and run.chief:  # After the figures are written: a failed export loses none of them.
        metrics["export"] = _export(config, run.entry, model, ds)
        files.write_json(path, metrics)
    return metrics


def _training_figures(path):
    """The throughput and training time of the run that trained the weights (its metrics.json), None if unknown:
    evaluating a finished run again times no training."""
    try:
        with open(path) as f:
            earlier = json.load(f)
    except (OSError, ValueError):
        earlier = {}
    return {key: earlier.get(key) for key in ("examples_per_second", "train_seconds")}


def _load_data(config, entry, plan, strategy):
    """(the dataset's name, its `Data`), checked against the model's input kind."""
    dataset = config.dataset or models.DEFAULT_DATASETS[entry.kind]
    ds = data.load(
        dataset,
        plan.global_batch,
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
    return dataset, ds


def _settings(config, dataset, plan, strategy, steps):
    """What run.json keeps: the settings an exact resume depends on (see `run_directory.EXACT`)."""
    return {
        "model": config.model,
        "dataset": dataset,
        "batch_size": plan.global_batch,
        "precision": config.precision,
        "seed": config.seed,
        "grad_accum_steps": plan.grad_accum_steps,
        "replicas": strategy.num_replicas_in_sync,
        "steps_per_epoch": steps,
        "epochs": config.epochs,
        "keep_float32": list(config.keep_float32),
        "float8_exclude": list(config.float8_exclude),
        "bf16_rounding": config.bf16_rounding,
        "lr_schedule": config.lr_schedule,
    }


def _model_builder(config, entry, ds):
    """A function building the bundled model under the global policy, with --keep_float32
    (and, under float8, its float8 layers but --float8_exclude)."""

    def build_model():
        with precision.keep_float32(list(config.keep_float32)):
            model = models.build(config.model, ds, config.sequence_length)
            # A typo's name, said before the block's warning or any training, naming the flag.
            precision.require_matches(model, config.keep_float32, "--keep_float32")
        if precision.float8_enabled():  # Before compile builds the optimizer (tfmp.float8).
            float8.quantize(model, exclude=list(config.float8_exclude), named="--float8_exclude")
        return model

    return build_model


def _train_and_test(config, run, model, summary, out):
    """Trains with tfmp.fit (resuming from the latest checkpoint) and evaluates on every
    test example; returns (train examples/s, train seconds, the test metrics, fit's params)."""
    dataset, ds, plan, strategy = run.dataset, run.ds, run.plan, run.strategy
    verbose = config.verbose if config.verbose is not None else (1 if out.isatty() else 2)
    calls = plan.effective_batch * config.steps_per_execution  # Examples per compiled call.
    throughput = callbacks.Throughput(calls, max(1, config.warmup_steps // config.steps_per_execution))
    try:
        begin = time.perf_counter()
        history = loop.fit(
            model,
            ds.make_train,  # Per-worker input: each worker reads its own shard.
            epochs=config.epochs,
            steps_per_epoch=run.steps * plan.grad_accum_steps,
            callbacks=[summary, throughput, *run.on_restored],
            strategy=strategy,
            grad_accum_steps=plan.grad_accum_steps,
            clipnorm=config.clipnorm,
            steps_per_execution=config.steps_per_execution,
            checkpoint_dir=run.checkpoint_dir,
            checkpoint_every=config.checkpoint_every,
            log_dir=run.model_dir,  # Its decisions.json keeps fit's XLA choice beside the precision one.
            log_every=config.log_every,
            jit_compile=JIT_COMPILE[config.jit_compile],
            verbose=verbose,
        )
        seconds = time.perf_counter() - begin
        test = evaluation.evaluate(
            model, ds.test, strategy=strategy, jit_compile=history.params["jit_compile"], verbose=0, return_dict=True
        )
    except tf.errors.DataLossError as e:  # A truncated or corrupted record file.
        raise TrainingError(
            f"the input data of {dataset!r} is corrupt ({first_line(e)}); prepare it again. The checkpoints are intact"
        ) from e
    return throughput.examples_per_second, seconds, test, history.params


def _plan_metrics(strategy, plan):
    return {
        "strategy": distribute.strategy_name(strategy),
        "replicas": strategy.num_replicas_in_sync,
        "workers": plan.workers,
        "global_batch_size": plan.global_batch,
        "per_replica_batch_size": plan.per_replica,
        "grad_accum_steps": plan.grad_accum_steps,
        "effective_batch_size": plan.effective_batch,
        "learning_rate": plan.learning_rate,
    }


def _export(config, entry, model, ds):
    """model.keras and a SavedModel in --export_dir, checked on a few test examples."""
    sample = next(iter(ds.test))[0][:8] if entry.kind == "image" else tf.constant(["a fine film", "dull"])
    return export.export(
        model, config.export_dir, np.asarray(sample) if entry.kind == "image" else sample, ds.vectorizer
    )
