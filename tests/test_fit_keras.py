"""Keras features that tfmp.fit honours as model.fit does, or refuses where it cannot: an
optimizer's moving averages (use_ema), BackupAndRestore, the losses layers add under a mixed
policy (where model.fit itself fails), compile(run_eagerly=True) and compile(auto_scale_loss=False),
a test_step of a model's own, TerminateOnNaN, the callbacks and progress bar of evaluation, steps_per_epoch
short of a last call of steps_per_execution."""

import inspect
import re

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import assert_same, regression, regression_arrays, regression_data, seeded, weights

import tfmp
from tfmp.errors import TrainingError, UsageError


@seeded
def averaged():
    model = regression()
    model.compile(keras.optimizers.Adam(1e-2, use_ema=True), "mse")
    return model


def test_an_ema_optimizer_ends_on_its_averages_and_resumes_from_the_trained_weights(tmp_path):
    """Keras fit ends by making use_ema's moving averages the weights; tfmp.fit too, and a run
    resumed from its checkpoint (taken before that) trains on from the weights it trained."""
    straight = averaged()
    tfmp.fit(straight, regression_data(), epochs=3, verbose=0)
    averages = straight.optimizer._model_variables_moving_average  # noqa: SLF001 - Keras keeps them there.
    assert_same(weights(straight), [v.numpy() for v in averages], atol=0)
    halves = averaged()
    tfmp.fit(halves, regression_data(), epochs=1, verbose=0, checkpoint_dir=str(tmp_path))
    tfmp.fit(halves, regression_data(), epochs=3, verbose=0, checkpoint_dir=str(tmp_path))
    assert_same(weights(halves), weights(straight))


class KLPenalty(keras.layers.Layer):
    """A layer adding a loss of its own, computed in its compute dtype (as a VAE's KL term)."""

    def call(self, x):
        self.add_loss(1e-2 * keras.ops.mean(keras.ops.square(x)))
        return x


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_losses_layers_add_train_under_a_mixed_policy(policy):
    """model.fit fails here (Keras sums the float16 or bfloat16 losses with the float32 one);
    tfmp.fit trains (test_keras_compat.py checks the sum)."""
    keras.config.set_dtype_policy(policy)
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, activation="relu", activity_regularizer=keras.regularizers.L2(1e-3))(inputs)
    model = keras.Model(inputs, keras.layers.Dense(1, dtype="float32")(KLPenalty()(hidden)))
    model.compile(keras.optimizers.Adam(1e-2), "mse")
    losses = tfmp.fit(model, regression_data(), epochs=3, verbose=0).history["loss"]
    assert np.isfinite(losses).all() and losses[2] < losses[0]


def test_run_eagerly_is_said_not_to_apply(caplog):
    model = regression()
    model.compile(keras.optimizers.Adam(1e-2), "mse", run_eagerly=True)
    with caplog.at_level("WARNING"):
        tfmp.fit(model, regression_data(), verbose=0)
    assert any("run_eagerly=True) does not apply" in r.getMessage() for r in caplog.records)


class _StopAfter(keras.callbacks.Callback):
    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.epoch:
            raise KeyboardInterrupt  # The run stops, as a killed one would.


def test_a_backup_and_restore_callback_resumes_at_its_epoch(tmp_path):
    """As under Keras fit: the callback loads its weights and optimizer, and the fit goes on
    from the epoch it saved, not from the first (which trained 4 more epochs after it)."""
    straight = regression()
    tfmp.fit(straight, regression_data(), epochs=4, verbose=0)
    broken = regression()
    with pytest.raises(KeyboardInterrupt):
        tfmp.fit(broken, regression_data(), epochs=4, verbose=0, callbacks=[backup(tmp_path), _StopAfter(1)])
    resumed = regression()
    history = tfmp.fit(resumed, regression_data(), epochs=4, verbose=0, callbacks=[backup(tmp_path)])
    assert history.epoch == [2, 3] and int(resumed.optimizer.iterations.numpy()) == 32  # 8 batches an epoch.
    assert_same(weights(resumed), weights(straight), atol=0)
    with pytest.raises(UsageError, match="give one"):
        tfmp.fit(resumed, regression_data(), callbacks=[backup(tmp_path)], checkpoint_dir=str(tmp_path / "c"))


