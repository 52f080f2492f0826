"""`python -m tfmp.doctor`'s flags, in a module that loads no TensorFlow: the command reads
them first, so that a wrong flag or --help is answered before TensorFlow starts."""

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
    flags.DEFINE_string(
        "baseline", None, "The policy --parity compares --policy with (default: float32; mixed_bfloat16 for float8)."
    )
    flags.DEFINE_integer("steps", 8, "float32 training steps the diagnosis measures.")
    flags.DEFINE_integer("batch_size", 128, "Global batch size.")
    flags.DEFINE_string("output_dir", "doctor_out", "Where diagnosis.json, gradients.png (or parity.json) go.")
    flags.DEFINE_bool("parity", False, "Compare test accuracy of float32 and --policy over --seeds seeds instead.")
    flags.DEFINE_integer("seeds", 3, "Seeds per policy for --parity.")
    flags.DEFINE_integer("epochs", 2, "Epochs per --parity run.")
    flags.DEFINE_integer("steps_per_epoch", None, "Steps per epoch for --parity runs (default: one pass).")
    flags.DEFINE_float("learning_rate", 1e-3, "Learning rate for --parity runs.")
