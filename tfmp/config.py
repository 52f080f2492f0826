"""A training run's settings, checked, and the choice of loop they imply."""

import dataclasses

import models
from tfmp import distribute, precision
from tfmp.errors import UsageError

DEFAULT_DATASETS = {"image": "digits", "text": "sentiment"}
LOOPS = ("auto", "fit", "custom")


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
    checkpoint_every: int = 200  # Steps between checkpoints; 0 turns checkpointing off.
    log_every: int = 10  # Steps between TensorBoard writes.
    export_dir: str | None = None
    warmup_steps: int = 3  # Steps left out of the examples/second figure.
    verbose: int | None = None  # None: progress bar on a terminal, a line per epoch otherwise.


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
    if config.checkpoint_every:
        broken.append("mid-epoch checkpoint/resume (--checkpoint_every) runs in the custom loop only")
    if config.loop == "auto":
        return "custom" if broken else "fit"
    if config.loop == "fit" and broken:
        raise UsageError(f"--loop=fit cannot do this run: {broken[0]}; use --loop=custom or --loop=auto")
    if config.loop not in LOOPS:
        raise UsageError(f"unknown loop {config.loop!r}; choose one of {', '.join(LOOPS)}")
    return config.loop


def validate(config):
    """Raises UsageError for settings that are wrong whatever the hardware."""
    if config.model not in models.MODELS:
        raise UsageError(f"unknown model {config.model!r}; choose one of {', '.join(models.MODELS)}")
    if config.loop not in LOOPS:
        raise UsageError(f"unknown loop {config.loop!r}; choose one of {', '.join(LOOPS)}")
    if config.precision not in (*precision.POLICIES, precision.AUTOTUNE):
        choices = ", ".join((*precision.POLICIES, precision.AUTOTUNE))
        raise UsageError(f"unknown precision {config.precision!r}; choose one of {choices}")
    for name in ("epochs", "steps_per_epoch", "grad_accum_steps", "steps_per_execution", "log_every"):
        value = getattr(config, name)
        if value is not None and value < 1:
            raise UsageError(f"--{name} must be >= 1, got {value}")
    if config.checkpoint_every < 0:
        raise UsageError(f"--checkpoint_every must be >= 0 (0: off), got {config.checkpoint_every}")
    if config.clipnorm is not None and config.clipnorm <= 0:
        raise UsageError(f"--clipnorm must be > 0, got {config.clipnorm}")
