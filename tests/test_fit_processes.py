"""tfmp.fit on a user's own script in separate processes: exact resume after kill -9, and
two worker processes ending with the weights of one process."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import REPO, assert_same, start_workers, wait_all

pytestmark = pytest.mark.slow  # Several train.py / worker processes.

SCRIPT = os.path.join(REPO, "tests", "user_script.py")
ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}


def run(*args, timeout=300, env=None):
    command = [sys.executable, SCRIPT, *map(str, args)]
    result = subprocess.run(command, env=env or ENV, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]


def load(path):
    return list(np.load(path).values())


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory):
    directory = tmp_path_factory.mktemp("unbroken")
    run(directory / "w.npz", directory / "ckpt")
    return load(directory / "w.npz")


def test_resume_after_kill_9_matches_an_unbroken_run(tmp_path, unbroken):
    checkpoints = tmp_path / "ckpt"
    process = subprocess.Popen([sys.executable, SCRIPT, str(tmp_path / "w.npz"), str(checkpoints), "0.3"], env=ENV)
    try:
        for _ in range(1200):  # The checkpoint after batch 8 of 24 (epoch 0 is 8 batches).
            if (checkpoints / "ckpt-12.index").exists() or process.poll() is not None:
                break
            time.sleep(0.05)
        assert process.poll() is None, "the run ended before it could be killed"
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=60)
    finally:
        process.kill()
    assert not (tmp_path / "w.npz").exists()
    run(tmp_path / "w.npz", checkpoints)
    for a, b in zip(load(tmp_path / "w.npz"), unbroken, strict=True):
        np.testing.assert_array_equal(a, b)


def test_sigterm_checkpoints_exits_75_and_resumes(tmp_path, unbroken):
    checkpoints = tmp_path / "ckpt"
    process = subprocess.Popen(
        [sys.executable, SCRIPT, str(tmp_path / "w.npz"), str(checkpoints), "0.3"],
        env=ENV,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for _ in range(1200):
            if (checkpoints / "ckpt-4.index").exists() or process.poll() is not None:
                break
            time.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 75, err[-3000:]
    assert "preempted: SIGTERM at batch" in err and "Traceback" not in err
    run(tmp_path / "w.npz", checkpoints)
    for a, b in zip(load(tmp_path / "w.npz"), unbroken, strict=True):
        np.testing.assert_array_equal(a, b)


def test_two_worker_processes_match_one_process(tmp_path):
    run(tmp_path / "one.npz", "-", 0, 0)  # No dropout: its masks differ between replicas.
    results = wait_all(start_workers(lambda i: [SCRIPT, str(tmp_path / f"w{i}.npz"), "-", "0", "0"]))
    for code, _, err in results:
        assert code == 0, err[-3000:]
    for i in range(2):
        assert_same(load(tmp_path / f"w{i}.npz"), load(tmp_path / "one.npz"))


@pytest.mark.parametrize("when", ["train_batch:3", "epoch:0"])
def test_a_stop_one_worker_asks_for_stops_every_worker_after_the_same_update(tmp_path, monkeypatch, when):
    """A callback that sets `model.stop_training` on worker 0 alone (a time limit, say), within an
    epoch or at its end: both workers stop after the same update, where worker 1 alone went on to
    wait for worker 0 in the next all-reduce (and lost it as a peer)."""
    monkeypatch.setenv("USER_SCRIPT_STOP", when)  # For the workers start_workers starts.
    results = wait_all(start_workers(lambda i: [SCRIPT, str(tmp_path / f"w{i}.npz"), "-", "0", "0"]))
    for code, _, err in results:
        assert code == 0, err[-3000:]
    np.testing.assert_array_equal(*(np.concatenate([w.ravel() for w in load(tmp_path / f"w{i}.npz")]) for i in (0, 1)))
    for i in range(2):  # Stopped within the first of 3 epochs, or at its end.
        with open(tmp_path / f"w{i}.npz.history.json") as f:
            assert len(json.load(f)["loss"]) == 1


def test_a_generator_that_runs_out_on_one_worker_first_ends_both_workers(tmp_path, monkeypatch):
    """Worker 0's generator ends three batches before worker 1's: worker 0 stops there with a
    warning and joins no collective worker 1 cannot join (validation, a vote on stopping), so
    worker 1 loses it as a peer and says so, where both would wait for each other for ever."""
    monkeypatch.setenv("USER_SCRIPT_DATA", "uneven")  # For the workers start_workers starts.
    (code0, _, err0), (code1, _, err1) = wait_all(
        start_workers(lambda i: [SCRIPT, str(tmp_path / f"w{i}.npz"), "-", "0", "0"]), timeout=120
    )
    assert code0 == 0 and "a worker cannot tell whether the others ran out too" in err0, err0[-3000:]
    assert code1 == 76 and "worker 0 stopped answering" in err1, err1[-3000:]


def test_keras_file_writing_callbacks_on_two_workers_write_the_chiefs_files_alone(tmp_path, monkeypatch):
    """ModelCheckpoint (.weights.h5), CSVLogger, TensorBoard and BackupAndRestore given to both
    workers with the same paths: the chief's files are there, once; the other worker's went to
    a temporary directory (two processes writing one .weights.h5 fail on HDF5's lock)."""
    monkeypatch.setenv("USER_SCRIPT_CALLBACKS", str(tmp_path / "out"))  # For the workers start_workers starts.
    for code, _, err in wait_all(start_workers(lambda i: [SCRIPT, str(tmp_path / f"w{i}.npz"), "-", "0", "0"])):
        assert code == 0, err[-3000:]
    assert len(list((tmp_path / "out" / "tb" / "train").iterdir())) == 1  # One event file: the chief's.
    assert len((tmp_path / "out" / "log.csv").read_text().splitlines()) == 1 + 3  # Its header and 3 epochs.
    assert sorted(p.name for p in (tmp_path / "out" / "backup").iterdir())[-2:] == [
        "latest.weights.h5",
        "training_metadata.json",
    ]
    sys.path.insert(0, os.path.dirname(SCRIPT))
    import user_script  # noqa: PLC0415 - the workers' model, to load the chief's weights into.

    user_script.build(0).load_weights(tmp_path / "out" / "w.weights.h5")


def test_workers_that_decide_differently_stop_at_once_saying_what_differs(tmp_path, monkeypatch):
    """Worker 0 trains in float32 with XLA off, worker 1 in mixed_bfloat16 with XLA on, as two
    workers deciding "auto" each by its own hardware might, and worker 1 is given another clipnorm:
    both stop before training, with one error naming the differences and the settings that make
    them agree, where both trained one model two ways (their copies of it apart) and exited 0."""
    monkeypatch.setenv("USER_SCRIPT_PRECISION", "float32|mixed_bfloat16")  # For the workers start_workers starts.
    monkeypatch.setenv("USER_SCRIPT_JIT_COMPILE", "0|1")
    monkeypatch.setenv("USER_SCRIPT_CLIPNORM", "1.0|0.5")
    results = wait_all(start_workers(lambda i: [SCRIPT, str(tmp_path / f"w{i}.npz"), "-", "0", "0"]), timeout=120)
    for (code, _, err), (mine, other, here, there) in zip(
        results, [("float32", "mixed_bfloat16", "off", "on"), ("mixed_bfloat16", "float32", "on", "off")], strict=True
    ):
        assert code != 0 and "the 2 workers decided differently" in err, err[-3000:]
        assert f"the precision policy: {mine} here, {other} elsewhere" in err, err[-3000:]
        assert f"XLA: {here} here, {there} elsewhere" in err, err[-3000:]
        assert "--precision and --jit_compile" in err, err[-3000:]
        clipnorms = ["clipnorm 1.0", "clipnorm 0.5"][:: 1 if mine == "float32" else -1]
        given = "the update: grad_accum_steps 2, {}, steps_per_execution 1 here, grad_accum_steps 2, {}, "
        assert "the 2 workers were given different settings" in err and "tfmp.launch" in err, err[-3000:]
        assert given.format(*clipnorms) in err, err[-3000:]
    assert not list(tmp_path.glob("w*.npz"))  # Nothing trained, nothing saved.


@pytest.mark.parametrize("kind", ["arrays", "pydataset"])
def test_arrays_and_py_datasets_on_two_worker_processes_match_one_process(tmp_path, monkeypatch, kind):
    """model.fit's arrays (shuffled by tfmp, a validation split), or a PyDataset (its batch
    order shuffled by tfmp), under two workers: each worker shuffles alike (one seed) and
    trains on its half of each global batch."""
    monkeypatch.setenv("USER_SCRIPT_DATA", kind)  # For the workers start_workers starts.
    run(tmp_path / "one.npz", "-", 0, 0, env={**ENV, "USER_SCRIPT_DATA": kind})
    results = wait_all(start_workers(lambda i: [SCRIPT, str(tmp_path / f"w{i}.npz"), "-", "0", "0"]))
    for code, _, err in results:
        assert code == 0, err[-3000:]
    for i in range(2):
        assert_same(load(tmp_path / f"w{i}.npz"), load(tmp_path / "one.npz"))
    dataset_run = tmp_path / "dataset.npz"  # Another order of the same examples: other weights.
    run(dataset_run, "-", 0, 0)
    assert max(np.abs(a - b).max() for a, b in zip(load(dataset_run), load(tmp_path / "one.npz"), strict=True)) > 1e-4


def test_float8_state_on_two_worker_processes_is_that_of_one_process(tmp_path):
    """Each worker sees its own half of every global batch; the float8 amax histories and
    scales after training are the same on both and equal to one process's."""
    env = {**ENV, "USER_SCRIPT_PRECISION": "float8"}
    command = [sys.executable, SCRIPT, str(tmp_path / "one.npz"), "-", "0", "0"]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    os.environ["USER_SCRIPT_PRECISION"] = "float8"  # For the workers start_workers starts.
    try:
        results = wait_all(start_workers(lambda i: [SCRIPT, str(tmp_path / f"w{i}.npz"), "-", "0", "0"]))
    finally:
        del os.environ["USER_SCRIPT_PRECISION"]
    for code, _, err in results:
        assert code == 0, err[-3000:]
    one, first, second = (load(tmp_path / f"{name}.npz.float8.npz") for name in ("one", "w0", "w1"))
    assert len(one) == 6 and any(a.max() > 0 for a in one)  # The hidden layer's 3 scales and 3 histories.
    for a, b, c in zip(first, second, one, strict=True):
        np.testing.assert_array_equal(a, b)  # The same on both workers.
        np.testing.assert_allclose(a, c, rtol=2**-6)  # As one process (bfloat16's last bits aside).


@pytest.mark.parametrize("jit_compile", ["0", "1"], ids=["no_xla", "xla"])
def test_bfloat16_weights_on_two_workers_kill_9_then_resume_match_unbroken(tmp_path, monkeypatch, jit_compile):
    """bfloat16 weights (Kahan buffers, slots rounded by seeded random bits) under a
    two-worker MultiWorkerMirroredStrategy, XLA off and on: both workers killed with
    SIGKILL after a checkpoint, the same command again resumes, and every worker ends with
    the weights of an unbroken two-worker run, bit for bit."""
    monkeypatch.setenv("USER_SCRIPT_PRECISION", "bfloat16")  # For the workers start_workers starts.
    monkeypatch.setenv("USER_SCRIPT_JIT_COMPILE", jit_compile)

    def args(name, seconds):  # No dropout: its masks differ between replicas.
        return lambda i: [SCRIPT, str(tmp_path / f"{name}{{worker}}.npz"), str(tmp_path / name), seconds, "0"]

    for code, _, err in wait_all(start_workers(args("unbroken", "0"))):
        assert code == 0, err[-3000:]
    processes = start_workers(args("broken", "0.3"))
    try:
        for _ in range(1200):  # A checkpoint mid-run (epoch 0 is 8 batches).
            if (tmp_path / "broken" / "ckpt-12.index").exists() or any(p.poll() is not None for p in processes):
                break
            time.sleep(0.05)
        assert all(p.poll() is None for p in processes), "a worker ended before it could be killed"
        for p in processes:
            p.send_signal(signal.SIGKILL)
    finally:
        for p in processes:
            p.kill()
            p.communicate(timeout=60)
    assert not list(tmp_path.glob("broken*.npz"))
    for code, _, err in wait_all(start_workers(args("broken", "0"))):
        assert code == 0, err[-3000:]
    unbroken = load(tmp_path / "unbroken0.npz")
    for worker in range(2):
        for a, b in zip(load(tmp_path / f"broken{worker}.npz"), unbroken, strict=True):
            np.testing.assert_array_equal(a, b)
    for a, b in zip(load(tmp_path / "unbroken1.npz"), unbroken, strict=True):
        np.testing.assert_array_equal(a, b)
    # The epoch it resumed in logs its loss over all its batches (the running sums were checkpointed).
    history = lambda run: json.loads((tmp_path / f"{run}0.npz.history.json").read_text())  # noqa: E731
    losses, expected = history("broken")["loss"], history("unbroken")["loss"]
    # Not to the bit: the sums restored are split evenly across the workers, then added to in another order.
    assert losses and losses == pytest.approx(expected[-len(losses) :], rel=1e-6)
