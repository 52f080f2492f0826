"""What `python -m tfmp.bench.gpu_report` runs once its flags are read (`gpu_flags`): tfmp's GPU
claims, in parts of at most 9 minutes each.

Parts (`gpu_flags.PARTS`): 1-2 ResNet-50 (batch 128) with SGD with momentum, then Adam; 3-4
BERT-base (batch 64) likewise, pure bfloat16 among the precisions; 5 which GEMMs of a
float8 step XLA makes float8 and how fast a large float8 Dense step is (`float8_hlo`,
under a few XLA_FLAGS, XLA's HLO after every pass kept); 6 float8 on BERT-base against
mixed_bfloat16 and Keras' own `quantize("float8")`; 7 the same on encoder_4096; 8 PyTorch
AMP on ResNet-50 and BERT-base (where this Python has torch). Part 1 also times the
GPU's matmul and conv peaks per dtype, the ratios the mixed policies' gains are judged by.

In each part every precision is trained by tfmp.fit and by Keras fit, both with XLA: each
fit warms up alone (time to its first step, and its own peak memory: what it holds
beyond what was held before it was built; the loops take turns to warm first, since a
precision's second compile reuses XLA's autotuning of its first), then all of them train
in alternating rounds, a few steps of each in turn (`lockstep`: tfmp.fit reads behind as
outside the bench), so that ratios compare neighbouring steps. A part stops warming new
fits before its budget runs out and says which it left; every line goes to the console
and report.log, at least one a minute. After each part report.md (`gpu_tables`) is
written again from every part*.json in the directory.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_FORCE_GPU_ALLOW_GROWTH", "true")  # Own peaks, and room for the PyTorch part.

import dataclasses  # noqa: E402
import functools  # noqa: E402
import gc  # noqa: E402
import glob  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import flags  # noqa: E402

from tfmp import bf16, callbacks, files, gradients, inputs, precision, timing  # noqa: E402
from tfmp.bench import float8_hlo, gpu_flags, gpu_tables, lockstep, measure, pytorch, realsize, runs  # noqa: E402

LOOPS = gpu_tables.LOOP_NAMES
BUDGET_SPENT = "not run: the part's budget was spent"
SMOKE_PEAK_SIZES = {"matmul": 256, "conv": {"batch": 2, "size": 16, "channels": 8}}

FLAGS = flags.FLAGS


class Log:
    """Prints a line and appends it to report.log; a watchdog thread prints what is still
    running when nothing was said for `quiet` seconds (an XLA compile can take minutes)."""

    def __init__(self, path, quiet=50.0):
        self.path, self.quiet, self.doing, self.last = path, quiet, "starting", time.monotonic()
        self._closed = threading.Event()
        threading.Thread(target=self._watch, daemon=True).start()

    def close(self):
        """Stops the watchdog."""
        self._closed.set()

    def __call__(self, line, doing=None):
        self.doing = doing or self.doing
        self.last = time.monotonic()
        stamp = time.strftime("%H:%M:%S")
        print(f"gpu_report {stamp} {line}", flush=True)
        with open(self.path, "a") as f:
            f.write(f"{stamp} {line}\n")

    def _watch(self):
        while not self._closed.wait(5):
            if time.monotonic() - self.last >= self.quiet:
                self(f"... still {self.doing}")


class FirstStepTimer(callbacks.Throughput):
    """A `callbacks.Throughput` that also records when the fit's first step ends."""

    def __init__(self, global_batch):
        super().__init__(global_batch, warmup_steps=1)
        self.first_end = None

    def on_train_batch_end(self, batch, logs=None):
        self.first_end = self.first_end or time.perf_counter()


def _on_gpu():
    return bool(tf.config.list_physical_devices("GPU"))


def _in_use():
    """Bytes the GPU allocator holds now (0 on a CPU: no own peak to measure there)."""
    return tf.config.experimental.get_memory_info("GPU:0")["current"] if _on_gpu() else 0


def _error_text(error):
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:300] if lines else ''}"


