"""tfmp.fit on users' own models: the same weights as model.fit, replicas, accumulation,
callbacks, bad use, loss-scale wrapping and strategies without merge calls."""

import gc
import weakref

import keras
import numpy as np
import pytest
import tensorflow as tf
import tiny
from conftest import assert_same, regression, regression_data, seeded, weights

import tfmp
from tfmp import inputs, run_directory
from tfmp.errors import UsageError


@seeded
def two_outputs():
    features = keras.Input((8,), name="features")
    hidden = keras.layers.Dense(16, activation="relu")(features)
    value = keras.layers.Dense(1, name="value")(hidden)
    label = keras.layers.Dense(3, activation="softmax", name="label")(hidden)
    model = keras.Model(features, {"value": value, "label": label})
    model.compile(
        keras.optimizers.SGD(0.05, momentum=0.9),
        loss={"value": "mse", "label": "sparse_categorical_crossentropy"},
        loss_weights={"value": 0.3, "label": 1.0},
        metrics={"label": ["accuracy"]},
        weighted_metrics={"value": ["mae"]},
    )
    return model


class Scale(keras.layers.Layer):
    """A custom layer with a weight of its own."""

    def build(self, input_shape):
        self.scale = self.add_weight(shape=(input_shape[-1],), initializer="ones")

    def call(self, x):
        return x * self.scale


def huber_ish(y_true, y_pred):
    error = y_true - y_pred
    return tf.reduce_mean(tf.sqrt(1.0 + tf.square(error)) - 1.0, axis=-1)


@seeded
def custom_loss():
    model = keras.Sequential([keras.Input((8,)), Scale(), keras.layers.Dense(4), keras.layers.Dense(1)])
    model.compile(keras.optimizers.RMSprop(1e-2), loss=huber_ish)
    return model


def two_output_data(batch=32, n=256):
    rng = np.random.default_rng(2)
    x = rng.random((n, 8), dtype=np.float32)
    targets = {"value": x.sum(1, keepdims=True), "label": (x[:, 0] * 3).astype(np.int64)}
    weights = rng.random(n, dtype=np.float32) + 0.5
    return tf.data.Dataset.from_tensor_slices(({"features": x}, targets, weights)).batch(batch)


