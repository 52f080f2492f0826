"""Monitoring and the NaN guard: injected NaN and float16 overflow, seen where a user looks."""

import glob
import logging

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import Poison

from tfmp import callbacks, checkpoint
from tfmp.app import models, training
from tfmp.errors import TrainingError
from tfmp.heads import classification_head


def poisoned(factor, first, last=10**9):
    def build(num_classes, input_shape, **_):
        inputs = keras.Input(input_shape)
        x = keras.layers.Flatten()(inputs)
        x = keras.layers.Dense(32, activation="relu")(x)
        x = Poison(factor, first, last, name="poison")(x)
        return keras.Model(inputs, classification_head(num_classes)(x))

    return models.Entry("image", build)


def config(tmp_path, policy, **kwargs):
    return training.Config(
        model="poisoned",
        dataset="synthetic",
        precision=policy,
        batch_size=16,
        epochs=1,
        steps_per_epoch=12,
        checkpoint_every=2,
        model_dir=str(tmp_path),
        verbose=0,
        **kwargs,
    )


def latest_checkpoint_is_finite(tmp_path, entry):
    model = entry.build(10, input_shape=(28, 28, 1))
    optimizer = keras.optimizers.Adam()
    optimizer.build(model.trainable_variables)
    ckpt = tf.train.Checkpoint(model=model)  # The model's part of the checkpoint.
    path = tf.train.latest_checkpoint(str(tmp_path / "checkpoints"))
    ckpt.restore(path).expect_partial()
    return path, all(np.isfinite(w.numpy()).all() for w in model.weights)


@pytest.mark.parametrize(
    "policy, scale, stop_step, words",
    [
        ("float32", 2.0**15, 5, "first non-finite weight: dense"),
        ("mixed_float16", 4.0, 7, "weights still finite; first non-finite gradient: dense"),
    ],
)
def test_nan_stops_cleanly_and_keeps_a_finite_checkpoint(tmp_path, monkeypatch, policy, scale, stop_step, words):
    entry = poisoned(float("nan"), first=stop_step if policy == "float32" else 5)
    monkeypatch.setitem(models.MODELS, "poisoned", entry)
    with pytest.raises(TrainingError) as e:
        training.train_and_evaluate(config(tmp_path, policy, loss_scale_initial=scale))
    message = str(e.value)
    assert f"non-finite loss (nan) at step {stop_step}" in message and words in message, message
    assert "\n" not in message
    path, finite = latest_checkpoint_is_finite(tmp_path, entry)
    assert path.endswith(f"ckpt-{stop_step - 1}") and finite  # Checkpoints every 2 steps.
    assert f"the last checkpoint, {path}, holds finite weights" in message


def test_the_message_claims_nothing_it_did_not_check():
    """Without a log_dir, loss scale or clip, tfmp.fit's step leaves out the gradients' check: a non-finite
    loss with finite weights then says so, not that the loss itself overflowed. Nor does it point to a checkpoint
    where the run kept none, or none yet."""
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    optimizer = keras.optimizers.SGD()
    said = {c: callbacks.non_finite_message(float("inf"), optimizer, model, checked=c) for c in (True, False)}
    assert said[True].endswith(
        "weights still finite: the loss itself overflowed. Training stopped; no checkpoint was kept (tfmp.fit keeps "
        "them with a checkpoint_dir)"
    )
    assert "gradients not checked (tfmp.fit checks them with a log_dir)" in said[False]
    nothing_saved = callbacks.non_finite_message(float("inf"), optimizer, model, checkpoint=None)
    assert nothing_saved.endswith("Training stopped; it had saved no checkpoint yet")
    assert "overflowed" not in said[False]
    assert callbacks.non_finite_message(1.0, optimizer, model, checked=False) is None


def _scalars(model_dir, tag):
    values = {}
    for event_file in glob.glob(f"{model_dir}/tensorboard/events.out.tfevents.*"):
        for event in tf.compat.v1.train.summary_iterator(event_file):
            for value in event.summary.value:
                if value.tag == tag:
                    values[event.step] = float(tf.make_ndarray(value.tensor))
    return [values[k] for k in sorted(values)]


