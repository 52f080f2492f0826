"""Start N workers of a multi-worker job, watch them, and end the job cleanly.

    python -m tfmp.launch --workers=3 train.py --model=cnn --epochs=2
    python -m tfmp.launch --workers=2 my_script.py                  # any script using tfmp.fit
    python -m tfmp.launch --hosts=a:2222,b:2222 --index=0 train.py  # once per host

Each worker gets a `TF_CONFIG` naming the cluster and its task (`tfmp.get_strategy("auto")`
then picks multi_worker). Output is merged line by line with a `[worker i]` prefix: the
chief's stdout and stderr in full, the others' stderr. When a worker exits with an error
or is killed, the others get SIGTERM, then SIGKILL after `--grace_seconds`; the launcher
exits with the first failure's status and one line saying which worker ended how.
SIGTERM or Ctrl-C to the launcher is passed to every worker (they checkpoint and exit 75).
A job in which no worker finishes a step for `--stall_timeout` seconds (a training step, or
a batch of a validation pass; or a first step within `--startup_timeout`) is ended too,
naming each worker's state and progress. A worker whose fit has returned is no longer
watched: what its script does next (saving, evaluating, exiting) takes as long as it takes.
Rerunning the same command resumes from the chief's checkpoint.

The launcher imports neither TensorFlow nor Keras.
"""

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

# tfmp.fit writes its batch count there after each step, renews its time at each validation batch, and
# adds "done" when it returns (`write_progress`).
PROGRESS_ENV = "TFMP_PROGRESS_FILE"
STALLED = 124  # Exit status of a job ended for making no progress.


def write_progress(path, batches, done=False):
    """A worker's progress file: its batch count, and "done" once its fit has returned."""
    with open(path, "w") as f:
        f.write(f"{batches} done" if done else str(batches))


def read_progress(path):
    """(batches done, time of the last step or validation batch, whether its fit has returned) from a
    worker's progress file, or None."""
    try:
        with open(path) as f:
            words = f.read().split()
        return int(words[0]) if words else 0, os.path.getmtime(path), words[1:] == ["done"]
    except (OSError, ValueError):
        return None


def free_ports(n, host="127.0.0.1"):
    """`n` ports that are free on `host` now."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def describe(status):
    """'exited with status 3' / 'was killed by SIGKILL'."""
    if status < 0:
        return f"was killed by {signal.Signals(-status).name}"
    return f"exited with status {status}"


def exit_status(status):
    """The shell's convention: 128 + N for a worker killed by signal N."""
    return 128 - status if status < 0 else status


