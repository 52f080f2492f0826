"""`python -m tfmp.doctor`'s flags, in a module that loads no TensorFlow: the command reads
them first, so that a wrong flag or --help is answered before TensorFlow starts."""

import math

from absl import flags

from tfmp import choices
from tfmp.app import models


def define():
    flags.DEFINE_enum("model", "cnn", list(models.MODELS), "A bundled model.")
    flags.DEFINE_string("dataset", None, "Dataset (default: the shipped sample for the model's input kind).")
    flags.DEFINE_string("data_dir", None, "Where TFDS looks for prepared datasets.")
    flags.DEFINE_enum(
        "policy",
        "mixed_float16",
        ["mixed_float16", "mixed_bfloat16", "float8", "bfloat16"],
        "The policy the model is built under (float8: bfloat16 with float8 matmuls; bfloat16: weights and "
        "optimizer state in bfloat16, updates rounded by --bf16_rounding).",
    )
    flags.DEFINE_enum("bf16_rounding", "kahan", list(choices.ROUNDINGS), "Under --policy=bfloat16: see train.py.")
    flags.DEFINE_enum(
        "baseline",
        None,
        ["float32", "mixed_float16", "mixed_bfloat16", "float8", "bfloat16"],
        "The policy --parity compares --policy with (default: float32; mixed_bfloat16 for float8).",
    )
    flags.DEFINE_integer("steps", 8, "float32 training steps the diagnosis measures.", lower_bound=1)
    flags.DEFINE_integer("batch_size", 128, "Global batch size.", lower_bound=1)
    flags.DEFINE_string("output_dir", "doctor_out", "Where diagnosis.json, gradients.png (or parity.json) go.")
    flags.DEFINE_bool("parity", False, "Compare test accuracy of float32 and --policy over --seeds seeds instead.")
    flags.DEFINE_integer("seeds", 3, "Seeds per policy for --parity (at least 2: their spread is the noise).")
    flags.DEFINE_integer("epochs", 2, "Epochs per --parity run.", lower_bound=1)
    flags.DEFINE_integer(
        "steps_per_epoch", None, "Updates per epoch for --parity runs (default: one pass).", lower_bound=1
    )
    flags.DEFINE_float("learning_rate", 1e-3, "Learning rate for --parity runs.")
    flags.DEFINE_enum(
        "lr_schedule", "cosine", list(choices.LR_SCHEDULES), "--parity runs' learning-rate schedule: see train.py."
    )
    # Checked as the flags are read, so that a wrong value is answered before TensorFlow loads.
    flags.register_multi_flags_validator(
        ["parity", "seeds"],
        lambda f: not f["parity"] or f["seeds"] >= 2,
        "--parity measures the noise over the seeds: give --seeds=2 or more",
    )
    flags.register_multi_flags_validator(
        ["policy", "baseline"],
        lambda f: f["baseline"] != f["policy"],
        "--parity compares --policy with another policy: give a --baseline other than --policy",
    )
    flags.register_validator("learning_rate", lambda v: math.isfinite(v) and v > 0, "must be a positive finite number")