def backup(tmp_path):
    return keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))


class OwnTestStep(keras.Model):
    def test_step(self, data):
        return {"custom": 1.0}


def test_a_test_step_of_its_own_is_refused_where_it_would_be_skipped():
    inputs = keras.Input((8,))
    model = OwnTestStep(inputs, keras.layers.Dense(1)(inputs))
    model.compile("sgd", "mse")
    tfmp.fit(model, regression_data(), verbose=0)  # No validation: nothing skipped.
    with pytest.raises(UsageError, match="overrides test_step, which tfmp.fit's validation replaces"):
        tfmp.fit(model, regression_data(), validation_data=regression_data(), verbose=0)
    with pytest.raises(UsageError, match="overrides test_step, which tfmp.evaluate replaces .* model.evaluate"):
        tfmp.evaluate(model, regression_data())


@pytest.mark.parametrize("raise_error", [False, True])
def test_terminate_on_nan_ends_the_run_as_in_model_fit(tmp_path, caplog, raise_error):
    """With keras.callbacks.TerminateOnNaN a non-finite loss ends the run (tfmp's culprit
    named in a warning) as model.fit's ends, not with tfmp's TrainingError; the last
    checkpoint is the one before. With raise_error=True, tfmp's error."""
    if raise_error and "raise_error" not in inspect.signature(keras.callbacks.TerminateOnNaN).parameters:
        pytest.skip("Keras before 3.13: TerminateOnNaN has no raise_error")
    x, y = regression_arrays()
    y[64:] = np.nan  # Batch 2 of 32.
    stop = {"raise_error": True} if raise_error else {}
    if raise_error:
        with pytest.raises(TrainingError, match="non-finite loss"):
            tfmp.fit(regression(), x, y, shuffle=False, verbose=0, callbacks=[keras.callbacks.TerminateOnNaN(**stop)])
        return
    expected = regression()
    expected.fit(x, y, shuffle=False, epochs=2, verbose=0, callbacks=[keras.callbacks.TerminateOnNaN()])
    model = regression()
    with caplog.at_level("WARNING"):
        history = tfmp.fit(
            model, x, y, shuffle=False, epochs=2, verbose=0, callbacks=[keras.callbacks.TerminateOnNaN()],
            checkpoint_dir=str(tmp_path), checkpoint_every=2,
        )  # fmt: skip
    assert history.epoch == expected.history.epoch == [0] and np.isnan(history.history["loss"]).all()
    assert int(model.optimizer.iterations.numpy()) == int(expected.optimizer.iterations.numpy()) == 3
    assert any("non-finite loss (nan) at step 3" in r.getMessage() for r in caplog.records)
    path = tf.train.latest_checkpoint(str(tmp_path))
    assert int(tf.train.load_variable(path, "step/.ATTRIBUTES/VARIABLE_VALUE")) == 2


class HideNaN(keras.layers.Layer):
    """NaN activations as 0 (what a ReLU does to them on some kernels), alike on every device."""

    def call(self, x):
        return keras.ops.where(keras.ops.isnan(x), 0.0, x)


