"""Exception types that end a run with one line instead of a traceback, and the test every
count argument (a batch size, a number of epochs or steps) is put to before one is raised."""

import re
import threading

import numpy as np

# Set by a SIGTERM handler that raises `Preempted` (train.py's, outside training), before it
# raises: a raise that lands in a finalizer (`__del__`, a weakref callback) is printed and
# dropped by Python, and the run would go on as if no SIGTERM had come. tfmp.fit's SIGTERM
# guard and the handler's block read it back (tfmp.cli, tfmp.guards).
SIGTERM_RECEIVED = threading.Event()


def is_count(value, low=0):
    """Whether `value` is an integer (Python's or numpy's, not a bool) >= `low`."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool) and value >= low


def first_line(error, limit=200, default=None):
    """The first line of `error`'s message, cut to `limit` characters, for one-line reports;
    `default` (the exception's type name unless given) when the message is empty."""
    text = str(error).strip()
    if not text:
        return type(error).__name__ if default is None else default
    return text.splitlines()[0][:limit]


def some_of(names, shown=5):
    """`names` for a one-line report: the first `shown`, comma-separated, then "and N more"."""
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


def column_width(names, least):
    """The width of a table's column that prints each of `names` whole, at least `least`: paths cut to one
    prefix would read alike (`bidirectional/forward_lstm` and `bidirectional/forward_lstm/lstm_cell`)."""
    return max([least, *map(len, names)])


class UsageError(ValueError):
    """A bad setting from the user: the message names the value, the choices and the fix.

    `train.py` prints it as one line and exits with status 2, without a traceback.
    """


def usage_error_inside(error):
    """The UsageError that tfmp's own Python code raised inside a tf.data pipeline (loading a PyDataset's or a
    generator's batches), which TensorFlow hands on as its own error with the message in its text, `error` its
    cause; None where `error` carries none."""
    carried = re.search(r"\bUsageError: (.+)", str(error))
    if not carried:
        return None
    usage = UsageError(carried.group(1).strip())
    usage.__cause__ = error  # As `raise usage from error` sets it.
    return usage


class TrainingError(RuntimeError):
    """Training had to stop (non-finite values, a failed checkpoint write): exit status 1."""


class Preempted(RuntimeError):
    """SIGTERM arrived; a checkpoint was saved. Exit status 75 (temporary failure: rerun)."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during `tfmp.fit` with a checkpoint directory; a checkpoint was saved. A
    KeyboardInterrupt, as Ctrl-C is elsewhere; exit status 130 from the command line."""


class PeerLost(RuntimeError):
    """Another worker of the job died or stopped answering: exit status 76 (rerun to resume)."""
