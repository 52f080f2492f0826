"""tfmp.app.config on its own: each run setting is stated once (train.py's flags take their
defaults from `Config`), and `validate` refuses what is wrong whatever the hardware."""

import dataclasses
import math

import pytest
from absl import flags

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
        config_lib.validate(config_lib.Config(model_dir=str(tmp_path), **change))


def test_validate_accepts_the_defaults(tmp_path):
    config_lib.validate(config_lib.Config(model_dir=str(tmp_path)))
