"""A tiny, dropout-free classifier trained through tfmp.fit: shared by the loop tests and
the multi-worker processes they start, so every setup runs exactly the same code.

Run as a script, it is one worker of a MultiWorkerMirroredStrategy cluster (TF_CONFIG):
    python tests/tiny.py INIT.npz OUT.npz STEPS BATCH
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfmp  # noqa: E402
from tfmp import data, loop, loss_scale  # noqa: E402


class InjectOverflow(keras.layers.Layer):
    """Multiplies its input by inf on replica `bad_replica` while `active` is set."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        # int64: on a GPU TensorFlow keeps int32 variables in host memory, out of XLA's reach.
        self.bad_replica = tf.Variable(-1, trainable=False, dtype=tf.int64)

    def call(self, x):
        ctx = tf.distribute.get_replica_context()
        replica = ctx.replica_id_in_sync_group if ctx is not None else 0
        factor = tf.where(tf.equal(self.bad_replica, tf.cast(replica, tf.int64)), float("inf"), 1.0)
        return x * tf.cast(factor, x.dtype)


def build(strategy, learning_rate=1e-2, schedule=False):
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((8, 8, 1)),
                keras.layers.Flatten(),
                keras.layers.Dense(16, activation="relu", kernel_regularizer=keras.regularizers.L2(1e-3)),
                InjectOverflow(name="inject"),
                keras.layers.Dense(10, activation="softmax", dtype="float32"),
            ]
        )
        lr = keras.optimizers.schedules.ExponentialDecay(learning_rate, 1, 0.5) if schedule else learning_rate
        optimizer = loss_scale.wrap_optimizer(keras.optimizers.Adam(lr), initial_scale=2.0**8)
        model.compile(optimizer, "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model, model.optimizer


def dataset(global_batch):
    source, train, test = data.synthetic("image", 512, image_shape=(8, 8, 1))
    return data.build(
        source,
        train,
        test,
        global_batch,
        seed=1,
        repeat=True,
        drop_remainder=True,
        deterministic=True,
    )


def steps_after(strategy, jit_compile, steps_count, policy="float32", configure=None):
    """(the model, its `Steps`) after `steps_count` updates of 32 examples, each dispatched
    and read alone, in a fresh Keras session under `policy` (set after clearing the session,
    which resets it); `configure(steps)` runs after compiling, before the first update."""
    keras.backend.clear_session(free_memory=False)
    keras.config.set_dtype_policy(policy)
    keras.utils.set_random_seed(0)
    model, _ = build(strategy)
    ds = dataset(32).train.repeat()
    compiled = loop.prepare(model, strategy, ds.element_spec)
    compiled.compile(jit_compile)
    if configure is not None:
        configure(compiled)
    if strategy.num_replicas_in_sync > 1:
        ds = strategy.experimental_distribute_dataset(ds)
    iterator = iter(ds)
    for _ in range(steps_count):
        compiled.read(compiled.dispatch(iterator))
    return model, compiled


def train(strategy, init, steps, global_batch, grad_accum_steps=1, clipnorm=None):
    """Trains `steps` updates from weights `init` (each of `grad_accum_steps` batches of
    `global_batch`); returns the final weights (numpy) and the model."""
    keras.utils.set_random_seed(0)  # The shuffle order depends on the global seed too.
    model, _ = build(strategy)
    model.set_weights(init)
    tfmp.fit(
        model,
        dataset(global_batch).make_train,  # Per-worker input: each worker reads its own shard.
        steps_per_epoch=steps * grad_accum_steps,
        strategy=strategy,
        grad_accum_steps=grad_accum_steps,
        clipnorm=clipnorm,
        verbose=0,
    )
    return [w.numpy() for w in model.weights], model


if __name__ == "__main__":
    init_path, out_path, steps, batch = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    keras.config.set_dtype_policy("float32")
    tf.config.experimental.enable_tensor_float_32_execution(False)  # As conftest: float32 means float32.
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    init = list(np.load(init_path).values())
    weights, _ = train(strategy, init, steps, batch)
    np.savez(out_path, *weights)