KINDS = {
    "regression": (regression, regression_data),
    "two_outputs": (two_outputs, two_output_data),
    "custom_loss": (custom_loss, regression_data),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_same_weights_and_history_as_model_fit(kind):
    build, data = KINDS[kind]
    keras_model = build()
    keras_history = keras_model.fit(data(), epochs=3, verbose=0)
    model = build()
    history = tfmp.fit(model, data(), epochs=3, verbose=0)
    assert isinstance(history, keras.callbacks.History) and history.epoch == [0, 1, 2]
    assert_same(weights(model), weights(keras_model))
    assert set(history.history) == set(keras_history.history)
    for key, values in keras_history.history.items():
        np.testing.assert_allclose(history.history[key], values, rtol=1e-5)
    assert max(np.abs(a - b).max() for a, b in zip(weights(build()), weights(model), strict=True)) > 1e-2


@pytest.mark.parametrize("kind", ["regression", "two_outputs"])
def test_two_replicas_match_one(mirrored, kind):
    build, data = KINDS[kind]
    one = build()
    one_history = tfmp.fit(one, data(), epochs=2, verbose=0)
    two = build(mirrored)
    two_history = tfmp.fit(two, data(), epochs=2, verbose=0)
    assert_same(weights(two), weights(one))
    for key, values in one_history.history.items():  # Metrics summed over both replicas.
        np.testing.assert_allclose(two_history.history[key], values, rtol=1e-4)


def test_callable_input_per_replica(mirrored):
    def per_replica(context):
        return regression_data().unbatch().batch(context.get_per_replica_batch_size(32)).repeat()

    one = regression()
    tfmp.fit(one, regression_data(), epochs=1, verbose=0)
    two = regression(mirrored)
    tfmp.fit(two, per_replica, steps_per_epoch=8, epochs=1, verbose=0)
    assert_same(weights(two), weights(one))


@pytest.mark.parametrize("replicas", [1, 2])
def test_accumulation_equals_the_concatenated_batch(mirrored, replicas):
    strategy = mirrored if replicas == 2 else tf.distribute.get_strategy()
    full = regression(strategy)
    tfmp.fit(full, regression_data(batch=32), epochs=2, verbose=0, strategy=strategy)
    accumulated = regression(strategy)
    tfmp.fit(accumulated, regression_data(batch=16), epochs=2, grad_accum_steps=2, verbose=0)
    assert_same(weights(accumulated), weights(full))
    assert int(accumulated.optimizer.iterations.numpy()) == int(full.optimizer.iterations.numpy()) == 16


def test_accumulation_under_float16_loss_scaling():
    keras.config.set_dtype_policy("mixed_float16")
    model = regression()
    history = tfmp.fit(model, regression_data(batch=16), epochs=1, grad_accum_steps=4, verbose=0)
    assert isinstance(model.optimizer, tfmp.LossScaleOptimizer)
    # 4 updates of 4 batches; each one skipped for overflow halved the scale from 2**15.
    skipped = round(np.log2(2.0**15 / history.history["loss_scale"][0]))
    assert int(model.optimizer.iterations.numpy()) == 4 - skipped >= 1
    assert np.isfinite(history.history["loss"][0])


def test_early_stopping_and_validation_history():
    model = regression()
    stop = keras.callbacks.EarlyStopping(monitor="val_loss", patience=1, min_delta=1e6)
    history = tfmp.fit(
        model, regression_data(), validation_data=regression_data(), epochs=10, callbacks=[stop], verbose=0
    )
    assert history.epoch == [0, 1] and len(history.history["val_loss"]) == 2
    assert len(history.history["val_mae"]) == 2 and model.stop_training


def test_a_sweep_of_short_fits_is_not_warned_of_retracing(caplog):
    """Each new model's steps and checks are traced once: TensorFlow must not read them as one
    function retraced (a notebook or a hyperparameter search fits one model after another)."""
    with caplog.at_level("WARNING", logger="tensorflow"):
        for _ in range(5):
            tfmp.fit(
                regression(), regression_data(), validation_data=regression_data(n=64), steps_per_epoch=2, verbose=0
            )
    assert not [r.getMessage() for r in caplog.records if "retracing" in r.getMessage()]


def test_keras_callbacks_run_unchanged(tmp_path):
    class Counter(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.batches, self.epochs, self.seen_model = 0, 0, None

        def on_train_batch_end(self, batch, logs=None):
            self.batches += 1

        def on_epoch_end(self, epoch, logs=None):
            self.epochs += 1
            self.seen_model = self.model

    counter = Counter()
    model = regression()
    callbacks = [
        counter,
        keras.callbacks.ModelCheckpoint(str(tmp_path / "model-{epoch}.keras")),
        keras.callbacks.CSVLogger(str(tmp_path / "log.csv")),
        keras.callbacks.TensorBoard(str(tmp_path / "tb")),
        keras.callbacks.LearningRateScheduler(lambda epoch, lr: 0.001 * (epoch + 1)),
        keras.callbacks.ReduceLROnPlateau(monitor="val_loss", patience=5),
    ]
    tfmp.fit(model, regression_data(), validation_data=regression_data(), epochs=3, callbacks=callbacks, verbose=0)
    assert counter.batches == 24 and counter.epochs == 3 and counter.seen_model is model
    assert sorted(p.name for p in tmp_path.glob("model-*.keras")) == ["model-1.keras", "model-2.keras", "model-3.keras"]
    assert (tmp_path / "log.csv").read_text().count("\n") == 4
    assert list((tmp_path / "tb").rglob("events.out.tfevents.*"))
    assert float(model.optimizer.learning_rate) == pytest.approx(0.003)


def test_monitor_records_loss_scale_and_skipped_steps(tmp_path):
    keras.config.set_dtype_policy("mixed_float16")
    model = tiny.build(tf.distribute.get_strategy())[0]
    model.get_layer("inject").bad_replica.assign(0)  # Every step overflows and is skipped.
    tfmp.fit(model, tiny.dataset(16).train, steps_per_epoch=3, log_dir=str(tmp_path), log_every=1, verbose=0)
    rows = (tmp_path / "history.csv").read_text().splitlines()
    assert rows[-1].split(",")[-1] == "3" and float(model.optimizer.dynamic_scale.numpy()) == 2.0**8 / 8
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def _uncompiled():
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])


class StepOverride(keras.Model):
    def train_step(self, data):
        return {}


@seeded
def _unreduced_loss():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
    model.compile("sgd", keras.losses.MeanSquaredError(reduction=None))
    return model


def _overrides_train_step():
    inputs = keras.Input((8,))
    model = StepOverride(inputs, keras.layers.Dense(1)(inputs))
    model.compile("sgd", "mse")
    return model


