"""What XLA makes of one training step of tfmp.fit and of Keras fit: the kernels of each
loop's compiled step, counted in XLA's optimized HLO, and which TensorFlow ops they come
from. On a GPU each kernel is a launch, and a step's launches are where two loops that
compute the same thing can still differ in time.

    python -m tfmp.bench.step_hlo --model=resnet50 --precision=float32 --optimizer=sgd \\
        --output_dir=step_hlo [--smoke]

compiles one step of each loop (both with `jit_compile=True`, synthetic data, the GPU
report's models and optimizers) in a subprocess that dumps XLA's optimized HLO of the
step modules (into a temporary folder, or `--dump_dir`), writes OUTPUT_DIR/step_hlo.json
and step_hlo.md, and prints the table and one JSON line: per loop, its kernels (the
entry computation's instructions other than parameters, constants, tuples and bitcasts),
by opcode and by the TensorFlow op type XLA's metadata names (`L2Loss`, `Conv2DBackpropFilter`, ...).
`--smoke` runs a tiny stand-in of the model, on a CPU in seconds (a test does).
"""

import argparse
import collections
import glob
import json
import os
import re
import subprocess
import sys
import tempfile

import keras

from tfmp.bench import realsize, runs

# Keras' compiled step, and tfmp's (one device: one XLA computation each).
STEP_MODULES = {"keras": "one_step_on_data", "tfmp": "_packed_update"}
NOT_KERNELS = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id"}
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*.*?\s([a-z][a-z0-9\-]*)\(")
_OP_TYPE = re.compile(r'op_type="([^"]+)"')


def kernels(hlo_text):
    """{"kernels": count, "by_opcode": {...}, "by_op_type": {...}} of an optimized HLO
    module's entry computation (its fusions, custom calls and any unfused op: on a GPU,
    each a kernel launch; an op type "-" where XLA's metadata names none)."""
    entry = re.search(r"^ENTRY [^\n]*\{\n(.*?)^\}", hlo_text, re.S | re.M)
    if entry is None:
        raise ValueError("no ENTRY computation in this HLO text")
    by_opcode, by_op_type = collections.Counter(), collections.Counter()
    for line in entry.group(1).splitlines():
        match = _INSTRUCTION.match(line)
        if match is None or match.group(1) in NOT_KERNELS:
            continue
        by_opcode[match.group(1)] += 1
        op_type = _OP_TYPE.search(line)
        by_op_type[op_type.group(1) if op_type else "-"] += 1
    return {"kernels": sum(by_opcode.values()), "by_opcode": dict(by_opcode), "by_op_type": dict(by_op_type)}


def read_dump(dump_dir):
    """{loop: kernels(...)} of the largest optimized module of each loop's step in `dump_dir`."""
    found = {}
    for loop, name in STEP_MODULES.items():
        # (Not the "...after_optimizations-buffer-assignment.txt" reports: the name must end so.)
        paths = glob.glob(os.path.join(dump_dir, f"*{name}*after_optimizations.txt"))
        if paths:
            largest = max(paths, key=os.path.getsize)
            with open(largest) as f:
                found[loop] = {"module": os.path.basename(largest), **kernels(f.read())}
    return found


def differences(found, most=12):
    """[(op type, keras count, tfmp count)], the largest differences first."""
    types = set(found["keras"]["by_op_type"]) | set(found["tfmp"]["by_op_type"])
    rows = [(t, found["keras"]["by_op_type"].get(t, 0), found["tfmp"]["by_op_type"].get(t, 0)) for t in types]
    rows = [r for r in rows if r[1] != r[2]]
    return sorted(rows, key=lambda r: (-abs(r[2] - r[1]), r[0]))[:most]


def markdown(found):
    """The two loops' kernel counts, then the op types whose counts differ."""
    lines = ["| loop | kernels | fusions | custom calls | module |", "|---|---|---|---|---|"]
    for loop in STEP_MODULES:
        if loop in found:
            k = found[loop]
            opcodes = k["by_opcode"]
            lines.append(
                f"| {loop} | {k['kernels']} | {opcodes.get('fusion', 0)} | {opcodes.get('custom-call', 0)} "
                f"| {k['module']} |"
            )
    if len(found) == len(STEP_MODULES):
        lines += ["", "| TensorFlow op type | Keras fit's kernels | tfmp.fit's kernels |", "|---|---|---|"]
        lines += [f"| {t} | {a} | {b} |" for t, a, b in differences(found)]
    return "\n".join(lines)


def compile_steps(model_name, precision_name, optimizer, batch, smoke):
    """Trains each loop 2 steps with XLA: in the subprocess `run` starts, under its XLA_FLAGS."""
    models = realsize.SMOKE if smoke else realsize.MODELS
    sizes = realsize.SMOKE_INPUTS if smoke else {}
    for trainer in STEP_MODULES:
        keras.backend.clear_session()
        dataset = realsize.synthetic(model_name, batch, **sizes)
        runner = runs.FitRunner(
            trainer, precision_name, models[model_name], dataset, batch, True, runs.OPTIMIZERS[optimizer]
        )
        runner.run(1)


def run(output_dir, model_name, precision_name, optimizer, batch, smoke=False, dump=None, timeout=480):
    """Compiles both loops' step in a subprocess dumping XLA's optimized HLO to `dump` (a
    new temporary folder by default: with a GPU's PTX it is large); returns {"device",
    "model", ..., "loops": read_dump(...)} and writes it, with the markdown, to
    OUTPUT_DIR/step_hlo.json and step_hlo.md."""
    os.makedirs(output_dir, exist_ok=True)
    dump = dump or tempfile.mkdtemp(prefix="tfmp-step-hlo-")
    modules = "|".join(STEP_MODULES.values())
    flags_now = f"--xla_dump_to={dump} --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*({modules}).*"
    env = {**os.environ, "XLA_FLAGS": " ".join(f for f in (os.environ.get("XLA_FLAGS", ""), flags_now) if f)}
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    code = (
        "import sys; from tfmp.bench import step_hlo; from tfmp import precision; "
        f"step_hlo.compile_steps({model_name!r}, {precision_name!r}, {optimizer!r}, {batch}, {smoke}); "
        "print(precision.device_name())"
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"the step's compile failed (exit {done.returncode}): {done.stderr.strip()[-600:]}")
    result = {
        "device": done.stdout.strip().splitlines()[-1],
        "model": model_name + (" (smoke)" if smoke else ""),
        "precision": precision_name,
        "optimizer": optimizer,
        "batch": batch,
        "loops": read_dump(dump),
    }
    with open(os.path.join(output_dir, "step_hlo.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(output_dir, "step_hlo.md"), "w") as f:
        f.write(f"{result['model']}, {precision_name}, {optimizer}, batch {batch}, on {result['device']}\n\n")
        f.write(markdown(result["loops"]) + "\n")
    return result


def step_arguments(parser):
    """The step's arguments, shared with `tfmp.bench.grouped_norm`: --model, --precision, --optimizer, --batch."""
    parser.add_argument("--model", default="resnet50", choices=("resnet50", "bert_base", "encoder_4096"))
    parser.add_argument("--precision", default="float32", choices=("float32", "mixed_float16", "mixed_bfloat16"))
    parser.add_argument("--optimizer", default="sgd", choices=("sgd", "adam"))
    parser.add_argument("--batch", type=int, default=None, help="global batch (default: 128 ResNet-50, else 64)")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    step_arguments(parser)
    parser.add_argument("--output_dir", default="step_hlo")
    parser.add_argument("--dump_dir", default=None, help="where XLA's dump goes (default: a temporary folder)")
    parser.add_argument("--smoke", action="store_true", help="a tiny stand-in of the model (a CPU, seconds)")
    args = parser.parse_args(argv)
    batch = args.batch or (8 if args.smoke else 128 if args.model == "resnet50" else 64)
    result = run(args.output_dir, args.model, args.precision, args.optimizer, batch, args.smoke, args.dump_dir)
    print(markdown(result["loops"]))
    print(json.dumps({k: v for k, v in result.items() if k != "loops"}))


if __name__ == "__main__":
    main()
