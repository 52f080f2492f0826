"""python -m tfmp.launch's stall watch, with stand-in workers that load no TensorFlow: a worker
whose fit has returned is no longer watched (its script may save or exit as slowly as it needs),
a worker inside its fit still is, and the report names each worker's state. tfmp.fit marks its
progress file done as it returns."""

import os
import subprocess
import sys

import keras
import numpy as np
from conftest import REPO

import tfmp
from tfmp import launch

# Worker i writes 3 batches, then returns from "its fit" if `argv[1 + i]` is "done" (or stays in it), then
# sleeps `argv[3 + i]` s and exits 0, as a script that saves its model after fit.
WORKER = """
import json, os, sys, time
from tfmp import launch
index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
path = os.environ[launch.PROGRESS_ENV]
launch.write_progress(path, 3)
launch.write_progress(path, 3, done=sys.argv[1 + index] == "done")
time.sleep(float(sys.argv[3 + index]))
"""


def launch_job(tmp_path, *args):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "PYTHONPATH": REPO, "TMPDIR": str(tmp_path)}
    options = ["--workers=2", "--stall_timeout=1", "--grace_seconds=1"]
    command = [sys.executable, "-m", "tfmp.launch", *options, str(script), *map(str, args)]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def test_workers_whose_fit_returned_are_not_watched_and_leave_no_progress_files(tmp_path):
    job = launch_job(tmp_path, "done", "done", 4, 3)  # 3-4 s after the last step, with a stall timeout of 1 s.
    assert job.returncode == 0, job.stderr
    assert not list(tmp_path.glob("tfmp-launch-*"))  # The launcher's progress files, removed.


def test_a_worker_still_in_its_fit_is_watched_and_the_report_names_each_state(tmp_path):
    job = launch_job(tmp_path, "done", "training", 0, 60)
    assert job.returncode == launch.STALLED, job.stderr
    assert (
        "no worker finished a step for 1 s: worker 0 (exited with status 0, fit returned, 3 batches), "
        "worker 1 (running, 3 batches); ended the job"
    ) in job.stderr
    assert not list(tmp_path.glob("tfmp-launch-*"))


def test_fit_marks_its_progress_file_done_as_it_returns(tmp_path, monkeypatch):
    path = tmp_path / "progress"
    monkeypatch.setenv(launch.PROGRESS_ENV, str(path))
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    x = np.ones((32, 4), np.float32)
    tfmp.fit(model, x, x[:, :1], batch_size=8, epochs=1, verbose=0, callbacks=[Peek(path)])
    assert launch.read_progress(path)[0::2] == (4, True)


class Peek(keras.callbacks.Callback):
    """Checks that the progress file is not done while the fit trains."""

    def __init__(self, path):
        super().__init__()
        self.path = path

    def on_epoch_end(self, epoch, logs=None):
        assert launch.read_progress(self.path)[0::2] == (4, False)