class Worker:
    """One worker process, its output relayed with a prefix, its progress file."""

    def __init__(self, index, command, env, progress_path, relay_stdout):
        self.index, self.progress_path = index, progress_path
        self.process = subprocess.Popen(
            command,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
            start_new_session=True,  # Its own process group: stopping it stops its children too.
        )
        self.threads = [
            threading.Thread(target=self._relay, args=(self.process.stdout, sys.stdout, relay_stdout), daemon=True),
            threading.Thread(target=self._relay, args=(self.process.stderr, sys.stderr, True), daemon=True),
        ]
        for thread in self.threads:
            thread.start()

    def _relay(self, stream, target, show):
        for line in stream:
            if show:
                target.write(f"[worker {self.index}] {line}")
                target.flush()

    def signal(self, signum):
        try:
            os.killpg(self.process.pid, signum)
        except ProcessLookupError:
            pass

    @property
    def progress(self):
        """(batches done, time of the last step, fit returned) as the worker last wrote them, or None."""
        return read_progress(self.progress_path)

    @property
    def stopped(self):
        """Whether the process is stopped (SIGSTOP, a debugger) rather than running."""
        try:
            with open(f"/proc/{self.process.pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
        except OSError:
            return False


def parse(argv):
    parser = argparse.ArgumentParser(
        prog="python -m tfmp.launch",
        usage="%(prog)s [--workers=N | --hosts=HOST:PORT,... --index=I] [options] SCRIPT [ITS ARGUMENTS]",
        description=__doc__.split("\n\n")[0],
        allow_abbrev=False,
    )
    parser.add_argument("--workers", type=int, default=2, help="worker processes on this host (default 2)")
    parser.add_argument("--hosts", default=None, help="HOST:PORT,... of every worker of a job over several hosts")
    parser.add_argument("--index", type=int, default=None, help="with --hosts: this host's worker index")
    parser.add_argument("--grace_seconds", type=float, default=10.0, help="SIGTERM to SIGKILL (default 10)")
    parser.add_argument(
        "--stall_timeout", type=float, default=900.0, help="end a job with no finished step for this long (900 s)"
    )
    parser.add_argument(
        "--startup_timeout", type=float, default=1800.0, help="end a job with no first step after this long (1800 s)"
    )
    parser.add_argument(  # Optional for argparse, which would also call the script's arguments required.
        "script", nargs="?", help="train.py or any script that calls tfmp.get_strategy('auto') / tfmp.fit"
    )
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    options = parser.parse_args(argv)
    if options.hosts:
        if options.index is None:
            parser.error("--hosts needs --index (this host's place in the list)")
        hosts = options.hosts.split(",")
        for host in hosts:
            name, _, port = host.rpartition(":")
            if not name or ":" in name or not port.isdigit():
                parser.error(f"--hosts: {host!r} is not HOST:PORT (each worker's address and port, e.g. 10.0.0.1:2222)")
        if not 0 <= options.index < len(hosts):
            named = f"{len(hosts)} worker{'s' if len(hosts) > 1 else ''}"
            parser.error(f"--index={options.index} must be in 0..{len(hosts) - 1}: --hosts names {named}")
    elif options.workers < 1:
        parser.error(f"--workers must be >= 1, got {options.workers}")
    for name in ("grace_seconds", "stall_timeout", "startup_timeout"):
        value, zero_ok = getattr(options, name), name == "grace_seconds"  # 0: SIGKILL at once.
        if not (value >= 0 if zero_ok else value > 0):  # nan too.
            parser.error(f"--{name}={value:g}: seconds, {'0 or more' if zero_ok else 'more than 0'}")
    if options.script is None:
        parser.error("no script to run: give it, and its own arguments, after the launcher's")
    if not os.path.exists(options.script):
        parser.error(f"no script {options.script}")
    return options


def main(argv=None):
    options = parse(sys.argv[1:] if argv is None else argv)
    if options.hosts:
        cluster, indices = options.hosts.split(","), [options.index]
    else:
        cluster, indices = [f"127.0.0.1:{p}" for p in free_ports(options.workers)], range(options.workers)
    progress_dir = tempfile.mkdtemp(prefix="tfmp-launch-")
    print(
        f"tfmp.launch: {len(cluster)} worker(s) {', '.join(cluster)}; stall timeout {options.stall_timeout:g} s "
        f"(start-up {options.startup_timeout:g} s)",
        file=sys.stderr,
        flush=True,
    )
    workers = []
    for index in indices:
        tf_config = {"cluster": {"worker": cluster}, "task": {"type": "worker", "index": index}}
        progress = os.path.join(progress_dir, f"worker-{index}")
        env = {**os.environ, "TF_CONFIG": json.dumps(tf_config), PROGRESS_ENV: progress}
        command = [sys.executable, options.script, *options.args]
        workers.append(Worker(index, command, env, progress, relay_stdout=index == 0))
    try:
        return _supervise(workers, options)
    finally:
        shutil.rmtree(progress_dir, ignore_errors=True)


def _supervise(workers, options):
    interrupted = []

    def forward(signum, frame):
        interrupted.append(signum)
        for w in workers:
            w.signal(signal.SIGTERM)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, forward)
    started = time.time()
    failure = None
    while True:
        statuses = [w.process.poll() for w in workers]
        if all(s is not None for s in statuses):
            break
        bad = next((w for w, s in zip(workers, statuses, strict=True) if s not in (None, 0)), None)
        if bad is not None and failure is None and not interrupted:
            failure = (bad, bad.process.returncode)
            _stop(workers, options.grace_seconds)
            break
        progress = [w.progress for w in workers]
        steps = [p[1] for p in progress if p]
        # Before the first step (start-up, compiling) the longer start-up limit applies; once every worker still
        # running has returned from its fit, none.
        limit, last = (options.stall_timeout, max(steps)) if steps else (options.startup_timeout, started)
        watched = any(s is None and not (p and p[2]) for s, p in zip(statuses, progress, strict=True))
        if watched and time.time() - last > limit and not interrupted:
            report = ", ".join(
                f"worker {w.index} ({_state(w, s, p)}, {p[0] if p else 0} batches)"
                for w, s, p in zip(workers, statuses, progress, strict=True)
            )
            print(
                f"tfmp.launch: no worker finished a step for {limit:g} s: {report}; ended the job",
                file=sys.stderr,
                flush=True,
            )
            _stop(workers, options.grace_seconds)
            return STALLED
        time.sleep(0.2)
    for w in workers:
        for thread in w.threads:
            thread.join(timeout=5)
    if failure is not None:
        worker, status = failure
        print(
            f"tfmp.launch: worker {worker.index} {describe(status)}; stopped the other workers",
            file=sys.stderr,
            flush=True,
        )
        return exit_status(status)
    statuses = [w.process.returncode for w in workers]
    failed = next(((w, s) for w, s in zip(workers, statuses, strict=True) if s != 0), None)
    if failed is None:
        return 0
    worker, status = failed
    how = "after SIGTERM to the launcher" if interrupted else ""
    print(f"tfmp.launch: worker {worker.index} {describe(status)} {how}".rstrip(), file=sys.stderr, flush=True)
    return exit_status(status)


def _state(worker, status, progress):
    """'running', 'stopped' (SIGSTOP), 'exited with status 0', ..., and whether its fit has returned."""
    state = describe(status) if status is not None else "stopped" if worker.stopped else "running"
    return f"{state}, fit returned" if progress and progress[2] else state


def _stop(workers, grace_seconds):
    """SIGTERM to every live worker, SIGKILL to those alive after the grace period."""
    for w in workers:
        if w.process.poll() is None:
            w.signal(signal.SIGTERM)
            w.signal(signal.SIGCONT)  # A stopped process must run to act on SIGTERM.
    deadline = time.time() + grace_seconds
    while time.time() < deadline and any(w.process.poll() is None for w in workers):
        time.sleep(0.1)
    for w in workers:
        if w.process.poll() is None:
            w.signal(signal.SIGKILL)
        w.process.wait()
        w.signal(signal.SIGKILL)  # Anything left in its process group.


if __name__ == "__main__":
    sys.exit(main())
