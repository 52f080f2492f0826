"""Benchmark precision policies per model, in one process: speed, MFU, memory, input rate.

    python -m tfmp.bench --models=cnn,lstm --policies=float32,mixed_bfloat16,mixed_float16

Prints a table; writes bench.json and bench.png into --output_dir.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

from absl import app, flags, logging  # noqa: E402

from tfmp import benchlib, precision  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list("models", ["cnn", "resnet", "lstm", "transformer"], "Models to benchmark.")
flags.DEFINE_list("policies", ["float32", "mixed_bfloat16", "mixed_float16"], "Policies to compare.")
flags.DEFINE_integer("batch_size", 256, "Global batch size.")
flags.DEFINE_integer("steps", 100, "Timed training steps per model and policy (after warm-up).")
flags.DEFINE_integer("warmup_steps", 5, "Untimed steps first (tracing, allocation).")
flags.DEFINE_float("budget_seconds", 60.0, "Wall-clock budget per model, policy and round; slower ones are cut off.")
flags.DEFINE_integer("rounds", 3, "Rounds in which the policies take turns; each row reports its best round.")
flags.DEFINE_integer("matmul_size", 2048, "Square matmul size for the peak FLOP/s micro-benchmark.")
flags.DEFINE_integer("overhead_repeats", 5, "Alternating runs of plain Keras vs tfmp for the overhead ratio.")
flags.DEFINE_string("overhead_model", "cnn", "Model for the plain-Keras overhead check ('' to skip).")
flags.DEFINE_string("output_dir", "bench_out", "Where bench.json and bench.png go.")
flags.DEFINE_bool("autotune", True, "Also run --precision=autotune's trial per model and compare its pick.")


def main(argv):
    del argv
    for policy in FLAGS.policies:
        if policy not in precision.POLICIES or policy == "auto":
            print(
                f"bench: error: unknown policy {policy!r}; choose from float32, mixed_bfloat16, mixed_float16",
                file=sys.stderr,
            )
            sys.exit(2)
    os.makedirs(FLAGS.output_dir, exist_ok=True)
    device = benchlib.device_name()
    print(f"device: {device}")
    peaks = benchlib.matmul_peaks(FLAGS.policies, FLAGS.matmul_size)
    for policy, peak in peaks.items():
        print(
            f"matmul {FLAGS.matmul_size}x{FLAGS.matmul_size} peak, {benchlib.compute_dtype(policy)}: "
            f"{peak['flops'] / 1e9:,.1f} GFLOP/s" + (" (cut off)" if peak["cut_off"] else "")
        )
    rows = []
    for name in FLAGS.models:
        rows += benchlib.bench_model(
            name,
            FLAGS.policies,
            FLAGS.batch_size,
            FLAGS.steps,
            FLAGS.warmup_steps,
            FLAGS.budget_seconds,
            peaks,
            FLAGS.rounds,
        )
        logging.info("%s", rows[-len(FLAGS.policies) :])
    benchlib.add_speedups(rows)
    choices = benchlib.policy_choices(rows, FLAGS.models, FLAGS.policies, FLAGS.batch_size) if FLAGS.autotune else []
    overhead = None
    if FLAGS.overhead_model:
        policy = max(
            (r for r in rows if r["model"] == FLAGS.overhead_model and not r["cut_off"]),
            key=lambda r: r["examples_per_second"],
            default={"policy": "float32"},
        )["policy"]
        overhead = benchlib.overhead(
            FLAGS.overhead_model, policy, FLAGS.batch_size, FLAGS.steps, FLAGS.warmup_steps, FLAGS.overhead_repeats
        )
    table = benchlib.table(rows)
    print(table)
    for c in choices:
        print(
            f"{c['model']}: fastest {c['fastest']}; auto -> {c['auto']} ({100 * c['auto_vs_fastest']:.1f}% of the "
            f"fastest, {c['auto_vs_float32']:.2f}x float32); autotune -> {c['autotune']} "
            f"({100 * c['autotune_vs_fastest']:.1f}% of the fastest, {c['autotune_vs_float32']:.2f}x float32)"
        )
    if overhead:
        print(
            f"overhead ({overhead['model']}, {overhead['policy']}, best of {FLAGS.overhead_repeats} alternating "
            f"runs): plain Keras fit {overhead['plain_best']:,.0f} ex/s, tfmp {overhead['tfmp_best']:,.0f} ex/s, "
            f"tfmp/plain = {overhead['ratio']:.3f} (medians: {overhead['median_ratio']:.3f})"
        )
    result = {
        "device": device,
        "batch_size": FLAGS.batch_size,
        "steps": FLAGS.steps,
        "matmul_peaks": peaks,
        "rounds": FLAGS.rounds,
        "rows": rows,
        "choices": choices,
        "overhead": overhead,
        "auto_policy": precision.resolve_policy("auto").policy,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    with open(os.path.join(FLAGS.output_dir, "bench.json"), "w") as f:
        json.dump(result, f, indent=2)
    benchlib.plot(rows, os.path.join(FLAGS.output_dir, "bench.png"))
    print(f"wrote {FLAGS.output_dir}/bench.json and bench.png")


if __name__ == "__main__":
    app.run(main)
