"""Each replica draws its own dropout mask under tfmp.fit (Keras gives every replica the same one), and one
device draws as model.fit does."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import weights

import tfmp
from tfmp import rng


def _masks(strategy, draw):
    """Each replica's dropout mask of one row of 64 ones, drawn by `draw(layer, ones)` in its replica context."""
    with strategy.scope():
        layer = keras.layers.Dropout(0.5, seed=1)
        layer.build((1, 64))
    out = tf.function(lambda: strategy.run(lambda: draw(layer, tf.ones((1, 64)))))()
    return [t.numpy() for t in strategy.experimental_local_results(out)]


def test_replicas_draw_apart_only_inside_the_block(mirrored):
    def inside(layer, ones):
        with rng.per_replica(mirrored):
            return layer(ones, training=True)

    first, second = _masks(mirrored, inside)
    assert (first != second).any()
    # Outside the block Keras draws as it does (the same mask on every replica), before and after it was used.
    first, second = _masks(mirrored, lambda layer, ones: layer(ones, training=True))
    np.testing.assert_array_equal(first, second)


def _column_moves(strategy, jit_compile, fit):
    """Two replicas, one example of ones each, an identity kernel, then Dropout(0.5); the loss is the output's
    mean, so one SGD step with rate 1 moves kernel column j by the number of replicas whose mask kept j."""
    with strategy.scope():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((64,))
        hidden = keras.layers.Dense(64, use_bias=False, kernel_initializer="identity")(inputs)
        model = keras.Model(inputs, keras.layers.Dropout(0.5)(hidden))
        model.compile(keras.optimizers.SGD(1.0), lambda y, p: keras.ops.mean(p, axis=-1))
    x, y = np.ones((2, 64), np.float32), np.zeros((2, 1), np.float32)
    fit(model, x, y, batch_size=2, epochs=1, verbose=0, shuffle=False, jit_compile=jit_compile)
    moved = -(model.get_weights()[0] - np.eye(64, dtype=np.float32)).sum(0)
    return np.round(moved / moved.max(), 3)  # 1: both replicas kept column j; 0.5: one did; 0: neither.


@pytest.mark.parametrize(
    "strategy, jit_compile", [("mirrored", False), ("mirrored", True), ("no_merge_call", True)], ids=str
)
def test_each_replica_draws_its_own_mask(request, strategy, jit_compile):
    moves = _column_moves(request.getfixturevalue(strategy), jit_compile, tfmp.fit)
    assert set(moves.tolist()) == {0.0, 0.5, 1.0}


def test_model_fit_gives_every_replica_one_mask(mirrored):
    """What tfmp.fit does not inherit: under model.fit both replicas keep the same columns."""

    def fit(model, *args, jit_compile, **kwargs):
        model.jit_compile = False  # Keras' XLA step cannot place mirrored variables on CPUs.
        return model.fit(*args, **kwargs)

    assert set(_column_moves(mirrored, False, fit).tolist()) == {0.0, 1.0}


def test_one_device_draws_as_model_fit():
    def train(fit):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((8,))
        hidden = keras.layers.Dropout(0.3)(keras.layers.Dense(16, activation="relu")(inputs))
        hidden = keras.layers.GaussianNoise(0.1)(hidden)
        model = keras.Model(inputs, keras.layers.Dense(1)(hidden))
        model.compile(keras.optimizers.SGD(0.1), "mse", jit_compile=False)
        x = np.random.default_rng(0).random((64, 8), dtype=np.float32)
        fit(model, x, x.sum(1, keepdims=True), batch_size=16, epochs=2, shuffle=False, verbose=0)
        return weights(model)

    ours = train(lambda model, *a, **k: tfmp.fit(model, *a, jit_compile=False, **k))
    theirs = train(lambda model, *a, **k: model.fit(*a, **k))
    for a, b in zip(ours, theirs, strict=True):
        np.testing.assert_array_equal(a, b)
