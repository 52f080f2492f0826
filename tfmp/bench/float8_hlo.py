"""Which matmuls of a float8 training step XLA runs as float8 GEMMs: compiles one step
(forward and backward) of Keras' float8 Dense and EinsumDense layers and of a float8
encoder block, reads the optimized HLO and counts its GEMMs by kind.

On an NVIDIA GPU a float8 GEMM is a cuBLASLt custom call `__cublas$lt$matmul$f8`; any
other `__cublas$...` call or Triton GEMM fusion multiplies 16-bit values. XLA's GEMM
rewriter makes the float8 call only where both operands of a dot are `convert(float8)`
times a broadcast scalar scale, with only layout ops (bitcast, copy, reshape, transpose...)
between that and the dot. A step has three matmuls per layer: the forward pass (inputs x
kernel, both E4M3) and two in the backward pass (the output gradient, E5M2, times the
kernel; the inputs times the output gradient).

It also times one large float8 Dense step against the same step in bfloat16: whether
float8 GEMMs, where XLA makes them, are faster by themselves, apart from a model's other
work (the quantize and amax kernels around them included).

    python -m tfmp.bench.float8_hlo [--small]

prints one JSON line: {"device", "xla_flags", "cases": [{"case", "gemms": {kind: count},
"lines"}], "timing": {...}}. `tfmp.bench.gpu_report` runs it under several XLA_FLAGS, the
first with "--xla_dump_to=DIR --xla_dump_hlo_pass_re=.*", which keeps the HLO after every
XLA pass, to see which pass undoes the pattern.
"""

import json
import os
import re
import statistics
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfmp import precision  # noqa: E402

FLOAT8_GEMM = "__cublas$lt$matmul$f8"
# XLA_FLAGS `run_variants` runs the probe under; the first also keeps XLA's HLO after every pass.
VARIANTS = {
    "XLA's defaults": "",
    "Triton GEMMs off": "--xla_gpu_enable_triton_gemm=false",
    "cuBLASLt on": "--xla_gpu_enable_cublaslt=true",
}
DUMP_FLAGS = "--xla_dump_hlo_pass_re=.* --xla_dump_hlo_module_re=.*float8_probe.*"  # Every pass, the probe's steps.


def gemm_kinds(hlo):
    """{kind: count} of the GEMMs in an optimized HLO text: "float8" (cuBLASLt float8),
    "cublas" (any other cuBLAS or cuBLASLt call), "triton_float8" and "triton" (Triton GEMM
    fusions with and without float8 operands) and "dot" (a dot as a CPU runs it: outside any
    fusion, or inside a fusion XLA's CPU backend hands to YNNPACK or XNNPACK, as TensorFlow
    2.22's does)."""
    kinds = {"float8": 0, "cublas": 0, "triton_float8": 0, "triton": 0, "dot": 0}
    computation, with_dot, library_calls = "", set(), []
    for line in hlo.splitlines():
        if line and not line.startswith(" ") and line.rstrip().endswith("{"):
            computation = line.split("(")[0].split()[-1]  # A computation's header: its name, then its parameters.
        if FLOAT8_GEMM in line:
            kinds["float8"] += 1
        elif 'custom_call_target="__cublas$' in line:
            kinds["cublas"] += 1
        elif "__triton_gemm" in line and "fusion(" in line:
            kinds["triton_float8" if "f8e" in line else "triton"] += 1  # Triton can take float8 operands.
        elif re.search(r"\bdot\(", line):
            if re.search("fus|triton|gemm", computation):
                with_dot.add(computation)
            else:
                kinds["dot"] += 1
        library = re.match(r"\s*(?:ROOT )?%[yx]nn_fusion[\w.]* = .*\bfusion\(.*\bcalls=(%[\w.\-]+)", line)
        if library:
            library_calls.append(library.group(1))
    kinds["dot"] += sum(called in with_dot for called in library_calls)
    return kinds


def _gemm_lines(hlo):
    return [line.strip()[:240] for line in hlo.splitlines() if "__cublas$" in line or re.search(r"\bdot\(", line)]


def _step(layer):
    """One compiled training step of `layer`: its gradients for a mean-square loss."""

    @tf.function(jit_compile=True)
    def float8_probe_step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=True)
            loss = tf.reduce_mean(tf.square(tf.cast(y, tf.float32)))
        return tape.gradient(loss, [x, *layer.trainable_variables])

    return float8_probe_step


def _step_hlo(layer, x):
    """The optimized HLO of one compiled training step of `layer` on `x`."""
    return _step(layer).experimental_get_compiler_ir(x)(stage="optimized_hlo")


def _dense(shape, units, float8=True):
    layer = keras.layers.Dense(units)
    layer.build(shape)
    if float8:
        layer.quantize("float8")
    return layer


def _einsum(shape, units):
    layer = keras.layers.EinsumDense("btd,de->bte", output_shape=(None, units))
    layer.build(shape)
    layer.quantize("float8")
    return layer


