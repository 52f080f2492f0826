import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmp
from tfmp.errors import UsageError


def test_unchanged_unless_float16():
    for policy in ("float32", "mixed_bfloat16"):
        keras.config.set_dtype_policy(policy)
        sgd = keras.optimizers.SGD()
        assert tfmp.wrap_optimizer(sgd) is sgd


def test_wraps_once_under_float16():
    keras.config.set_dtype_policy("mixed_float16")
    wrapped = tfmp.wrap_optimizer(keras.optimizers.SGD(), initial_scale=64, growth_steps=10)
    assert isinstance(wrapped, tfmp.LossScaleOptimizer)
    assert (wrapped.initial_scale, wrapped.dynamic_growth_steps) == (64, 10)
    assert tfmp.wrap_optimizer(wrapped) is wrapped


def test_keras_own_wrapper_is_replaced():
    keras.config.set_dtype_policy("mixed_float16")
    inner = keras.optimizers.SGD()
    wrapped = tfmp.wrap_optimizer(keras.optimizers.LossScaleOptimizer(inner))
    assert type(wrapped) is tfmp.LossScaleOptimizer and wrapped.inner_optimizer is inner


def test_rewrapping_keeps_settings_and_state():
    keras.config.set_dtype_policy("mixed_float16")
    variables = [tf.Variable(tf.ones((3,)))]
    own = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(), initial_scale=64.0, dynamic_growth_steps=7)
    fresh = tfmp.wrap_optimizer(own)
    assert (fresh.initial_scale, fresh.dynamic_growth_steps, fresh.built) == (64.0, 7, False)
    own.build(variables)
    own.dynamic_scale.assign(16.0)
    own.step_counter.assign(3)
    slot = own.inner_optimizer.variables[-1]
    wrapped = tfmp.wrap_optimizer(own)
    assert float(wrapped.dynamic_scale.numpy()) == 16.0 and int(wrapped.step_counter.numpy()) == 3
    assert (wrapped.initial_scale, wrapped.dynamic_growth_steps) == (64.0, 7)
    assert wrapped.inner_optimizer.variables[-1] is slot  # The inner optimizer's state is kept, not rebuilt.
    assert tfmp.wrap_optimizer(own, initial_scale=8.0).initial_scale == 8.0  # Given values win.


def test_compile_does_not_wrap_twice():
    keras.config.set_dtype_policy("mixed_float16")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2), tfmp.classification_head(2)])
    wrapped = tfmp.wrap_optimizer(keras.optimizers.SGD())
    model.compile(wrapped, "sparse_categorical_crossentropy")
    assert model.optimizer is wrapped
    x, y = np.random.rand(32, 4).astype("float32"), np.random.randint(0, 2, 32)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert int(wrapped.iterations.numpy()) == 4


@pytest.mark.parametrize("policy", ["mixed_float16", "float32"])
def test_an_optimizer_named_as_compile_takes_it_is_wrapped_and_anything_else_refused(policy):
    keras.config.set_dtype_policy(policy)
    wrapped = tfmp.wrap_optimizer("adamw", initial_scale=8.0)
    inner = wrapped.inner_optimizer if policy == "mixed_float16" else wrapped
    assert isinstance(inner, keras.optimizers.AdamW) and (policy == "float32" or wrapped.initial_scale == 8.0)
    for given, words in (("adamm", "wrap_optimizer: 'adamm' names no Keras optimizer"), (None, "got NoneType")):
        with pytest.raises(UsageError, match=words):  # Under mixed_float16 these had raised AttributeError.
            tfmp.wrap_optimizer(given)


@pytest.mark.parametrize(
    "kwargs", [{"initial_scale": 0}, {"initial_scale": float("inf")}, {"growth_steps": 0}, {"growth_steps": 1.5}]
)
def test_bad_arguments(kwargs):
    with pytest.raises(UsageError):
        tfmp.wrap_optimizer(keras.optimizers.SGD(), **kwargs)