def _model_and_data(name, batch):
    if FLAGS.smoke:
        build, dataset = realsize.SMOKE[name], realsize.synthetic(name, batch, **realsize.SMOKE_INPUTS)
    else:
        build, dataset = realsize.MODELS[name], realsize.synthetic(name, batch)
    if FLAGS.input_on_device == "both":  # TensorFlow copies a host batch to a GPU after the steps queued before it.
        dataset = dataset.apply(tf.data.experimental.prefetch_to_device(_device(), buffer_size=2))
    return build, dataset


def _device():
    return "/gpu:0" if _on_gpu() else "/cpu:0"


def _cell(part, policy, trainer):
    return {"model": part.model, "optimizer": part.optimizer, "precision": policy, "loop": trainer}


def _warm(part, policy, trainer, batch, log, first):
    """Builds and warms up one fit alone: (runner or None where it failed, its cell).
    `first`: the first of its precision's fits in this process, whose compile finds none
    of XLA's autotuning for its GEMMs and convolutions done (the second's does)."""
    cell = {**_cell(part, policy, trainer), "warmed_first": first}
    what = f"{part.model} {policy} {LOOPS[trainer]}"
    log(f"{what}: building, then {FLAGS.warmup_steps} steps alone", doing=f"warming up {what}")
    base = _in_use()
    start = time.perf_counter()
    try:
        build, dataset = _model_and_data(part.model, batch)
        runner = runs.FitRunner(trainer, policy, build, dataset, batch, True, runs.OPTIMIZERS[part.optimizer])
        timer = FirstStepTimer(batch)
        begun = time.perf_counter()
        runner.run(FLAGS.warmup_steps - 1, timer=timer)
    except Exception as e:  # noqa: BLE001 - an out-of-memory or a compile failure is this cell's result.
        cell["error"] = _error_text(e)
        log(f"{what}: FAILED: {cell['error']}")
        return None, cell
    runner.warm_step = statistics.median(timer.step_times[-5:])
    runner.step_times = []
    cell.update(
        build_seconds=begun - start,
        first_step_seconds=timer.first_end - begun,  # Trace, compile and one step.
        warm_step_ms=1e3 * runner.warm_step,
        peak_memory_mb=(measure.memory_bytes() - base) / 2**20 if _on_gpu() else None,
        state_mb=bf16.state_bytes(runner.model, runner.model.optimizer) / 2**20,
        jit_compile=runner.jit_used,
    )
    peak = "" if cell["peak_memory_mb"] is None else f", peak memory {cell['peak_memory_mb'] / 1024:.2f} GiB"
    log(f"{what}: first step after {cell['first_step_seconds']:.1f} s, then {cell['warm_step_ms']:.1f} ms a step{peak}")
    return runner, cell


def _rounds(held, began, log):
    """Alternating rounds over the warm fits `held`, as many steps a round (10 to
    --max_steps) as the part's budget leaves room for: 10 even past it (7 rounds of 10 steps
    of six ResNet-50 fits take about 25 s on an H100; of 3 steps, the rounds spread wide)."""
    per_step = max(sum(r.warm_step for r in held.values()), 1e-3)
    left = FLAGS.budget_seconds - (time.perf_counter() - began)
    steps = int(min(FLAGS.max_steps, max(10, 0.8 * left / FLAGS.rounds / per_step)))
    order = list(held.values())
    for index in range(FLAGS.rounds):
        log(f"round {index + 1}/{FLAGS.rounds}: {steps} steps of each of {len(order)} fits, in turn", doing="timing")
        turn = order if index % 2 == 0 else order[::-1]
        for runner, rate in zip(turn, lockstep.run(turn, steps, FLAGS.steps_per_turn), strict=True):
            runner.rates.append(rate)


