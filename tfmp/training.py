"""A whole training run as plain steps: strategy, seed, precision, data, model, train, evaluate."""

import contextlib
import dataclasses
import hashlib
import json
import os
import sys
import tempfile
import time

import keras
import numpy as np
from absl import logging

import models
from tfmp import callbacks, data, distribute, loop, loss_scale, precision, seed
from tfmp.errors import UsageError
from tfmp.heads import audit


@dataclasses.dataclass
class Config:
    """Everything a training run depends on; `train.py` fills it from flags.

    Attributes mirror the flags of `train.py`; see `python train.py --help`.
    """

    model: str = "cnn"
    dataset: str | None = None  # None: the shipped sample for the model's input kind.
    data_dir: str | None = None
    download: bool = True
    precision: str = "auto"
    strategy: str = "auto"
    tpu: str | None = None
    batch_size: int = 128
    epochs: int = 3
    steps_per_epoch: int | None = None
    learning_rate: float = 1e-3
    lr_scaling: str = "none"
    base_batch_size: int | None = None
    seed: int = 0
    deterministic: bool = False
    model_dir: str = "runs/default"
    loss_scale_initial: float = 2.0**15
    loss_scale_growth_steps: int = 2000
    vocab_size: int = 20000
    sequence_length: int = 64
    augment: bool = False
    loop: str = "auto"
    grad_accum_steps: int = 1
    clipnorm: float | None = None
    steps_per_execution: int = 1
    warmup_steps: int = 3  # Steps left out of the examples/second figure.
    verbose: int | None = None  # None: progress bar on a terminal, a line per epoch otherwise.


DEFAULT_DATASETS = {"image": "digits", "text": "sentiment"}
LOOPS = ("auto", "fit", "custom")


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


def write_json_atomically(path, obj):
    """Writes `obj` as JSON to `path` via a temporary file and a rename: never half-written."""
    directory = os.path.dirname(os.path.abspath(path))
    with tempfile.NamedTemporaryFile("w", dir=directory, delete=False, suffix=".tmp") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        tmp = f.name
    os.replace(tmp, path)


def weights_fingerprint(model):
    """SHA-256 of every weight's bytes: equal exactly when two runs end with the same weights."""
    digest = hashlib.sha256()
    for weight in model.weights:
        digest.update(np.ascontiguousarray(weight.numpy()).tobytes())
    return digest.hexdigest()


def summary(config, decision, strategy, plan, source, model, loop_name, steps):
    """The one-screen summary printed before training."""
    lines = [
        "=" * 72,
        f"model       {config.model} ({model.count_params():,} parameters)",
        f"dataset     {source.name} ({source.kind}, {source.num_classes} classes, "
        f"{source.train_size or '?'} train examples, eval on {source.test_split})",
        f"precision   {decision.policy} ({decision.reason})",
        f"strategy    {distribute.strategy_name(strategy)} ({strategy.num_replicas_in_sync} replicas), "
        f"loop {loop_name}, {config.epochs} epochs x {steps} steps",
        "batch",
        plan.table(),
        "=" * 72,
    ]
    if decision.warning:
        lines.insert(-1, f"WARNING     {decision.warning}")
    return "\n".join(lines)


def choose_loop(config, strategy):
    """`fit` or `custom` for `config.loop`; refuses `fit` where Keras' fit is wrong or broken."""
    replicas = strategy.num_replicas_in_sync
    broken = []
    if distribute.num_workers(strategy) > 1:
        broken.append("Keras 3 model.fit fails under MultiWorkerMirroredStrategy (keras#20585)")
    if config.grad_accum_steps > 1:
        broken.append("Keras 3 gradient accumulation fails under tf.distribute (keras#20582)")
    if config.clipnorm and replicas > 1:
        broken.append("Keras 3 clips each replica's gradients before the cross-replica sum")
    if config.loop == "auto":
        return "custom" if broken else "fit"
    if config.loop == "fit" and broken:
        raise UsageError(f"--loop=fit cannot do this run: {broken[0]}; use --loop=custom or --loop=auto")
    if config.loop not in LOOPS:
        raise UsageError(f"unknown loop {config.loop!r}; choose one of {', '.join(LOOPS)}")
    return config.loop


def _validate(config):
    if config.model not in models.MODELS:
        raise UsageError(f"unknown model {config.model!r}; choose one of {', '.join(models.MODELS)}")
    if config.loop not in LOOPS:
        raise UsageError(f"unknown loop {config.loop!r}; choose one of {', '.join(LOOPS)}")
    for name in ("epochs", "steps_per_epoch", "grad_accum_steps", "steps_per_execution"):
        value = getattr(config, name)
        if value is not None and value < 1:
            raise UsageError(f"--{name} must be >= 1, got {value}")
    if config.clipnorm is not None and config.clipnorm <= 0:
        raise UsageError(f"--clipnorm must be > 0, got {config.clipnorm}")


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


def _train_fit(model, ds, strategy, config, plan, steps, verbose):
    throughput = callbacks.Throughput(plan.global_batch, config.warmup_steps)
    model.fit(
        ds.distribute(strategy),
        epochs=config.epochs,
        steps_per_epoch=steps,
        callbacks=[throughput],
        verbose=verbose,
        shuffle=False,
    )
    test_loss, test_accuracy = model.evaluate(ds.test, verbose=0)
    return throughput.examples_per_second, float(test_loss), float(test_accuracy)


