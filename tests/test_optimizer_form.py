"""A run resumed with another optimizer, or other trainable layers, than the checkpoint's: refused in
words (tfmp.optimizer_form). Before, TensorFlow's restore failed on a shape or an unmatched slot
(the checkpoint said to be another model's), or dropped the state unsaid (Adam's under SGD)."""

import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmp
from tfmp.errors import UsageError

X, Y = np.ones((8, 3), "float32"), np.ones((8, 2), "float32")


def _model(optimizer, frozen=False):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, use_bias=False), keras.layers.Dense(2)])
    model.layers[0].trainable = not frozen
    model.compile(optimizer, "mse")
    return model


def _fit(tmp_path, optimizer, frozen=False, epochs=1):
    model = _model(optimizer, frozen)
    tfmp.fit(model, X, Y, epochs=epochs, batch_size=4, verbose=0, checkpoint_dir=str(tmp_path))
    return model


def _restore_as_said(error, model):
    """Runs the restore of the weights that `error` gives; returns `model`'s weights."""
    (code,) = re.findall(r"its weights first[^:]*: (.*)\)$", str(error))
    eval(code, {"tf": tf, "model": model})  # noqa: S307 - the message's own line, as a user would paste it.
    return [w.numpy() for w in model.weights]


@pytest.mark.parametrize(
    ("saved", "now", "words"),
    [
        (lambda: keras.optimizers.Adam(), lambda: keras.optimizers.SGD(momentum=0.9), "Adam (6 state variables), and "),
        (
            lambda: keras.optimizers.Adam(),
            lambda: keras.optimizers.SGD(),
            "this run trains with SGD (0 state variables)",
        ),
        (lambda: keras.optimizers.SGD(momentum=0.9), lambda: keras.optimizers.SGD(), "SGD (3 state variables), and"),
        (lambda: keras.optimizers.SGD(), lambda: keras.optimizers.Adam(), "SGD (0 state variables), and this run"),
        # The same shapes, another meaning: SGD's momentum would have gone on as RMSprop's mean square.
        (
            lambda: keras.optimizers.SGD(momentum=0.9),
            lambda: keras.optimizers.RMSprop(),
            "SGD (3 state variables), and this run trains with RMSprop (3 state variables)",
        ),
    ],
)
def test_a_checkpoint_of_another_optimizer_says_so_and_how_its_weights_go_on(tmp_path, saved, now, words):
    trained = _fit(tmp_path, saved())
    with pytest.raises(
        UsageError, match=f"{re.escape(words)}.*carries over only to the same optimizer .* new checkpoint_dir"
    ) as e:
        _fit(tmp_path, now(), epochs=2)
    for a, b in zip(trained.weights, _restore_as_said(e.value, _model(now())), strict=True):
        np.testing.assert_array_equal(a.numpy(), b)


def test_a_checkpoint_training_other_layers_says_so_and_how_its_weights_go_on(tmp_path):
    trained = _fit(tmp_path, keras.optimizers.Adam())
    with pytest.raises(
        UsageError, match="saved training 3 of the model's weights, and this run trains 2 .*trainable"
    ) as e:
        _fit(tmp_path, keras.optimizers.Adam(), frozen=True, epochs=2)
    model = _model(keras.optimizers.Adam())  # Its layers trainable as saved while restored (frozen after, to train on).
    for a, b in zip(trained.weights, _restore_as_said(e.value, model), strict=True):
        np.testing.assert_array_equal(a.numpy(), b)


def test_the_same_state_under_another_type_goes_on_with_a_warning(tmp_path, caplog):
    saved = _fit(tmp_path, keras.optimizers.Adam())
    with caplog.at_level("WARNING"):
        resumed = _fit(tmp_path, keras.optimizers.AdamW(), epochs=1)  # Nothing left to train: the state restored.
    assert "saved with Adam (6 state variables); its state goes on in this run's AdamW" in caplog.text
    for a, b in zip(saved.optimizer.variables, resumed.optimizer.variables, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
