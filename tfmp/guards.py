"""What `tfmp.fit` does when the run is interrupted: SIGTERM, Ctrl-C, preemption notices, lost peers."""

import contextlib
import os
import re
import signal
import sys
import threading

import tensorflow as tf

from tfmp import distribute
from tfmp.errors import SIGTERM_RECEIVED, Interrupted, Preempted

_CTRL_C_LINE = b"\nCtrl-C: saving a checkpoint after this update (Ctrl-C again stops at once)\n"
# What a collective op raises when another worker dies or its heartbeats stop.
PEER_ERRORS = (
    tf.errors.UnavailableError,
    tf.errors.AbortedError,
    tf.errors.InternalError,
    tf.errors.CancelledError,
    tf.errors.DeadlineExceededError,
)


def peer_message(error, saver):
    """One line for `PeerLost`: who stopped answering, and what checkpoint is left."""
    tasks = sorted(set(re.findall(r"/job:(\w+)/replica:\d+/task:(\d+)", str(error))))
    who = ", ".join(f"{job} {index}" for job, index in tasks) or "another worker"
    latest = tf.train.latest_checkpoint(saver.restore_from) if saver is not None else None
    kept = f"the last checkpoint, {latest}, is intact" if latest else "no checkpoint was saved yet"
    return f"{who} stopped answering ({type(error).__name__}); {kept}; rerun the job to resume"


class Stop:
    """What asked training to stop after the update under way: SIGTERM or Ctrl-C, or nothing yet."""

    def __init__(self):
        self.cause = None

    def set(self, cause):
        self.cause = self.cause or cause

    def is_set(self):
        return self.cause is not None

    def error(self, step, directory):
        """The exception to raise once the checkpoint at batch `step` is saved in `directory`."""
        kind = Interrupted if self.cause == "Ctrl-C" else Preempted
        return kind(f"{self.cause} at batch {step}: checkpoint saved in {directory}; rerun the same command to resume")


@contextlib.contextmanager
def signals_set(stop, active):
    """While active, SIGTERM and a first Ctrl-C (SIGINT) set `stop` instead of ending the
    process, so that training saves a checkpoint after the update under way. A second
    Ctrl-C interrupts at once, as Python does. Main thread only; SIGINT only where Python's
    own handler has it (not where a program handles it itself)."""
    if not active or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous_int = signal.getsignal(signal.SIGINT)
    trap_int = previous_int is signal.default_int_handler

    def on_interrupt(signum, frame):
        stop.set("Ctrl-C")
        signal.signal(signal.SIGINT, previous_int)  # The next Ctrl-C: at once.
        # os.write to sys.stderr's descriptor (train.py's is not fd 2): a print here could
        # re-enter a print under way. A stream without one (a notebook's) is left alone.
        with contextlib.suppress(OSError, ValueError, AttributeError):
            os.write(sys.stderr.fileno(), _CTRL_C_LINE)

    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set("SIGTERM"))
    if trap_int:
        signal.signal(signal.SIGINT, on_interrupt)
    if SIGTERM_RECEIVED.is_set():  # Came before training, its exception lost: stop at the first step.
        stop.set("SIGTERM")
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        if trap_int:
            signal.signal(signal.SIGINT, previous_int)


def preemption_handler(strategy, saver):
    """TensorFlow's own preemption handling where several hosts must agree on when to save
    (multi-worker, TPU); None elsewhere, where a SIGTERM handler does it."""
    if saver is None or distribute.strategy_name(strategy) not in ("multi_worker", "tpu"):
        return None

    def exit_fn():
        raise Preempted(f"SIGTERM: checkpoint saved in {saver.directory}; rerun the same command to resume")

    config = tf.distribute.experimental.TerminationConfig(exit_fn=exit_fn)
    return tf.distribute.experimental.PreemptionCheckpointHandler(
        strategy.cluster_resolver, saver.manager, termination_config=config
    )
