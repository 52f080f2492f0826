"""`python -m tfmp.bench`: the benchmark itself (`tfmp/bench/__main__.py` has read its flags, from
`tfmp.bench.bench_flags`, before TensorFlow loaded)."""

import os
import time

import tensorflow as tf
from absl import flags

from tfmp import files, precision
from tfmp.app.config import JIT_COMPILE
from tfmp.bench import bench_flags, measure, micro, pytorch, realsize, runs, tables

FLAGS = flags.FLAGS


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
    return FLAGS.batch_size or realsize.BATCH_SIZES.get(name, bench_flags.BUNDLED_BATCH)


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
    batches = {name: _batch_size(name) for name in _models()}
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
