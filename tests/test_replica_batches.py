"""How a global batch splits over replicas: a last batch too small to give every replica an example, where a
BatchNormalization would compute NaN statistics on the replica left without one."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import assert_same, weights

import tfmp
from tfmp.errors import TrainingError


@pytest.mark.parametrize("policy", ["float32", "mixed_float16"])
def test_an_arrays_last_batch_that_would_leave_a_replica_none_is_left_out_under_batch_norm(mirrored, caplog, policy):
    """97 examples in batches of 32 on 2 replicas: the last batch, of 1 example, gives a replica none, and
    BatchNormalization's moments over no example are NaN. model.fit trains to NaN weights; loss-scaled, the update
    is skipped but that replica's copy of the moving statistics alone turns NaN (a later evaluation's loss is NaN).
    tfmp.fit leaves that batch out, saying so, and trains as on the first 96; without BatchNormalization it keeps
    the batch, which does no harm there. A dataset's such batch stops training after its epoch, saying why."""
    keras.config.set_dtype_policy(policy)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(97, 8)).astype(np.float32), rng.integers(0, 3, 97)

    def build(strategy, norm=True):
        keras.utils.set_random_seed(0)
        with strategy.scope():
            norms = [keras.layers.BatchNormalization(name="norm")] if norm else []
            model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16), *norms, keras.layers.Dense(3)])
            model.compile(keras.optimizers.Adam(0.01), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    run = dict(batch_size=32, epochs=2, shuffle=False, verbose=0, jit_compile=False)
    model = build(mirrored)
    with caplog.at_level("WARNING"):
        tfmp.fit(model, x, y, **run)
    (line,) = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
    assert "1 of the 97 examples for 2 replicas" in line and "norm's statistics" in line
    for variable in model.non_trainable_variables:  # Every replica's copy, not only the first's.
        assert all(np.isfinite(copy.numpy()).all() for copy in variable.value.values), variable.path
    expected = build(mirrored)
    tfmp.fit(expected, x[:96], y[:96], **run)
    assert_same(weights(model), weights(expected), atol=1e-6)
    plain = build(mirrored, norm=False)
    tfmp.fit(plain, x, y, **run)
    assert int(plain.optimizer.iterations.numpy()) == 8
    # A dataset's batches are the user's: its last one trains, and the error says what happened and what to do.
    batches = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)
    with pytest.raises(TrainingError, match="after epoch 1: norm's moving statistics are non-finite on replica 1"):
        tfmp.fit(build(mirrored), batches, epochs=2, verbose=0, jit_compile=False)


@pytest.mark.parametrize("jit_compile", [False, True])
@pytest.mark.parametrize("examples, batch", [(33, 32), (99, 33)])
def test_batches_split_unevenly_train_as_on_one_device(mirrored, jit_compile, examples, batch):
    """A global batch the replicas split unevenly (a last batch of 1 example: 1 and 0; 33 examples: 17 and 16)
    weighs each example as one device does: the mean over the global batch, not the mean of the replicas' means
    (which gives a lone example half its gradient). Without the weighting, 6e-2 and 1.5e-3 apart."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(examples, 8)).astype(np.float32), rng.integers(0, 3, examples)

    def trained(strategy):
        keras.utils.set_random_seed(0)
        with strategy.scope():
            layers = [keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)]
            model = keras.Sequential(layers)
            model.compile(keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        batches = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)  # Its batch size not static: the last.
        history = tfmp.fit(model, batches, epochs=2, verbose=0, jit_compile=jit_compile)
        return weights(model), history.history["loss"]

    (one, one_loss), (two, two_loss) = trained(tf.distribute.get_strategy()), trained(mirrored)
    assert_same(two, one, atol=1e-6)
    np.testing.assert_allclose(two_loss, one_loss, rtol=1e-6)