def _compare(cells, held):
    """Figures from the rounds; ratios from rounds that ran back to back: tfmp / Keras fit,
    and each precision against float32 (float8: against mixed_bfloat16) in the same loop."""
    for (policy, trainer), runner in held.items():
        cell = cells[(policy, trainer)]
        cell.update(examples_per_second=statistics.median(runner.rates), rounds=runner.rates, final_loss=runner.loss)
        if trainer == "tfmp" and (policy, "keras") in held:
            cell["vs_keras"], cell["vs_keras_error"] = timing.median_ratio(runner.rates, held[(policy, "keras")].rates)
        base = held.get(("mixed_bfloat16" if policy == "float8" else "float32", trainer))
        if base is not None and base is not runner:
            cell["vs_base"], cell["vs_base_error"] = timing.median_ratio(runner.rates, base.rates)


def _warm_order(part, policy):
    """The loops in the order they warm up for `policy`: tfmp.fit first for the part's 1st,
    3rd, ... precision, Keras fit first for its 2nd, 4th, ... XLA keeps its autotuning of
    GEMMs and convolutions for the process, so the second fit of a precision compiles
    faster than from cold: alternating gives each loop cold first steps to compare."""
    return runs.TRAINERS if part.precisions.index(policy) % 2 == 0 else runs.TRAINERS[::-1]


def _timed_cells(part, batch, log, began):
    """Every (precision, loop) of `part`: warm-ups, rounds and the cells' figures."""
    groups = [part.precisions] if part.together else [(p,) for p in part.precisions]
    cells = {}
    for group in groups:
        held = {}
        for policy in group:
            for turn, trainer in enumerate(_warm_order(part, policy)):
                if _spent(began):
                    cells[(policy, trainer)] = {**_cell(part, policy, trainer), "error": BUDGET_SPENT}
                    log(f"{part.model} {policy} {LOOPS[trainer]}: {BUDGET_SPENT}")
                    continue
                runner, cells[(policy, trainer)] = _warm(part, policy, trainer, batch, log, first=turn == 0)
                if runner is not None:
                    held[(policy, trainer)] = runner
        if held:
            _rounds(held, began, log)
            _compare(cells, held)
        held.clear()  # Frees this group's models before the next is built.
        keras.backend.clear_session()
        gc.collect()
    return list(cells.values())


def _remaining(began):
    """Seconds of the part's budget left (negative once spent)."""
    return FLAGS.budget_seconds - (time.perf_counter() - began)


def _left(began):
    """`_remaining`, at least 60: a subprocess's own time limit."""
    return max(60.0, _remaining(began))


def _spent(began):
    return _remaining(began) < 0


def _pytorch_rows(part, log, began):
    """PyTorch AMP's rows for the part's models, both optimizers, while the budget lasts."""
    rows, left_out = [], []
    for name in part.pytorch:
        python = pytorch.find_python(FLAGS.pytorch, name)
        if python is None:
            left_out.append(f"{name}: no {' and '.join(pytorch.NEEDS[name])} in this Python (--pytorch=PATH)")
            log(f"pytorch {name}: left out, {left_out[-1]}")
            continue
        batch = 4 if FLAGS.smoke else realsize.BATCH_SIZES[name]
        for optimizer in pytorch.OPTIMIZERS:
            if _spent(began):
                left_out.append(f"{name} {optimizer}: {BUDGET_SPENT}")
                log(f"pytorch {left_out[-1]}")
                continue
            log(f"pytorch {name} {optimizer}: a subprocess in {python}", doing=f"timing pytorch {name} {optimizer}")
            found, facts = pytorch.rates(
                python, gpu_flags.MIXED, batch, FLAGS.rounds, 4.0, FLAGS.max_steps, timeout=_left(began),
                model=name, optimizer=optimizer, smoke=FLAGS.smoke, say=log,
            )  # fmt: skip
            if found is None:
                left_out.append(f"{name} {optimizer}: {facts}")
                log(f"pytorch {name} {optimizer}: left out, {facts}")
                continue
            for policy, row in found.items():
                rows.append({"model": name, "optimizer": optimizer, "precision": policy, "loop": "pytorch", **row})
    return rows, left_out


