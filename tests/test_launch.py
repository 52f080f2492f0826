"""python -m tfmp.launch on 127.0.0.1: 3 workers match one process; a killed worker ends
the job fast with no process left; a stopped worker ends it after the stall timeout; SIGTERM
to the launcher checkpoints every worker, exits 75, and a rerun resumes."""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import REPO, assert_same

from tfmp import launch

pytestmark = pytest.mark.slow  # Several train.py / worker processes.

SCRIPT = os.path.join(REPO, "tests", "user_script.py")
ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}


def load(path):
    return list(np.load(path).values())


def children(pid):
    """Process ids whose parent is `pid`."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    return found


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def start(*args, options=(), env=ENV):
    return subprocess.Popen(
        [sys.executable, "-m", "tfmp.launch", *options, SCRIPT, *map(str, args)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def batches_trained(pid):
    """The batch count a launcher's worker `pid` last reported (its progress file), 0 before any."""
    with open(f"/proc/{pid}/environ", "rb") as f:
        env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
    progress = launch.read_progress(env[launch.PROGRESS_ENV.encode()])
    return progress[0] if progress else 0


def wait_for(path, process, timeout=180):
    deadline = time.time() + timeout
    while time.time() < deadline and not os.path.exists(path):
        assert process.poll() is None, process.communicate()[1][-3000:]
        time.sleep(0.1)
    assert os.path.exists(path), f"no {path} after {timeout} s"


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    out = tmp_path_factory.mktemp("one") / "w.npz"
    result = subprocess.run([sys.executable, SCRIPT, str(out), "-", "0", "0", "48"], env=ENV, capture_output=True)
    assert result.returncode == 0, result.stderr[-3000:]
    return load(out)


def test_three_workers_match_one_process(tmp_path, one_process):
    launcher = start(tmp_path / "w{worker}.npz", "-", 0, 0, 48, options=["--workers=3"])
    out, err = launcher.communicate(timeout=600)
    assert launcher.returncode == 0, err[-3000:]
    assert "tfmp.launch: 3 worker(s) 127.0.0.1:" in err
    for i in range(3):
        assert_same(load(tmp_path / f"w{i}.npz"), one_process)


def test_killed_worker_ends_the_job_fast_and_leaves_no_process(tmp_path):
    launcher = start(tmp_path / "w{worker}.npz", tmp_path / "ckpt", 0.3, 0, 48, options=["--workers=3"])
    wait_for(tmp_path / "ckpt" / "checkpoint", launcher)
    workers = children(launcher.pid)
    assert len(workers) == 3
    os.kill(workers[1], signal.SIGKILL)
    killed = time.time()
    _, err = launcher.communicate(timeout=120)
    assert time.time() - killed < 60
    assert launcher.returncode != 0
    ends = [line for line in err.splitlines() if line.startswith("tfmp.launch: worker")]
    assert ends == ["tfmp.launch: worker 1 was killed by SIGKILL; stopped the other workers"], err[-3000:]
    assert not any(alive(pid) for pid in workers)


def test_stopped_workers_end_the_job_after_the_stall_timeout(tmp_path):
    launcher = start(
        tmp_path / "w{worker}.npz",
        tmp_path / "ckpt",
        0.3,
        0,
        48,
        options=["--workers=2", "--stall_timeout=8", "--grace_seconds=5"],
    )
    wait_for(tmp_path / "ckpt" / "checkpoint", launcher)
    workers = children(launcher.pid)
    # Stopped as they train, past the first epoch's end: its validation pass compiles a step,
    # which on a loaded machine (a GPU's, with XLA) took longer than the 8 s themselves.
    deadline = time.time() + 120
    while min(batches_trained(pid) for pid in workers) <= 4:
        assert launcher.poll() is None, launcher.communicate()[1][-3000:]
        assert time.time() < deadline, "a worker did not train past its first epoch in 120 s"
        time.sleep(0.05)
    # Every worker stopped (a hung file system, say): no worker can notice a lost peer, so
    # only the launcher's stall timeout ends the job. With one worker stopped, the other's
    # collective may time out first and end the job as PeerLost (exit 76) instead.
    for pid in workers:
        os.kill(pid, signal.SIGSTOP)
    stopped = time.time()
    _, err = launcher.communicate(timeout=120)
    assert launcher.returncode == launch.STALLED and time.time() - stopped < 60, err[-3000:]
    lines = [line for line in err.splitlines() if "no worker finished a step for 8 s" in line]
    assert len(lines) == 1 and "worker 0 (stopped" in lines[0] and "worker 1 (stopped" in lines[0], err[-3000:]
    assert not any(alive(pid) for pid in workers)


def test_a_validation_pass_longer_than_the_stall_timeout_is_no_stall(tmp_path):
    # Each of its 2 batches takes 8 s more: no step for 16 s, where the stall timeout is 12.
    env = {**ENV, "USER_SCRIPT_VALIDATION_SECONDS": "8"}
    launcher = start(tmp_path / "w{worker}.npz", options=["--workers=2", "--stall_timeout=12"], env=env)
    _, err = launcher.communicate(timeout=600)
    assert launcher.returncode == 0, err[-3000:]
    assert (tmp_path / "w1.npz").exists()


