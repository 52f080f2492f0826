"""What "auto" decided for a run (precision, XLA), kept in the run's directory.

A timing-based choice can come out otherwise on another run, and the two code paths give
other weights. So the first decision is written to decisions.json beside the run's files,
and a resumed run, or a rerun of the same command in the same directory, takes it from
there instead of deciding again. A run whose decision differs from the recorded one (asked
for explicitly, or impossible here) says so in one line.
"""

import json
import os

from absl import logging

from tfmp import files
from tfmp.errors import UsageError

FILE = "decisions.json"


def path(directory):
    return os.path.join(directory, FILE)


def recorded(directory, name):
    """The decision `name` recorded in `directory` ({"value": ..., "reason": ...}), or None."""
    if not directory or not os.path.exists(path(directory)):
        return None
    try:
        with open(path(directory)) as f:
            return json.load(f).get(name)
    except (OSError, ValueError) as e:
        raise UsageError(f"{path(directory)} is unreadable ({type(e).__name__}); move it away to decide anew") from e


def record(directory, name, value, reason):
    """Records decision `name` in `directory` (atomically, keeping the other decisions)."""
    target = path(directory)
    kept = {}
    if os.path.exists(target):
        with open(target) as f:
            kept = json.load(f)
    kept[name] = {"value": value, "reason": reason}
    files.write_json(target, kept)


def reused_reason(directory, entry):
    """Why a run took the recorded decision: where it is, and why it was made."""
    return f"as recorded in {path(directory)}: {entry['reason'].splitlines()[0]}"


def say_if_different(directory, name, entry, value, show=str):
    """Logs one line when `value` is not the one recorded; returns whether it differs."""
    if entry is None or entry["value"] == value:
        return False
    logging.warning(
        "%s: %s, where %s recorded %s (%s): this run's weights will not match the recorded run's",
        name,
        show(value),
        path(directory),
        show(entry["value"]),
        entry["reason"].splitlines()[0],
    )
    return True
