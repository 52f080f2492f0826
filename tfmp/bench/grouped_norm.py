"""The gradient norm's reductions, per gradient or per shape (`tfmp.gradients.half_squares_all`):
tfmp's compiled step both ways, and Keras' compiled step, timed in alternating rounds in one
process, and the kernels of tfmp's steps counted in XLA's optimized HLO (all three with the
norm, as tfmp.fit compiles them with a log_dir). A third tfmp step, "no norm", has zeros for
its sums of squares: in float32 and mixed_bfloat16 it computes what tfmp.fit's step computes
where nothing reads the norm (no log_dir, clip or loss scale: `Steps`' grad_norm); under
mixed_float16 it is a diagnostic, whose speed is the most a cheaper finite check could give.

    python -m tfmp.bench.grouped_norm --model=resnet50 --precision=float32 --optimizer=sgd \\
        --output_dir=grouped_norm [--smoke]

Each variant is warmed (its compile), then `--rounds` rounds of `--steps` steps each, the
variants' order reversed every other round; a step is one call of the compiled step and
the read of its outputs (tfmp: `Steps.train`; Keras: `model.train_function` and a read of
its loss). Prints ms per step (median of the rounds), each ratio, the kernels, and writes
OUTPUT_DIR/grouped_norm.json and .md. The choice it prints last ("grouped_norm: on" or "off") is
the faster of tfmp's two steps.
"""

import argparse
import contextlib
import glob
import json
import os
import statistics
import tempfile
import time

_DUMP = tempfile.mkdtemp(prefix="tfmp-grouped-norm-")
os.environ["XLA_FLAGS"] = " ".join(
    f
    for f in (os.environ.get("XLA_FLAGS", ""), f"--xla_dump_to={_DUMP} --xla_dump_hlo_module_re=.*_packed_update.*")
    if f
)
os.environ.setdefault("TF_FORCE_GPU_ALLOW_GROWTH", "true")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfmp import gradients, loop, precision  # noqa: E402
from tfmp.bench import realsize, runs, step_hlo  # noqa: E402

VARIANTS = ("per gradient", "grouped", "no norm", "keras")
# Each: the second step's speed over the first's (the first's ms a step over the second's), a median of rounds.
RATIOS = {
    "speed grouped / per gradient": ("per gradient", "grouped"),
    "speed grouped / keras": ("keras", "grouped"),
    "speed per gradient / keras": ("keras", "per gradient"),
    "speed no norm / grouped": ("grouped", "no norm"),
    "speed no norm / keras": ("keras", "no norm"),
}


@contextlib.contextmanager
def _without_norm():
    """Steps traced inside the block get zeros for their sums of squares (a diagnostic)."""
    real = gradients.half_squares_all
    gradients.half_squares_all = lambda grads, grouped: tf.zeros([len(grads)], tf.float32)
    try:
        yield
    finally:
        gradients.half_squares_all = real


def _variant(name, model_name, policy, optimizer, batch, smoke):
    """(a function running one step and reading its outputs, its model) of one variant, compiled and warmed."""
    keras.config.set_dtype_policy(policy)
    keras.utils.set_random_seed(0)
    models = realsize.SMOKE if smoke else realsize.MODELS
    sizes = realsize.SMOKE_INPUTS if smoke else {}
    dataset = realsize.synthetic(model_name, batch, **sizes)
    model = models[model_name]()
    model.compile(runs.OPTIMIZERS[optimizer](1e-3), "sparse_categorical_crossentropy", jit_compile=True)
    iterator = iter(dataset)
    if name == "keras":
        model.make_train_function()
        step = lambda: float(model.train_function(iterator)["loss"])  # noqa: E731
    else:
        with gradients.forced_grouping(name != "per gradient"):  # Read when the steps are compiled.
            steps = loop.prepare(model, tf.distribute.get_strategy(), dataset.element_spec)
            steps.compile(True)
        assert steps._grouped == (name != "per gradient")
        step = lambda: steps.train(iterator)  # noqa: E731
    began = time.perf_counter()
    with _without_norm() if name == "no norm" else contextlib.nullcontext():  # Traced at the first step.
        for _ in range(3):
            step()
    print(f"{name}: warmed in {time.perf_counter() - began:.0f} s", flush=True)
    return step, model


def measure(model_name, policy, optimizer, batch, rounds, steps, smoke=False):
    """{variant: [ms per step, per round]}."""
    made = {name: _variant(name, model_name, policy, optimizer, batch, smoke) for name in VARIANTS}
    times = {name: [] for name in VARIANTS}
    for r in range(rounds):
        for name in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
            step = made[name][0]
            began = time.perf_counter()
            for _ in range(steps):
                step()
            times[name].append((time.perf_counter() - began) / steps * 1000)
    return times


def tfmp_kernels():
    """The kernels of each tfmp step module dumped, in the order they were compiled (the variants' order)."""
    paths = sorted(glob.glob(os.path.join(_DUMP, "*_packed_update*after_optimizations.txt")))
    names = [name for name in VARIANTS if name != "keras"]
    found = []
    for i, path in enumerate(paths):
        with open(path) as f:
            k = step_hlo.kernels(f.read())
        found.append(
            {
                "variant": names[i] if len(paths) == len(names) else "-",
                "module": os.path.basename(path),
                "kernels": k["kernels"],
                "L2Loss": k["by_op_type"].get("L2Loss", 0),
            }
        )
    return found


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    step_hlo.step_arguments(parser)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20, help="steps per variant a round")
    parser.add_argument("--output_dir", default="grouped_norm")
    parser.add_argument("--smoke", action="store_true", help="a tiny stand-in, on a CPU in seconds")
    args = parser.parse_args(argv)
    batch = args.batch or (4 if args.smoke else 128 if args.model == "resnet50" else 64)
    times = measure(args.model, args.precision, args.optimizer, batch, args.rounds, args.steps, args.smoke)
    ms = {name: statistics.median(v) for name, v in times.items()}
    ratio = lambda a, b: statistics.median(x / y for x, y in zip(times[a], times[b], strict=True))  # noqa: E731
    result = {
        "device": precision.device_name(),
        "model": args.model + (" (smoke)" if args.smoke else ""),
        "precision": args.precision,
        "optimizer": args.optimizer,
        "batch": batch,
        "ms_per_step": ms,
        "rounds": times,
        **{key: ratio(*pair) for key, pair in RATIOS.items()},
        "tfmp_kernels": tfmp_kernels(),
    }
    os.makedirs(args.output_dir, exist_ok=True)
    with open(os.path.join(args.output_dir, "grouped_norm.json"), "w") as f:
        json.dump(result, f, indent=1)
    lines = [f"{result['model']}, {args.precision}, {args.optimizer}, batch {batch}, on {result['device']}", ""]
    lines += ["| step | ms a step | rounds |", "|---|---|---|"]
    lines += [f"| {name} | {ms[name]:.2f} | {', '.join(f'{t:.2f}' for t in times[name])} |" for name in VARIANTS]
    lines += [""] + [f"- {key}: {result[key]:.3f}" for key in RATIOS]
    lines += [
        f"- tfmp's kernels, {k['variant']}: {k['kernels']} (L2Loss {k['L2Loss']}): {k['module']}"
        for k in result["tfmp_kernels"]
    ]
    with open(os.path.join(args.output_dir, "grouped_norm.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    print("grouped_norm:", "on" if result["speed grouped / per gradient"] > 1 else "off")
    return result


if __name__ == "__main__":
    main()
