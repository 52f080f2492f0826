"""A run's directory: one run at a time in it, the flag that names it in a message, the settings
an exact resume from it depends on, and whether it can be written."""

import json
import os
import tempfile

import tensorflow as tf

from tfmp import files
from tfmp.errors import UsageError


class RunLock:
    """One run at a time in a directory: an exclusive `flock` on DIRECTORY/.lock.

    The kernel drops the lock when its process ends, however it ends, so a crashed run
    never leaves the directory stuck. The file names its holder for the message. A run
    holds one lock: inside a directory this process has locked (train.py's --model_dir),
    `tfmp.fit`'s lock on its checkpoint_dir takes nothing more.
    """

    def __init__(self, directory, flag="--model_dir"):
        self.path = os.path.join(directory, ".lock")
        self.directory, self.flag, self._file = directory, flag, None

    def __enter__(self):
        import fcntl
        import socket
        import time

        os.makedirs(self.directory, exist_ok=True)
        if self._held_within():  # This process's run already owns it (train.py's --model_dir).
            return self
        handle = open(self.path, "a+")  # noqa: SIM115 - held until __exit__.
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as e:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            handle.close()
            raise UsageError(
                f"{self.flag}={self.directory} is in use by {holder}; wait for it to finish, stop it, or use "
                f"another {self.flag}"
            ) from e
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}")
        handle.flush()
        self._file = handle
        _HELD[os.path.realpath(self.directory)] = self.flag
        return self

    def __exit__(self, *exc):
        if self._file is None:
            return False
        _HELD.pop(os.path.realpath(self.directory), None)
        os.remove(self.path)  # Still ours: the lock is held until the close below.
        self._file.close()
        return False

    def _held_within(self):
        """Whether this process holds the lock of a directory above this one (the same
        directory twice is refused, as from another process)."""
        path = os.path.realpath(self.directory)
        return any(path.startswith(held + os.sep) for held in _HELD)


_HELD = {}  # The real paths of the directories whose RunLock this process holds, and the flag naming each.


def flag_for(directory, default="checkpoint_dir"):
    """What names `directory` in a message: the flag of a directory above it whose lock this process's run
    holds (train.py's --model_dir), else `default` (tfmp.fit's argument)."""
    path = os.path.realpath(directory)
    return next((flag for held, flag in _HELD.items() if path.startswith(held + os.sep)), default)


SETTINGS_FILE = "run.json"
# What an exact resume depends on: a rerun that changes one of these is refused.
EXACT = (
    "model",
    "dataset",
    "batch_size",
    "precision",
    "keep_float32",
    "float8_exclude",
    "bf16_rounding",
    "seed",
    "grad_accum_steps",
    "replicas",
    "steps_per_epoch",
)


# What a checkpoint of each precision holds that another cannot restore (float32 and mixed_bfloat16 alike).
_STATE = {
    precision: state
    for state, precisions in {
        "float32 weights": ("float32", "mixed_bfloat16"),
        "float32 weights and a loss scale": ("mixed_float16",),
        "bfloat16 weights": ("bfloat16",),
        "float32 weights and float8 layers' scales": ("float8",),
    }.items()
    for precision in precisions
}


def check_settings(run_dir, settings, latest_path, force=False):
    """Refuses to resume the checkpoint `latest_path` with settings that would change what
    an exact resume means, and `epochs` fewer than the checkpoint already trained; and, even
    forced, another precision form or learning-rate schedule, whose state it cannot restore.

    Args:
        run_dir: the run's directory, holding run.json from the run that saved.
        settings: this run's settings (a dict with the keys of `EXACT`, `epochs` and `lr_schedule`).
        latest_path: the checkpoint to resume, or None (then nothing is checked).
        force: resume even where the `EXACT` settings differ (`--resume=force`).

    Returns:
        Whether a checkpoint is resumed with other settings (forced): run.json, which describes the checkpoints,
        is then rewritten only once the checkpoint is restored.

    Raises:
        UsageError: naming the differences and the ways out.
    """
    path = os.path.join(run_dir, SETTINGS_FILE)
    if not latest_path or not os.path.exists(path):
        return False
    try:
        with open(path) as f:
            saved = json.load(f)
    except (OSError, ValueError) as e:
        raise UsageError(f"{path} is unreadable ({type(e).__name__}); move it away to resume anyway") from e
    forms = [_STATE.get(saved.get("precision")), _STATE.get(settings["precision"])]
    if forms[0] != forms[1] and None not in forms:  # Not even --resume=force restores it.
        raise UsageError(
            f"--model_dir={run_dir} holds a checkpoint of a run in {saved['precision']} ({forms[0]}), and this run "
            f"trains in {settings['precision']} ({forms[1]}): an optimizer's state does not carry over between these "
            f"precisions; resume with --precision={saved['precision']}, or use a new --model_dir"
        )
    # A constant rate is one of the optimizer's variables, a schedule none: neither state loads into the other.
    schedules = [saved.get("lr_schedule", "constant"), settings.get("lr_schedule", "constant")]  # Older: constant.
    if schedules[0] != schedules[1]:
        raise UsageError(
            f"--model_dir={run_dir} holds a checkpoint of a run with --lr_schedule={schedules[0]}, and this run's is "
            f"--lr_schedule={schedules[1]}: an optimizer's state does not carry over between a constant rate and a "
            f"schedule; resume with --lr_schedule={schedules[0]}, or use a new --model_dir"
        )
    changed = [f"{k} {saved[k]} -> {settings[k]}" for k in EXACT if k in saved and saved[k] != settings[k]]
    if changed and not force:
        raise UsageError(
            f"--model_dir={run_dir} holds a checkpoint of a run with other settings ({', '.join(changed)}); "
            "resuming it would not be exact: use a new --model_dir, or --resume=force to continue from it anyway "
            "(a point within an epoch then goes on at the same share of this run's epoch)"
        )
    epochs_done = int(tf.train.load_variable(latest_path, "epoch/.ATTRIBUTES/VARIABLE_VALUE"))
    if settings["epochs"] < epochs_done:
        raise UsageError(
            f"--model_dir={run_dir} has trained {epochs_done} epochs already, more than --epochs={settings['epochs']}; "
            f"give --epochs={epochs_done} or more to continue, or use a new --model_dir"
        )
    return bool(changed)


def save_settings(run_dir, settings):
    """Writes the run's settings beside its checkpoints (atomically)."""
    path = os.path.join(run_dir, SETTINGS_FILE)
    files.write_json(path, settings)


def check_writable(path, flag):
    """Raises UsageError unless files can be written in directory `path`.

    Really tries (permissions alone do not tell, e.g. for root or read-only mounts): a
    temporary file in `path`, or, if `path` does not exist yet, in its nearest existing
    parent. It creates no directory: nothing is left behind, and several workers checking
    one shared path at once cannot remove a directory another has just made.
    """
    if not isinstance(path, str | os.PathLike):
        raise UsageError(f"{flag} must be a directory's path, got {type(path).__name__}")
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        where = "is a file" if probe == os.path.abspath(path) else f"is inside a file ({probe})"
        raise UsageError(f"{flag}={path} {where}, not a directory")
    try:
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as e:
        raise UsageError(f"{flag}={path} cannot be written ({e.strerror or e})") from e
