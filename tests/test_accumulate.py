"""A mean over a masked output's elements (padded tokens) trains on accumulated micro-batches and on replicas as
one batch of the whole on one device (tfmp.accumulate): each part's mean weighed by its unmasked elements, where
Keras weighs the replicas' means equally whatever their counts; what cannot be weighed so is said."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmp

# Padded sequences of 1 to 10 tokens (0 is padding), few in the first half of each batch of 8, many in the second.
LENGTHS = [1, 2, 1, 3, 10, 9, 10, 8, 2, 10, 1, 7, 4, 10, 3, 5]


def token_data(batch):
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 20, (len(LENGTHS), 10))
    for row, length in enumerate(LENGTHS):
        tokens[row, length:] = 0
    targets = rng.integers(0, 5, (len(LENGTHS), 10))
    return tf.data.Dataset.from_tensor_slices((tokens, targets)).batch(batch)


def token_model(strategy, loss=None):
    """Per-token logits, a weight regularizer besides: the compiled loss is the mean over the unmasked tokens."""
    with strategy.scope():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((10,), dtype="int32")
        hidden = keras.layers.Embedding(20, 8, mask_zero=True)(inputs)
        hidden = keras.layers.Dense(8, activation="relu", kernel_regularizer=keras.regularizers.L2(1e-2))(hidden)
        model = keras.Model(inputs, keras.layers.Dense(5)(hidden))
        model.compile(keras.optimizers.SGD(0.5), loss or keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def trained(strategy, batch, grad_accum_steps, jit_compile, loss=None):
    model = token_model(strategy, loss)
    history = tfmp.fit(
        model,
        token_data(batch),
        validation_data=token_data(8),
        epochs=2,
        grad_accum_steps=grad_accum_steps,
        jit_compile=jit_compile,
        verbose=0,
    )
    return [w.numpy() for w in model.weights], history.history


@pytest.mark.parametrize("jit_compile", [False, True], ids=["no_xla", "xla"])
@pytest.mark.parametrize("parts", ["accumulated", "replicas", "both"])
def test_a_masked_mean_trains_as_one_batch_of_the_whole(mirrored, parts, jit_compile):
    whole, whole_logs = trained(tf.distribute.get_strategy(), 8, 1, jit_compile)
    strategy = tf.distribute.get_strategy() if parts == "accumulated" else mirrored
    accumulated = 1 if parts == "replicas" else 2
    weights, logs = trained(strategy, 8 // accumulated, accumulated, jit_compile)
    for a, b in zip(weights, whole, strict=True):  # Were 0.04 apart: each part's mean weighed alike.
        np.testing.assert_allclose(a, b, atol=2e-7)
    # The logged losses too (on replicas, each replica's mean weighed by its examples was 0.5% off).
    np.testing.assert_allclose(logs["loss"], whole_logs["loss"], rtol=1e-5)
    np.testing.assert_allclose(logs["val_loss"], whole_logs["val_loss"], rtol=1e-5)


@pytest.mark.parametrize(
    "parts, reduction, said",
    [
        ("accumulated", "mean_with_sample_weight", True),  # Divided by the weights' sum, which parts count apart.
        ("replicas", "mean_with_sample_weight", True),
        ("accumulated", "sum_over_batch_size", False),  # Weighed exactly.
        ("whole", "mean_with_sample_weight", False),  # One part.
    ],
)
def test_a_masked_mean_that_cannot_be_weighed_is_said(mirrored, caplog, parts, reduction, said):
    strategy = mirrored if parts == "replicas" else tf.distribute.get_strategy()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction)
    model = token_model(strategy, loss)
    with caplog.at_level("WARNING"):
        tfmp.fit(model, token_data(4), grad_accum_steps=2 if parts == "accumulated" else 1, verbose=0)
    lines = [r.getMessage() for r in caplog.records if "unmasked elements" in r.getMessage()]
    assert len(lines) == int(said)


@pytest.mark.parametrize(
    "parts, weighted, said",
    [("replicas", True, True), ("accumulated", True, True), ("replicas", False, False), ("whole", True, False)],
)
def test_a_mean_divided_by_its_parts_sample_weights_is_said(mirrored, caplog, parts, weighted, said):
    """'mean_with_sample_weight' divides each replica's and micro-batch's loss by its own sum of sample weights, and
    the parts weigh alike (2 replicas whose weights sum 4:1 ended 0.014 from one device's weights after 2 epochs,
    model.fit the same): said once, with the exact way. Without sample weights, or in one part, nothing to say."""
    strategy = mirrored if parts == "replicas" else tf.distribute.get_strategy()
    x = np.random.default_rng(0).random((32, 8), dtype=np.float32)
    arrays = (x, x[:, :1], np.where(np.arange(32) % 8 < 4, 4.0, 1.0).astype(np.float32))
    data = tf.data.Dataset.from_tensor_slices(arrays if weighted else arrays[:2]).batch(
        4 if parts == "accumulated" else 8
    )
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
        model.compile("sgd", keras.losses.MeanSquaredError(reduction="mean_with_sample_weight"))
    with caplog.at_level("WARNING"):
        tfmp.fit(model, data, epochs=2, grad_accum_steps=2 if parts == "accumulated" else 1, verbose=0)
    lines = [r.getMessage() for r in caplog.records if "mean_with_sample_weight" in r.getMessage()]
    assert len(lines) == int(said)
    assert not said or "reduction='sum'" in lines[0]
