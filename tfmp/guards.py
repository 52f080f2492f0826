"""What `tfmp.fit` does when the run is interrupted: SIGTERM, preemption notices, lost peers."""

import contextlib
import re
import signal
import threading

import tensorflow as tf

from tfmp import distribute
from tfmp.errors import SIGTERM_RECEIVED, Preempted

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


@contextlib.contextmanager
def sigterm_sets(event, active):
    """While active, SIGTERM sets `event` instead of killing the process (main thread only)."""
    if not active or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, lambda *_: event.set())
    if SIGTERM_RECEIVED.is_set():  # Came before training, its exception lost: stop at the first step.
        event.set()
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


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
