"""A training run's settings (`tfmp.app.config.Config`), checked: what is wrong whatever the
hardware, before anything is written, and the flags a run leaves unread; then, once its data is
known, its batch against an epoch and against this host's memory."""

import math
import os
import re

from tfmp import choices
from tfmp.app import models
from tfmp.app.config import JIT_COMPILE, RESUME, Config
from tfmp.data import sources
from tfmp.errors import UsageError
from tfmp.run_directory import check_writable


def _positive_finite(name, value):
    if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
        raise UsageError(f"--{name} must be a positive finite number, got {value}")


# The flags that name one of a few choices, and those choices.
_CHOICES = {
    "model": models.MODELS,
    "precision": (*choices.POLICIES, choices.AUTOTUNE),
    "strategy": choices.STRATEGIES,
    "lr_scaling": choices.LR_SCALING,
    "lr_schedule": choices.LR_SCHEDULES,
    "bf16_rounding": choices.ROUNDINGS,
    "jit_compile": JIT_COMPILE,
    "resume": RESUME,
}


def validate(config):
    """Raises UsageError for settings that are wrong whatever the hardware: names, ranges,
    nan and inf, and paths that cannot be written (before anything is written)."""
    for name, names in _CHOICES.items():
        if getattr(config, name) not in names:
            raise UsageError(f"unknown --{name}={getattr(config, name)!r}; choose one of {', '.join(names)}")
    if config.trial_seconds is not None:
        _positive_finite("trial_seconds", config.trial_seconds)
    for name in ("epochs", "batch_size", "steps_per_epoch", "grad_accum_steps", "steps_per_execution", "log_every"):
        value = getattr(config, name)
        if value is not None and value < 1:
            raise UsageError(f"--{name} must be >= 1, got {value}")
    if config.base_batch_size is not None and config.base_batch_size < 1:
        raise UsageError(f"--base_batch_size must be >= 1, got {config.base_batch_size}")
    if config.checkpoint_every < 0:
        raise UsageError(f"--checkpoint_every must be >= 0 (0: off), got {config.checkpoint_every}")
    if config.warmup_steps < 0:
        raise UsageError(f"--warmup_steps must be >= 0, got {config.warmup_steps}")
    _positive_finite("learning_rate", config.learning_rate)
    _positive_finite("loss_scale_initial", config.loss_scale_initial)
    if config.clipnorm is not None:
        _positive_finite("clipnorm", config.clipnorm)
    if config.loss_scale_growth_steps < 1:
        raise UsageError(f"--loss_scale_growth_steps must be >= 1, got {config.loss_scale_growth_steps}")
    if models.MODELS[config.model].kind == "text":
        if config.vocab_size < 3:  # Padding, out-of-vocabulary and at least one word.
            raise UsageError(f"--vocab_size must be >= 3, got {config.vocab_size}")
        if config.sequence_length < 1:
            raise UsageError(f"--sequence_length must be >= 1, got {config.sequence_length}")
    for flag in ("keep_float32", "float8_exclude"):
        for pattern in getattr(config, flag):
            try:
                re.compile(pattern)
            except re.error as e:
                raise UsageError(f"--{flag}: {pattern!r} is not a regular expression ({e})") from e
    if config.export_dir:
        check_writable(config.export_dir, "--export_dir")
    check_writable(config.model_dir, "--model_dir")


def without_effect(config, policy, strategy_name):
    """A line for each flag `config` sets (to other than its default) that this run leaves
    unread, under the `policy` and strategy it resolved to: `--float8_exclude` without
    float8, say, would otherwise pass unnoticed."""
    default, text = Config(), models.MODELS[config.model].kind == "text"
    unread = {
        "float8_exclude": policy != "float8" and f"the policy is {policy}, not float8",
        "bf16_rounding": policy != "bfloat16" and f"the policy is {policy}, not bfloat16 (weights in bfloat16)",
        "keep_float32": policy == "float32" and "the policy is float32: every layer computes in float32",
        "loss_scale_initial": policy != "mixed_float16" and f"the policy is {policy}: nothing is loss-scaled",
        "loss_scale_growth_steps": policy != "mixed_float16" and f"the policy is {policy}: nothing is loss-scaled",
        "trial_seconds": config.precision not in ("auto", choices.AUTOTUNE) and "no precision trial runs",
        "tpu": strategy_name != "tpu" and f"the strategy is {strategy_name}, not tpu",
        "base_batch_size": config.lr_scaling == "none" and "--lr_scaling=none: the learning rate is not scaled",
        "vocab_size": not text and f"--model={config.model} takes images",
        "sequence_length": not text and f"--model={config.model} takes images",
        "augment": text and f"--model={config.model} takes text",
        "data_dir": config.dataset in (None, sources.SYNTHETIC, *sources.SHIPPED) and "the dataset is not a TFDS one",
    }

    def given(name):  # train.py's list flags give lists where Config's defaults are tuples.
        value = getattr(config, name)
        return (tuple(value) if isinstance(value, list) else value) != getattr(default, name)

    return [f"--{name} has no effect: {why}" for name, why in unread.items() if why and given(name)]


def no_full_update(config, size, batches, plan):
    """The refusal for an epoch (`size` examples, None if unknown, in `batches` global
    batches) shorter than one update: the flag to change and the largest value that fits."""
    epoch = f"an epoch of {size} examples" if size else "an epoch"
    update = f"{plan.effective_batch} examples (--batch_size={config.batch_size}"
    if plan.grad_accum_steps > 1 and batches >= 1:
        return (
            f"--grad_accum_steps={plan.grad_accum_steps}: {epoch} holds no full update of {update} x "
            f"--grad_accum_steps={plan.grad_accum_steps}); the largest --grad_accum_steps that fits is {batches} "
            "(or set --steps_per_epoch to repeat the data)"
        )
    if size and size >= plan.replicas:
        largest = f"the largest --batch_size that fits is {size // plan.replicas * plan.replicas}"
        if plan.grad_accum_steps > 1:
            largest += " with --grad_accum_steps=1"
    else:
        largest = "lower --batch_size"
    return (
        f"--batch_size={config.batch_size}: {epoch} holds no full update of {update}); {largest} "
        "(or set --steps_per_epoch to repeat the data)"
    )


def check_batch_memory(plan, source, config):
    """Refuses a batch whose input alone would not fit in this host's memory."""
    per_example = 4 * math.prod(source.image_shape) if source.kind == "image" else 8 * config.sequence_length
    need = plan.per_worker * per_example
    try:
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return
    if need > have / 2:
        raise UsageError(
            f"--batch_size={config.batch_size}: one batch of input alone takes {need / 2**30:,.1f} GiB, more than "
            f"half of this host's {have / 2**30:,.1f} GiB; lower --batch_size (use --grad_accum_steps for a larger "
            "effective batch)"
        )
