"""Keras' Adafactor update without its 0 / 0 (tfmp.adafactor): Keras' bits wherever Keras' update
is finite, the factored second moment's own value where its product underflows, and a ReLU MLP
that model.fit turns to NaN trains under tfmp.fit."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import seeded

import tfmp
from tfmp import fused, keras_optimizers


def _apply(optimizer, grads, variables, repaired):
    """Applies each list of `grads` in turn, with Keras' update or tfmp's (its applier's)."""
    optimizer.build(variables)
    applier = optimizer
    if repaired:
        applier = keras_optimizers.reduced_applier(optimizer, {id(optimizer): (fused.update_step(optimizer), None)})
    for step in grads:
        applier.apply([tf.constant(g) for g in step], variables)


def _variables(shapes, rng):
    return [tf.Variable(rng.normal(size=shape).astype(np.float32)) for shape in shapes]


SCHEDULE = keras.optimizers.schedules.ExponentialDecay(0.05, 2, 0.5)  # Called: no relative step (Keras).


# 2.0: above 1 / sqrt(step), where the relative step caps it.
OPTIONS = [{}, {"learning_rate": 2.0}, {"learning_rate": 0.05, "relative_step": False}, {"learning_rate": SCHEDULE}]


@pytest.mark.parametrize("options", OPTIONS)
def test_keras_bits_wherever_keras_update_is_finite(options):
    rng = np.random.default_rng(0)
    shapes = [(6, 4), (2, 3, 5), (4,)]
    start = [rng.normal(size=s).astype(np.float32) for s in shapes]
    grads = [[rng.normal(size=s).astype(np.float32) for s in shapes] for _ in range(3)]
    states = []
    for repaired in (False, True):
        variables = [tf.Variable(v) for v in start]
        optimizer = keras.optimizers.Adafactor(**options)
        _apply(optimizer, grads, variables, repaired)
        states.append([v.numpy() for v in variables] + [v.numpy() for v in optimizer.variables])
    assert not np.array_equal(states[0][0], start[0])  # It moved.
    for keras_own, ours in zip(*states, strict=True):
        np.testing.assert_array_equal(ours, keras_own)


def _paper_step(weight, grad, lr=1e-3, eps1=1e-30, eps2=1e-3, clip=1.0):
    """Adafactor's first step (beta_2 = 0 there) in float64, where r x c does not underflow."""
    weight, grad = weight.astype(np.float64), grad.astype(np.float64)
    square = grad**2 + eps1
    r, c = square.mean(-1), square.mean(-2)
    v = np.outer(r / r.mean(), c)
    u = grad / np.sqrt(v)
    u /= max(1.0, np.sqrt((u**2).mean()) / clip)
    return weight - max(eps2, np.sqrt((weight**2).mean())) * min(lr, 1.0) * u


def test_a_dead_row_and_column_leave_the_kernel_finite_and_right():
    """A kernel's gradient with a zero row (a dead input unit) and zero columns (dead output
    units): Keras' v is 1e-30 x 1e-30 = 0 where they cross, 0 / 0 NaNs the whole kernel; tfmp's
    step is the float64 step's."""
    rng = np.random.default_rng(1)
    start, grad = rng.normal(size=(5, 4)).astype(np.float32), rng.normal(size=(5, 4)).astype(np.float32)
    grad[0, :] = 0.0
    grad[:, [1, 3]] = 0.0
    kept, ours = tf.Variable(start), tf.Variable(start)
    _apply(keras.optimizers.Adafactor(), [[grad]], [kept], repaired=False)
    assert np.isnan(kept.numpy()).all()  # Keras' own: the defect tfmp repairs.
    _apply(keras.optimizers.Adafactor(), [[grad]], [ours], repaired=True)
    np.testing.assert_allclose(ours.numpy(), _paper_step(start, grad), rtol=1e-6)
    assert np.array_equal(ours.numpy()[:, 1], start[:, 1])  # No gradient: not moved.


@seeded
def _relu_mlp():
    model = keras.Sequential(
        [keras.Input((8,)), *(keras.layers.Dense(16, activation="relu") for _ in range(2)), keras.layers.Dense(1)]
    )
    model.compile(keras.optimizers.Adafactor(learning_rate=0.01), "mse")
    return model


@pytest.mark.parametrize("policy", ["float32", "bfloat16"])
def test_a_relu_mlp_trains_where_model_fit_makes_nan(policy):
    rng = np.random.default_rng(0)
    x = rng.random((320, 8), dtype=np.float32)
    y = x.mean(1, keepdims=True)
    tfmp.configure_precision(policy)
    keras_own = _relu_mlp()
    keras_own.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    assert not all(np.isfinite(w.astype(np.float32)).all() for w in keras_own.get_weights())  # The defect.
    model = _relu_mlp()
    history = tfmp.fit(model, x, y, batch_size=32, epochs=3, shuffle=False, verbose=0)
    assert all(np.isfinite(w.astype(np.float32)).all() for w in model.get_weights())
    assert history.history["loss"][-1] < 0.5 * history.history["loss"][0]
