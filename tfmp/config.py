"""A training run's settings, checked."""

import dataclasses

import models
from tfmp import precision
from tfmp.errors import UsageError

DEFAULT_DATASETS = {"image": "digits", "text": "sentiment"}


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
    grad_accum_steps: int = 1
    clipnorm: float | None = None
    steps_per_execution: int = 1
    checkpoint_every: int = 200  # Steps between checkpoints; 0 turns checkpointing off.
    log_every: int = 10  # Steps between TensorBoard writes.
    export_dir: str | None = None
    warmup_steps: int = 3  # Steps left out of the examples/second figure.
    verbose: int | None = None  # None: progress bar on a terminal, a line per epoch otherwise.


def validate(config):
    """Raises UsageError for settings that are wrong whatever the hardware."""
    if config.model not in models.MODELS:
        raise UsageError(f"unknown model {config.model!r}; choose one of {', '.join(models.MODELS)}")
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