@pytest.mark.parametrize(
    "make_model, data, kwargs, words",
    [
        (_uncompiled, regression_data, {}, "compiled model"),
        (_overrides_train_step, regression_data, {}, "overrides train_step"),
        (regression, lambda: np.zeros((4, 8)), {}, "data holds inputs only: give the targets too"),
        (regression, lambda: "data.csv", {}, "tf.data.Dataset, a callable"),
        (regression, lambda: regression_data().map(lambda x, y: (x[:, :4], y)), {}, "input"),
        (regression, lambda: regression_data().map(lambda x, y: ((x, x), y)), {}, "takes 1 input"),
        (regression, lambda: regression_data().map(lambda x, y: x), {}, "no targets"),
        (regression, lambda: regression_data().repeat(), {}, "steps_per_epoch"),
        (regression, regression_data, {"grad_accum_steps": 0}, "grad_accum_steps"),
        (regression, regression_data, {"steps_per_epoch": 5, "grad_accum_steps": 2}, "multiple of"),
        (regression, regression_data, {"clipnorm": float("nan")}, "clipnorm"),
        (regression, regression_data, {"verbose": 3}, "verbose"),
        (regression, lambda: regression_data().take(1), {"grad_accum_steps": 2}, "fewer than"),
        (_unreduced_loss, regression_data, {}, r"not one number but shape \(None,\).*reduction='sum_over_batch_size'"),
        (_unreduced_loss, regression_data, {"jit_compile": True}, "reduction=None gives one per example"),
    ],
)
def test_bad_use_is_one_usage_error(make_model, data, kwargs, words):
    with pytest.raises(UsageError, match=words):
        tfmp.fit(make_model(), data(), **{"verbose": 0, **kwargs})


@seeded
def classifier():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)])
    model.compile(keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def labelled(one_hot=False, batch=32):
    rng = np.random.default_rng(3)
    x = rng.random((256, 8), dtype=np.float32)
    y = np.minimum((x[:, 0] * 4).astype(np.int64), 2)  # Classes 0, 1 and 2 at about 1:1:2.
    return tf.data.Dataset.from_tensor_slices((x, np.eye(3, dtype=np.float32)[y] if one_hot else y)).batch(batch)


@pytest.mark.parametrize("labels", ["indices", "one-hot"])
def test_class_weight_trains_as_model_fit_does(mirrored, labels):
    """Keras' semantics (a class left out weighs 1; one-hot labels by their argmax), the same
    weights as model.fit's, and under two replicas the same again; weighting changes them."""
    one_hot = labels == "one-hot"
    build = classifier
    if one_hot:
        build = seeded(lambda: _recompiled(classifier(), keras.losses.CategoricalCrossentropy(from_logits=True)))
    class_weight = {0: 4.0, 2: 0.25}
    theirs = build()
    theirs.fit(labelled(one_hot), epochs=2, class_weight=class_weight, verbose=0)
    ours = build()
    tfmp.fit(ours, labelled(one_hot), epochs=2, class_weight=class_weight, verbose=0)
    assert_same(weights(ours), weights(theirs))
    two = build(mirrored)
    tfmp.fit(two, labelled(one_hot), epochs=2, class_weight=class_weight, verbose=0)
    assert_same(weights(two), weights(ours))
    unweighted = build()
    tfmp.fit(unweighted, labelled(one_hot), epochs=2, verbose=0)
    assert max(np.abs(a - b).max() for a, b in zip(weights(unweighted), weights(ours), strict=True)) > 1e-2


def _recompiled(model, loss):
    model.compile(keras.optimizers.SGD(0.1), loss)
    return model


def test_class_weight_reaches_a_callable_input_and_survives_resume(tmp_path):
    """A per-replica callable gets the weights too; a resumed run skips into the weighted stream."""

    def per_replica(context):
        return labelled(batch=context.get_per_replica_batch_size(32)).repeat()

    run = {"epochs": 2, "steps_per_epoch": 8, "class_weight": {1: 3.0}, "verbose": 0}
    straight = classifier()
    tfmp.fit(straight, per_replica, **run)
    halves = classifier()
    tfmp.fit(halves, per_replica, **{**run, "epochs": 1}, checkpoint_dir=str(tmp_path))
    tfmp.fit(halves, per_replica, **run, checkpoint_dir=str(tmp_path))
    assert_same(weights(halves), weights(straight))
    theirs = classifier()
    # Keras fails on a label above the largest class given (here 2); tfmp weighs it 1, as any left out.
    theirs.fit(labelled().repeat(), epochs=2, steps_per_epoch=8, class_weight={1: 3.0, 2: 1.0}, verbose=0)
    assert_same(weights(straight), weights(theirs))


@pytest.mark.parametrize(
    "kwargs, data, words",
    [
        ({"class_weight": {0: 1.0}}, lambda: two_output_data(), "sample weights in the data"),
        ({"class_weight": {0: 1.0}}, lambda: two_output_data().map(lambda x, y, w: (x, y)), "single"),
        ({"class_weight": {-1: 1.0}}, labelled, "class indices"),
        ({"class_weight": {0: float("inf")}}, labelled, "finite weights"),
        ({"class_weight": []}, labelled, "non-empty dict"),
    ],
)
def test_bad_class_weight_is_a_usage_error(kwargs, data, words):
    with pytest.raises(UsageError, match=words):
        tfmp.fit(classifier(), data(), verbose=0, **kwargs)


def test_model_built_outside_the_strategy_is_refused(mirrored):
    with pytest.raises(UsageError, match="outside the scope"):
        tfmp.fit(regression(), regression_data(), strategy=mirrored, verbose=0)


def test_batch_that_does_not_divide_by_replicas_is_refused(mirrored):
    with pytest.raises(UsageError, match="batch size 33 does not divide by the 2 replicas"):
        tfmp.fit(regression(mirrored), regression_data(batch=33, drop_remainder=True), verbose=0)


def test_steps_per_execution_trains_the_same_weights():
    one = regression()
    tfmp.fit(one, regression_data(), epochs=2, verbose=0)
    batches = []
    counter = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: batches.append(batch))
    grouped = regression()
    # 8 batches an epoch: two calls of 3 updates, then two single updates.
    tfmp.fit(grouped, regression_data(), epochs=2, steps_per_execution=3, callbacks=[counter], verbose=0)
    assert_same(weights(grouped), weights(one))
    assert batches == [2, 5, 6, 7] * 2
    compiled = regression()  # As model.fit takes it: compile(steps_per_execution=3)'s, where fit gives none.
    compiled.compile(keras.optimizers.Adam(1e-2), "mse", metrics=["mae"], steps_per_execution=3)
    batches.clear()
    tfmp.fit(compiled, regression_data(), epochs=2, callbacks=[counter], verbose=0)
    assert_same(weights(compiled), weights(one))
    assert batches == [2, 5, 6, 7] * 2


