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

from tfmp import checkpoint, run_directory
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
    with run_directory.RunLock(str(run_dir)):
        # Another process cannot take it, and is told who holds it.
        held = subprocess.run(
            [sys.executable, "-c", f"from tfmp import run_directory as d\nwith d.RunLock({str(run_dir)!r}): pass"],
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert held.returncode != 0 and f"--model_dir={run_dir} is in use by pid {os.getpid()}" in held.stderr
        # Inside the directory this run holds (tfmp.fit's checkpoint_dir under train.py's
        # --model_dir) no second lock is taken; the same directory twice is refused.
        with run_directory.RunLock(str(run_dir / "checkpoints"), "checkpoint_dir"):
            assert not (run_dir / "checkpoints" / ".lock").exists()
        with pytest.raises(UsageError, match="is in use by"):
            with run_directory.RunLock(str(run_dir)):
                pass
    assert not (run_dir / ".lock").exists()
    with run_directory.RunLock(str(run_dir / "checkpoints"), "checkpoint_dir"):  # Its own lock, now.
        assert (run_dir / "checkpoints" / ".lock").exists()


def test_settings_that_change_an_exact_resume_are_refused(tmp_path):
    model = _model()
    path = checkpoint.Checkpointer(str(tmp_path / "ckpt"), model, model.optimizer).save(step=4, epoch=2)
    settings = {key: 1 for key in run_directory.EXACT} | {"epochs": 3}
    run_directory.save_settings(str(tmp_path), settings)
    run_directory.check_settings(str(tmp_path), settings, path)  # The same: fine.
    changed = {**settings, "seed": 2}
    with pytest.raises(UsageError, match=r"other settings \(seed 1 -> 2\).*--resume=force"):
        run_directory.check_settings(str(tmp_path), changed, path)
    run_directory.check_settings(str(tmp_path), changed, path, force=True)
    # Saved without a schedule (an older tfmp's run.json): a constant rate, which no force resumes with one.
    with pytest.raises(UsageError, match="--lr_schedule=constant, and this run's is --lr_schedule=cosine"):
        run_directory.check_settings(str(tmp_path), {**settings, "lr_schedule": "cosine"}, path, force=True)
    with pytest.raises(UsageError, match="trained 2 epochs already, more than --epochs=1"):
        run_directory.check_settings(str(tmp_path), {**settings, "epochs": 1}, path)


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


@pytest.mark.parametrize(
    "epoch, position, saved, now, multiple, expected",
    [
        (1, 20, None, (8, 64), 1, (20, True)),  # A checkpoint of an older tfmp: as saved.
        (1, 20, (16, 32), (16, 32), 1, (20, True)),  # Unchanged.
        (1, 16, (16, 32), (8, 64), 1, (8, True)),  # An epoch's start stays its start.
        (1, 16, (16, 32), (32, 16), 1, (32, True)),
        (1, 20, (16, 32), (8, 64), 1, (10, False)),  # 4 of 16 batches in: 2 of 8.
        (0, 6, (16, 32), (32, 16), 4, (12, False)),  # 12 of 32, a whole number of 4-batch updates.
        (0, 6, (16, 32), (32, 16), 5, (10, False)),
        (2, 3, (0, 32), (0, 64), 1, (1, False)),  # Unknown lengths: by the examples.
        (2, 3, (0, 0), (0, 16), 1, (3, False)),  # Nothing to go by: the batches.
        (1, 21, (16, 32), (16, 32), 2, (20, False)),  # Saved 5 batches in, resumed with updates of 2.
        (1, 21, None, (16, 32), 2, (20, False)),
    ],
)
def test_a_resume_with_other_batches_goes_on_at_the_same_point_of_its_epoch(
    epoch, position, saved, now, multiple, expected
):
    at, note, exact = checkpoint.resume_position(epoch, position, saved, now, multiple)
    assert (at, exact) == expected
    unchanged = (saved or now) == now and (position - epoch * now[0]) % multiple == 0
    assert (note is None) == unchanged
    if not exact:
        assert note.startswith("not an exact resume") and f"epoch {epoch + 1}" in note


def test_tfmp_fit_resumed_with_another_batch_size_trains_whole_epochs_of_it(tmp_path, caplog):
    """A run resumed with another batch size: before the checkpoint held its epochs' length, an epoch of 8
    batches resumed from one of 16 batches at its end trained none (and one of 32, 48)."""
    import tfmp

    x = np.random.default_rng(0).normal(size=(512, 3)).astype("float32")
    y = x.sum(1, keepdims=True)
    counts = {}
    for batch_size, expect in ((64, 8), (16, 32)):
        model = _model()
        directory = str(tmp_path / f"run{batch_size}")
        tfmp.fit(model, x, y, batch_size=32, epochs=1, verbose=0, checkpoint_dir=directory)
        model = _model()
        tfmp.fit(model, x, y, batch_size=batch_size, epochs=3, verbose=0, checkpoint_dir=directory)
        counts[batch_size] = int(model.optimizer.iterations.numpy()) - 16, 2 * expect
    assert counts[64][0] == counts[64][1] and counts[16][0] == counts[16][1], counts

    class Fail(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 5:
                raise RuntimeError("stopped")

    directory = str(tmp_path / "within")
    with pytest.raises(RuntimeError, match="stopped"):
        tfmp.fit(
            _model(),
            x,
            y,
            batch_size=32,
            epochs=2,
            verbose=0,
            checkpoint_dir=directory,
            checkpoint_every=4,
            callbacks=[Fail()],
        )
    model = _model()
    with caplog.at_level("WARNING"):
        tfmp.fit(model, x, y, batch_size=64, epochs=2, verbose=0, checkpoint_dir=directory)
    assert int(model.optimizer.iterations.numpy()) == 4 + (8 - 2) + 8  # 4 batches of 32 in: 2 of 64.
    # Arrays in whole batches have a static batch size (as in model.fit), which the note names.
    assert "not an exact resume: epochs of 16 batches of 32 when saved, of 8 batches of 64 now; epoch 1, saved 4" in (
        caplog.text
    )


def test_a_finished_run_rerun_says_nothing_is_left_to_train(tmp_path, capsys, caplog):
    import tfmp

    x, y = np.ones((8, 3), "float32"), np.ones((8, 2), "float32")
    tfmp.fit(_model(), x, y, batch_size=4, epochs=2, verbose=0, checkpoint_dir=str(tmp_path))
    capsys.readouterr()
    history = tfmp.fit(_model(), x, y, batch_size=4, epochs=2, checkpoint_dir=str(tmp_path))
    assert not history.history and "its 2 epochs are trained, nothing left (more train on)" in capsys.readouterr().out
    with caplog.at_level("WARNING"):
        tfmp.fit(_model(), x, y, batch_size=4, epochs=1, verbose=0, checkpoint_dir=str(tmp_path))
    assert "holds a run that trained 2 epochs, more than epochs=1: nothing trained" in caplog.text
    assert not capsys.readouterr().out  # verbose=0: nothing printed.


@pytest.mark.parametrize(
    "saved, now, words",
    [
        (
            "float32",
            "mixed_float16",
            "float32 weights and no loss scale, and this run trains with float32 weights and a",
        ),
        (
            "mixed_float16",
            "float32",
            "float32 weights and a loss scale, and this run trains with float32 weights and no",
        ),
        ("float32", "bfloat16", "float32 weights and no loss scale, and this run trains with bfloat16 weights and no"),
        (
            "mixed_bfloat16",
            "float8",
            "no loss scale, and this run trains with float32 weights, no loss scale and float8",
        ),
        ("float8", "mixed_bfloat16", "weights, no loss scale and float8 on 1 layer, and this run trains with float32"),
    ],
)
def test_a_checkpoint_of_another_precision_says_so(tmp_path, saved, now, words):
    """Before, the message said the checkpoint belonged to another model, with TensorFlow's dtype error."""
    import tfmp

    x, y = np.ones((8, 3), "float32"), np.ones((8, 2), "float32")
    for policy in (saved, now):
        tfmp.configure_precision(policy)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(2, dtype="float32")])
        model.compile(keras.optimizers.Adam(), "mse")
        if policy == now:
            with pytest.raises(UsageError, match=f"{words} .*: an optimizer's state does not carry over"):
                tfmp.fit(model, x, y, batch_size=4, verbose=0, checkpoint_dir=str(tmp_path))
        else:
            tfmp.fit(model, x, y, batch_size=4, verbose=0, checkpoint_dir=str(tmp_path))


