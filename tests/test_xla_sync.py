"""jit_compile under a strategy on CPU replicas: a layer that syncs replicas in its forward pass (a merge call,
which a compiled step cannot hold) trains without XLA, named in one warning."""

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmp
from tfmp import xla


def regression_data(batch=32):
    rng = np.random.default_rng(1)
    x = rng.random((256, 8), dtype=np.float32)
    return tf.data.Dataset.from_tensor_slices((x, x.sum(1, keepdims=True))).batch(batch, drop_remainder=True)


def _synchronized_batch_norm(strategy, synchronized=True):
    keras.utils.set_random_seed(0)
    with strategy.scope():
        hidden = [keras.layers.Dense(16), keras.layers.BatchNormalization(synchronized=synchronized)]
        model = keras.Sequential([keras.Input((8,)), *hidden, keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.05), "mse")
    return model


@pytest.mark.parametrize("probed", [True, False])
def test_a_layer_that_all_reduces_in_its_forward_pass_trains_without_xla_on_cpu_replicas(
    mirrored, monkeypatch, caplog, probed
):
    """BatchNormalization(synchronized=True) all-reduces its moments across replicas with a merge call, which a
    compiled function refuses (and XLA compiles no ring all-reduce on CPUs): the up-front probe, or where it
    missed it the first step, says so by the layer's name and trains without XLA, as jit_compile=False does."""
    if not probed:
        monkeypatch.setattr(xla, "probe", lambda *_: None)
    monkeypatch.setattr(xla, "_PROBES", {})
    expected = _synchronized_batch_norm(mirrored)
    tfmp.fit(expected, regression_data(), epochs=2, jit_compile=False, verbose=0)
    model = _synchronized_batch_norm(mirrored)
    with caplog.at_level(logging.WARNING):
        history = tfmp.fit(model, regression_data(), epochs=2, jit_compile=True, verbose=0)
    assert history.params["jit_compile"] is False
    warnings = [r.getMessage() for r in caplog.records if "XLA cannot compile" in r.getMessage()]
    assert len(warnings) == 1 and "BatchNormalization" in warnings[0] and "all-reduces" in warnings[0]
    if probed:  # All of it trained: the same weights as without XLA. (A failed first step loses its batch.)
        for a, b in zip(model.weights, expected.weights, strict=True):
            np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=0, atol=1e-6)
        plain = _synchronized_batch_norm(mirrored, synchronized=False)  # Not refused by the verdict above.
        assert tfmp.fit(plain, regression_data(), epochs=1, jit_compile=True, verbose=0).params["jit_compile"]


class Seen(keras.layers.Layer):
    """Counts the examples it sees in training, in a variable of the given aggregation."""

    def __init__(self, aggregation, **kwargs):
        super().__init__(**kwargs)
        self.aggregation = aggregation

    def build(self, shape):
        self.seen = self.add_weight(shape=(), initializer="zeros", trainable=False, aggregation=self.aggregation)

    def call(self, x, training=False):
        if training:
            self.seen.assign_add(keras.ops.cast(keras.ops.shape(x)[0], "float32"))
        return x


def _counting(strategy, aggregation):
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4), Seen(aggregation), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.01), "mse")
    return model


def test_a_layer_updating_a_mean_variable_is_named_and_its_verdict_is_not_taken_for_a_plain_one(
    mirrored, monkeypatch, caplog
):
    """Updating a variable aggregated by "mean" or "sum" syncs replicas with a merge call, as synchronized
    BatchNormalization does: the warning says that of the layer, without claiming it is a BatchNormalization; and
    the same layers and shapes with a variable of aggregation "none" (no sync) compile, the refusal above not being
    taken for them."""
    monkeypatch.setattr(xla, "_PROBES", {})
    with caplog.at_level(logging.WARNING):
        refused = tfmp.fit(_counting(mirrored, "mean"), regression_data(), epochs=1, jit_compile=True, verbose=0)
    (warning,) = [r.getMessage() for r in caplog.records if "XLA cannot compile" in r.getMessage()]
    assert "Seen syncs replicas" in warning and "aggregation" in warning and "synchronized" not in warning
    assert refused.params["jit_compile"] is False
    assert tfmp.fit(_counting(mirrored, "none"), regression_data(), epochs=1, jit_compile=True, verbose=0).params[
        "jit_compile"
    ]