def test_a_nan_the_loss_never_shows_stops_training_after_its_epoch(caplog):
    """A NaN input that a layer hides from the loss still reaches the first kernel through its
    gradient: model.fit trains on with NaN weights and a finite loss; tfmp.fit stops after the
    epoch, naming the weight (with TerminateOnNaN the run ends, the message a warning)."""

    def model():
        keras.utils.set_random_seed(0)
        built = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4), HideNaN(), keras.layers.Dense(1)])
        built.compile("sgd", "mse")
        return built

    x, y = regression_arrays()
    x[40] = np.nan
    expected = model()
    history = expected.fit(x, y, epochs=2, shuffle=False, verbose=0)
    assert np.isfinite(history.history["loss"]).all() and np.isnan(expected.layers[0].kernel.numpy()).all()
    with pytest.raises(TrainingError, match="after epoch 1: non-finite weight .*kernel although the loss stayed"):
        tfmp.fit(model(), x, y, epochs=2, shuffle=False, verbose=0)
    with caplog.at_level("WARNING"):
        history = tfmp.fit(
            model(), x, y, epochs=2, shuffle=False, verbose=0, callbacks=[keras.callbacks.TerminateOnNaN()]
        )
    assert history.epoch == [0] and any("although the loss stayed finite" in r.getMessage() for r in caplog.records)


def test_validation_freq_as_a_list_of_epochs_validates_those_as_model_fit_does():
    def validated_epochs(fit):
        epochs = []
        record = keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: epochs.append("val_loss" in logs))
        fit(callbacks=[record], epochs=4, validation_data=regression_data(), validation_freq=[1, 3], verbose=0)
        return epochs

    theirs = regression()
    expected = validated_epochs(lambda **kw: theirs.fit(regression_data(), **kw))
    ours = regression()
    assert validated_epochs(lambda **kw: tfmp.fit(ours, regression_data(), **kw)) == expected == [1, 0, 1, 0]
    for bad in ([], [0, 2], 1.5):
        with pytest.raises(UsageError, match="validation_freq must be an integer >= 1 or a list of epochs"):
            tfmp.fit(ours, regression_data(), validation_data=regression_data(), validation_freq=bad, verbose=0)


def test_steps_per_epoch_that_fills_no_last_call_trains_that_many_updates():
    # model.fit (Keras 3.15) runs whole calls, so an endless dataset's epoch of steps_per_epoch=5 at
    # steps_per_execution=3 makes 6 updates; tfmp.fit makes the 5 asked for: a call of 3, then 2 single ones.
    one, grouped, batches = regression(), regression(), []
    tfmp.fit(one, regression_data().repeat(), epochs=2, steps_per_epoch=5, verbose=0)
    counter = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: batches.append(batch))
    data = regression_data().repeat()
    tfmp.fit(grouped, data, epochs=2, steps_per_epoch=5, steps_per_execution=3, callbacks=[counter], verbose=0)
    assert int(grouped.optimizer.iterations.numpy()) == 10 and batches == [2, 3, 4] * 2
    assert_same(weights(grouped), weights(one))  # Within 1e-5: a GPU need not repeat its sums.


@pytest.mark.parametrize("auto_scale_loss", [True, False])
def test_compile_auto_scale_loss_is_honoured_as_model_fit_honours_it(auto_scale_loss):
    """A mixed_float16 model compiled with auto_scale_loss=False trains without loss scaling
    in model.fit; tfmp.fit too (it added its wrapper all the same). Left True, tfmp's wrapper
    replaces the one Keras' compile added."""
    keras.config.set_dtype_policy("mixed_float16")

    def compiled():
        model = regression()
        model.compile(keras.optimizers.SGD(1e-3), "mse", jit_compile=False, auto_scale_loss=auto_scale_loss)
        return model

    theirs, ours = compiled(), compiled()
    theirs.fit(regression_data(), epochs=2, verbose=0)
    history = tfmp.fit(ours, regression_data(), epochs=2, verbose=0, jit_compile=False)
    assert isinstance(ours.optimizer, tfmp.LossScaleOptimizer) == auto_scale_loss
    assert ("loss_scale" in history.history) == auto_scale_loss
    assert_same(weights(ours), weights(theirs), atol=1e-6)


