"""Random draws that differ between replicas: under `tf.distribute` Keras gives every replica the same ones.

Keras 3 draws a layer's randomness (Dropout, GaussianNoise, SpatialDropout, the random augmentation layers,
`keras.random.*` with a `SeedGenerator` or no seed) from stateless ops seeded by a `SeedGenerator`, whose state
is a variable every replica holds alike. Under a strategy every replica therefore draws the same numbers: on N
replicas, N examples of each global batch share one dropout mask (and on 8 GPUs, 8 share it), where one device
draws one per example. `model.fit` trains so. While tfmp's step runs a replica's forward pass, each seed a
`SeedGenerator` hands out is folded with the replica's index (`tf.random.experimental.stateless_fold_in`), so
that each replica draws its own numbers; the generators' states still advance alike on every replica (a
resumed run draws what the interrupted one would have). One device draws as before, and as `model.fit`.
"""

import contextlib
import threading

import keras
import tensorflow as tf

_replica = threading.local()  # MirroredStrategy runs each replica's function in a thread of its own.
_lock = threading.Lock()
_original_next = None


def _next(self, ordered=True):
    seed = _original_next(self, ordered)
    replica = getattr(_replica, "index", None)
    if replica is None:  # Outside tfmp's replica forward pass: Keras' own draw.
        return seed
    return tf.cast(tf.random.experimental.stateless_fold_in(seed, replica), seed.dtype)


def _install():
    """Puts `_next` in `SeedGenerator.next` once: it draws as Keras does wherever `per_replica` is not active."""
    global _original_next
    with _lock:
        if _original_next is None:
            _original_next = keras.random.SeedGenerator.next
            keras.random.SeedGenerator.next = _next


@contextlib.contextmanager
def per_replica(strategy):
    """Inside the block, in a replica's context under a strategy of several replicas, the seeds Keras'
    `SeedGenerator`s hand out are folded with the replica's index; elsewhere, and on one replica, unchanged."""
    context = tf.distribute.get_replica_context()
    if context is None or strategy.num_replicas_in_sync == 1:
        yield
        return
    _install()
    _replica.index = context.replica_id_in_sync_group
    try:
        yield
    finally:
        _replica.index = None