def cases(size=1024, tokens=2048, sequence=128):
    """{case: (layer, input)}: the shapes float8 training meets. Sizes are multiples of 16
    (cuBLASLt's float8 GEMMs need them) and large enough that XLA does not inline them."""
    batch = tokens // sequence
    return {
        "Dense, 2-D input (tokens x width)": (_dense((None, size), size), tf.ones((tokens, size))),
        "Dense, 3-D input (batch x sequence x width)": (
            _dense((None, sequence, size), size),
            tf.ones((batch, sequence, size)),
        ),
        "EinsumDense btd,de->bte": (_einsum((None, sequence, size), size), tf.ones((batch, sequence, size))),
    }


def probe(size=1024, tokens=2048, sequence=128):
    """[{"case", "gemms", "lines"}] for each of `cases`, under the float8 policy's bfloat16 base."""
    keras.config.set_dtype_policy(precision.FLOAT8_BASE)
    found = []
    for case, (layer, x) in cases(size, tokens, sequence).items():
        hlo = _step_hlo(layer, x)
        found.append({"case": case, "gemms": gemm_kinds(hlo), "lines": _gemm_lines(hlo)[:6]})
    return found


def _milliseconds(step, x, calls):
    """Median milliseconds of `step(x)` over `calls` calls, after two to compile and settle."""
    for _ in range(2):
        step(x)[0].numpy()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        step(x)[0].numpy()  # Waits for the device.
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def timing(tokens=8192, width=4096, units=16384, calls=20):
    """One Dense step of encoder_4096's feed-forward shape in bfloat16 and in float8:
    {"shape", "bfloat16_ms", "float8_ms", "speedup", "float8_gemms"}."""
    keras.config.set_dtype_policy(precision.FLOAT8_BASE)
    x = tf.random.normal((tokens, width))
    found = {"shape": f"{tokens} x {width} -> {units}"}
    for name, float8 in (("bfloat16", False), ("float8", True)):
        layer = _dense((None, width), units, float8)
        found[f"{name}_ms"] = _milliseconds(_step(layer), x, calls)
        if float8:
            found["float8_gemms"] = gemm_kinds(_step_hlo(layer, x))
    found["speedup"] = found["bfloat16_ms"] / found["float8_ms"]
    return found


def run_variants(dump_dir, *, small, left, log, spent_text):
    """Runs this module in a subprocess under each of `VARIANTS` (the first keeping XLA's
    HLO after every pass in `dump_dir`): a list of its results, or of {"error"}, each with
    its "variant". `left()`: seconds left of the caller's budget (negative: `spent_text`);
    `log(text, doing=...)`: the caller's log."""
    found = []
    for index, (variant, extra) in enumerate(VARIANTS.items()):
        if left() < 0:
            found.append({"variant": variant, "error": spent_text})
            log(f"float8 probe, {variant}: {spent_text}")
            continue
        flags_now = [os.environ.get("XLA_FLAGS", ""), extra]
        if index == 0:
            flags_now.append(f"--xla_dump_to={dump_dir} {DUMP_FLAGS}")
        env = {**os.environ, "XLA_FLAGS": " ".join(f for f in flags_now if f)}
        log(f"float8 probe, {variant}: GEMM kinds of a float8 step, a large float8 Dense step timed", doing=variant)
        command = [sys.executable, "-m", "tfmp.bench.float8_hlo", *(["--small"] if small else [])]
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=min(240, max(60, left())))
        except subprocess.TimeoutExpired as e:
            found.append({"variant": variant, "error": f"timed out after {e.timeout:.0f} s"})
            log(f"float8 probe, {variant}: {found[-1]['error']}")
            continue
        if done.returncode != 0:
            found.append({"variant": variant, "error": f"exit {done.returncode}: {done.stderr.strip()[-400:]}"})
            log(f"float8 probe, {variant}: failed, {found[-1]['error']}")
            continue
        found.append({"variant": variant, **json.loads(done.stdout.strip().splitlines()[-1])})
        _log_result(found[-1], log)
    return found


def _log_result(result, log):
    for case in result["cases"]:
        log(f"float8 probe, {result['variant']}, {case['case']}: GEMMs {case['gemms']}")
    t = result["timing"]
    log(
        f"float8 probe, {result['variant']}, Dense {t['shape']} step: bfloat16 {t['bfloat16_ms']:.2f} ms, "
        f"float8 {t['float8_ms']:.2f} ms ({t['speedup']:.2f}x), float8 GEMMs {t['float8_gemms']}"
    )


def main(argv):
    small = "--small" in argv  # Smoke runs: shapes a CPU compiles in a second.
    sizes = {"size": 64, "tokens": 128, "sequence": 16} if small else {}
    timed = {"tokens": 128, "width": 64, "units": 128, "calls": 3} if small else {}
    result = {"device": precision.device_name(), "xla_flags": os.environ.get("XLA_FLAGS", "")}
    result.update(cases=probe(**sizes), timing=timing(**timed))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
