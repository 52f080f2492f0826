"""python -m tfmp.bench end to end, tiny: figures for every row, a cut-off, the files."""

import json
import os
import subprocess
import sys

from conftest import REPO


def test_bench_writes_figures_and_cuts_off_slow_policies(tmp_path):
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tfmp.bench",
            "--models=cnn",
            "--policies=float32,mixed_bfloat16,mixed_float16",
            "--batch_size=32",
            "--steps=4",
            "--warmup_steps=1",
            "--budget_seconds=3",
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
        assert row["examples_per_second"] > 0 and row["mfu"] > 0 and row["train_flops_per_example"] > 1e6
        assert row["input_examples_per_second"] > 0 and row["peak_memory_mb"] > 0
    assert rows["float32"]["speedup_vs_float32"] == 1.0
    assert rows["mixed_float16"]["cut_off"]  # float16 convolutions on this CPU take seconds per step.
    assert bench["overhead"]["ratio"] > 0 and set(bench["matmul_peaks"]) == set(rows)
    assert bench["choices"][0]["autotune"] in rows
    assert (tmp_path / "bench.png").stat().st_size > 5000
    assert "MFU" in result.stdout and "CUT OFF" in result.stdout and "overhead" in result.stdout