def _train_custom(model, optimizer, ds, strategy, config, plan, steps, verbose):
    runner = loop.Loop(
        model,
        optimizer,
        strategy,
        plan.global_batch,
        plan.grad_accum_steps,
        config.clipnorm,
        config.steps_per_execution,
    )
    iterator = iter(ds.distribute(strategy))
    spe = config.steps_per_execution
    throughput = callbacks.Throughput(plan.effective_batch * spe, max(1, config.warmup_steps // spe))
    throughput.on_train_begin()
    for epoch in range(config.epochs):
        progress = keras.utils.Progbar(steps, verbose=verbose, stateful_metrics=["loss", "accuracy", "grad_norm"])
        if verbose:
            print(f"Epoch {epoch + 1}/{config.epochs}", flush=True)
        totals, done = {"loss": 0.0, "accuracy": 0.0}, 0
        while done < steps:
            # Whole executions while they fit in the epoch, then single steps.
            step_fn, n = (runner.train_steps, spe) if steps - done >= spe else (runner.train_step, 1)
            logs = step_fn(iterator)
            done += n
            if n == spe:
                throughput.on_train_batch_end(done)
            for key in totals:
                totals[key] += float(logs[key]) * n
            progress.update(
                done, [(k, v / done) for k, v in totals.items()] + [("grad_norm", float(logs["grad_norm"]))]
            )
    test_loss, test_accuracy = runner.evaluate(ds.test)
    return throughput.examples_per_second, test_loss, test_accuracy


def train_and_evaluate(config, out=sys.stdout):
    """Trains `config.model` and evaluates it; writes metrics.json into `config.model_dir`.

    Args:
        config: a `Config`.
        out: where the summary and final line are printed.

    Returns:
        The metrics dict (written by the chief only).

    Raises:
        UsageError: for any bad setting, before anything is written.
    """
    _validate(config)
    entry = models.MODELS[config.model]

    # 1. Strategy first: multi-worker and TPU strategies must exist before TensorFlow
    # starts its runtime, which listing devices for the precision choice would do.
    strategy = distribute.get_strategy(config.strategy, config.tpu)
    # 2. Seed.
    seed.set_seed(config.seed, config.deterministic)
    # 3. Precision: decided once, here; everything after reads the global policy.
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
            f"model {config.model!r} takes {entry.kind} input but dataset {dataset!r} is "
            f"{ds.source.kind}; pick a {ds.source.kind} model ("
            + ", ".join(n for n, e in models.MODELS.items() if e.kind == ds.source.kind)
            + ")"
        )
    steps = _steps_per_epoch(config, ds, plan)
    # 6. Model and optimizer, built inside the strategy's scope.
    with strategy.scope():
        if entry.kind == "image":
            model = entry.build(ds.source.num_classes, input_shape=ds.source.image_shape)
        else:
            model = entry.build(
                ds.source.num_classes,
                vocab_size=ds.vectorizer.vocabulary_size(),
                sequence_length=config.sequence_length,
            )
        inner = keras.optimizers.Adam(plan.learning_rate, global_clipnorm=config.clipnorm)
        optimizer = loss_scale.wrap_optimizer(inner, config.loss_scale_initial, config.loss_scale_growth_steps)
        if loop_name == "fit":
            model.compile(
                optimizer=optimizer,
                loss=keras.losses.SparseCategoricalCrossentropy(),
                metrics=["accuracy"],
                steps_per_execution=config.steps_per_execution,
            )
    problems = audit(model)
    if problems:
        logging.warning("Low-precision outputs: %s", "; ".join(problems))
    print(summary(config, decision, strategy, plan, ds.source, model, loop_name, steps), file=out, flush=True)

    # 7. Train; 8. evaluate on every test example.
    os.makedirs(model_dir, exist_ok=True)
    verbose = config.verbose if config.verbose is not None else (1 if out.isatty() else 2)
    start = time.perf_counter()
    if loop_name == "fit":
        rate, test_loss, test_accuracy = _train_fit(model, ds, strategy, config, plan, steps, verbose)
    else:
        rate, test_loss, test_accuracy = _train_custom(model, optimizer, ds, strategy, config, plan, steps, verbose)
    train_seconds = time.perf_counter() - start
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
        "steps": int(optimizer.iterations.numpy()),
        "final_loss_scale": loss_scale.loss_scale_of(optimizer),
        "seed": config.seed,
        "weights_sha256": weights_fingerprint(model),
    }
    path = os.path.join(model_dir, "metrics.json")
    write_json_atomically(path, metrics)
    print(
        f"test accuracy {test_accuracy:.4f}  test loss {test_loss:.4f}  ({rate:,.0f} train examples/s; "
        f"weights {metrics['weights_sha256'][:12]}; metrics in {path})",
        file=out,
        flush=True,
    )
    return metrics


@contextlib.contextmanager
def user_errors(prog):
    """Turns a `UsageError` into one line on stderr and exit status 2, no traceback."""
    try:
        yield
    except UsageError as e:
        print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
