"""The doctor's commands, each in a process of its own: `python -m tfmp.doctor` (the report,
--parity) and `train.py --diagnose`, their errors in one line before TensorFlow loads."""

import json

import pytest
from conftest import entry_point_process


def _command(*args):
    """Runs `python ARGS...` from the repository root; returns the completed process."""
    import os
    import subprocess
    import sys

    from conftest import REPO

    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def test_doctor_command_errors_in_one_line_and_lists_its_flags():
    """Both before TensorFlow loads (its flags come from a module that loads none), as train.py's."""
    run = "runpy.run_module('tfmp.doctor', run_name='__main__', alter_sys=True)"
    bad = entry_point_process(run, "--model=bogus")
    assert bad.returncode == 2 and bad.stderr.splitlines() == [
        "tfmp.doctor: error: flag --model=bogus: value should be one of <cnn|resnet|lstm|transformer>"
    ]
    wrong = {  # Each answered as the flags are read, naming the flag, not by TensorFlow or a parity run.
        "--baseline=fp32": "flag --baseline=fp32: value should be one of <float32|",
        "--batch_size=0": "flag --batch_size=0: 0 is not a positive integer",
        "--steps=0": "flag --steps=0: 0 is not a positive integer",
        "--learning_rate=nan": "flag --learning_rate=nan: must be a positive finite number",
        "--parity --seeds=1": "flags parity=True, seeds=1: --parity measures the noise over the seeds: give --seeds=2",
        "--policy=float8 --baseline=float8": "flags policy=float8, baseline=float8: --parity compares --policy with",
    }
    for args, message in wrong.items():
        result = entry_point_process(run, *args.split())
        assert result.returncode == 2 and result.stderr.startswith(f"tfmp.doctor: error: {message}"), result.stderr
        assert len(result.stderr.splitlines()) == 1 and result.stdout.splitlines() == ["tensorflow loaded: False"]
    usage = entry_point_process(run, "--helpshort")
    assert usage.stdout.startswith("The numerics doctor") and "--[no]parity:" in usage.stdout, usage.stdout[:500]
    for result in (bad, usage):
        assert result.stdout.splitlines()[-1] == "tensorflow loaded: False", result


@pytest.mark.slow  # Three commands in processes of their own, one training on the real digits: 30-50 s.
def test_doctor_command_and_train_diagnose(tmp_path):
    report = _command("-m", "tfmp.doctor", "--model=cnn", "--steps=2", f"--output_dir={tmp_path / 'doc'}")
    assert report.returncode == 0, report.stderr[-2000:]
    assert report.stderr == "", report.stderr[-2000:]  # Not even that float16 is slow here: 2 steps.
    assert "keep in float32:" in report.stdout and "recommended initial loss scale" in report.stdout
    assert json.loads((tmp_path / "doc" / "diagnosis.json").read_text())["layers"]
    parity = _command(
        "-m",
        "tfmp.doctor",
        "--parity",
        "--model=cnn",
        "--dataset=synthetic",
        "--seeds=2",
        "--epochs=1",
        "--steps_per_epoch=2",
        "--batch_size=16",
        "--policy=mixed_bfloat16",
        "--bf16_rounding=stochastic",  # For --policy=bfloat16; no run here reads it, and none is told it.
        "--lr_schedule=constant",
        f"--output_dir={tmp_path / 'parity'}",
    )
    assert parity.returncode == 0, parity.stderr[-2000:]
    assert "has no effect" not in parity.stderr, parity.stderr[-2000:]
    result = json.loads((tmp_path / "parity" / "parity.json").read_text())
    assert len(result["float32"]["accuracies"]) == 2 and "within_noise" in result
    assert result["lr_schedule"] == "constant", result  # As every run trained, from its metrics.
    assert "seed-to-seed noise" in parity.stdout
    diagnose = _command(
        "train.py",
        "--diagnose",
        "--dataset=synthetic",
        "--precision=mixed_float16",
        "--keep_float32=conv0.*",
        f"--model_dir={tmp_path / 'run'}",
    )
    assert diagnose.returncode == 0, diagnose.stderr[-2000:]
    layers = json.loads((tmp_path / "run" / "doctor" / "diagnosis.json").read_text())["layers"]
    dtypes = {r["name"]: r["compute_dtype"] for r in layers}
    assert dtypes["conv0a"] == dtypes["conv0b"] == "float32" and dtypes["conv1a"] == "float16"
    assert (tmp_path / "run" / "doctor" / "gradients.png").exists()
