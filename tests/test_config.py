"""tfmp.app.config and checks on their own: each run setting is stated once (train.py's flags take their
defaults from `Config`), and `validate` refuses what is wrong whatever the hardware."""

import dataclasses
import math

import pytest
from absl import flags

from tfmp.app import checks
from tfmp.app import config as config_lib
from tfmp.errors import UsageError


@pytest.fixture(scope="module")
def train_flags():
    """train.py's flags (importing train.py defines them, once per process)."""
    import train  # noqa: F401

    return flags.FLAGS


def test_every_flag_defaults_to_its_config_field(train_flags):
    default = config_lib.Config()
    fields = {f.name for f in dataclasses.fields(config_lib.Config)}
    names = [name for name in train_flags if name in fields]
    assert len(names) >= 30 and fields - set(names) <= {"warmup_steps", "verbose"}  # Those two are library-side.
    for name in names:
        value = train_flags[name].default
        expected = getattr(default, name)
        assert (list(value) if isinstance(expected, tuple) else value) == (
            list(expected) if isinstance(expected, tuple) else expected
        ), name
    assert list(train_flags["jit_compile"].parser.enum_values) == list(config_lib.JIT_COMPILE)


@pytest.mark.parametrize(
    "change, words",
    [
        ({"learning_rate": math.nan}, "--learning_rate must be a positive finite number, got nan"),
        ({"clipnorm": math.inf}, "--clipnorm must be a positive finite number, got inf"),
        ({"keep_float32": ("dense[",)}, "--keep_float32: 'dense\\[' is not a regular expression"),
        ({"jit_compile": "sometimes"}, "unknown --jit_compile='sometimes'; choose one of auto, autotune, true, false"),
        ({"model": "lstm", "vocab_size": 2}, "--vocab_size must be >= 3"),
        ({"checkpoint_every": -1}, "--checkpoint_every must be >= 0"),
    ],
)
def test_validate_refuses(change, words, tmp_path):
    with pytest.raises(UsageError, match=words):
        checks.validate(config_lib.Config(model_dir=str(tmp_path), **change))


def test_validate_accepts_the_defaults(tmp_path):
    checks.validate(config_lib.Config(model_dir=str(tmp_path)))


@pytest.mark.parametrize(
    "change, policy, strategy, words",
    [
        ({"float8_exclude": ["head"]}, "mixed_bfloat16", "default", "--float8_exclude has no effect: the policy is"),
        ({"bf16_rounding": "stochastic"}, "mixed_bfloat16", "default", "--bf16_rounding has no effect"),
        ({"keep_float32": ["head"]}, "float32", "default", "--keep_float32 has no effect"),
        ({"loss_scale_initial": 8.0}, "mixed_bfloat16", "default", "--loss_scale_initial has no effect"),
        ({"loss_scale_growth_steps": 5}, "float32", "default", "--loss_scale_growth_steps has no effect"),
        ({"precision": "float32", "trial_seconds": 5.0}, "float32", "default", "--trial_seconds has no effect"),
        ({"tpu": "local"}, "float32", "mirrored", "--tpu has no effect: the strategy is mirrored"),
        ({"base_batch_size": 64}, "float32", "default", "--base_batch_size has no effect: --lr_scaling=none"),
        ({"vocab_size": 500}, "float32", "default", "--vocab_size has no effect: --model=cnn takes images"),
        ({"model": "lstm", "augment": True}, "float32", "default", "--augment has no effect: --model=lstm takes text"),
        ({"data_dir": "/data"}, "float32", "default", "--data_dir has no effect"),
    ],
)
def test_a_flag_the_run_leaves_unread_is_named(change, policy, strategy, words):
    lines = checks.without_effect(config_lib.Config(**change), policy, strategy)
    assert len(lines) == 1 and lines[0].startswith(words), lines


@pytest.mark.parametrize(
    "change, policy, strategy",
    [
        ({"float8_exclude": [], "keep_float32": []}, "float32", "default"),  # train.py's flags give lists.
        ({"float8_exclude": ["head"], "keep_float32": ["head"]}, "float8", "default"),
        ({"bf16_rounding": "stochastic"}, "bfloat16", "default"),
        ({"loss_scale_initial": 8.0, "loss_scale_growth_steps": 5}, "mixed_float16", "default"),
        ({"trial_seconds": 5.0}, "mixed_bfloat16", "default"),  # --precision=auto: a trial may run.
        ({"tpu": "local"}, "float32", "tpu"),
        ({"base_batch_size": 64, "lr_scaling": "linear"}, "float32", "default"),
        ({"model": "lstm", "vocab_size": 500, "sequence_length": 16}, "float32", "default"),
        ({"dataset": "mnist", "data_dir": "/data", "augment": True}, "float32", "default"),
    ],
)
def test_a_flag_the_run_reads_is_not_named(change, policy, strategy):
    assert checks.without_effect(config_lib.Config(**change), policy, strategy) == []
