"""A compiled loss whose function returns one number for the batch trains under a strategy as on one device
(tfmp.scalar_losses): Keras scales every other loss by 1/replicas but not that one, so that `model.fit` under 2
replicas trains with twice one device's gradient and reports twice its loss."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmp


def batch_mean(y_true, y_pred):
    return keras.ops.mean(keras.ops.square(y_true - y_pred))  # One number, as tutorials write a custom loss.


class BatchMean(keras.losses.Loss):
    def call(self, y_true, y_pred):
        return keras.ops.mean(keras.ops.square(y_true - y_pred))


def data(weighted=False, batch=32):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, 8)).astype("float32")
    y = x[:, :1] * 2.0 + 0.5
    arrays = (x, y, rng.random(128).astype("float32") + 0.5) if weighted else (x, y)
    return tf.data.Dataset.from_tensor_slices(arrays).batch(batch)


def trained(strategy, loss, jit_compile, weighted=False, grad_accum_steps=1):
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.01), loss)
    history = tfmp.fit(
        model,
        data(weighted, batch=32 // grad_accum_steps),
        epochs=2,
        grad_accum_steps=grad_accum_steps,
        jit_compile=jit_compile,
        strategy=strategy,
        verbose=0,
    )
    return history.history["loss"], [w.numpy() for w in model.weights]


@pytest.mark.parametrize("jit_compile", [False, True])
@pytest.mark.parametrize(
    "loss", [batch_mean, BatchMean(), keras.losses.MeanSquaredError()], ids=["function", "loss_class", "per_example"]
)
def test_a_loss_that_returns_one_number_trains_on_replicas_as_on_one_device(mirrored, loss, jit_compile):
    one_loss, one = trained(tf.distribute.get_strategy(), loss, jit_compile)
    two_loss, two = trained(mirrored, loss, jit_compile)
    np.testing.assert_allclose(two_loss, one_loss, rtol=1e-5)  # Was twice one device's.
    for a, b in zip(two, one, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_one_number_weighed_by_each_example_stays_near_one_device(mirrored):
    """Weighed by sample weights, one number for the batch becomes the batch's mean times the weights' mean, a
    product of two means that no sum over replicas gives exactly (each replica's product, averaged): near one
    device's, as under model.fit, and not scaled twice by the per-example values tfmp gives Keras."""
    one_loss, one = trained(tf.distribute.get_strategy(), batch_mean, False, weighted=True)
    two_loss, two = trained(mirrored, batch_mean, False, weighted=True)
    np.testing.assert_allclose(two_loss, one_loss, rtol=1e-2)
    for a, b in zip(two, one, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-2, atol=5e-3)


def test_a_summed_loss_is_left_alone(mirrored):
    """A sum over replicas of their sums is the global sum: nothing to scale."""
    summed = keras.losses.MeanSquaredError(reduction="sum")
    one_loss, one = trained(tf.distribute.get_strategy(), summed, False)
    two_loss, two = trained(mirrored, summed, False)
    np.testing.assert_allclose(two_loss, one_loss, rtol=1e-5)
    for a, b in zip(two, one, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("jit_compile", [False, True])
def test_a_summed_loss_accumulated_is_the_sum_over_the_whole_batch(jit_compile):
    """Accumulated micro-batches of 16 make the update one batch of 32 makes: for a mean, the mean of their means;
    for a sum, the sum of their sums (was half of it: each micro-batch's loss divided by their number)."""
    summed = keras.losses.MeanSquaredError(reduction="sum")
    whole_loss, whole = trained(tf.distribute.get_strategy(), summed, jit_compile)
    parts_loss, parts = trained(tf.distribute.get_strategy(), summed, jit_compile, grad_accum_steps=2)
    np.testing.assert_allclose(parts_loss, whole_loss, rtol=1e-5)
    for a, b in zip(parts, whole, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def _regression(strategy, reduction, learning_rate=0.05):
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(learning_rate), keras.losses.MeanSquaredError(reduction=reduction))
    return model


def _trains_as_on_one_device(mirrored, build, data, jit_compile=False):
    """`build(strategy)`'s model, 2 epochs on `data` (validated on it too), on 2 replicas as on one device: the
    same weights and logs (loss, val_loss, each output's), which it returns."""

    def train(strategy):
        model = build(strategy)
        history = tfmp.fit(model, data, epochs=2, validation_data=data, jit_compile=jit_compile, verbose=0).history
        return [w.numpy() for w in model.weights], history

    (weights, logs), (one_weights, one_logs) = train(mirrored), train(tf.distribute.get_strategy())
    for a, b in zip(weights, one_weights, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert logs.keys() == one_logs.keys()
    for key in logs:
        np.testing.assert_allclose(logs[key], one_logs[key], rtol=1e-5, err_msg=key)
    return logs


def test_a_summed_loss_split_unevenly_is_left_alone(mirrored):
    """35 examples in batches of 8: the last batch of 3 splits 2 and 1. A mean's parts are weighed by their
    examples (tfmp.crossing.weigh_by_share); a sum's add up as they are (weighed, they were 3e-3 off). The logged
    loss and val_loss weigh each batch's sum by all its examples, as one device does (each replica's by its own
    examples, they were 1-2% off)."""
    x = np.random.default_rng(0).random((35, 8), dtype=np.float32)
    data = tf.data.Dataset.from_tensor_slices((x, x.sum(1, keepdims=True) / 8)).batch(8)
    _trains_as_on_one_device(mirrored, lambda strategy: _regression(strategy, "sum", 0.01), data)


@pytest.mark.parametrize("reduction", ["sum_over_batch_size", "sum"])
@pytest.mark.parametrize("replicas", [1, 2])
def test_micro_batches_of_different_sizes_train_as_their_concatenation(mirrored, reduction, replicas):
    """38 examples in batches of 4, two to an update: the last update's batches hold 4 and 2 examples. Weighed
    alike, a mean's 2 weighed 1.5 times each of the 4 (weights 5e-3 from one batch of 6, the logged loss 0.9%);
    a sum's logged loss was 1.8% off. Each batch now weighs by its examples, as in one update on their concatenation
    (batches of 8 and 6), on one device and on 2 replicas, with and without XLA."""
    strategy = mirrored if replicas == 2 else tf.distribute.get_strategy()
    x = np.random.default_rng(0).random((38, 8), dtype=np.float32)
    y = x.sum(1, keepdims=True) / 8

    def train(batch, accumulate, jit_compile):
        model = _regression(strategy, reduction)
        data = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)
        history = tfmp.fit(model, data, epochs=2, grad_accum_steps=accumulate, jit_compile=jit_compile, verbose=0)
        return [w.numpy() for w in model.weights], history.history["loss"]

    whole, whole_loss = train(8, 1, False)
    for jit_compile in (False, True):
        parts, parts_loss = train(4, 2, jit_compile)
        np.testing.assert_allclose(parts_loss, whole_loss, rtol=2e-6)
        for a, b in zip(parts, whole, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_batches_past_the_last_whole_update_are_said(caplog):
    """9 batches, two to an update: the ninth is drawn and left out each epoch, and a warning says so."""
    x, model = np.zeros((36, 8), np.float32), _regression(tf.distribute.get_strategy(), "sum")
    with caplog.at_level("WARNING"):
        tfmp.fit(model, x, x[:, :1], batch_size=4, grad_accum_steps=2, verbose=0)
    said = [r.getMessage() for r in caplog.records if "leaves out" in r.getMessage()]
    assert said and "holds 9 batches" in said[0] and "makes 4 updates and leaves out its last 1 batch" in said[0]


@pytest.mark.parametrize("form, examples", [("filtered", 36), ("filtered", 32), ("generator", 36), ("stream", 36)])
def test_batches_read_past_the_last_whole_update_of_an_input_that_runs_out_are_said(mirrored, caplog, form, examples):
    """An input of unknown length (a filter; a generator, on 2 replicas) that runs out one batch past its last
    whole update, two batches to an update: the update that reads that batch fails, so it is left out, and a
    warning (once) says so. "stream": a generator at steps_per_epoch=4 runs out at the third epoch's first read.
    With 32 examples the input ends on a whole update: no warning."""
    x = np.random.default_rng(0).random((examples, 8), dtype=np.float32)
    strategy = tf.distribute.get_strategy() if form == "filtered" else mirrored
    model = _regression(strategy, "sum_over_batch_size")
    if form == "filtered":
        data = tf.data.Dataset.from_tensor_slices((x, x[:, :1])).batch(4).filter(lambda *_: True)
    else:
        data = ((x[i : i + 4], x[i : i + 4, :1]) for i in range(0, examples, 4))
    stream = form == "stream"
    with caplog.at_level("WARNING"):
        tfmp.fit(model, data, epochs=3 if stream else 2, steps_per_epoch=4 if stream else None, grad_accum_steps=2)
    said = [r.getMessage() for r in caplog.records if "past its last whole update" in r.getMessage()]
    assert model.optimizer.iterations.numpy() == (4 if stream else 8 if form == "filtered" else 4)
    if examples == 32:
        assert not said
        return
    assert len(said) == 1 and f"ran out at epoch {3 if stream else 1} with 1 batch(es)" in said[0]
    assert ("every epoch" in said[0]) == (form == "filtered")
    assert ("repeat it" in said[0]) == (form == "filtered")


@pytest.mark.parametrize(
    "reductions, jit_compile",
    [
        (("sum", "sum_over_batch_size"), False),
        (("sum", "sum_over_batch_size"), True),
        (("sum_over_batch_size", "sum_over_batch_size"), True),
        (("sum", "sum"), False),
    ],
)
def test_sum_and_mean_losses_split_unevenly_train_as_on_one_device(mirrored, reductions, jit_compile):
    """Two outputs, one loss reduced by "sum", one a mean; 35 examples in batches of 8 on 2 replicas, the last
    batch split 2 and 1. Weighed by its share of the examples, each replica's whole loss weighed its sum by it too
    (weights 3.3e-3 from one device's after 2 epochs, val_loss 0.6%); the share is now counted before the losses
    and each sum divided by it first (tfmp.accumulate.replica_share). Each output's logged loss weighs each
    replica's by that share too (weighed alike, `a_loss` and `b_loss` were 0.7-6% off one device's), except where
    all are sums, whose replicas' parts add up as they are."""
    x = np.random.default_rng(0).random((35, 8), dtype=np.float32)
    data = tf.data.Dataset.from_tensor_slices((x, {"a": x[:, :1], "b": x[:, 1:2]})).batch(8)

    def build(strategy):
        with strategy.scope():
            keras.utils.set_random_seed(0)
            inputs = keras.Input((8,))
            hidden = keras.layers.Dense(4, activation="relu")(inputs)
            outputs = {"a": keras.layers.Dense(1, name="a")(hidden), "b": keras.layers.Dense(1, name="b")(hidden)}
            model = keras.Model(inputs, outputs)
            losses = {key: keras.losses.MeanSquaredError(reduction=r) for key, r in zip("ab", reductions, strict=True)}
            model.compile(keras.optimizers.SGD(0.01), losses, loss_weights={"a": 0.5, "b": 1.0})
        return model

    _trains_as_on_one_device(mirrored, build, data, jit_compile)


class OwnLoss(keras.Model):
    """A `compute_loss` of the model's own, as Keras' guide writes one: a mean over its batch, alone ("own") or
    added to Keras' ("plus"); two outputs, "a" reduced by `reduction`, so that per-output losses are logged too."""

    def __init__(self, kind, **kwargs):
        super().__init__(**kwargs)
        self.kind, self.hidden = kind, keras.layers.Dense(4, activation="relu")
        self.a, self.b = keras.layers.Dense(1, name="a"), keras.layers.Dense(1, name="b")

    def call(self, x):
        hidden = self.hidden(x)
        return {"a": self.a(hidden), "b": self.b(hidden)}

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        own = keras.ops.mean(keras.ops.abs(y_pred["a"] - y["a"]))
        if self.kind == "own":
            return own
        return super().compute_loss(x, y, y_pred, sample_weight, training) + 0.5 * own


@pytest.mark.parametrize(
    "kind, reduction, examples, jit_compile",
    [
        ("own", "sum_over_batch_size", 32, False),
        ("own", "sum_over_batch_size", 35, True),
        ("plus", "sum_over_batch_size", 32, False),
        ("plus", "sum_over_batch_size", 35, False),
        ("plus", "sum", 32, True),
        ("plus", "sum", 35, False),
    ],
)
def test_a_compute_loss_of_the_models_own_trains_on_replicas_as_on_one_device(
    mirrored, kind, reduction, examples, jit_compile
):
    """Keras divides each compiled loss and each added loss by the replicas, not the terms a `compute_loss` of the
    model's own adds: on 2 replicas model.fit trained those with twice one device's gradient (weights 0.022 apart
    after 2 epochs with SGD) and logged twice their loss. tfmp takes what the override returns as its replica's
    loss as one device's (Keras' division off while it runs, a sum counted whole) and weighs it as a mean. With 35
    examples in batches of 8 the last batch splits 2 and 1: the weights and every log as one device's."""
    x = np.random.default_rng(0).random((examples, 8), dtype=np.float32)
    data = tf.data.Dataset.from_tensor_slices((x, {"a": x[:, :1], "b": x[:, 1:2]})).batch(8)

    def build(strategy):
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = OwnLoss(kind)
            losses = {"a": keras.losses.MeanSquaredError(reduction=reduction), "b": keras.losses.MeanSquaredError()}
            model.compile(keras.optimizers.SGD(0.05), None if kind == "own" else losses)
        return model

    _trains_as_on_one_device(mirrored, build, data, jit_compile)


@pytest.mark.skipif(not hasattr(keras, "distillation"), reason="keras.distillation is Keras 3.12's and later")
def test_keras_distiller_trains_and_logs_on_replicas_as_on_one_device(mirrored):
    """Keras' own `Distiller` overrides `compute_loss`: its student loss is divided by the replicas, its logits
    distillation is not, and its trackers log what it computed. Under model.fit on 2 replicas the student and
    total losses logged half one device's and `loss` mixed both; under tfmp.fit every log is one device's, the
    validation's too."""
    x = np.random.default_rng(0).random((256, 8), dtype=np.float32)
    data = tf.data.Dataset.from_tensor_slices((x, (x.sum(1) > 4).astype(np.int64))).batch(32)

    def build(strategy):
        with strategy.scope():
            keras.utils.set_random_seed(0)
            teacher = keras.Sequential(
                [keras.Input((8,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(2)]
            )
            student = keras.Sequential(
                [keras.Input((8,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(2)]
            )
            distiller = keras.distillation.Distiller(
                teacher=teacher,
                student=student,
                distillation_losses=keras.distillation.LogitsDistillation(temperature=3.0),
                student_loss_weight=0.5,
            )
            distiller.compile(keras.optimizers.SGD(0.05), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return distiller

    logs = _trains_as_on_one_device(mirrored, build, data)
    assert {"student_loss", "total_loss", "loss", "val_student_loss", "val_loss"} <= logs.keys()