def test_float16_overflow_shows_in_scalars_and_warns(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(models.MODELS, "poisoned", poisoned(1e6, first=3, last=8))  # 1e6 > float16's 65504.
    caplog.set_level(logging.WARNING)
    cfg = config(tmp_path, "mixed_float16", loss_scale_initial=2.0**10, log_every=1)
    cfg.steps_per_epoch = 24
    metrics = training.train_and_evaluate(cfg)
    skipped, scale = _scalars(tmp_path, "skipped_steps"), _scalars(tmp_path, "loss_scale")
    assert len(skipped) == len(scale) == 24
    assert skipped[1] == 0 and skipped[7] == 6 and skipped[-1] == 6
    assert scale[1] == 2.0**10 and scale[7] == 2.0**4 and scale[-1] == 2.0**4
    assert _scalars(tmp_path, "skipped_rate")[-1] == pytest.approx(6 / 24)
    assert len(_scalars(tmp_path, "grad_norm")) == 24 and len(_scalars(tmp_path, "examples_per_second")) == 24
    assert metrics["skipped_steps"] == 6 and metrics["steps"] == 18 and metrics["final_loss_scale"] == 2.0**4
    (skips,) = [m for r in caplog.records if "steps were skipped for non-finite gradients" in (m := r.getMessage())]
    assert "wrap_optimizer's initial_scale; train.py's --loss_scale_initial" in skips
    assert (tmp_path / "training.png").stat().st_size > 10_000


def test_full_disk_during_a_save(tmp_path, monkeypatch):
    saves = []
    original = tf.train.CheckpointManager.save

    def save(self, *args, **kwargs):
        saves.append(1)
        if len(saves) == 2:
            raise tf.errors.ResourceExhaustedError(None, None, "No space left on device")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(tf.train.CheckpointManager, "save", save)
    cfg = training.Config(
        dataset="synthetic", epochs=1, steps_per_epoch=6, checkpoint_every=2, model_dir=str(tmp_path), verbose=0
    )
    with pytest.raises(
        TrainingError, match="saving a checkpoint .* failed .*No space left.* latest good checkpoint: .*ckpt-2"
    ):
        training.train_and_evaluate(cfg)
    monkeypatch.setattr(tf.train.CheckpointManager, "save", original)
    keras.backend.clear_session(free_memory=False)
    model = models.MODELS["cnn"].build(10, input_shape=(28, 28, 1))
    optimizer = keras.optimizers.Adam(keras.optimizers.schedules.CosineDecay(1e-3, 6))  # The run's own.
    assert checkpoint.Checkpointer(str(tmp_path / "checkpoints"), model, optimizer).restore() == 2


def test_a_loss_scale_below_one_warns_once_naming_the_fixes(tmp_path, caplog):
    from tfmp import loss_scale

    optimizer = loss_scale.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    monitor = callbacks.Monitor(str(tmp_path), optimizer, examples_per_step=8)
    caplog.set_level(logging.WARNING)
    for step, scale in enumerate([2.0, 0.5, 0.25], 1):
        monitor.recent.append(0)  # As `record` does before it warns: a step applied.
        monitor._warn({"step": step, "loss_scale": scale})  # noqa: SLF001
    (message,) = [r.getMessage() for r in caplog.records if "Loss scale fell" in r.getMessage()]
    assert "Loss scale fell to 0.5 at step 2" in message
    fixes = ("tfmp.diagnose", "tfmp.keep_float32", "--keep_float32", "the optimizer's learning_rate", "--learning_rate")
    assert all(fix in message for fix in fixes)


def test_finiteness_reads_one_compiled_check_or_each_variable_where_it_cannot_run(monkeypatch):
    weights = [keras.Variable(np.ones(3, np.float32)), keras.Variable(np.ones(2, np.int32)), keras.Variable(1.0)]
    finite = callbacks.finiteness(weights)
    assert finite()
    weights[2].assign(float("nan"))
    assert not finite()

    def no_such_op(x):
        raise TypeError("no kernel here")

    monkeypatch.setattr(tf.math, "is_finite", no_such_op)  # The compiled check then fails to trace.
    host = callbacks.finiteness(weights)
    assert not host()
    weights[2].assign(2.0)
    assert host() and callbacks.finiteness([weights[1]])()  # No floating-point weight: finite.


def test_finiteness_reads_each_variable_where_finite_values_overflow_their_sums():
    """The check adds each variable's values (a NaN or inf makes the sum so); where finite values overflow a sum
    (float32's largest, twice) it reads each, in its own dtype (float64's 1e300 is inf in float32). float16's
    largest values, added in float32, overflow nothing."""
    weights = [
        keras.Variable(np.full(2, 3e38, np.float32)),
        keras.Variable(np.full(4, 6e4, np.float16)),
        keras.Variable(np.array([1e300, 1e300]), dtype="float64"),
    ]
    check = callbacks.finiteness(weights)
    assert check() and callbacks.first_non_finite(weights) is None
    for weight, bad in zip(weights, (np.inf, np.nan, -np.inf), strict=True):
        kept = weight.numpy()
        spoiled = kept.copy()
        spoiled[0] = bad
        weight.assign(spoiled)
        assert not check() and callbacks.first_non_finite(weights) == weight.path
        weight.assign(kept)
    assert check()


def test_a_models_finiteness_check_is_kept_while_its_weights_are_the_same():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    check = callbacks.weights_finiteness(model)
    assert callbacks.weights_finiteness(model) is check and check()
    model.add(keras.layers.Dense(1))  # Other weights: another check.
    assert callbacks.weights_finiteness(model) is not check


def test_history_is_held_a_bounded_number_of_steps_and_a_resume_keeps_its_steps_to_the_checkpoint(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(callbacks, "_ROWS_HELD", 5, raising=False)
    optimizer = keras.optimizers.SGD(0.1)
    monitor = callbacks.Monitor(str(tmp_path), optimizer, examples_per_step=8)
    for step in range(1, 13):
        logs = {"steps": 1, "updates": 1, "iterations": step - (step > 10), "loss": 1.0 / step, "grad_norm": 1.0}
        monitor.record(step, logs)  # Step 11 skipped.
        assert len(monitor.rows) < 5  # A long run's steps go to history.csv, not to the host's memory.
    monitor.flush()
    path = tmp_path / "history.csv"
    rows = path.read_text().splitlines()
    assert rows[0].startswith("step,loss") and [r.split(",")[0] for r in rows[1:]] == [str(s) for s in range(1, 13)]
    resumed = callbacks.Monitor(str(tmp_path), optimizer, examples_per_step=8, start_step=11)
    assert resumed.skipped == 1 and path.read_text().splitlines() == rows[:12]  # Step 12 is redone.
    with open(path, "a") as f:  # A row cut short: the process killed while appending it.
        f.write(rows[12][:1])  # "1": a step the checkpoint covers, and no other field.
    assert callbacks.skipped_steps(str(path)) == 1  # The last whole row's count.
    callbacks.Monitor(str(tmp_path), optimizer, examples_per_step=8, start_step=11)
    assert path.read_text().splitlines() == rows[:12]


def test_scalars_are_written_by_one_compiled_call_that_converts_no_python_number(tmp_path, monkeypatch):
    """Each eager tf.summary.scalar, and each Python number an eager op converts, keeps host memory
    TensorFlow never frees (about 0.7 KB a value): over a long run's log_dir that was hundreds of MB."""
    traced = []
    scalar = tf.summary.scalar
    monkeypatch.setattr(tf.summary, "scalar", lambda *a, **k: traced.append(a[0]) or scalar(*a, **k))
    monitor = callbacks.Monitor(str(tmp_path), keras.optimizers.SGD(0.1), examples_per_step=8, log_every=1)
    for step in range(1, 31):
        monitor.record(step, {"steps": 1, "updates": 1, "iterations": step, "loss": 1.0 / step, "grad_norm": 2.0})
    monitor.flush()
    assert len(traced) == len(set(traced)) >= 5  # Each tag once, while the write was traced; not 30 times.
    events = glob.glob(str(tmp_path / "tensorboard" / "events*"))
    losses = [
        (e.step, float(tf.make_ndarray(v.tensor)))
        for path in events
        for e in tf.compat.v1.train.summary_iterator(path)
        for v in e.summary.value
        if v.tag == "loss"
    ]
    assert losses == [(s, pytest.approx(1.0 / s)) for s in range(1, 31)]
