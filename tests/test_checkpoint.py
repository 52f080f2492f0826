"""tfmp.checkpoint on its own: a save restores exactly, a broken state file is one clear
error, a run directory is one run at a time (one lock per run), settings that would make a
resume inexact are refused."""

import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmp import checkpoint
from tfmp.errors import UsageError


def _model():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(keras.optimizers.SGD(0.1, momentum=0.9), "mse")
    model.optimizer.build(model.trainable_variables)
    return model


def test_a_save_restores_weights_slots_and_counters(tmp_path):
    model = _model()
    model.optimizer.apply([tf.ones_like(v) for v in model.trainable_variables], model.trainable_variables)
    saved = [w.numpy().copy() for w in model.weights] + [v.numpy().copy() for v in model.optimizer.variables]
    path = checkpoint.Checkpointer(str(tmp_path), model, model.optimizer).save(step=7, epoch=1, position=9)
    assert checkpoint.latest(str(tmp_path)) == path and checkpoint.step_of(path) == 7
    other = _model()
    restorer = checkpoint.Checkpointer(str(tmp_path), other, other.optimizer)
    assert restorer.restore() == 7 and (int(restorer.epoch), int(restorer.position)) == (1, 9)
    restored = [w.numpy() for w in other.weights] + [v.numpy() for v in other.optimizer.variables]
    for a, b in zip(saved, restored, strict=True):
        np.testing.assert_array_equal(a, b)


def test_nothing_saved_yet_and_a_garbage_state_file(tmp_path):
    assert checkpoint.latest(str(tmp_path)) is None and checkpoint.step_of(None) == 0
    (tmp_path / "checkpoint").write_bytes(b"\xff\xfe not a checkpoint state")
    with pytest.raises(UsageError, match="checkpoint is unreadable"):
        checkpoint.latest(str(tmp_path))