class _TestEvents(keras.callbacks.Callback):
    """Records the test hooks with their logs; sets model.stop_evaluating after batch `stop_after`."""

    def __init__(self, stop_after=None):
        super().__init__()
        self.events, self.stop_after = [], stop_after

    def on_test_begin(self, logs=None):
        self.events.append(("begin",))

    def on_test_batch_begin(self, batch, logs=None):
        self.events.append(("batch begin", batch))

    def on_test_batch_end(self, batch, logs=None):
        self.events.append(("batch end", batch, {k: round(v, 4) for k, v in (logs or {}).items()}))
        if batch == self.stop_after:
            self.model.stop_evaluating = True

    def on_test_end(self, logs=None):
        self.events.append(("end", {k: round(v, 4) for k, v in (logs or {}).items()}))


def test_evaluate_and_validation_call_callbacks_as_model_evaluate_and_fit_do():
    """The test hooks, each batch's running logs, and stop_evaluating ending the pass: as
    model.evaluate calls them, and as model.fit's validation pass does."""
    x, y = regression_arrays()
    theirs, ours = regression(), regression()
    expected, got = _TestEvents(stop_after=3), _TestEvents(stop_after=3)
    logs = theirs.evaluate(x, y, callbacks=[expected], verbose=0, return_dict=True)
    assert tfmp.evaluate(ours, x, y, callbacks=[got], verbose=0, return_dict=True) == pytest.approx(logs, rel=1e-6)
    assert got.events == expected.events and len(expected.events) == 10  # Begin, 4 batches, end.
    expected, got = _TestEvents(), _TestEvents()
    theirs.fit(x, y, shuffle=False, validation_data=(x, y), callbacks=[expected], verbose=0)
    tfmp.fit(ours, x, y, shuffle=False, validation_data=(x, y), callbacks=[got], verbose=0)
    assert got.events == expected.events and len(expected.events) == 18


def test_evaluate_shows_progress_as_model_evaluate_does(capsys):
    model = regression()
    tfmp.evaluate(model, regression_data())
    assert "8/8" in capsys.readouterr().out
    tfmp.evaluate(model, regression_data(), verbose=2)
    assert re.search(r"^8/8 - .* - loss: [0-9.]+ - mae: [0-9.]+$", capsys.readouterr().out, re.MULTILINE)
    tfmp.evaluate(model, regression_data(), verbose=0)
    assert capsys.readouterr().out == ""
    with pytest.raises(UsageError, match="verbose must be one of auto, 0, 1, 2, got 3"):
        tfmp.evaluate(model, regression_data(), verbose=3)


class _Killed(keras.callbacks.Callback):
    """Ends the process's run at its `at`-th batch, saving nothing, as kill -9 would."""

    def __init__(self, at):
        super().__init__()
        self.at, self.batches = at, 0

    def on_train_batch_end(self, batch, logs=None):
        self.batches += 1
        if self.batches == self.at:
            raise RuntimeError("killed")