def test_sigterm_to_the_launcher_checkpoints_exits_75_and_a_rerun_resumes(tmp_path, one_process):
    args = (tmp_path / "w{worker}.npz", tmp_path / "ckpt", 0.3, 0, 48)
    launcher = start(*args, options=["--workers=3"])
    wait_for(tmp_path / "ckpt" / "checkpoint", launcher)
    launcher.send_signal(signal.SIGTERM)
    _, err = launcher.communicate(timeout=180)
    assert launcher.returncode == 75, err[-3000:]
    assert err.count("preempted: SIGTERM") == 3  # One line from each worker.
    assert not (tmp_path / "w0.npz").exists()
    rerun = start(*args[:2], 0, 0, 48, options=["--workers=3"])
    _, err = rerun.communicate(timeout=600)
    assert rerun.returncode == 0, err[-3000:]
    for i in range(3):
        assert_same(load(tmp_path / f"w{i}.npz"), one_process)


def test_bad_launcher_arguments(capsys):
    for args, words in [
        (["--workers=0", SCRIPT], "--workers must be >= 1"),
        (["--hosts=a:1,b:2", SCRIPT], "--hosts needs --index"),
        (["--hosts=a:1,b:2", "--index=2", SCRIPT], "--index=2 must be in 0..1: --hosts names 2 workers"),
        (["--hosts=10.0.0.1", "--index=0", SCRIPT], "--hosts: '10.0.0.1' is not HOST:PORT"),  # Not "0 in 0..0".
        (["--hosts=a:1,b:x", "--index=0", SCRIPT], "--hosts: 'b:x' is not HOST:PORT"),
        (["no_such_script.py"], "no script no_such_script.py"),
        ([], "no script to run: give it, and its own arguments, after the launcher's"),  # Not "required: args".
        (["--workers=2"], "no script to run"),
        (["--stall_timeout=0", SCRIPT], "--stall_timeout=0: seconds, more than 0"),
        (["--startup_timeout=nan", SCRIPT], "--startup_timeout=nan: seconds, more than 0"),
        (["--grace_seconds=-1", SCRIPT], "--grace_seconds=-1: seconds, 0 or more"),
    ]:
        with pytest.raises(SystemExit) as e:
            launch.parse(args)
        assert e.value.code == 2 and f"python -m tfmp.launch: error: {words}" in capsys.readouterr().err, words
    assert launch.parse(["--grace_seconds=0", SCRIPT]).grace_seconds == 0


def test_without_the_launcher_a_worker_that_loses_a_peer_says_so_in_one_line(tmp_path):
    from test_loop import start_workers

    model_dir = tmp_path / "run"
    flags = [
        "--strategy=multi_worker",
        "--dataset=synthetic",
        "--epochs=1",
        "--steps_per_epoch=100000",
        "--batch_size=16",
        "--checkpoint_every=5",
        f"--model_dir={model_dir}",
        "--precision=float32",
    ]
    processes = start_workers(lambda i: [os.path.join(REPO, "train.py"), *flags])
    try:
        wait_for(model_dir / "checkpoints" / "checkpoint", processes[0])
        processes[1].kill()
        _, err = processes[0].communicate(timeout=120)
    finally:
        for p in processes:
            p.kill()
    assert processes[0].returncode == 76, err[-3000:]
    assert err.strip().splitlines() == [err.strip()], err[-3000:]
    assert "train.py: lost a peer: worker 1 stopped answering" in err and "is intact; rerun the job" in err


def test_train_py_through_the_launcher(tmp_path):
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tfmp.launch",
            "--workers=2",
            "train.py",
            "--dataset=synthetic",
            "--epochs=1",
            "--steps_per_epoch=3",
            "--batch_size=16",
            "--precision=float32",
            f"--model_dir={tmp_path / 'run'}",
        ],
        cwd=REPO,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = launcher.communicate(timeout=600)
    assert launcher.returncode == 0, err[-3000:]
    assert "[worker 0] strategy    multi_worker (2 replicas)" in out and "[worker 0] test accuracy" in out
    assert "[worker 1]" not in out  # The other workers' stdout is not repeated; their stderr would be.
    assert (tmp_path / "run" / "metrics.json").exists()


def test_two_hosts_each_with_its_own_launcher(tmp_path, one_process):
    """--hosts/--index, as on two machines: here two launchers on 127.0.0.1."""
    hosts = ",".join(f"127.0.0.1:{p}" for p in launch.free_ports(2))
    launchers = [
        start(tmp_path / "w{worker}.npz", "-", 0, 0, 48, options=[f"--hosts={hosts}", f"--index={i}"]) for i in (0, 1)
    ]
    for launcher in launchers:
        _, err = launcher.communicate(timeout=600)
        assert launcher.returncode == 0, err[-3000:]
    for i in range(2):
        assert_same(load(tmp_path / f"w{i}.npz"), one_process)
