"""Where Keras' file-writing callbacks write on workers other than the chief.

Several workers writing one path fail or mix their files: HDF5 locks a `.weights.h5` that
another process is writing (ModelCheckpoint, BackupAndRestore: `BlockingIOError`, and the
other worker loses a peer), and TensorBoard gets one event file per worker in one
directory. So on every worker but the chief they write under a temporary directory,
removed when `tfmp.fit` returns, as tfmp's own checkpoints and logs do. They still run on
every worker, as Keras 2 had them run: a save reads variables, which may take every worker.
"""

import contextlib
import os
import shutil
import tempfile

import keras
import tensorflow as tf

# Keras' callbacks that write files, and the attribute that says where.
_PATHS = (
    (keras.callbacks.ModelCheckpoint, "filepath"),
    (keras.callbacks.CSVLogger, "filename"),
    (keras.callbacks.TensorBoard, "log_dir"),
    (keras.callbacks.BackupAndRestore, "backup_dir"),
)


def _made_from(callback, root):
    """The names of `callback`'s attributes that hold `root` or a path under it: the paths it made from it
    (BackupAndRestore's files, at construction; TensorBoard's directories, in an earlier set_model)."""
    under = os.path.join(root, "")
    paths = {name: value for name, value in vars(callback).items() if isinstance(value, str)}
    return [name for name, value in paths.items() if value == root or value.startswith(under)]


def _under(directory, path):
    """`path` (relative, absolute, or a URL such as gs://...) as a path under `directory`."""
    return os.path.join(directory, str(path).split("://")[-1].lstrip("/\\"))


def _copy_backup(source, target):
    """A BackupAndRestore's files (one flat directory), so that this worker resumes from the chief's backup."""
    if not tf.io.gfile.isdir(source):
        return
    tf.io.gfile.makedirs(target)
    for name in tf.io.gfile.listdir(source):
        if not tf.io.gfile.isdir(os.path.join(source, name)):
            tf.io.gfile.copy(os.path.join(source, name), os.path.join(target, name), overwrite=True)


@contextlib.contextmanager
def apart(callbacks, chief):
    """While it lasts, `callbacks`' file-writing Keras callbacks write under a temporary directory unless
    `chief`; their paths are given back, and the directory removed, when it ends. Enter it before the
    callbacks' `set_model` (TensorBoard makes its directories' names there)."""
    if chief or not callbacks:
        yield
        return
    directory = tempfile.mkdtemp(prefix="tfmp-worker-files-")
    given = []  # (callback, attribute, its value): what to give back.
    try:
        for callback in callbacks:
            for kind, attribute in _PATHS:
                if not isinstance(callback, kind):
                    continue
                root = getattr(callback, attribute)
                if kind is keras.callbacks.BackupAndRestore:
                    _copy_backup(root, _under(directory, root))
                for name in _made_from(callback, root):
                    value = getattr(callback, name)
                    given.append((callback, name, value))
                    setattr(callback, name, _under(directory, value))
        yield
    finally:
        for callback, name, value in reversed(given):
            setattr(callback, name, value)
        shutil.rmtree(directory, ignore_errors=True)
