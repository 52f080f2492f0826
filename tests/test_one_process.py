"""Several models trained one after the other in one process, each under a MirroredStrategy
of its own (a sweep in a notebook): TensorFlow's runtime remembers every collective it ran,
and a new strategy reusing an old one's keys fails (tensorflow/tensorflow#62790)."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import assert_same, regression, regression_data, weights

import tfmp
from tfmp import tf_compat


class FailOnReplica1(keras.layers.Layer):
    """Fails inside the step, on replica 1 only, at its third call: replica 0 is then
    inside the gradients' all-reduce when the step is cancelled."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.calls = tf.Variable(0, trainable=False)

    def call(self, x):
        context = tf.distribute.get_replica_context()
        on_1 = tf.equal(context.replica_id_in_sync_group if context else 0, 1)
        self.calls.assign_add(1)
        tf.debugging.assert_less(self.calls * tf.cast(on_1, tf.int32), 3, message="the first run fails")
        return x


def wider(fail=False):
    keras.utils.set_random_seed(1)
    layers = [keras.Input((8,)), keras.layers.Dense(40, activation="relu")]
    model = keras.Sequential(layers + [FailOnReplica1()] * fail + [keras.layers.Dense(1)])
    model.compile(tfmp.wrap_optimizer(keras.optimizers.SGD(1e-2)), "mse", jit_compile=False)
    return model


def two_cpus():
    return tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])


@pytest.mark.parametrize("jit_compile, first_fails", [(False, False), (True, False), (False, True)])
def test_a_new_mirrored_strategy_after_another_trains_like_one_device(jit_compile, first_fails):
    first = two_cpus()
    with first.scope():
        model = wider(fail=first_fails)
    if first_fails:
        with pytest.raises(tf.errors.InvalidArgumentError, match="the first run fails"):
            tfmp.fit(model, regression_data(batch=16), epochs=1, verbose=0, jit_compile=jit_compile)
    else:
        tfmp.fit(model, regression_data(batch=16), epochs=1, verbose=0, jit_compile=jit_compile)
    second = two_cpus()
    two = regression(second)
    history = tfmp.fit(two, regression_data(), epochs=2, verbose=0, jit_compile=jit_compile)
    one = regression()
    tfmp.fit(one, regression_data(), epochs=2, verbose=0, jit_compile=jit_compile)
    assert np.isfinite(history.history["loss"]).all()
    assert_same(weights(two), weights(one), atol=1e-4 if jit_compile else 1e-5)
    assert set(tf_compat.collective_group_keys(first)).isdisjoint(tf_compat.collective_group_keys(second))


def test_keras_fit_with_wrap_optimizer_under_a_second_strategy():
    results = []
    for width in (12, 48):  # Two sizes: the second's all-reduce differs in shape from the first's.
        keras.utils.set_random_seed(0)
        with two_cpus().scope():
            model = keras.Sequential(
                [keras.Input((8,)), keras.layers.Dense(width, activation="relu"), keras.layers.Dense(1)]
            )
            model.compile(tfmp.wrap_optimizer(keras.optimizers.Adam(1e-2)), "mse")
        results.append(model.fit(regression_data(), epochs=2, verbose=0).history["loss"])
    assert np.isfinite(results).all() and results[1][-1] < results[1][0]