def test_a_checkpoint_of_float8_on_other_layers_says_so(tmp_path):
    """float8's exclude changed between runs: its scales, 3 tensors a layer, could not be placed ("does not load into
    this model ... move the broken checkpoint away")."""
    import tfmp

    x, y = np.ones((8, 3), "float32"), np.ones((8, 2), "float32")
    tfmp.configure_precision("float8")
    for exclude in ([], ["hidden2"]):
        layers = [keras.layers.Dense(4, name="hidden"), keras.layers.Dense(4, name="hidden2")]
        model = keras.Sequential([keras.Input((3,)), *layers, keras.layers.Dense(2, dtype="float32")])
        model.compile(keras.optimizers.Adam(), "mse")
        tfmp.float8.quantize(model, exclude=exclude)
        if not exclude:
            tfmp.fit(model, x, y, batch_size=4, verbose=0, checkpoint_dir=str(tmp_path))
    words = "saved with float32 weights, no loss scale and float8 on 2 layers, and this run trains with float32 weights"
    with pytest.raises(UsageError, match=f"{words}, no loss scale and float8 on 1 layer: an optimizer's state"):
        tfmp.fit(model, x, y, batch_size=4, verbose=0, checkpoint_dir=str(tmp_path))


def test_a_rerun_begun_with_another_learning_rate_is_told_the_checkpoints_goes_on(tmp_path, caplog):
    """An exact resume restores the optimizer's rate as it stood; a script edited to another rate got the old one
    without a word. A rate a callback lowered during the run that saved is no change of the script's."""
    import tfmp

    x, y = np.ones((8, 3), "float32"), np.ones((8, 2), "float32")

    def model(rate):
        built = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        built.compile(keras.optimizers.Adam(rate), "mse")
        return built

    lower = keras.callbacks.LearningRateScheduler(lambda epoch, rate: rate / 10)
    fit = {"batch_size": 4, "verbose": 0, "checkpoint_dir": str(tmp_path)}
    tfmp.fit(model(0.1), x, y, epochs=1, callbacks=[lower], **fit)
    with caplog.at_level("WARNING"):
        tfmp.fit(model(0.1), x, y, epochs=2, **fit)  # The same script: the checkpoint's 0.01 goes on, unsaid.
    assert "learning rate" not in caplog.text
    edited = model(0.001)
    with caplog.at_level("WARNING"):
        tfmp.fit(edited, x, y, epochs=3, **fit)
    assert (
        "began with learning rate 0.001, the run that saved" in caplog.text
        and "with 0.1: the checkpoint's rate, 0.01" in caplog.text
    )
    assert float(edited.optimizer.learning_rate.numpy()) == pytest.approx(0.01)