def test_one_run_at_a_time_and_one_lock_per_run(tmp_path):
    run_dir = tmp_path / "run"
    with checkpoint.RunLock(str(run_dir)):
        # Another process cannot take it, and is told who holds it.
        held = subprocess.run(
            [sys.executable, "-c", f"from tfmp import checkpoint\nwith checkpoint.RunLock({str(run_dir)!r}): pass"],
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert held.returncode != 0 and f"--model_dir={run_dir} is in use by pid {os.getpid()}" in held.stderr
        # Inside the directory this run holds (tfmp.fit's checkpoint_dir under train.py's
        # --model_dir) no second lock is taken; the same directory twice is refused.
        with checkpoint.RunLock(str(run_dir / "checkpoints"), "checkpoint_dir"):
            assert not (run_dir / "checkpoints" / ".lock").exists()
        with pytest.raises(UsageError, match="is in use by"):
            with checkpoint.RunLock(str(run_dir)):
                pass
    assert not (run_dir / ".lock").exists()
    with checkpoint.RunLock(str(run_dir / "checkpoints"), "checkpoint_dir"):  # Its own lock, now.
        assert (run_dir / "checkpoints" / ".lock").exists()


def test_settings_that_change_an_exact_resume_are_refused(tmp_path):
    model = _model()
    path = checkpoint.Checkpointer(str(tmp_path / "ckpt"), model, model.optimizer).save(step=4, epoch=2)
    settings = {key: 1 for key in checkpoint.EXACT} | {"epochs": 3}
    checkpoint.save_settings(str(tmp_path), settings)
    checkpoint.check_settings(str(tmp_path), settings, path)  # The same: fine.
    changed = {**settings, "seed": 2}
    with pytest.raises(UsageError, match=r"other settings \(seed 1 -> 2\).*--resume=force"):
        checkpoint.check_settings(str(tmp_path), changed, path)
    checkpoint.check_settings(str(tmp_path), changed, path, force=True)
    with pytest.raises(UsageError, match="trained 2 epochs already, more than --epochs=1"):
        checkpoint.check_settings(str(tmp_path), {**settings, "epochs": 1}, path)


def test_callbacks_state_round_trips_and_an_older_checkpoint_without_it_restores(tmp_path):
    """EarlyStopping's counts, best value and best weights (bfloat16 ones too), ReduceLROnPlateau's
    and ModelCheckpoint's state come back from a checkpoint; one written without callbacks'
    state (an older tfmp's) still restores."""
    model = _model()
    stopping = keras.callbacks.EarlyStopping(patience=3, restore_best_weights=True)
    stopping.wait, stopping.best, stopping.best_epoch = 2, np.float32(0.25), 4
    bfloat16 = tf.bfloat16.as_numpy_dtype
    stopping.best_weights = [np.arange(6, dtype=np.float32).reshape(3, 2), np.array([1.5, -2], bfloat16)]
    plateau = keras.callbacks.ReduceLROnPlateau()
    plateau.wait, plateau.cooldown_counter, plateau.best = 1, 3, float("inf")
    best_only = keras.callbacks.ModelCheckpoint(str(tmp_path / "best.keras"), save_best_only=True)
    best_only.best = 0.5
    saver = checkpoint.Checkpointer(str(tmp_path / "new"), model, model.optimizer)
    saver.callbacks.apply([stopping, keras.callbacks.History(), plateau, best_only])
    saver.callbacks.stopped = 5
    saver.save(step=3, epoch=6)
    restorer = checkpoint.Checkpointer(str(tmp_path / "new"), model, model.optimizer)
    assert restorer.restore() == 3
    fresh, fresh_plateau = keras.callbacks.EarlyStopping(restore_best_weights=True), keras.callbacks.ReduceLROnPlateau()
    fresh_best = keras.callbacks.ModelCheckpoint(str(tmp_path / "best.keras"), save_best_only=True)
    assert restorer.callbacks.apply([fresh_plateau, keras.callbacks.TerminateOnNaN(), fresh, fresh_best]) == 5
    assert (fresh.wait, fresh.best, fresh.best_epoch, fresh.stopped_epoch) == (2, 0.25, 4, 0)
    for a, b in zip(fresh.best_weights, stopping.best_weights, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)
    assert (fresh_plateau.wait, fresh_plateau.cooldown_counter, fresh_plateau.best) == (1, 3, float("inf"))
    assert fresh_best.best == 0.5  # (The callbacks restored in another order than saved.)
    other_value = keras.callbacks.EarlyStopping(monitor="loss")
    other_value.on_train_begin()
    restorer.callbacks.apply([other_value])
    assert other_value.wait == 0 and other_value.best is None  # The state was val_loss's.
    older = checkpoint.Checkpointer(str(tmp_path / "old"), model, model.optimizer)
    older.manager.save(checkpoint_number=2)  # What save wrote before callbacks' state was kept.
    again = checkpoint.Checkpointer(str(tmp_path / "old"), model, model.optimizer)
    assert again.restore() == 0 and again.callbacks.apply([keras.callbacks.EarlyStopping()]) is None


def test_a_callback_state_json_cannot_hold_is_left_out_with_a_warning(tmp_path, caplog):
    model = _model()
    odd = keras.callbacks.EarlyStopping()
    odd.best = object()  # A subclass might keep anything there.
    saver = checkpoint.Checkpointer(str(tmp_path), model, model.optimizer)
    saver.callbacks.apply([odd, keras.callbacks.ReduceLROnPlateau()])
    with caplog.at_level("WARNING"):
        saver.save(step=1, epoch=0)
    assert any("EarlyStopping(val_loss):0's state is not checkpointed" in r.getMessage() for r in caplog.records)
    restorer = checkpoint.Checkpointer(str(tmp_path), model, model.optimizer)
    fresh = keras.callbacks.EarlyStopping()
    fresh.on_train_begin()
    assert restorer.restore() == 1 and restorer.callbacks.apply([fresh, keras.callbacks.ReduceLROnPlateau()]) is None
    assert fresh.best is None and fresh.wait == 0
