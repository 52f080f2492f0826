"""A training run's settings and their defaults (`tfmp.app.checks` checks them). It loads no
TensorFlow: `train.py` defines its flags from it, so that a wrong flag or --help is answered
before TensorFlow starts."""

import dataclasses


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
    lr_schedule: str = "cosine"  # cosine: the learning rate decays to 0 over the run's updates; constant.
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
    jit_compile: str = "auto"  # XLA: auto (GPUs and TPUs: on; CPUs: float16 only), autotune (measured), true or false.
    trial_seconds: float | None = None  # The precision trial's alternating rounds (None: autotune's default).
    resume: str = "auto"  # force: resume even where the saved settings differ (not exact).
    keep_float32: tuple = ()  # Layer names or regexes built in float32 under a mixed policy.
    float8_exclude: tuple = ()  # Under float8: layers whose matmuls stay in bfloat16.
    bf16_rounding: str = "kahan"  # Under --precision=bfloat16: kahan, stochastic or nearest (tfmp.bf16).
    diagnose: bool = False  # Run the numerics doctor on the model and data instead of training.
    warmup_steps: int = 3  # Steps left out of the examples/second figure.
    verbose: int | None = None  # None: progress bar on a terminal, a line per epoch otherwise.


RESUME = ("auto", "force")
JIT_COMPILE = {"auto": "auto", "autotune": "autotune", "true": True, "false": False}
