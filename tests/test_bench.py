"""python -m tfmp.bench end to end, tiny: figures for every row and the files; a cut-off
forced by a budget that no step can meet (never by how fast this CPU happens to be)."""

import json
import os
import subprocess
import sys

from conftest import REPO

from tfmp import benchlib


def test_bench_writes_figures(tmp_path):
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tfmp.bench",
            "--models=cnn",
            "--policies=float32,mixed_bfloat16",
            "--batch_size=32",
            "--steps=4",
            "--warmup_steps=1",
            "--budget_seconds=600",
            "--matmul_size=512",
            "--overhead_repeats=1",
            f"--output_dir={tmp_path}",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    bench = json.loads((tmp_path / "bench.json").read_text())
    rows = {r["policy"]: r for r in bench["rows"]}
    for policy in ("float32", "mixed_bfloat16"):
        row = rows[policy]
        assert not row["cut_off"] and row["steps_timed"] >= 4
        assert row["examples_per_second"] > 0 and row["mfu"] > 0 and row["train_flops_per_example"] > 1e6
        assert row["input_examples_per_second"] > 0 and row["peak_memory_mb"] > 0
    assert rows["float32"]["speedup_vs_float32"] == 1.0
    assert bench["overhead"]["ratio"] > 0 and set(bench["matmul_peaks"]) == set(rows)
    assert bench["choices"][0]["autotune"] in rows
    assert (tmp_path / "bench.png").stat().st_size > 5000
    assert "MFU" in result.stdout and "overhead" in result.stdout and "CUT OFF" not in result.stdout


def test_policy_over_budget_is_cut_off_and_reported():
    peaks = {"float32": {"flops": 1e9, "cut_off": False}}
    # A budget of zero seconds: the first (warm-up) step overruns it on any machine.
    (row,) = benchlib.bench_model("cnn", ["float32"], 16, steps=4, warmup=1, budget_seconds=0.0, peaks=peaks)
    assert row["cut_off"] and row["steps_timed"] == 0 and row["examples_per_second"] == 0.0
    row["speedup_vs_float32"] = None
    assert "CUT OFF" in benchlib.table([row])
