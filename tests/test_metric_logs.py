"""Metric results as model.fit logs them: a Python float for one number, a numpy array for several (F1Score's, one
per class), each entry of a metric's dict result on its own."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import regression_arrays, seeded

import tfmp


class Counted(keras.metrics.Metric):
    """A metric whose result is a dict, one entry a variable as it is."""

    def __init__(self, name="counted", **kwargs):
        super().__init__(name=name, **kwargs)
        self.total = self.add_variable(shape=(), initializer="zeros", name="total")
        self.count = self.add_variable(shape=(), initializer="zeros", name="count")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.total.assign_add(keras.ops.sum(keras.ops.cast(y_pred, "float32")))
        self.count.assign_add(keras.ops.cast(keras.ops.shape(y_pred)[0], "float32"))

    def result(self):
        return {"mean_prediction": self.total / self.count, "examples": self.count}


@seeded
def _classifier():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1, activation="sigmoid")])
    model.compile("sgd", "binary_crossentropy", metrics=[keras.metrics.F1Score(threshold=0.5), "accuracy", Counted()])
    return model


@pytest.mark.parametrize("replicas", [1, 2])
def test_metrics_of_several_values_are_logged_as_model_fit_logs_them(tmp_path, mirrored, replicas):
    """F1Score gives one value per class, and a metric may give a dict: model.fit logs an array where other
    metrics log a float, and each entry of a dict on its own. tfmp.fit failed converting them to floats. Logged
    alike, through validation, the progress bar, checkpoints, TensorBoard, a resume, and evaluate."""
    strategy = mirrored if replicas == 2 else None
    x, _ = regression_arrays(64)
    y = (x.sum(1, keepdims=True) > 4).astype("float32")
    run = {"batch_size": 32, "shuffle": False, "validation_data": (x, y)}
    expected = _classifier(strategy).fit(x, y, epochs=2, verbose=0, **run)
    run["checkpoint_dir"] = tmp_path
    first = tfmp.fit(_classifier(strategy), x, y, epochs=1, verbose=2, **run)
    model = _classifier(strategy)
    resumed = tfmp.fit(model, x, y, epochs=2, verbose=0, **run)  # At its second epoch.
    assert {"examples", "val_mean_prediction"} <= set(expected.history) == set(resumed.history)
    for key, values in expected.history.items():
        for ours, theirs in zip(first.history[key] + resumed.history[key], values, strict=True):
            if isinstance(theirs, keras.Variable):  # Keras 3.10 logs a variable result as it is (its last value).
                continue
            assert isinstance(ours, float if np.ndim(theirs) == 0 else np.ndarray), key  # Keras 3.15: F1's (1,).
            np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=1e-5, err_msg=key)
    results = tfmp.evaluate(model, x, y, return_dict=True, verbose=0)
    for key, theirs in model.evaluate(x, y, return_dict=True, verbose=0).items():
        assert isinstance(results[key], float if np.ndim(theirs) == 0 else np.ndarray), key
        np.testing.assert_allclose(np.asarray(results[key]), np.asarray(theirs), rtol=1e-5, err_msg=key)
    assert results["examples"] == len(x)  # Summed over the replicas.


class Extra(keras.Model):
    """A model whose compute_metrics returns an entry of its own beside its metrics' results."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(1)

    def call(self, x):
        return self.dense(x)

    def compute_metrics(self, x, y, y_pred, sample_weight=None):
        return {**super().compute_metrics(x, y, y_pred, sample_weight), "prediction_mean": keras.ops.mean(y_pred)}


def test_entries_compute_metrics_adds_are_said_not_to_be_logged(caplog):
    x, y = regression_arrays(64)
    keras.utils.set_random_seed(0)
    model = Extra()
    model.compile("sgd", "mse", metrics=["mae"])
    history = tfmp.fit(model, x, y, batch_size=32, verbose=0)
    assert set(history.history) == {"loss", "mae"}
    assert "compute_metrics returns prediction_mean beside its metrics' results" in caplog.text


