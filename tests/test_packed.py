"""A step's outputs cross to the host as one int32 vector and come back bit for bit: floats
(NaN and infinities included), int64s past 32 bits, booleans, scalars and shapes."""

import numpy as np
import pytest
import tensorflow as tf

from tfmp import packed


def test_every_kind_comes_back_bit_for_bit():
    out = {
        "loss": np.float32(0.1),
        "odd": np.array([np.nan, np.inf, -np.inf, -0.0, 1e-45], np.float32),
        "scale": np.float16(32768.0),  # Any float: as float32.
        "iterations": np.int64(2**40 + 3),
        "small": np.int32(-7),  # Any integer: as int64.
        "finite": np.array([[True, False], [False, True]]),
    }
    outputs = packed.Packed()
    vector = tf.function(outputs.pack)({k: tf.constant(v) for k, v in out.items()})
    assert vector.dtype == tf.int32 and vector.shape.rank == 1
    back = outputs.unpack(vector.numpy())
    assert sorted(back) == sorted(out)
    odd = back["odd"]
    assert odd.dtype == np.float32 and odd.tobytes() == out["odd"].tobytes()  # NaN, signs: the same bits.
    assert back["loss"] == np.float32(0.1) and back["scale"] == 32768.0 and np.ndim(back["loss"]) == 0
    assert back["iterations"] == 2**40 + 3 and back["small"] == -7 and back["iterations"].dtype == np.int64
    np.testing.assert_array_equal(back["finite"], out["finite"])
    assert back["finite"].dtype == bool


def test_an_output_without_a_static_shape_is_named():
    host = tf.function(lambda x: packed.Packed().pack({"auc": tf.numpy_function(lambda a: a, [x], tf.float32)}))
    with pytest.raises(ValueError, match=r"'auc' has no static shape \(<unknown>\) .*tf.ensure_shape"):
        host(tf.constant(1.0))
