"""A step's outputs cross to the host as one int32 vector and come back bit for bit: floats
(NaN and infinities included), int64s past 32 bits, booleans, scalars and shapes, known when
the step traces or only when it runs."""

import numpy as np
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


def test_an_output_whose_shape_only_a_run_knows_comes_back_in_its_shape():
    """A metric's result from the host (`tf.numpy_function`) has no static shape: the vector carries it."""
    outputs = packed.Packed()
    host = lambda x: tf.numpy_function(lambda a: a, [x], x.dtype)  # noqa: E731

    def step(scalar, table, count, empty, flags):
        return outputs.pack(
            {
                "auc": host(scalar),
                "table": host(table),
                "count": host(count),
                "empty": host(empty),
                "flags": host(flags),
                "loss": scalar,
            }
        )

    table = np.arange(6, dtype=np.float32).reshape(2, 3)
    args = (np.float32(0.5), table, np.array([2**40, -1]), np.zeros((0,), np.float32), np.array([True, False]))
    back = outputs.unpack(tf.function(step)(*args).numpy())
    assert back["auc"] == 0.5 and np.ndim(back["auc"]) == 0 and back["loss"] == 0.5
    np.testing.assert_array_equal(back["table"], table)
    assert back["count"].dtype == np.int64 and back["count"].tolist() == [2**40, -1]
    assert back["empty"].shape == (0,) and back["flags"].tolist() == [True, False]
