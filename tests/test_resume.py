"""Checkpoint/resume: SIGKILL at several points and SIGTERM, then the same command resumes
to exactly the weights of an unbroken run; corrupt and incompatible checkpoints."""

import json
import signal
import time

import pytest
from conftest import BFLOAT16_EMULATED, train_process

pytestmark = pytest.mark.slow  # Several train.py / worker processes.

# Resume is under test, not the policy: bfloat16 where the CPU computes it, float32 where it
# would be emulated (several times slower, and these runs start train.py a dozen times).
FLAGS = [
    "--model=cnn",
    "--epochs=2",
    "--steps_per_epoch=12",
    "--batch_size=32",
    "--checkpoint_every=3",
    "--deterministic",
    "--precision=float32" if BFLOAT16_EMULATED else "--precision=mixed_bfloat16",
    "--strategy=default",
]


def start(model_dir, *extra):
    return train_process(*FLAGS, f"--model_dir={model_dir}", *extra, env={"TF_CPP_MIN_LOG_LEVEL": "2"})


def finish(process, timeout=300):
    out, err = process.communicate(timeout=timeout)
    return process.returncode, out, err


def checkpoint_steps(model_dir):
    """The checkpoints that TensorFlow's state file lists: a checkpoint counts once the
    state file names it (its files are written first), as a resumed run sees it."""
    state = model_dir / "checkpoints" / "checkpoint"
    if not state.exists():
        return []
    lines = [line for line in state.read_text().splitlines() if line.startswith("all_model_checkpoint_paths")]
    return sorted(int(line.split('"ckpt-')[1].rstrip('"')) for line in lines)


def wait_for_checkpoint(process, model_dir, at_least, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        steps = checkpoint_steps(model_dir)
        if steps and steps[-1] >= at_least:
            return steps[-1]
        if process.poll() is not None:
            pytest.fail(f"run ended before checkpoint {at_least}: {process.stderr.read()[-2000:]}")
        time.sleep(0.05)
    pytest.fail(f"no checkpoint >= {at_least} within {timeout}s")


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("unbroken")
    code, _, err = finish(start(model_dir))
    assert code == 0, err[-3000:]
    return json.loads((model_dir / "metrics.json").read_text())


def test_sigkill_at_three_points_then_resume_matches_unbroken(tmp_path, unbroken):
    model_dir = tmp_path / "run"
    killed_after = []
    for step in (3, 9, 15):
        process = start(model_dir)
        killed_after.append(wait_for_checkpoint(process, model_dir, step))
        process.send_signal(signal.SIGKILL)
        process.wait()
    assert killed_after[0] < killed_after[1] < killed_after[2] < 24
    code, out, err = finish(start(model_dir))
    assert code == 0, err[-3000:]
    metrics = json.loads((model_dir / "metrics.json").read_text())
    assert metrics["resumed_from_step"] >= killed_after[-1]
    assert metrics["steps"] == unbroken["steps"] == 24
    assert metrics["weights_sha256"] == unbroken["weights_sha256"]
    assert "resumed     from batch" in out


def test_sigterm_saves_exits_cleanly_and_resumes(tmp_path, unbroken):
    model_dir = tmp_path / "run"
    process = start(model_dir)
    wait_for_checkpoint(process, model_dir, 3)
    process.send_signal(signal.SIGTERM)
    code, _, err = finish(process)
    assert code == 75, err[-3000:]
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if "preempted" in line]
    assert len(lines) == 1 and "checkpoint saved" in lines[0]
    stopped_at = int(lines[0].split("SIGTERM at batch ")[1].split(":")[0])
    assert checkpoint_steps(model_dir)[-1] == stopped_at
    code, _, err = finish(start(model_dir))
    assert code == 0, err[-3000:]
    metrics = json.loads((model_dir / "metrics.json").read_text())
    assert metrics["resumed_from_step"] == stopped_at
    assert metrics["weights_sha256"] == unbroken["weights_sha256"]


def test_corrupt_latest_checkpoint_is_one_line_and_previous_still_loads(tmp_path):
    model_dir = tmp_path / "run"
    code, _, err = finish(start(model_dir, "--epochs=1", "--steps_per_epoch=6"))
    assert code == 0, err[-3000:]
    steps = checkpoint_steps(model_dir)
    assert steps[-2:] == [3, 6]
    data = next((model_dir / "checkpoints").glob("ckpt-6.data-*"))
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 3])
    code, _, err = finish(start(model_dir, "--epochs=1", "--steps_per_epoch=6"))
    assert code == 2 and "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("train.py: error:")]
    assert len(errors) == 1 and "ckpt-6" in errors[0] and "ckpt-3" in errors[0]
    # The previous checkpoint still loads: move the broken one away and the run resumes from 3.
    for path in (model_dir / "checkpoints").glob("ckpt-6.*"):
        path.rename(tmp_path / path.name)
    (model_dir / "checkpoints" / "checkpoint").write_text(
        'model_checkpoint_path: "ckpt-3"\nall_model_checkpoint_paths: "ckpt-3"\n'
    )
    code, _, err = finish(start(model_dir, "--epochs=1", "--steps_per_epoch=6"))
    assert code == 0, err[-3000:]
    assert json.loads((model_dir / "metrics.json").read_text())["resumed_from_step"] == 3


def test_checkpoint_of_another_model_is_one_line(tmp_path):
    model_dir = tmp_path / "run"
    code, _, err = finish(start(model_dir, "--epochs=1", "--steps_per_epoch=3"))
    assert code == 0, err[-3000:]
    other = ["--model=resnet", "--dataset=synthetic", "--epochs=1", "--steps_per_epoch=3"]
    code, _, err = finish(start(model_dir, *other))
    assert code == 2 and "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("train.py: error:")]
    assert len(errors) == 1 and "model cnn -> resnet" in errors[0]
    # Forced past the settings check, the checkpoint itself does not load: one line too.
    code, _, err = finish(start(model_dir, *other, "--resume=force"))
    assert code == 2 and "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("train.py: error:")]
    assert len(errors) == 1 and "does not load into this model" in errors[0] and "a new --model_dir" in errors[0]


@pytest.mark.parametrize("rounding", ["stochastic", "kahan"])
def test_bfloat16_weights_sigkill_then_resume_match_unbroken(tmp_path, rounding):
    """The compensation buffers and the rounding's seed live in the checkpoint: a run killed
    after a checkpoint resumes to the unbroken run's bfloat16 weights, bit for bit."""
    extra = ["--precision=bfloat16", f"--bf16_rounding={rounding}"]
    if BFLOAT16_EMULATED:  # A quarter of the emulated steps' work: the same checkpoints, half the run's time.
        extra.append("--batch_size=8")
    code, _, err = finish(start(tmp_path / "unbroken", *extra))
    assert code == 0, err[-3000:]
    unbroken = json.loads((tmp_path / "unbroken" / "metrics.json").read_text())
    model_dir = tmp_path / "run"
    process = start(model_dir, *extra)
    killed_after = wait_for_checkpoint(process, model_dir, 9)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert process.returncode == -signal.SIGKILL and killed_after < unbroken["steps"]
    code, _, err = finish(start(model_dir, *extra))
    assert code == 0, err[-3000:]
    metrics = json.loads((model_dir / "metrics.json").read_text())
    assert metrics["resumed_from_step"] >= killed_after and metrics["bf16_rounding"] == rounding
    assert metrics["weights_sha256"] == unbroken["weights_sha256"]
