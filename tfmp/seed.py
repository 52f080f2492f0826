"""One call that seeds every random number generator a training run touches."""

import keras
import tensorflow as tf
from absl import logging

from tfmp import tf_compat
from tfmp.errors import UsageError


def set_seed(seed, deterministic=False):
    """Seeds python, numpy, TensorFlow and Keras; optionally makes TF ops deterministic.

    Args:
        seed: a non-negative integer.
        deterministic: also turn on TensorFlow op determinism (slower on GPU; same
            results run to run on the same device setup). It is process-wide: False
            leaves it as it is (on, if an earlier call in this process turned it on), and
            the log line says which.

    Raises:
        UsageError: for a negative or non-integer seed.
    """
    try:
        whole = not isinstance(seed, str) and int(seed) == seed and seed >= 0
    except (TypeError, ValueError, OverflowError):  # None, nan, inf.
        whole = False
    if not whole:
        raise UsageError(f"seed must be a non-negative integer, got {seed!r}")
    keras.utils.set_random_seed(int(seed))  # python `random`, numpy and TensorFlow.
    if deterministic:
        tf.config.experimental.enable_op_determinism()
    logging.info("Seed %d (op determinism %s)", seed, "on" if tf_compat.op_determinism() else "off")
