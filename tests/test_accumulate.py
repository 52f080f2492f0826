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


def token_data(batch, weighted=False, outputs=1):
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 20, (len(LENGTHS), 10))
    for row, length in enumerate(LENGTHS):
        tokens[row, length:] = 0
    targets = rng.integers(0, 5, (len(LENGTHS), 10))
    targets = targets if outputs == 1 else (targets,) * outputs
    weights = np.where(np.arange(len(LENGTHS)) % 8 < 4, 4.0, 1.0).astype(np.float32)  # A batch's first half: 4.
    weights = np.repeat(weights[:, None], 10, axis=1)  # One per token, as Keras multiplies them with the mask.
    arrays = (tokens, targets, weights) if weighted else (tokens, targets)
    return tf.data.Dataset.from_tensor_slices(arrays).batch(batch)


def token_model(strategy, loss=None, outputs=1):
    """Per-token logits, a weight regularizer besides: the compiled loss is the mean over the unmasked tokens."""
    with strategy.scope():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((10,), dtype="int32")
        hidden = keras.layers.Embedding(20, 8, mask_zero=True)(inputs)
        hidden = keras.layers.Dense(8, activation="relu", kernel_regularizer=keras.regularizers.L2(1e-2))(hidden)
        heads = [keras.layers.Dense(5)(hidden) for _ in range(outputs)]
        model = keras.Model(inputs, heads[0] if outputs == 1 else heads)
        loss = loss or keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        model.compile(keras.optimizers.SGD(0.5), loss if outputs == 1 else [loss] * outputs)
    return model


def trained(strategy, batch, grad_accum_steps, jit_compile, loss=None, weighted=False):
    model = token_model(strategy, loss)
    history = tfmp.fit(
        model,
        token_data(batch, weighted),
        validation_data=token_data(8, weighted),
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
    "parts, weighted, jit_compile",
    [("accumulated", False, True), ("replicas", True, False), ("both", True, True), ("both", False, False)],
)
def test_a_masked_mean_divided_by_its_weights_trains_as_one_batch_of_the_whole(mirrored, parts, weighted, jit_compile):
    """'mean_with_sample_weight' over a masked output divides by the sum of the sample weights times the mask (the
    unmasked tokens, without sample weights), which each part sums apart: weighed by it (`scalar_losses.divisor`)."""
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="mean_with_sample_weight")
    whole, whole_logs = trained(tf.distribute.get_strategy(), 8, 1, jit_compile, loss, weighted)
    strategy = tf.distribute.get_strategy() if parts == "accumulated" else mirrored
    accumulated = 1 if parts == "replicas" else 2
    weights, logs = trained(strategy, 8 // accumulated, accumulated, jit_compile, loss, weighted)
    for a, b in zip(weights, whole, strict=True):
        np.testing.assert_allclose(a, b, atol=2e-7)
    np.testing.assert_allclose(logs["loss"], whole_logs["loss"], rtol=1e-5)
    np.testing.assert_allclose(logs["val_loss"], whole_logs["val_loss"], rtol=1e-5)


@pytest.mark.parametrize(
    "parts, reduction, outputs, said",
    [
        ("accumulated", "mean_with_sample_weight", 2, True),  # Several losses: one divisor cannot weigh them.
        ("replicas", "sum_over_batch_size", 2, True),
        ("accumulated", "sum_over_batch_size", 1, False),  # Weighed exactly.
        ("replicas", "mean_with_sample_weight", 1, False),
        ("whole", "sum_over_batch_size", 2, False),  # One part.
    ],
)
def test_a_masked_mean_that_cannot_be_weighed_is_said(mirrored, caplog, parts, reduction, outputs, said):
    strategy = mirrored if parts == "replicas" else tf.distribute.get_strategy()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction)
    model = token_model(strategy, loss, outputs)
    data = token_data(4, outputs=outputs)
    with caplog.at_level("WARNING"):
        tfmp.fit(model, data, grad_accum_steps=2 if parts == "accumulated" else 1, verbose=0)
    lines = [r.getMessage() for r in caplog.records if "unmasked elements" in r.getMessage()]
    assert len(lines) == int(said)


def weighted_data(batch, weighted=True, outputs=1):
    """Regression targets; each batch of 8's first half weighs 4, its second 1: halves whose weights sum 4:1."""
    x = np.random.default_rng(0).random((32, 8), dtype=np.float32)
    y = x[:, :1] if outputs == 1 else (x[:, :1],) * outputs
    arrays = (x, y, np.where(np.arange(32) % 8 < 4, 4.0, 1.0).astype(np.float32))
    return tf.data.Dataset.from_tensor_slices(arrays if weighted else arrays[:2]).batch(batch)


def weighted_model(strategy, outputs=1):
    with strategy.scope():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((8,))
        hidden = keras.layers.Dense(4, activation="relu")(inputs)
        heads = [keras.layers.Dense(1)(hidden) for _ in range(outputs)]
        loss = keras.losses.MeanSquaredError(reduction="mean_with_sample_weight")
        model = keras.Model(inputs, heads[0] if outputs == 1 else heads)
        model.compile(keras.optimizers.SGD(0.1), loss if outputs == 1 else [loss] * outputs)
    return model


