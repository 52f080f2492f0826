"""What `python -m tfmp.bench.gpu_report` writes: report.md from the parts' figures, with the goals
the figures are judged by, and the versions that name the setup."""

import platform
import subprocess
import time

import keras
import tensorflow as tf

from tfmp.bench import gpu_flags

VERSUS_KERAS_GOAL = 1.05  # tfmp.fit / Keras fit, every cell.
SHARE_OF_PEAK_GOAL = 0.9  # A mixed policy's speedup over float32 / the peaks' ratio for its kind of model.
FLOAT8_GOAL = 1.3  # float8 / mixed_bfloat16 on encoder_4096, tfmp.fit.
CONV_MODELS = ("resnet50",)
LOOP_NAMES = {"tfmp": "tfmp.fit", "keras": "Keras fit", "pytorch": "PyTorch AMP"}
MIXED_POLICIES = ("mixed_float16", "mixed_bfloat16")  # Judged against the peaks' ratio.


def versions():
    """{"driver", "tensorflow", "keras", "cuda", "cudnn", "python"}: what names the setup."""
    build = tf.sysconfig.get_build_info()
    try:
        driver = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        driver = ""
    return {
        "driver": driver.splitlines()[0] if driver else None,
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "cuda": build.get("cuda_version"),
        "cudnn": build.get("cudnn_version"),
        "python": platform.python_version(),
        "created": time.strftime("%Y-%m-%d %H:%M"),
    }


def _number(value, spec=",.0f", none="-"):
    return none if value is None else format(value, spec)


def _first_step(cell):
    """Seconds to the end of the first step; * where the fit warmed first for its
    precision (a compile from cold: the other reused XLA's autotuning)."""
    return _number(cell.get("first_step_seconds"), ".0f") + ("*" if cell.get("warmed_first") else "")


def _ratio(cell, key):
    value, error = cell.get(key), cell.get(f"{key}_error")
    if value is None:
        return "-"
    return f"{value:.2f}" if not error else f"{value:.2f} ±{value * error:.2f}"


def _cells(parts, float8):
    """The cells of the float8 parts (`float8`) or of the others."""
    return [c for p in parts if _is_float8(p) == float8 for c in p.get("cells", [])]


def _is_float8(part):
    return any(c["precision"] == "float8" for c in part.get("cells", []))


def _find(cells, model, optimizer, policy, loop):
    key = (model, optimizer, policy, loop)
    return next((c for c in cells if (c["model"], c["optimizer"], c["precision"], c["loop"]) == key), {})


def _gib(cell):
    return _number(cell.get("peak_memory_mb") and cell["peak_memory_mb"] / 1024, ".1f")


