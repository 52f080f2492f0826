"""`python -m tfmp.bench`'s flags and the checks they need together, in a module that loads no TensorFlow: the
command reads them first, so that a wrong flag or --help is answered before TensorFlow starts."""

import os

from absl import flags

from tfmp import choices, cli
from tfmp.app import models as bundled
from tfmp.app.config import JIT_COMPILE

FLAGS = flags.FLAGS
BUNDLED_BATCH = 256
# tfmp.bench.realsize's models (on synthetic data), by name: their default batch sizes, the GPU sizes.
BATCH_SIZES = {"resnet50": 128, "bert_base": 64, "encoder_4096": 64}
GPU_MODELS = ("resnet50", "bert_base")  # The bench's default on a GPU.


def define():
    flags.DEFINE_list(
        "models",
        None,
        "Models: the bundled cnn, resnet, lstm, transformer (shipped data) and the real-size resnet50 "
        "(224x224x3), bert_base (12 x 768, sequence 128) and encoder_4096 on synthetic data. Default: the "
        "bundled ones on a CPU, resnet50 and bert_base on a GPU (the bundled ones are too small to fill it).",
    )
    flags.DEFINE_list(
        "policies",
        ["float32", "mixed_bfloat16", "mixed_float16", "bfloat16"],
        "Policies to compare (bfloat16: weights and optimizer state in bfloat16, Kahan-compensated updates; its "
        "'state MB' is half of float32's).",
    )
    flags.DEFINE_integer(
        "batch_size",
        None,
        f"Global batch size (default: {BUNDLED_BATCH} for the bundled models; "
        + ", ".join(f"{name} {batch}" for name, batch in BATCH_SIZES.items())
        + ").",
        lower_bound=1,
    )
    flags.DEFINE_integer(
        "rounds", 3, "Rounds; in each, every policy is trained by tfmp and by Keras fit in turn.", lower_bound=1
    )
    flags.DEFINE_float(
        "round_seconds", 24.0, "About how long one round of one model takes, shared by its turns.", lower_bound=1e-3
    )
    flags.DEFINE_integer("max_steps", 100, "Most timed steps in one turn.", lower_bound=1)
    flags.DEFINE_enum("jit_compile", "auto", list(JIT_COMPILE), "tfmp.fit's jit_compile (Keras fit: its default).")
    flags.DEFINE_integer(
        "matmul_size",
        None,
        "Square matmul size for the peak FLOP/s micro-benchmark (default: GPU 8192, CPU 2048).",
        lower_bound=1,
    )
    flags.DEFINE_integer(
        "autotune_runs", 3, "Independent autotune trials per bundled model, compared with the rounds.", lower_bound=0
    )
    flags.DEFINE_float(
        "trial_seconds",
        45.0,
        "At most this many seconds of alternating rounds in each autotune trial.",
        lower_bound=1e-3,
    )
    flags.DEFINE_list(
        "sparse_vocab", ["20000", "200000"], "Transformer vocabularies timed with dense vs sparse gradients."
    )
    flags.DEFINE_integer(
        "sparse_replicas",
        1,
        "Replicas for the sparse check: above 1, a MirroredStrategy over that many GPUs, or over logical CPU devices "
        "on a CPU (where the all-reduce is what a dense embedding gradient costs). On 1 the check is skipped: with "
        "nothing to all-reduce, tfmp makes Adam's embedding gradient dense at once, as its update would.",
        lower_bound=1,
    )
    flags.DEFINE_list("update_models", ["resnet50", "bert_base"], "Real-size models whose Adam update is timed.")
    flags.DEFINE_integer(
        "overhead_rounds",
        3,
        "Alternating rounds timing each training loop's own cost per step, 12 settings (0: skip).",
        lower_bound=0,
    )
    flags.DEFINE_integer("overhead_layers", 150, "Dense layers of the loop-cost MLP (2 variables each).", lower_bound=1)
    flags.DEFINE_string(
        "pytorch",
        "auto",
        "PyTorch's column for resnet50 (torchvision, autocast, channels_last, in a subprocess on the same device): "
        "auto (where this Python has torch and torchvision), off, or the path of a Python that has them.",
    )
    flags.DEFINE_string("output_dir", "bench_out", "Where bench.json and bench.png go.")


def check():
    """What the flags cannot check one by one: one line `bench: error: ...` and exit status 2."""
    unknown = [p for p in FLAGS.policies if p not in choices.POLICIES or p == "auto"]
    if unknown:
        cli.error("bench", f"unknown policy {unknown[0]!r}; choose from {', '.join(choices.POLICIES[1:])}")
    known = [*bundled.MODELS, *BATCH_SIZES]
    unknown = [m for m in FLAGS.models or () if m not in known]
    if unknown:
        cli.error("bench", f"unknown model {unknown[0]!r}; choose from {', '.join(known)}")
    if FLAGS.pytorch not in ("auto", "off") and not os.access(FLAGS.pytorch, os.X_OK):
        cli.error("bench", f"--pytorch={FLAGS.pytorch}: not an executable Python (or auto, off)")
