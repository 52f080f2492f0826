"""Benchmark precision policies per model, in one process: tfmp.fit against plain Keras
`model.fit`, every policy in alternating rounds, with this machine's matmul and conv peaks.

    python -m tfmp.bench                      # bundled models, shipped data (GPU: resnet50, bert_base)
    python -m tfmp.bench --models=resnet50,bert_base --policies=float32,mixed_bfloat16 \\
        --batch_size=16 --rounds=3 --autotune_runs=0 --sparse_vocab=

Prints the table and comparisons; writes bench.json, bench.md (the same as README tables) and
bench.png into --output_dir.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import sys  # noqa: E402
import time  # noqa: E402

import tensorflow as tf  # noqa: E402
from absl import app, flags  # noqa: E402

from tfmp import cli, files, precision  # noqa: E402
from tfmp.app.config import JIT_COMPILE  # noqa: E402
from tfmp.bench import measure, micro, pytorch, realsize, runs, tables  # noqa: E402

FLAGS = flags.FLAGS
BUNDLED_BATCH = 256
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
    + ", ".join(f"{name} {batch}" for name, batch in realsize.BATCH_SIZES.items())
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
    "trial_seconds", 45.0, "At most this many seconds of alternating rounds in each autotune trial.", lower_bound=1e-3
)
flags.DEFINE_list("sparse_vocab", ["20000", "200000"], "Transformer vocabularies timed with dense vs sparse gradients.")
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


def _print_choices(choices):
    for c in choices:
        picks = ", ".join(
            f"{p['policy']} ({tables.share_text(p)} of the fastest, {p['seconds']:.0f} s: "
            f"{p['warm_up_seconds']:.0f} s warm-up, {p['rounds_seconds']:.0f} s rounds)"
            for p in c["picks"]
        )
        print(f"{c['model']}: fastest in the rounds {c['fastest']}; autotune picked {picks}")


def _sparse_strategy(replicas):
    if replicas <= 1:
        return tf.distribute.get_strategy()
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * replicas)
    devices = [d.name for d in tf.config.list_logical_devices("GPU" if gpus else "CPU")][:replicas]
    return tf.distribute.MirroredStrategy(devices)


def _models():
    """--models, or the default for this machine (read without starting TensorFlow's runtime)."""
    if FLAGS.models is not None:
        return FLAGS.models
    return list(realsize.GPU_MODELS) if tf.config.list_physical_devices("GPU") else list(runs.models.MODELS)


def _batch_size(name):
    return FLAGS.batch_size or realsize.BATCH_SIZES.get(name, BUNDLED_BATCH)


def _pytorch_column(batches):
    """PyTorch's resnet50 rows ({policy: row}, facts), run before TensorFlow takes the GPU's
    memory; ({}, {"left_out": why}) where it does not run. `batches`: {model: batch size}."""
    python = pytorch.find_python(FLAGS.pytorch)
    if pytorch.MODEL not in batches or python is None:
        return {}, {}
    print(f"bench: pytorch {pytorch.MODEL}: torchvision in {python}, a subprocess", flush=True)
    turn = FLAGS.round_seconds / len(FLAGS.policies) / len(tables.TRAINERS)  # A turn of one loop in a round.
    found, facts = pytorch.rates(python, FLAGS.policies, batches[pytorch.MODEL], FLAGS.rounds, turn, FLAGS.max_steps)
    if found is None:
        print(f"bench: pytorch column left out: {facts}", flush=True)
        return {}, {"left_out": facts}
    return found, facts


def _peaks():
    """This machine's matmul and conv peaks per policy, printed as they are measured."""
    sizes = measure.peak_sizes()
    n, conv = FLAGS.matmul_size or sizes["matmul"], sizes["conv"]
    labels = {
        "matmul": f"matmul {n}x{n}",
        "conv": f"conv 3x3 {conv['batch']}x{conv['size']}x{conv['size']}x{conv['channels']} fwd+bwd",
    }
    print(f"bench: timing the peaks ({', '.join(labels.values())}), up to 20 s an op and policy", flush=True)
    peaks = {"matmul": measure.matmul_peaks(FLAGS.policies, n), "conv": measure.conv_peaks(FLAGS.policies, **conv)}
    for op, label in labels.items():
        for policy, peak in peaks[op].items():
            print(
                f"{label} peak, {precision.compute_dtype(policy)}: {peak['flops'] / 1e9:,.1f} GFLOP/s"
                + (" (cut off)" if peak["cut_off"] else ""),
                flush=True,
            )
    return peaks


def _print_micro(updates, overhead, sparse):
    """The micro-benchmarks' lines: Adam update, the loop's cost per step, sparse gradients."""
    for u in updates:
        print(
            f"Adam update, {u['model']} ({u['parameters'] / 1e6:.1f}M float32 weights): Keras {u['keras_ms']:.1f} ms, "
            f"tfmp fused {u['fused_ms']:.1f} ms"
        )
    if overhead:
        print(f"training loop's cost: tfmp.fit / Keras fit speed, geometric mean {overhead['geomean']:.2f}x")
    for s in sparse:
        print(
            f"transformer step, vocabulary {s['vocab_size']:,}, {s['replicas']} replicas: embedding gradient "
            f"dense {s['dense_ms']:.1f} ms, "
            f"sparse {s['sparse_ms']:.1f} ms ({s['speedup']:.2f}x)"
        )


def _write(result, rows):
    """bench.json, bench.md (README tables) and bench.png in --output_dir."""
    files.write_json(os.path.join(FLAGS.output_dir, "bench.json"), result)
    with open(os.path.join(FLAGS.output_dir, "bench.md"), "w") as f:
        f.write(tables.markdown(result) + "\n")
    if rows:
        tables.plot(rows, os.path.join(FLAGS.output_dir, "bench.png"))
    print(f"wrote {FLAGS.output_dir}/bench.json, bench.md (README tables) and bench.png")


def main(argv):
    del argv
    unknown = [p for p in FLAGS.policies if p not in precision.POLICIES or p == "auto"]
    if unknown:
        choices = ", ".join(precision.POLICIES[1:])
        print(f"bench: error: unknown policy {unknown[0]!r}; choose from {choices}", file=sys.stderr)
        sys.exit(2)
    known = [*runs.models.MODELS, *realsize.MODELS]
    batches = {name: _batch_size(name) for name in _models()}
    unknown = [m for m in batches if m not in known]
    if unknown:
        print(f"bench: error: unknown model {unknown[0]!r}; choose from {', '.join(known)}", file=sys.stderr)
        sys.exit(2)
    if FLAGS.pytorch not in ("auto", "off") and not os.access(FLAGS.pytorch, os.X_OK):
        print(f"bench: error: --pytorch={FLAGS.pytorch}: not an executable Python (or auto, off)", file=sys.stderr)
        sys.exit(2)
    os.makedirs(FLAGS.output_dir, exist_ok=True)
    torch_rows, torch_facts = _pytorch_column(batches)  # Before TensorFlow takes the GPU's memory.
    strategy = _sparse_strategy(FLAGS.sparse_replicas)  # Before TensorFlow starts its runtime.
    device = precision.device_name()
    print(f"device: {device}", flush=True)
    peaks = _peaks()
    jit = JIT_COMPILE[FLAGS.jit_compile]
    rows = []
    for name, batch in batches.items():
        model_rows = runs.bench_model(
            name, FLAGS.policies, batch, FLAGS.rounds, FLAGS.round_seconds, FLAGS.max_steps, peaks, jit
        )
        for row in model_rows:
            if name == pytorch.MODEL and row["policy"] in torch_rows:
                row["pytorch_examples_per_second"] = torch_rows[row["policy"]]["examples_per_second"]
        print(tables.table(model_rows), flush=True)
        rows += model_rows
    bundled = [n for n in batches if n in runs.models.MODELS]
    choices = (
        runs.policy_choices(
            rows, bundled, FLAGS.policies, batches[bundled[0]], FLAGS.autotune_runs, FLAGS.trial_seconds
        )  # The bundled models share one batch size.
        if FLAGS.autotune_runs and bundled
        else []
    )
    updates = [micro.update_times(name) for name in FLAGS.update_models]
    overhead = micro.loop_costs(FLAGS.overhead_rounds, FLAGS.overhead_layers) if FLAGS.overhead_rounds else None
    sparse = []
    if FLAGS.sparse_vocab and strategy.num_replicas_in_sync > 1:
        sparse = micro.sparse_steps([int(v) for v in FLAGS.sparse_vocab], strategy)
    elif FLAGS.sparse_vocab:
        print("sparse check skipped: one replica has nothing to all-reduce (--sparse_replicas=2 times it)")
    sizes = set(batches.values())
    batch_text = f"batch {sizes.pop()}" if len(sizes) == 1 else ", ".join(f"{n} batch {b}" for n, b in batches.items())
    print(f"\n{device}, {batch_text}, medians of {FLAGS.rounds} alternating rounds")
    summary = tables.versus_keras(rows)
    if rows:
        print(tables.table(rows))
    if summary:
        print(tables.versus_keras_text(summary))
    if torch_facts:
        print(tables.pytorch_text(torch_facts))
    _print_choices(choices)
    _print_micro(updates, overhead, sparse)
    result = {
        "device": device,
        "batch_size": batches,
        "rounds": FLAGS.rounds,
        "round_seconds": FLAGS.round_seconds,
        "jit_compile": FLAGS.jit_compile,
        "peaks": peaks,
        "rows": rows,
        "versus_keras": summary,
        "choices": choices,
        "sparse": sparse,
        "overhead": overhead,
        "updates": updates,
        "pytorch": {"rows": torch_rows, **torch_facts} if torch_rows or torch_facts else None,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    _write(result, rows)


if __name__ == "__main__":
    app.run(main, flags_parser=cli.flags_parser("bench"))
