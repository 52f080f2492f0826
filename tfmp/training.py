"""A whole training run as plain steps: seed, precision, strategy, data, model, train, evaluate."""

import contextlib
import dataclasses
import json
import os
import sys
import tempfile
import time

import keras
from absl import logging

import models
from tfmp import callbacks, data, distribute, loss_scale, precision, seed
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
    warmup_steps: int = 3  # Steps left out of the examples/second figure.
    verbose: int | None = None  # None: progress bar on a terminal, a line per epoch otherwise.


DEFAULT_DATASETS = {"image": "digits", "text": "sentiment"}


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


def summary(config, decision, strategy, plan, source, model):
    """The one-screen summary printed before training."""
    lines = [
        "=" * 72,
        f"model       {config.model} ({model.count_params():,} parameters)",
        f"dataset     {source.name} ({source.kind}, {source.num_classes} classes, "
        f"{source.train_size or '?'} train examples, eval on {source.test_split})",
        f"precision   {decision.policy} ({decision.reason})",
        f"strategy    {distribute.strategy_name(strategy)} ({strategy.num_replicas_in_sync} replicas)",
        "batch",
        plan.table(),
        "=" * 72,
    ]
    if decision.warning:
        lines.insert(-1, f"WARNING     {decision.warning}")
    return "\n".join(lines)


def train_and_evaluate(config, out=sys.stdout):
    """Trains `config.model` and evaluates it; writes metrics.json into `config.model_dir`.

    Args:
        config: a `Config`.
        out: where the summary and final line are printed.

    Returns:
        The metrics dict that was written.

    Raises:
        UsageError: for any bad setting, before anything is written.
    """
    if config.model not in models.MODELS:
        raise UsageError(f"unknown model {config.model!r}; choose one of {', '.join(models.MODELS)}")
    entry = models.MODELS[config.model]
    _check_writable(config.model_dir)
    if config.epochs < 1:
        raise UsageError(f"--epochs must be >= 1, got {config.epochs}")
    if config.steps_per_epoch is not None and config.steps_per_epoch < 1:
        raise UsageError(f"--steps_per_epoch must be >= 1, got {config.steps_per_epoch}")

    # 1. Seed.
    seed.set_seed(config.seed, config.deterministic)
    # 2. Precision: decided once, here; everything after reads the global policy.
    decision = precision.resolve_policy(config.precision)
    precision.apply_policy(decision)
    # 3. Strategy and the batch split.
    strategy = distribute.get_strategy(config.strategy, config.tpu)
    plan = distribute.plan_batch(
        config.batch_size,
        strategy.num_replicas_in_sync,
        config.learning_rate,
        config.lr_scaling,
        config.base_batch_size,
        workers=distribute.num_workers(strategy),
    )
    # 4. Data, batched at the global batch size.
    dataset = config.dataset or DEFAULT_DATASETS[entry.kind]
    ds = data.load(
        dataset,
        plan.global_batch,
        config.data_dir,
        kind=entry.kind,
        download=config.download,
        seed=config.seed,
        deterministic=config.deterministic,
        augment=config.augment,
        repeat=config.steps_per_epoch is not None,
        drop_remainder=True,
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
    # 5. Model and optimizer, built inside the strategy's scope.
    with strategy.scope():
        if entry.kind == "image":
            model = entry.build(ds.source.num_classes, input_shape=ds.source.image_shape)
        else:
            model = entry.build(
                ds.source.num_classes,
                vocab_size=ds.vectorizer.vocabulary_size(),
                sequence_length=config.sequence_length,
            )
        optimizer = loss_scale.wrap_optimizer(
            keras.optimizers.Adam(plan.learning_rate),
            config.loss_scale_initial,
            config.loss_scale_growth_steps,
        )
        model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(), metrics=["accuracy"])
    problems = audit(model)
    if problems:
        logging.warning("Low-precision outputs: %s", "; ".join(problems))
    print(summary(config, decision, strategy, plan, ds.source, model), file=out, flush=True)

    # 6. Train.
    os.makedirs(config.model_dir, exist_ok=True)
    throughput = callbacks.Throughput(plan.global_batch, config.warmup_steps)
    verbose = config.verbose if config.verbose is not None else (1 if out.isatty() else 2)
    start = time.perf_counter()
    model.fit(
        ds.distribute(strategy),
        epochs=config.epochs,
        steps_per_epoch=config.steps_per_epoch,
        callbacks=[throughput],
        verbose=verbose,
        shuffle=False,
    )
    train_seconds = time.perf_counter() - start
    # 7. Evaluate and record.
    test_loss, test_accuracy = model.evaluate(ds.test, verbose=0)
    metrics = {
        "model": config.model,
        "dataset": ds.source.name,
        "test_split": ds.source.test_split,
        "test_accuracy": float(test_accuracy),
        "test_loss": float(test_loss),
        "policy": decision.policy,
        "policy_reason": decision.reason,
        "strategy": distribute.strategy_name(strategy),
        "replicas": strategy.num_replicas_in_sync,
        "global_batch_size": plan.global_batch,
        "per_replica_batch_size": plan.per_replica,
        "learning_rate": plan.learning_rate,
        "examples_per_second": throughput.examples_per_second,
        "train_seconds": train_seconds,
        "epochs": config.epochs,
        "steps": int(optimizer.iterations.numpy()),
        "final_loss_scale": loss_scale.loss_scale_of(optimizer),
        "seed": config.seed,
    }
    if distribute.is_chief(strategy):
        write_json_atomically(os.path.join(config.model_dir, "metrics.json"), metrics)
    print(
        f"test accuracy {test_accuracy:.4f}  test loss {test_loss:.4f}  "
        f"({throughput.examples_per_second:,.0f} train examples/s; "
        f"metrics in {os.path.join(config.model_dir, 'metrics.json')})",
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