def test_each_outputs_loss_is_logged_as_model_fit_logs_it_where_the_last_batch_is_smaller():
    """Two outputs, 35 examples in batches of 8 (the last of 3): each output's loss (`a_loss`, `val_a_loss`) is
    the mean of the batches' values, as model.fit and model.evaluate log it. Keras weighs each by the batch's
    static size, which tfmp's evaluation step knows for all but the last: val_a_loss was 0.676, not 0.626."""
    x = np.random.default_rng(0).random((35, 8), dtype=np.float32)
    data = tf.data.Dataset.from_tensor_slices((x, {"a": x[:, :1], "b": x.sum(1, keepdims=True) / 8})).batch(8)

    def build():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((8,))
        hidden = keras.layers.Dense(4, activation="relu")(inputs)
        model = keras.Model(inputs, {name: keras.layers.Dense(1, name=name)(hidden) for name in "ab"})
        model.compile(keras.optimizers.SGD(0.01), {"a": keras.losses.MeanSquaredError(reduction="sum"), "b": "mse"})
        return model

    ours, theirs = build(), build()
    logs = tfmp.fit(ours, data, epochs=2, validation_data=data, jit_compile=False, verbose=0).history
    expected = theirs.fit(data, epochs=2, validation_data=data, verbose=0).history
    assert logs.keys() == expected.keys()
    for key in logs:
        np.testing.assert_allclose(logs[key], expected[key], rtol=1e-6, err_msg=key)
    evaluated = tfmp.evaluate(ours, data, return_dict=True)
    assert evaluated == pytest.approx(theirs.evaluate(data, verbose=0, return_dict=True), rel=1e-6)


@pytest.mark.parametrize(
    ("loop", "replicas", "jit_compile"),
    [("evaluate", 1, False), ("fit", 1, False), ("evaluate", 2, True), ("fit", 2, True)],
)
def test_elements_holding_none_train_and_evaluate_a_model_not_yet_built(mirrored, loop, replicas, jit_compile):
    """Elements `(x, y, None)` (a dataset mapped to give no sample weight) on a model whose metrics are not yet
    built: the logs model.evaluate and model.fit give on one device, from tfmp on one device and on two
    replicas, with XLA and without. tfmp's build read a shape from the None's spec and failed."""
    x, y = regression_arrays(64)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(16).map(lambda x, y: (x, y, None))

    @seeded
    def build():
        model = keras.Sequential([keras.Input((x.shape[1],)), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.01), "mse", metrics=["mae"])
        return model

    ours, theirs = build(mirrored if replicas == 2 else None), build()
    if loop == "evaluate":
        got = tfmp.evaluate(ours, data, return_dict=True, verbose=0, jit_compile=jit_compile)
        expected = theirs.evaluate(data, return_dict=True, verbose=0)
    else:
        got = tfmp.fit(ours, data, epochs=2, jit_compile=jit_compile, verbose=0).history
        expected = theirs.fit(data, epochs=2, verbose=0).history
    assert got.keys() == expected.keys()
    for key in got:
        np.testing.assert_allclose(got[key], expected[key], rtol=1e-5, err_msg=key)


class HostAccuracy(keras.metrics.BinaryAccuracy):
    """A result read through the host (as a scikit-learn metric would be): no static shape."""

    def result(self):
        return tf.numpy_function(lambda a: np.float32(a), [super().result()], tf.float32, stateful=False)


@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("jit_compile", [False, True])
def test_a_metric_whose_result_comes_from_the_host_is_logged_as_model_fit_logs_it(mirrored, jit_compile, replicas):
    """Its result has no static shape: Keras' symbolic build of the metrics failed on it (model.fit on one device
    builds them at its first step), and tfmp's packed step outputs refused it. Under XLA, which cannot compile the
    host call, the step falls back before it reads a batch."""
    x, _ = regression_arrays(64)
    y = (x.sum(1, keepdims=True) > 4).astype("float32")

    @seeded
    def classifier():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1, activation="sigmoid")])
        model.compile("sgd", "binary_crossentropy", metrics=[HostAccuracy()], jit_compile=False)
        return model

    run = {"batch_size": 16, "epochs": 2, "shuffle": False, "verbose": 0, "validation_data": (x[:32], y[:32])}
    expected = classifier().fit(x, y, **run).history
    history = tfmp.fit(classifier(mirrored if replicas == 2 else None), x, y, jit_compile=jit_compile, **run)
    assert history.params["jit_compile"] is False
    for key in ("loss", "binary_accuracy", "val_loss", "val_binary_accuracy"):
        assert all(isinstance(v, float) for v in history.history[key])
        np.testing.assert_allclose(history.history[key], expected[key], rtol=1e-5, err_msg=key)
