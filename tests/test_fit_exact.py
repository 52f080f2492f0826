"""tfmp.fit gives model.fit's weights: one device, float32, no XLA, 3 epochs of a user's
model (a convolution, a custom layer with a scalar weight, a float32 softmax Activation,
a custom loss function) with Adam, AdamW, SGD with momentum, and Adam keeping a moving
average of the weights (use_ema=True, which Keras fit makes the weights at its end); and a
BatchNormalization trained on arrays. (With TensorFlow's fused Adam kernel, which rounds
1 - beta in float32, AdamW ended 1.2e-5 away here.)"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import GPUS

import tfmp


class Scale(keras.layers.Layer):
    """A user's layer holding one scalar weight."""

    def build(self, input_shape):
        self.scale = self.add_weight(shape=(), initializer="ones", name="scale")

    def call(self, x):
        return x * self.scale


def smoothed_crossentropy(y_true, y_pred):
    """A user's loss: label-smoothed cross-entropy on probabilities."""
    y_true = tf.one_hot(tf.cast(tf.reshape(y_true, [-1]), tf.int32), 10) * 0.9 + 0.01
    return -tf.reduce_sum(y_true * tf.math.log(tf.clip_by_value(y_pred, 1e-7, 1.0)), axis=-1)


OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(3e-3),
    "adamw": lambda: keras.optimizers.AdamW(3e-3),
    "sgd_momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    # Keras fit ends by making the moving averages the weights (finalize_variable_values).
    "adam_ema": lambda: keras.optimizers.Adam(3e-3, use_ema=True),
}


def _model(optimizer):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 8, 1))
    x = keras.layers.Conv2D(8, 3, activation="relu")(inputs)
    x = keras.layers.Flatten()(x)
    x = Scale()(keras.layers.Dense(10)(x))
    model = keras.Model(inputs, keras.layers.Activation("softmax", dtype="float32")(x))
    model.compile(OPTIMIZERS[optimizer](), smoothed_crossentropy, jit_compile=False)
    return model


def _data():
    rng = np.random.default_rng(0)
    x = rng.random((1024, 8, 8, 1), dtype=np.float32)
    y = (x.reshape(1024, -1).sum(1) * 10 / 64 % 10).astype("int64")
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(64)


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_tfmp_fit_gives_model_fit_weights(optimizer, deterministic_gpu):
    ours, theirs = _model(optimizer), _model(optimizer)
    tfmp.fit(ours, _data(), epochs=3, jit_compile=False, verbose=0)
    theirs.fit(_data(), epochs=3, verbose=0)
    assert int(ours.optimizer.iterations.numpy()) == int(theirs.optimizer.iterations.numpy()) == 48
    pairs = zip(ours.weights, theirs.weights, strict=True)
    difference = max(float(np.max(np.abs(a.numpy() - b.numpy()))) for a, b in pairs)
    # To the bit on a CPU. A GPU's deterministic kernels make each loop repeat itself, but the two loops'
    # graphs may still meet other kernels there: not yet read on one, so within 1e-6 there.
    assert difference <= (1e-6 if GPUS else 0.0), difference


NORMALIZED = {
    "momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "nesterov": lambda: keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True),
    "adam": lambda: keras.optimizers.Adam(1e-2),
}


@pytest.mark.parametrize("optimizer, batch_size", [("momentum", 32), ("nesterov", 24), ("adam", 24), ("adam", 25)])
def test_a_batch_normalization_trains_to_model_fits_bits(optimizer, batch_size, deterministic_gpu):
    """Arrays, and the optimizer's slots too. Two rewrites of TensorFlow's graph optimizer make
    model.fit's numbers: a chain of products reordered (gamma's gradient times the learning rate:
    tfmp's SGD kernels take that product as Keras' update makes it), and a mean's gradient
    multiplied by 1 / N where the batch size N is static (in model.fit where every batch is whole:
    240 examples in batches of 24, not of 25)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(240, 8)).astype(np.float32)
    y = (x[:, 0] + x[:, 1] > 0).astype(np.int64)

    def build():
        keras.utils.set_random_seed(0)
        layers = [keras.layers.Dense(16), keras.layers.BatchNormalization(), keras.layers.ReLU()]
        model = keras.Sequential([keras.Input((8,)), *layers, keras.layers.Dense(2, activation="softmax")])
        model.compile(NORMALIZED[optimizer](), "sparse_categorical_crossentropy", jit_compile=False)
        return model

    ours, theirs = build(), build()
    tfmp.fit(ours, x, y, batch_size=batch_size, epochs=2, shuffle=False, jit_compile=False, verbose=0)
    theirs.fit(x, y, batch_size=batch_size, epochs=2, shuffle=False, verbose=0)
    state = lambda model: [v.numpy() for v in model.weights + model.optimizer.variables]  # noqa: E731
    for a, b in zip(state(ours), state(theirs), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6 if GPUS else 0.0)  # As the test above, on a GPU.