def _speed_table(cells):
    """Parts 1-4: each precision, tfmp.fit against Keras fit (and PyTorch AMP)."""
    keys = sorted(
        {(c["model"], c["optimizer"], c["precision"]) for c in cells if c["loop"] != "pytorch"},
        key=lambda k: (k[0], k[1], gpu_flags.ORDER.index(k[2])),
    )
    lines = [
        "| model | optimizer | precision | tfmp.fit ex/s | Keras fit ex/s | tfmp/Keras | vs float32 | "
        "peak GiB tfmp / Keras | first step s tfmp / Keras | PyTorch AMP ex/s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for model, optimizer, policy in keys:
        ours, theirs = _find(cells, model, optimizer, policy, "tfmp"), _find(cells, model, optimizer, policy, "keras")
        torch = _find(cells, model, optimizer, policy, "pytorch")
        lines.append(
            f"| {model} | {optimizer} | {policy} | {_number(ours.get('examples_per_second'))} | "
            f"{_number(theirs.get('examples_per_second'))} | {_ratio(ours, 'vs_keras')} | {_ratio(ours, 'vs_base')} | "
            f"{_gib(ours)} / {_gib(theirs)} | {_first_step(ours)} / {_first_step(theirs)} | "
            f"{_number(torch.get('examples_per_second'))} |"
        )
    return lines


def _versus_bfloat16(cells, cell):
    """float8 / mixed_bfloat16 in the same loop: from alternating rounds where they ran
    together, else the ratio of the two medians, marked as turns apart."""
    if cell.get("vs_base") or cell["precision"] != "float8":
        return _ratio(cell, "vs_base")
    base = _find(cells, cell["model"], cell["optimizer"], "mixed_bfloat16", cell["loop"])
    if not (cell.get("examples_per_second") and base.get("examples_per_second")):
        return "-"
    return f"{cell['examples_per_second'] / base['examples_per_second']:.2f} (turns apart)"


def _float8_table(cells):
    """Parts 5-6: float8 (tfmp's layers; Keras' `quantize("float8")` in Keras fit) against
    mixed_bfloat16."""
    lines = [
        "| model | precision | loop | ex/s | vs mixed_bfloat16 | tfmp/Keras | peak GiB | first step s | final loss |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in sorted(cells, key=lambda c: (c["model"], gpu_flags.ORDER.index(c["precision"]), c["loop"])):
        lines.append(
            f"| {c['model']} | {c['precision']} | {LOOP_NAMES[c['loop']]} | {_number(c.get('examples_per_second'))} | "
            f"{_versus_bfloat16(cells, c)} | {_ratio(c, 'vs_keras')} | {_gib(c)} | "
            f"{_first_step(c)} | {_number(c.get('final_loss'), '.3f')} |"
        )
    return lines


def _goals(parts, cells, float8_cells):
    """One line per goal: met or not, with the cells that miss it."""
    timed = [c for c in cells + float8_cells if c["loop"] == "tfmp" and c.get("vs_keras")]
    slow = [f"{c['model']} {c['optimizer']} {c['precision']} {c['vs_keras']:.2f}" for c in timed]
    slow = [s for s, c in zip(slow, timed, strict=True) if c["vs_keras"] < VERSUS_KERAS_GOAL]
    lines = [
        f"- tfmp.fit >= {VERSUS_KERAS_GOAL}x Keras fit in every cell: {len(timed) - len(slow)} of {len(timed)} cells"
        + (f"; below: {', '.join(slow)}" if slow else "")
    ]
    peaks = next((p["peaks"] for p in parts if p.get("peaks")), None)
    if peaks:
        for c in cells:
            if c["loop"] != "tfmp" or c["precision"] not in MIXED_POLICIES or not c.get("vs_base"):
                continue
            op = "conv" if c["model"] in CONV_MODELS else "matmul"
            possible = peaks[op][c["precision"]]["flops"] / peaks[op]["float32"]["flops"]
            head = f"- {c['model']} {c['optimizer']} {c['precision']}: {c['vs_base']:.2f}x float32, the {op} peaks' "
            if possible < 1.1:
                lines.append(head + f"ratio {possible:.2f}x: this device has no gain to share")
                continue
            verdict = "met" if c["vs_base"] >= SHARE_OF_PEAK_GOAL * possible else "missed"
            lines.append(head + f"ratio {possible:.2f}x: {verdict} (goal {SHARE_OF_PEAK_GOAL:.0%} of it)")
    else:
        lines.append("- mixed policies against the peaks' ratio: part 1 (the peaks) not run yet")
    eight, sixteen = (_find(float8_cells, "encoder_4096", "adam", p, "tfmp") for p in ("float8", "mixed_bfloat16"))
    # (Part 7 runs each precision's pair alone: this ratio is of medians taken apart.)
    if eight.get("examples_per_second") and sixteen.get("examples_per_second"):
        ratio = eight["examples_per_second"] / sixteen["examples_per_second"]
        lines.append(
            f"- float8 >= {FLOAT8_GOAL}x mixed_bfloat16 on encoder_4096 (tfmp.fit): {ratio:.2f}x, "
            f"{'met' if ratio >= FLOAT8_GOAL else 'missed'} (turns apart: the two do not fit in memory at once; "
            "accuracy within 0.5 pt: `python -m tfmp.doctor --parity --policy=float8`)"
        )
    else:
        lines.append("- float8 on encoder_4096: part 7 not run yet, or a cell failed")
    return lines


def _float8_hlo(parts):
    """Part 5: the GEMMs of a float8 step by kind, and a float8 Dense step's speed, under
    each XLA_FLAGS variant."""
    probes = next((p["float8_hlo"] for p in parts if p.get("float8_hlo")), None)
    if not probes:
        return []
    lines = [
        "GEMMs of one float8 training step by kind (3 matmuls a layer; `python -m tfmp.bench.float8_hlo`; XLA's "
        "HLO after each pass in float8_hlo/), and one Dense step of encoder_4096's feed-forward shape:",
        "",
        "| XLA_FLAGS | layer | float8 cuBLASLt | other cuBLAS | Triton float8 | other Triton | plain dot |",
        "|---|---|---|---|---|---|---|",
    ]
    timings = []
    for probe in probes:
        variant = probe["variant"]
        if "error" in probe:
            lines.append(f"| {variant} | failed: {probe['error'][:200]} | | | | | |")
            continue
        for case in probe["cases"]:
            g = case["gemms"]
            lines.append(
                f"| {variant} | {case['case']} | {g['float8']} | {g['cublas']} | {g['triton_float8']} | "
                f"{g['triton']} | {g['dot']} |"
            )
        t = probe["timing"]
        timings.append(
            f"| {variant} | {t['shape']} | {t['bfloat16_ms']:.2f} | {t['float8_ms']:.2f} | {t['speedup']:.2f}x | "
            f"{t['float8_gemms']['float8'] + t['float8_gemms']['triton_float8']} of 3 |"
        )
    if timings:
        lines += [
            "",
            "| XLA_FLAGS | Dense step | bfloat16 ms | float8 ms | float8 speedup | float8 GEMMs |",
            "|---|---|---|---|---|---|",
            *timings,
        ]
    return lines


def markdown(parts, all_parts):
    """report.md from the parts run so far (their part<N>.json)."""
    if not parts:
        return "# GPU report\n\nNo part has run yet."
    first = parts[0]
    done = sorted(p["part"] for p in parts)
    missing = [n for n in all_parts if n not in done]
    cells, float8_cells = _cells(parts, False), _cells(parts, True)
    lines = [
        f"# GPU report: {first['device']}",
        "",
        f"{first['device']}, driver {first.get('driver') or '-'}, TensorFlow {first['tensorflow']}, Keras "
        f"{first['keras']}, CUDA {first.get('cuda') or '-'}, cuDNN {first.get('cudnn') or '-'}, Python "
        f"{first['python']}; parts {', '.join(map(str, done))} run {first['created']}"
        + (f"; not yet: {', '.join(map(str, missing))}" if missing else "")
        + ". `python -m tfmp.bench.gpu_report --part=N`.",
        "",
    ]
    if any(p.get("smoke") for p in parts):
        lines += ["**Smoke run: tiny stand-in models; these figures measure nothing.**", ""]
    for part in parts:
        mode = part.get("input_on_device", "off")
        if mode != "off":
            who, keras_reads = ("both loops", "") if mode == "both" else ("tfmp.fit", "; Keras fit, from host memory")
            lines += [
                f"**Input on the device (part {part['part']}: --input_on_device={mode}):** {who} read the batches "
                f"already copied to the GPU, 2 ahead (tf.data's prefetch_to_device){keras_reads}.",
                "",
            ]
    per_turn = first.get("steps_per_turn", 1)
    lines += [
        f"Examples/s are medians of alternating rounds, {per_turn} step{'s' * (per_turn != 1)} of each fit in turn "
        "(the devices synced at each turn's end), after a 12-step warm-up; both loops with XLA. tfmp/Keras and vs "
        "float32 are medians of per-round ratios (± standard error). Peak memory: "
        "what a fit held beyond what was held before it was built. First step: from the fit call to the end of "
        "its first step (trace, compile, one step); * marks the fit of a precision that warmed first, whose "
        "compile started cold: XLA keeps its autotuning of GEMMs and convolutions for the process, and the "
        "other fit's compile found it done (the loops take turns to warm first, precision by precision).",
        "",
        *_speed_table(cells),
        "",
    ]
    if float8_cells:
        lines += ["## float8", "", *_float8_table(float8_cells), ""]
    hlo = _float8_hlo(parts)
    if hlo:
        lines += ["## float8 GEMMs", "", *hlo, ""]
    lines += ["## Goals", "", *_goals(parts, cells, float8_cells), ""]
    failed = [
        f"- {c['model']} {c['optimizer']} {c['precision']} {c['loop']}: {c['error']}"
        for c in cells + float8_cells
        if "error" in c
    ]
    failed += [f"- PyTorch {why}" for p in parts for why in p.get("left_out", [])]
    failed += [
        f"- part {p['part']} {', '.join(p['not_chosen'])}: not run (--precisions)" for p in parts if p.get("not_chosen")
    ]
    if failed:
        lines += ["## Not measured", "", *failed]
    return "\n".join(lines)