@pytest.mark.parametrize("part", ["index", "data-00000-of-00001"])
def test_a_truncated_checkpoint_is_one_usage_error(tmp_path, part):
    import tfmp

    x, y = np.ones((8, 3), "float32"), np.ones((8, 2), "float32")
    tfmp.fit(_model(), x, y, batch_size=4, verbose=0, checkpoint_dir=str(tmp_path))
    with open(f"{checkpoint.latest(str(tmp_path))}.{part}", "r+b") as f:
        f.truncate(10)
    with pytest.raises(UsageError, match="does not load into this model .* or move the broken checkpoint away"):
        tfmp.fit(_model(), x, y, batch_size=4, epochs=2, verbose=0, checkpoint_dir=str(tmp_path))


ANOTHER_MODEL = """
import sys, keras, numpy as np, tfmp
def model(width):
    m = keras.Sequential([keras.Input((3,)), keras.layers.Dense(width)])
    m.compile("sgd", "mse")
    return m
x = np.ones((8, 3), "float32")
tfmp.fit(model(2), x, np.ones((8, 2), "float32"), batch_size=4, verbose=0, checkpoint_dir=sys.argv[1])
try:
    tfmp.fit(model(4), x, np.ones((8, 4), "float32"), batch_size=4, verbose=0, checkpoint_dir=sys.argv[1])
except tfmp.UsageError as e:
    print(e)
print("after the error")
"""


def test_a_checkpoint_of_another_model_is_one_error_naming_tfmp_fits_argument(tmp_path):
    """The error names checkpoint_dir (train.py's says --model_dir: tests/test_resume.py). The failed restore left
    TensorFlow's warnings of each value it had not restored, printed when Python freed it: none now."""
    done = subprocess.run(
        [sys.executable, "-c", ANOTHER_MODEL, str(tmp_path)],
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "does not load into this model" in done.stdout and "use a new checkpoint_dir for a" in done.stdout
    assert "after the error" in done.stdout and "unrestored values" not in done.stderr, done.stderr[-3000:]


def test_each_replicas_metric_sums_come_back_its_own(tmp_path, mirrored):
    """A strategy keeps a metric's running sums per replica and TensorFlow restores their total as
    total / replicas on each: a run resumed within an epoch would sum its batches otherwise than the
    unbroken run (its mean 1 ulp off). Each replica gets its own back; a run on one device, the total."""

    def metric_parts(model):
        return [[float(part.numpy()) for part in v.value.values] for v in model.metrics_variables]

    with mirrored.scope():
        model = _model()
    assert model.metrics_variables  # The loss' mean: its total and count.
    for i, v in enumerate(model.metrics_variables):
        for r, part in enumerate(v.value.values):
            part.assign(1.0 + i + 10 * r)
    saved = metric_parts(model)
    checkpoint.Checkpointer(str(tmp_path), model, model.optimizer).save(step=3, epoch=0, position=3)
    with mirrored.scope():
        other = _model()
    assert checkpoint.Checkpointer(str(tmp_path), other, other.optimizer).restore() == 3
    assert metric_parts(other) == saved
    alone = _model()
    checkpoint.Checkpointer(str(tmp_path), alone, alone.optimizer).restore()
    assert [float(v.numpy()) for v in alone.metrics_variables] == [sum(parts) for parts in saved]
