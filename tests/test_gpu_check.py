""".ci/gpu-check, a lent GPU's checks in one command, rehearsed here with --smoke: its stages
run, its summary names each one's result and the report's rows, a spent budget runs no
stage, and it refuses what it cannot do, saying why."""

import os
import pathlib
import subprocess
import sys

import pytest
from conftest import GPUS, REPO

SCRIPT = os.path.join(REPO, ".ci", "gpu-check")
# The script runs `python3`: this interpreter's, as in CI's activated virtual environment.
ENV = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}


def _check(*args, budget=None, timeout=300):
    env = ENV if budget is None else {**ENV, "BUDGET": str(budget)}
    return subprocess.run(["bash", SCRIPT, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow  # The stages for real: a pytest run, a report part and two benches, 80 s on 2 cores.
def test_rehearsal_runs_the_stages_and_sums_them_up(tmp_path):
    # One stage of each kind: `slow` is `suite`'s pytest with other marks, `bert_adam` and the
    # other report stages are encoder_adam's `report` with another part and precisions.
    stages = ("suite", "step_hlo", "grouped_norm", "encoder_adam")
    result = _check("--smoke", str(tmp_path), *stages)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = (tmp_path / "summary.md").read_text()
    assert "TensorFlow" in summary.splitlines()[0] and "Smoke run" in summary
    for stage in stages:
        assert f"| {stage} | passed |" in summary
    assert "| tfmp |" in summary and "| TensorFlow op type |" in summary  # step_hlo's tables.
    assert "| grouped |" in summary and "- speed grouped / keras: " in summary  # grouped_norm's.
    assert "| encoder_4096 | adam | mixed_bfloat16 |" in summary and "## Goals" in summary
    assert "- part 7 float8: not run (--precisions)" in summary
    suite = (tmp_path / "suite.log").read_text()
    assert "tests/test_layout.py::" in suite and " PASSED" in suite  # -v: each test named.
    assert summary in result.stdout


def test_a_spent_budget_runs_no_stage_and_fails(tmp_path):
    result = _check("--smoke", str(tmp_path), "gpu_tests", "suite", budget=30)
    assert result.returncode == 1, result.stderr[-3000:]
    summary = (tmp_path / "summary.md").read_text()
    for stage in ("gpu_tests", "suite"):
        assert f"| {stage} | not run: the budget (30 s) was spent | - |" in summary
    assert sorted(p.name for p in tmp_path.iterdir()) == ["device.txt", "summary.md"]


def test_refusals_say_why(tmp_path):
    result = _check()
    assert result.returncode == 2 and "name the output folder" in result.stderr
    result = _check(str(tmp_path), "resnet")
    stages = "gpu_tests bert_adam suite resnet_sgd slow step_hlo grouped_norm resnet_rows encoder_adam resnet_input"
    choices = f"stage resnet: choose {stages}"
    assert result.returncode == 2 and choices in result.stderr
    if GPUS:
        return
    result = _check(str(tmp_path / "out"))
    assert result.returncode == 2 and "TensorFlow sees no GPU: source .gpu/base/setup.sh first" in result.stderr
    assert "GPUs 0" in pathlib.Path(tmp_path / "out" / "device.txt").read_text()
