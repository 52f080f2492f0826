"""python -m tfmp.bench.gpu_report: every part's code path, tiny (--smoke), so that a GPU
session's few minutes never go to a failure a CPU could have shown; the report's goals
from figures made up here; its budget and its refusals."""

import json
import os
import subprocess
import sys
import time

import pytest
from absl import flags
from conftest import GPUS, REPO, entry_point_process

from tfmp.bench import float8_hlo, gpu_flags, gpu_parts, gpu_tables, pytorch

ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
if GPUS:  # Tiny stand-ins: XLA's autotuning of each GEMM and convolution (Triton's configurations
    # above all) would be most of a GPU's compile time here, and the smoke times nothing.
    ENV["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_gpu_autotune_level=0".strip()


def _report(tmp_path, *flags, timeout=600):
    """The report's command, tiny; past `timeout` seconds the test fails with the last lines of
    report.log (the part and fit it was in), not only a pytest cut-off with nothing to read."""
    try:
        return subprocess.run(
            [sys.executable, "-m", "tfmp.bench.gpu_report", "--smoke", f"--output_dir={tmp_path}", *flags],
            cwd=REPO,
            env=ENV,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        log = tmp_path / "report.log"
        tail = log.read_text().splitlines()[-25:] if log.exists() else ["(no report.log)"]
        pytest.fail(f"gpu_report {' '.join(flags)} ran past {timeout} s; report.log ends:\n" + "\n".join(tail))


@pytest.mark.slow  # Every part of the report, in a process of its own: two minutes on 2 cores.
def test_smoke_runs_every_part_and_writes_the_report(tmp_path):
    started = time.monotonic()
    # On a GPU, within the gpu-check's slow stage (400 s), so that a cut-off says where it was.
    result = _report(tmp_path, "--part=all", timeout=330 if GPUS else 600)
    assert result.returncode == 0, result.stderr[-3000:]
    print(f"smoke report: {time.monotonic() - started:.0f} s")
    parts = {n: json.loads((tmp_path / f"part{n}.json").read_text()) for n in gpu_flags.PARTS}
    for number, part in gpu_flags.PARTS.items():
        if part.pytorch or part.float8_hlo:
            continue
        cells = {(c["precision"], c["loop"]): c for c in parts[number]["cells"]}
        assert set(cells) == {(p, loop) for p in part.precisions for loop in ("tfmp", "keras")}, number
        for (policy, loop), cell in cells.items():
            assert "error" not in cell, (number, policy, loop, cell.get("error"))
            assert cell["examples_per_second"] > 0 and len(cell["rounds"]) == 2, (number, policy, loop)
            assert cell["first_step_seconds"] > 0 and cell["jit_compile"] is True, (number, policy, loop)
            assert (cell["peak_memory_mb"] is None) == (GPUS == 0)  # A GPU's own peak, nothing on a CPU.
        assert cells[(part.precisions[-1], "tfmp")]["vs_keras"] > 0
    assert set(parts[1]["peaks"]) == {"matmul", "conv"}
    bert = {c["precision"]: c for c in parts[4]["cells"] if c["loop"] == "tfmp"}
    assert bert["bfloat16"]["state_mb"] < 0.7 * bert["mixed_bfloat16"]["state_mb"]  # Kahan: 8 bytes, not 12.
    probes = parts[5]["float8_hlo"]
    assert [p["variant"] for p in probes] == list(float8_hlo.VARIANTS)
    for probe in probes:
        variant = probe["variant"]
        assert "error" not in probe and len(probe["cases"]) == 3, (variant, probe.get("error"))
        assert probe["timing"]["bfloat16_ms"] > 0 and probe["timing"]["float8_ms"] > 0
        if not GPUS:  # A CPU compiles each of a layer's three matmuls as a plain dot.
            plain = {"float8": 0, "cublas": 0, "triton_float8": 0, "triton": 0, "dot": 3}
            assert all(case["gemms"] == plain for case in probe["cases"]), variant
    torch_ready = pytorch.find_python("auto", "bert_base")
    assert bool(parts[8]["cells"]) == bool(torch_ready), parts[8].get("left_out")
    report = (tmp_path / "report.md").read_text()
    assert "Smoke run" in report and "## Goals" in report and "## float8" in report and "## float8 GEMMs" in report
    assert "| Triton GEMMs off | Dense, 2-D input (tokens x width) |" in report
    assert "| bert_base | sgd | bfloat16 |" in report and "| encoder_4096 | float8 | tfmp.fit |" in report
    assert "float8 >= 1.3x mixed_bfloat16 on encoder_4096 (tfmp.fit):" in report
    log = (tmp_path / "report.log").read_text()
    assert "first step after" in log and "round 2/2" in log and "part 8 done" in log
    assert len(list((tmp_path / "float8_hlo").iterdir())) > 10  # XLA's passes, kept for reading.


def test_a_part_warms_no_fit_past_its_budget(tmp_path):
    result = _report(tmp_path, "--part=2", "--budget_seconds=0", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    cells = json.loads((tmp_path / "part2.json").read_text())["cells"]
    assert len(cells) == 6 and all(c["error"] == "not run: the part's budget was spent" for c in cells)
    report = (tmp_path / "report.md").read_text()
    assert "## Not measured" in report and "resnet50 adam float32 tfmp: not run" in report
    assert "not yet: 1, 3, 4, 5, 6, 7, 8" in report
    result = _report(tmp_path, "--part=5", "--budget_seconds=0", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    probes = json.loads((tmp_path / "part5.json").read_text())["float8_hlo"]
    assert [p["error"] for p in probes] == ["not run: the part's budget was spent"] * len(float8_hlo.VARIANTS)


@pytest.mark.parametrize("mode", ["both", "tfmp"])
def test_input_on_the_device_trains_both_loops_and_the_report_says_so(tmp_path, mode):
    # The probe of what a step's input copy costs: batches prefetched to the device, for both loops or tfmp.fit's own.
    result = _report(tmp_path, "--part=7", "--precisions=mixed_bfloat16", f"--input_on_device={mode}", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    part = json.loads((tmp_path / "part7.json").read_text())
    assert part["input_on_device"] == mode
    assert [(c["loop"], "error" in c) for c in part["cells"]] == [("tfmp", False), ("keras", False)]
    assert all(c["examples_per_second"] > 0 for c in part["cells"])
    assert f"**Input on the device (part 7: --input_on_device={mode}):**" in (tmp_path / "report.md").read_text()


def test_bad_flags_are_refused_naming_the_flag_before_tensorflow_loads():
    def refused(*flags):
        run = "runpy.run_module('tfmp.bench.gpu_report', run_name='__main__', alter_sys=True)"
        result = entry_point_process(run, *flags)
        assert result.returncode == 2 and result.stdout == "tensorflow loaded: False\n", result
        return result.stderr

    assert refused("--part=12") == "gpu_report: error: --part=12: choose 1, 2, 3, 4, 5, 6, 7, 8 or all\n"
    assert refused() == "gpu_report: error: --part is needed: choose 1, 2, 3, 4, 5, 6, 7, 8 or all\n"
    assert "--pytorch=/no/such/python: not an executable Python" in refused("--part=1", "--pytorch=/no/such/python")
    trains = "float32, mixed_float16, mixed_bfloat16, bfloat16"
    result = refused("--part=4", "--precisions=mixed_bfloat16,float8")
    assert f"--precisions=mixed_bfloat16,float8: --part=4 trains {trains}" in result
    assert "trains no precisions (a probe, or PyTorch)" in refused("--part=5", "--precisions=float8")
    # absl's own check: one line, as tfmp's.
    assert refused("--part=1", "--rounds=0") == "gpu_report: error: flag --rounds=0: 0 is not a positive integer\n"


def test_the_log_says_what_is_still_running_when_quiet(tmp_path):
    log = gpu_parts.Log(str(tmp_path / "report.log"), quiet=0.2)
    log("compiling", doing="compiling resnet50")
    time.sleep(6)  # The watchdog looks every 5 s.
    log.close()
    assert "... still compiling resnet50" in (tmp_path / "report.log").read_text()
    assert "budget_seconds" not in flags.FLAGS  # Not on import.


def _cell(model, optimizer, policy, loop, rate, **more):
    return {"model": model, "optimizer": optimizer, "precision": policy, "loop": loop, "examples_per_second": rate,
            **more}  # fmt: skip


def test_goals_are_judged_from_the_figures():
    versions = {"device": "GPU", "tensorflow": "2", "keras": "3", "python": "3", "created": "now"}
    peaks = {
        op: {"float32": {"flops": 1.0}, "mixed_float16": {"flops": 2.0}, "mixed_bfloat16": {"flops": 2.0}}
        for op in ("matmul", "conv")
    }
    speed = {
        "part": 4,
        "peaks": peaks,
        "cells": [
            _cell("bert_base", "adam", "float32", "tfmp", 100, vs_keras=1.10),
            _cell("bert_base", "adam", "float32", "keras", 91),
            _cell("bert_base", "adam", "mixed_bfloat16", "tfmp", 190, vs_keras=1.02, vs_base=1.9),
            _cell("bert_base", "adam", "mixed_float16", "tfmp", 170, vs_keras=1.2, vs_base=1.7),
            _cell("bert_base", "adam", "mixed_bfloat16", "pytorch", 150),
        ],
        **versions,
    }
    float8 = {
        "part": 7,
        "cells": [
            _cell("encoder_4096", "adam", "mixed_bfloat16", "tfmp", 400),
            _cell("encoder_4096", "adam", "float8", "tfmp", 560),
            {**_cell("encoder_4096", "adam", "float8", "keras", None), "error": "ResourceExhaustedError: OOM"},
        ],
        **versions,
    }
    report = gpu_tables.markdown([speed, float8], gpu_flags.PARTS)
    assert "2 of 3 cells; below: bert_base adam mixed_bfloat16 1.02" in report
    assert "bert_base adam mixed_bfloat16: 1.90x float32, the matmul peaks' ratio 2.00x: met" in report
    assert "bert_base adam mixed_float16: 1.70x float32, the matmul peaks' ratio 2.00x: missed" in report
    assert "encoder_4096 (tfmp.fit): 1.40x, met" in report
    assert "| bert_base | adam | mixed_bfloat16 | 190 | - | 1.02 | 1.90 |" in report and "| 150 |" in report
    assert "encoder_4096 adam float8 keras: ResourceExhaustedError: OOM" in report
    assert "not yet: 1, 2, 3, 5, 6, 8" in report


def test_loops_take_turns_to_warm_first_and_the_cold_first_step_is_marked():
    """XLA keeps its GEMM and convolution autotuning for the process: a precision's second
    fit compiles faster than its first, so the loops alternate and the table says which was cold."""
    part = gpu_flags.PARTS[1]
    orders = [gpu_parts._warm_order(part, policy) for policy in part.precisions]
    assert [order[0] for order in orders] == ["tfmp", "keras", "tfmp"][: len(orders)]
    assert all(sorted(order) == ["keras", "tfmp"] for order in orders)
    versions = {"device": "GPU", "tensorflow": "2", "keras": "3", "python": "3", "created": "now"}
    cells = [
        {
            **_cell("resnet50", "sgd", "float32", "tfmp", 100, vs_keras=1.1),
            "first_step_seconds": 60,
            "warmed_first": True,
        },
        {**_cell("resnet50", "sgd", "float32", "keras", 90), "first_step_seconds": 25, "warmed_first": False},
    ]
    report = gpu_tables.markdown([{"part": 1, "cells": cells, **versions}], gpu_flags.PARTS)
    assert "| 60* / 25 |" in report and "* marks the fit of a precision that warmed first" in report


def test_gemm_kinds_reads_gpu_hlo():
    hlo = "\n".join(
        [
            "%fused_computation (p: bf16[8,8]) -> bf16[8,8] {",
            "  %d = bf16[8,8]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}",
            "}",
            "ENTRY %main (x: f8e4m3fn[64,64]) -> bf16[64,64] {",
            '  %g = (bf16[64,64], s8[0]) custom-call(%x, %y), custom_call_target="__cublas$lt$matmul$f8"',
            '  %h = (bf16[64,64], s8[0]) custom-call(%p, %q), custom_call_target="__cublas$gemm"',
            '  %t = bf16[64,64] fusion(%p, %q), kind=kCustom, backend_config={"kind":"__triton_gemm"}',
            "  %u = bf16[64,64] fusion(f8e4m3fn[64,64] %r, f8e5m2[64,64] %s), kind=kCustom, "
            'backend_config={"kind":"__triton_gemm"}',
            "  %e = f32[64,64]{1,0} dot(%m, %n), lhs_contracting_dims={1}, rhs_contracting_dims={0}",
            "}",
        ]
    )
    assert float8_hlo.gemm_kinds(hlo) == {"float8": 1, "cublas": 1, "triton_float8": 1, "triton": 1, "dot": 1}


def test_gemm_kinds_counts_a_cpu_library_fusions_dot():
    """XLA's CPU backend in TensorFlow 2.22 runs a dot inside a YNNPACK fusion: still one GEMM,
    and a fusion of a reduction is none."""
    hlo = "\n".join(
        [
            "%fused_computation.4 (param_0.7: bf16[256,64], param_1.7: bf16[64,64]) -> bf16[256,64] {",
            "  ROOT %MatMul.0 = bf16[256,64]{1,0} dot(%param_0.7, %param_1.7), lhs_contracting_dims={1}",
            "}",
            "%fused_computation.2 (param_0.1: bf16[256,64]) -> bf16[] {",
            "  ROOT %Max.1 = bf16[] reduce(%param_0.1, %c), dimensions={0,1}, to_apply=%region_0.1",
            "}",
            "ENTRY %main.1 (arg0.1: f32[256,64]) -> f32[64,64] {",
            "  %ynn_fusion.5 = bf16[256,64]{1,0} fusion(%a, %b), kind=kCustom, calls=%fused_computation.4",
            "  %ynn_fusion.2 = bf16[] fusion(%a), kind=kCustom, calls=%fused_computation.2",
            "  %MatMul_1.2 = f32[64,64]{1,0} dot(%c, %d), lhs_contracting_dims={0}, rhs_contracting_dims={0}",
            "}",
        ]
    )
    assert float8_hlo.gemm_kinds(hlo) == {"float8": 0, "cublas": 0, "triton_float8": 0, "triton": 0, "dot": 2}