def run_part(number, log):
    """Runs part `number`; its figures go to part<number>.json."""
    part = gpu_flags.PARTS[number]
    began = time.perf_counter()
    result = {"part": number, "smoke": FLAGS.smoke, "device": precision.device_name(), **gpu_tables.versions()}
    result.update(grouped_norm=FLAGS.grouped_norm, input_on_device=FLAGS.input_on_device)
    result.update(steps_per_turn=FLAGS.steps_per_turn or lockstep.steps_per_turn())
    log(f"part {number} on {result['device']}: {_describe(part)}", doing=f"part {number}")
    if part.peaks:
        sizes = SMOKE_PEAK_SIZES if FLAGS.smoke else measure.peak_sizes()
        log("timing the matmul and conv peaks per dtype", doing="timing peaks")
        result["peaks"] = {
            "matmul": measure.matmul_peaks(gpu_flags.MIXED, sizes["matmul"], budget_seconds=20.0),
            "conv": measure.conv_peaks(gpu_flags.MIXED, **sizes["conv"], budget_seconds=20.0),
        }
        for op, peaks in result["peaks"].items():
            log(f"{op} peak: " + ", ".join(f"{p} {v['flops'] / 1e12:.1f} TFLOP/s" for p, v in peaks.items()))
    if part.pytorch:
        result["cells"], result["left_out"] = _pytorch_rows(part, log, began)
    elif part.float8_hlo:
        result["float8_hlo"] = float8_hlo.run_variants(
            os.path.join(FLAGS.output_dir, "float8_hlo"),
            small=FLAGS.smoke,
            left=functools.partial(_remaining, began),
            log=log,
            spent_text=BUDGET_SPENT,
        )
    else:
        batch = 4 if FLAGS.smoke else realsize.BATCH_SIZES[part.model]
        chosen = tuple(p for p in part.precisions if not FLAGS.precisions or p in FLAGS.precisions)
        result["not_chosen"] = [p for p in part.precisions if p not in chosen]
        result["cells"] = _timed_cells(dataclasses.replace(part, precisions=chosen), batch, log, began)
    result["seconds"] = time.perf_counter() - began
    files.write_json(os.path.join(FLAGS.output_dir, f"part{number}.json"), result)
    log(f"part {number} done in {result['seconds']:.0f} s")
    return result


def _describe(part):
    if part.pytorch:
        return f"PyTorch AMP on {', '.join(part.pytorch)}"
    if part.float8_hlo:
        return f"float8 GEMMs and a float8 Dense step under {', '.join(float8_hlo.VARIANTS)}"
    return f"{part.model}, {part.optimizer}, {', '.join(part.precisions)}, tfmp.fit and Keras fit, XLA on"


def main(argv):
    del argv  # The flags were read and checked (gpu_flags) before TensorFlow loaded.
    if FLAGS.smoke:
        FLAGS.warmup_steps, FLAGS.rounds, FLAGS.max_steps = min(FLAGS.warmup_steps, 3), min(FLAGS.rounds, 2), 3
    gradients.GROUPED = {"auto": None, "on": True, "off": False}[FLAGS.grouped_norm]
    inputs.PREFETCH_TO = _device() if FLAGS.input_on_device == "tfmp" else None
    os.makedirs(FLAGS.output_dir, exist_ok=True)
    log = Log(os.path.join(FLAGS.output_dir, "report.log"))
    for number in gpu_flags.wanted():
        run_part(number, log)
        parts = []
        for path in sorted(glob.glob(os.path.join(FLAGS.output_dir, "part*.json"))):
            with open(path) as f:
                parts.append(json.load(f))
        with open(os.path.join(FLAGS.output_dir, "report.md"), "w") as f:
            f.write(gpu_tables.markdown(parts, gpu_flags.PARTS) + "\n")
        log(f"wrote {FLAGS.output_dir}/report.md ({len(parts)} of {len(gpu_flags.PARTS)} parts)")
    log.close()
    # Everything is written. Tearing down a process that compiled dozens of XLA steps takes
    # half a minute more (measured after --part=all --smoke), time a GPU session lacks.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