def _overflow_step(strategy, optimizer_fn):
    """Builds a model and a step that multiplies one replica's loss by inf."""
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1, dtype="float32")])
        optimizer = optimizer_fn()
        optimizer.build(model.trainable_variables)

    @tf.function
    def step(bad_replica):
        def replica_fn():
            replica = tf.distribute.get_replica_context().replica_id_in_sync_group
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(model(tf.ones((2, 4))) ** 2)
                loss *= tf.where(tf.equal(replica, bad_replica), float("inf"), 1.0)
                scaled = optimizer.scale_loss(loss)
            grads = tape.gradient(scaled, model.trainable_variables)
            optimizer.apply(grads, model.trainable_variables)

        strategy.run(replica_fn)

    return model, optimizer, step


def _finite(model):
    return all(np.isfinite(v.numpy()).all() for v in model.trainable_variables)


@pytest.mark.parametrize("bad_replica", [1, 0])
def test_overflow_on_one_replica_skips_everywhere(mirrored, bad_replica):
    keras.config.set_dtype_policy("mixed_float16")
    model, optimizer, step = _overflow_step(
        mirrored, lambda: tfmp.wrap_optimizer(keras.optimizers.SGD(0.1), initial_scale=8.0)
    )
    before = [v.numpy() for v in model.trainable_variables]
    step(tf.constant(bad_replica))
    assert _finite(model)
    for b, v in zip(before, model.trainable_variables, strict=False):
        np.testing.assert_array_equal(b, v.numpy())  # Skipped: nothing moved.
    for per_replica in mirrored.experimental_local_results(model.trainable_variables[0].value):
        np.testing.assert_array_equal(before[0], per_replica.numpy())
    assert float(optimizer.dynamic_scale.numpy()) == 4.0
    assert int(optimizer.iterations.numpy()) == 0
    # A clean step afterwards is applied, on both replicas alike.
    step(tf.constant(-1))
    assert int(optimizer.iterations.numpy()) == 1 and float(optimizer.dynamic_scale.numpy()) == 4.0
    assert not np.array_equal(before[0], model.trainable_variables[0].numpy())
    a, b = mirrored.experimental_local_results(model.trainable_variables[0].value)
    np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert _finite(model)


def test_keras_own_wrapper_writes_nan_when_replica_1_overflows(mirrored):
    """The defect the wrapper exists for. If Keras fixes it, this test says so."""
    keras.config.set_dtype_policy("mixed_float16")
    model, optimizer, step = _overflow_step(
        mirrored, lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=8.0)
    )
    step(tf.constant(1))
    if _finite(model):
        pytest.fail("Keras' LossScaleOptimizer now skips a replica-1 overflow; tfmp's override may be dropped")


def test_growth_after_finite_steps(mirrored):
    keras.config.set_dtype_policy("mixed_float16")
    model, optimizer, step = _overflow_step(
        mirrored, lambda: tfmp.wrap_optimizer(keras.optimizers.SGD(0.01), initial_scale=8.0, growth_steps=2)
    )
    for _ in range(2):
        step(tf.constant(-1))
    assert float(optimizer.dynamic_scale.numpy()) == 16.0
    assert int(optimizer.iterations.numpy()) == 2


def test_fit_under_mirrored_float16(mirrored):
    keras.config.set_dtype_policy("mixed_float16")
    with mirrored.scope():
        model = keras.Sequential(
            [keras.Input((4,)), keras.layers.Dense(8, activation="relu"), tfmp.classification_head(2)]
        )
        model.compile(
            tfmp.wrap_optimizer(keras.optimizers.Adam(1e-2)), "sparse_categorical_crossentropy", metrics=["accuracy"]
        )
    x = np.random.RandomState(0).rand(256, 4).astype("float32")
    y = (x[:, 0] > 0.5).astype("int64")
    history = model.fit(x, y, batch_size=32, epochs=4, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]
    assert _finite(model)