@pytest.mark.parametrize("known_length", [False, True], ids=["unknown_length_no_xla", "known_length_xla"])
def test_no_iterator_of_a_fit_outlives_it(monkeypatch, known_length):
    # Each would hold its prefetched batches and tf.data's tuning thread; kept until the process
    # ended, the bench's process took 25 s to exit, waiting for those threads.
    made = []

    def recording(make):
        def record(self, *args):
            iterator = make(self, *args)
            made.append(weakref.ref(iterator))
            return iterator

        return record

    for name in ("stream", "epoch"):  # One iterator a fit where the length is known, else one an epoch.
        monkeypatch.setattr(inputs.Input, name, recording(getattr(inputs.Input, name)))
    data = regression_data() if known_length else regression_data().filter(lambda *_: True)
    tfmp.fit(regression(), data, epochs=2, validation_data=data, jit_compile=known_length, verbose=0)
    failing = tiny.build(tf.distribute.get_strategy())[0]
    failing.get_layer("inject").bad_replica.assign(0)
    with pytest.raises(tfmp.TrainingError):  # A fit that fails lets go of its iterator too.
        tfmp.fit(failing, tiny.dataset(16).train, steps_per_epoch=3, verbose=0)
    gc.collect()
    assert len(made) == (1 if known_length else 2) + 1
    assert [ref() for ref in made] == [None] * len(made)


def test_non_finite_loss_stops_with_the_culprit_named():
    model = tiny.build(tf.distribute.get_strategy())[0]  # float32: no loss scale to absorb it.
    model.get_layer("inject").bad_replica.assign(0)
    with pytest.raises(tfmp.TrainingError, match="non-finite loss .* at step 1.*dense"):
        tfmp.fit(model, tiny.dataset(16).train, steps_per_epoch=3, verbose=0)


def test_checkpoint_dir_is_one_run_at_a_time_and_must_be_writable(tmp_path):

    with run_directory.RunLock(str(tmp_path), "checkpoint_dir"):
        with pytest.raises(UsageError, match="checkpoint_dir=.* is in use by pid"):
            tfmp.fit(regression(), regression_data(), checkpoint_dir=str(tmp_path), verbose=0)
    with pytest.raises(UsageError, match="cannot be written"):
        tfmp.fit(regression(), regression_data(), checkpoint_dir="/proc/tfmp_ckpt", verbose=0)
