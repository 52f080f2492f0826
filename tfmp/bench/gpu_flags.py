"""`python -m tfmp.bench.gpu_report`'s parts, flags and the checks they need together, in a module that loads no
TensorFlow: the command reads them first, so that a wrong flag or --help is answered before TensorFlow starts (and,
on a GPU machine, before CUDA does)."""

import dataclasses
import os

from absl import flags

from tfmp import cli

FLAGS = flags.FLAGS
MIXED = ("float32", "mixed_float16", "mixed_bfloat16")
ORDER = ("float32", "mixed_float16", "mixed_bfloat16", "bfloat16", "float8")  # The report's order of precisions.


@dataclasses.dataclass(frozen=True)
class Part:
    """One part: `model` trained with `optimizer` under each of `precisions`.

    Args:
        together: whether all its fits are held at once and timed in alternating rounds;
            False for models too large for that (each precision's pair alone).
        peaks: time the matmul and conv peaks first.
        float8_hlo: instead, which GEMMs XLA makes float8, and a float8 Dense step's speed,
            under each of `float8_hlo.VARIANTS`.
        pytorch: PyTorch AMP's rows for these models (each: both optimizers) instead.
    """

    model: str = ""
    optimizer: str = "adam"
    precisions: tuple = ()
    together: bool = True
    peaks: bool = False
    float8_hlo: bool = False
    pytorch: tuple = ()


PARTS = {
    1: Part("resnet50", "sgd", MIXED, peaks=True),
    2: Part("resnet50", "adam", MIXED),
    3: Part("bert_base", "sgd", (*MIXED, "bfloat16")),
    4: Part("bert_base", "adam", (*MIXED, "bfloat16")),
    5: Part(float8_hlo=True),
    6: Part("bert_base", "adam", ("mixed_bfloat16", "float8")),
    7: Part("encoder_4096", "adam", ("mixed_bfloat16", "float8"), together=False),
    8: Part(pytorch=("resnet50", "bert_base")),
}


def define():
    """The command's flags, defined when it runs (not on import: tests import this module
    beside train.py's flags)."""
    flags.DEFINE_string("part", None, f"Which part to run: {', '.join(map(str, PARTS))} or all.")
    flags.DEFINE_string("output_dir", "gpu_report", "Where part<N>.json, report.md and report.log go.")
    flags.DEFINE_bool("smoke", False, "Tiny stand-ins of the models, batch 4, a few steps: the code path on a CPU.")
    flags.DEFINE_float(
        "budget_seconds",
        450.0,
        "A part warms no new fit after this many seconds (the last warm-up and rounds end within 9 min).",
        lower_bound=0.0,
    )
    flags.DEFINE_integer(
        "warmup_steps", 12, "Steps of each fit's first call (trace, compile, settle), untimed.", lower_bound=1
    )
    flags.DEFINE_integer(
        "rounds",
        7,
        "Alternating rounds after the warm-up; a ratio is the median of its rounds' (3 rounds of one H200 row read "
        "1.025-1.058).",
        lower_bound=1,
    )
    flags.DEFINE_integer("max_steps", 30, "Most timed steps of a fit in one round.", lower_bound=1)
    flags.DEFINE_integer("steps_per_turn", None, "Steps a fit's turn (default: 5 on a GPU, 1 on a CPU).", lower_bound=1)
    flags.DEFINE_string("pytorch", "auto", "Part 8's Python: auto (this one, where it has torch), off, or a path.")
    flags.DEFINE_enum(
        "input_on_device",
        "off",
        ["off", "both", "tfmp"],
        "Batches prefetched to the GPU, 2 ahead, not copied from host memory as each step runs (after the steps "
        "queued before it): off; both (the dataset each loop gets, tf.data's prefetch_to_device); tfmp (tfmp.fit's "
        "own, tfmp.inputs.PREFETCH_TO: off by default until measured so; Keras fit reads from host memory).",
    )
    flags.DEFINE_enum("grouped_norm", "auto", ["auto", "on", "off"], "tfmp's norm per shape: auto (on GPUs), on, off.")
    flags.DEFINE_list(
        "precisions",
        [],
        "Only these of a part's precisions (comma-separated; empty: all). The others are listed as not run.",
    )


def wanted():
    """The parts --part names, in order (empty where it names none)."""
    if FLAGS.part == "all":
        return list(PARTS)
    return [int(FLAGS.part)] if (FLAGS.part or "").isdigit() and int(FLAGS.part) in PARTS else []


def check():
    """What the flags cannot check one by one: one line `gpu_report: error: ...` and exit status 2."""
    if not wanted():
        given = "--part is needed" if FLAGS.part is None else f"--part={FLAGS.part}"
        cli.error("gpu_report", f"{given}: choose {', '.join(map(str, PARTS))} or all")
    if FLAGS.pytorch not in ("auto", "off") and not os.access(FLAGS.pytorch, os.X_OK):
        cli.error("gpu_report", f"--pytorch={FLAGS.pytorch}: not an executable Python (or auto, off)")
    trained = {p for n in wanted() for p in PARTS[n].precisions}
    if FLAGS.precisions and not set(FLAGS.precisions) <= trained:
        trains = ", ".join(p for p in ORDER if p in trained) or "no precisions (a probe, or PyTorch)"
        cli.error("gpu_report", f"--precisions={','.join(FLAGS.precisions)}: --part={FLAGS.part} trains {trains}")