@pytest.mark.parametrize(("where", "killed_at"), [("one_device", 76), ("one_device", 86), ("mirrored", 86)])
def test_early_stopping_and_reduce_lr_on_plateau_resume_as_the_unbroken_run_goes_on(
    tmp_path, caplog, request, where, killed_at
):
    """Killed while their patience counts run (its last checkpoint at an epoch's end, or 4
    batches into one), a resumed run ends on the unbroken run's epoch, learning rate and
    (restored best) weights; rerun after the early stop, it trains no further."""
    x, y = regression_arrays()
    validation = (x[:64], y[:64] * 1.3)  # Its loss stops falling while the training loss falls.
    strategy = request.getfixturevalue("mirrored") if where == "mirrored" else None

    def run(directory, *extra):
        model = regression(strategy)
        stopping = [
            keras.callbacks.ReduceLROnPlateau(monitor="val_loss", patience=1, factor=0.5),
            keras.callbacks.EarlyStopping(monitor="val_loss", patience=3, restore_best_weights=True),
        ]
        history = tfmp.fit(
            model, x, y, validation_data=validation, epochs=30, callbacks=[*stopping, *extra], verbose=0,
            checkpoint_dir=str(directory), checkpoint_every=4,
        )  # fmt: skip
        return model, history

    unbroken, expected = run(tmp_path / "unbroken")
    assert 8 < len(expected.epoch) < 30 and len(set(expected.history["learning_rate"])) > 1
    with pytest.raises(RuntimeError, match="killed"):
        run(tmp_path / "killed", _Killed(killed_at))
    resumed, history = run(tmp_path / "killed")
    assert history.epoch == expected.epoch[killed_at // 8 :]
    assert history.history["learning_rate"] == expected.history["learning_rate"][killed_at // 8 :]
    assert history.history["loss"] == expected.history["loss"][killed_at // 8 :]  # The resumed epoch's over all.
    assert_same(weights(resumed), weights(unbroken), atol=0)
    with caplog.at_level("WARNING"):
        rerun, history = run(tmp_path / "killed")
    assert history.epoch == [] and any("nothing left to train there" in r.getMessage() for r in caplog.records)
    assert_same(weights(rerun), weights(unbroken), atol=0)


def test_a_learning_rate_scheduler_resumed_within_an_epoch_steps_the_rate_once(tmp_path):
    """The schedule halves the rate at each epoch's begin, which ran before the checkpoint
    within epoch 3: resumed there, the rate is halved once, as in the unbroken run."""
    x, y = regression_arrays()

    def run(directory, *extra):
        model = regression()
        halving = keras.callbacks.LearningRateScheduler(lambda epoch, rate: rate * 0.5)
        history = tfmp.fit(
            model, x, y, epochs=5, callbacks=[halving, *extra], verbose=0, checkpoint_dir=str(directory),
            checkpoint_every=4,
        )  # fmt: skip
        return model, history

    unbroken, expected = run(tmp_path / "unbroken")
    with pytest.raises(RuntimeError, match="killed"):
        run(tmp_path / "killed", _Killed(22))  # Its last checkpoint: batch 20, 4 batches into epoch 3.
    resumed, history = run(tmp_path / "killed")
    assert history.history["learning_rate"] == expected.history["learning_rate"][2:]
    assert history.history["loss"] == expected.history["loss"][2:]  # Epoch 3's mean over its 8 batches.
    assert_same(weights(resumed), weights(unbroken), atol=0)


def test_a_resumed_run_adds_its_rows_to_the_csv_logger_file_of_the_run_before(tmp_path):
    x, y = regression_arrays()

    def run(name, *extra):
        logger = keras.callbacks.CSVLogger(str(tmp_path / f"{name}.csv"))
        tfmp.fit(
            regression(), x, y, epochs=4, callbacks=[logger, *extra], verbose=0, checkpoint_dir=str(tmp_path / name),
            checkpoint_every=4,
        )  # fmt: skip
        assert not logger.append

    run("unbroken")
    with pytest.raises(RuntimeError, match="killed"):
        run("killed", _Killed(22))  # Rows for epochs 1 and 2 written; resumed 4 batches into epoch 3.
    run("killed")
    expected = (tmp_path / "unbroken.csv").read_text()
    assert (tmp_path / "killed.csv").read_text() == expected and expected.count("\n") == 5


def test_a_metric_added_since_the_checkpoint_does_not_stop_the_run_resuming(tmp_path):
    """The checkpoints hold the metrics' running sums by name: one added on the rerun starts at
    zero, the others are restored, and the run resumes (a checkpoint is not refused for it)."""
    x, y = regression_arrays()
    tfmp.fit(regression(), x, y, epochs=1, verbose=0, checkpoint_dir=str(tmp_path))
    model = regression()
    model.compile(keras.optimizers.Adam(1e-2), "mse", metrics=["mae", "mse"])
    assert tfmp.fit(model, x, y, epochs=2, verbose=0, checkpoint_dir=str(tmp_path)).epoch == [1]