@pytest.mark.parametrize("jit_compile", [False, True], ids=["no_xla", "xla"])
@pytest.mark.parametrize("parts", ["accumulated", "replicas", "both"])
def test_a_mean_divided_by_its_weights_trains_as_one_batch_of_the_whole(mirrored, parts, jit_compile):
    """'mean_with_sample_weight' divides each replica's and micro-batch's loss by its own sample weights' sum, and
    Keras weighs the parts alike (2 replicas whose weights summed 4:1 ended 0.025 from one device's weights after 2
    epochs, model.fit weighing them alike too): each part is weighed by its weights' sum (`scalar_losses.divisor`)."""
    whole = weighted_model(tf.distribute.get_strategy())
    fit = {"validation_data": weighted_data(8), "epochs": 2, "jit_compile": jit_compile, "verbose": 0}
    whole_logs = tfmp.fit(whole, weighted_data(8), **fit).history
    model = weighted_model(tf.distribute.get_strategy() if parts == "accumulated" else mirrored)
    accumulated = 1 if parts == "replicas" else 2
    logs = tfmp.fit(model, weighted_data(8 // accumulated), grad_accum_steps=accumulated, **fit).history
    for a, b in zip(model.weights, whole.weights, strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=2e-7)
    np.testing.assert_allclose(logs["loss"], whole_logs["loss"], rtol=1e-5)
    np.testing.assert_allclose(logs["val_loss"], whole_logs["val_loss"], rtol=1e-5)


def test_class_weights_validation_without_weights_and_evaluate_with_them_as_on_one_device(mirrored):
    """'mean_with_sample_weight' on 2 replicas, 37 examples in batches of 8: trained with class weights (sample
    weights to Keras), validated on batches that have none (which once failed: None taken for a weight), then
    evaluated with sample weights: the weights, every log and the evaluation as one device's, the evaluation as
    `model.evaluate`'s."""
    rng = np.random.default_rng(0)
    x = rng.random((37, 8), dtype=np.float32)
    y, w = (x.sum(1) > 4).astype(np.int64), rng.random(37).astype(np.float32) * 3
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="mean_with_sample_weight")
    fit = {"batch_size": 8, "epochs": 2, "class_weight": {0: 3.0, 1: 0.5}, "shuffle": False, "validation_split": 0.3}
    results = []
    for strategy in (mirrored, tf.distribute.get_strategy()):
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = keras.Sequential(
                [keras.Input((8,)), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(2)]
            )
            model.compile(keras.optimizers.SGD(0.1), loss, metrics=["accuracy"])
        logs = tfmp.fit(model, x, y, verbose=0, **fit).history
        results.append((model, logs, tfmp.evaluate(model, x, y, sample_weight=w, batch_size=8, return_dict=True)))
    (model, logs, evaluated), (one, one_logs, one_evaluated) = results
    for a, b in zip(model.weights, one.weights, strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=2e-7)
    assert logs.keys() == one_logs.keys()
    for key in logs:
        np.testing.assert_allclose(logs[key], one_logs[key], rtol=1e-5, err_msg=key)
    expected = one.evaluate(x, y, sample_weight=w, batch_size=8, verbose=0, return_dict=True)
    assert evaluated == pytest.approx(one_evaluated, rel=1e-5)
    assert evaluated == pytest.approx(expected, rel=1e-5)


def test_a_mean_divided_by_its_weights_keeps_its_magnitude_under_float16_loss_scaling(mirrored):
    """A replica's one batch is weighed by its divisor after the backward pass, its loss left as Keras scales it
    before: weighed by its weights' sum over its examples (4 here), the float16 gradients of the first updates
    overflowed on 2 replicas where one device's did not, and 2 of 8 updates were skipped (weights 0.05 off)."""
    keras.config.set_dtype_policy("mixed_float16")
    whole, model = weighted_model(tf.distribute.get_strategy()), weighted_model(mirrored)
    for trained in (whole, model):
        tfmp.fit(trained, weighted_data(8), epochs=2, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == int(whole.optimizer.iterations.numpy()) == 8
    for a, b in zip(model.weights, whole.weights, strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=5e-4)


@pytest.mark.parametrize(
    "parts, weighted, outputs, said",
    [
        ("replicas", True, 2, True),  # Several losses: one divisor cannot weigh them.
        ("accumulated", True, 2, True),
        ("replicas", True, 1, False),  # Weighed by its divisor.
        ("replicas", False, 2, False),  # Divided by its elements.
        ("whole", True, 2, False),  # One part.
    ],
)
def test_a_mean_divided_by_its_parts_sample_weights_is_said(mirrored, caplog, parts, weighted, outputs, said):
    """Where 'mean_with_sample_weight' cannot be weighed by its parts' weights (several losses), it is said once,
    with the exact way. Without sample weights, weighed, or in one part, nothing to say."""
    strategy = mirrored if parts == "replicas" else tf.distribute.get_strategy()
    model = weighted_model(strategy, outputs)
    data = weighted_data(4 if parts == "accumulated" else 8, weighted, outputs)
    with caplog.at_level("WARNING"):
        tfmp.fit(model, data, epochs=2, grad_accum_steps=2 if parts == "accumulated" else 1, verbose=0)
    lines = [r.getMessage() for r in caplog.records if "mean_with_sample_weight" in r.getMessage()]
    assert len(lines) == int(said)
    assert not said or "reduction='sum'" in lines[0]
