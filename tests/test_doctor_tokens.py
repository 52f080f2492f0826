"""The numerics doctor on a model that takes strings: its lookup layers' token ids hold no float to measure, and
its table says so instead of printing a maximum and an error of 0."""

import keras
import numpy as np
import tensorflow as tf

import tfmp


def test_a_lookups_token_ids_show_no_float_figures():
    keras.config.set_dtype_policy("mixed_bfloat16")
    keras.utils.set_random_seed(0)
    words = np.array(["good", "bad", "great", "awful"] * 16)
    lookup = keras.layers.StringLookup(vocabulary=["good", "bad", "great", "awful"], name="lookup")
    inputs = keras.Input((1,), dtype="string")
    x = keras.layers.Embedding(5, 8, name="embedding")(lookup(inputs))
    x = keras.layers.Flatten(name="flatten")(x)
    model = keras.Model(inputs, keras.layers.Dense(2, activation="softmax", dtype="float32", name="out")(x))
    model.compile(keras.optimizers.Adam(1e-3), "sparse_categorical_crossentropy")
    labels = np.array([1, 0, 1, 0] * 16)
    diagnosis = tfmp.diagnose(model, tf.data.Dataset.from_tensor_slices((words[:, None], labels)).batch(16), steps=2)
    records = {r["name"]: r for r in diagnosis.layers}
    assert not records["lookup"]["output_floating"] and records["embedding"]["output_floating"]
    rows = {line.split()[0]: line.split() for line in diagnosis.table().splitlines()[1:] if line.split()}
    assert rows["lookup"][2] == "-" and rows["lookup"][-2:] == ["-", "-"], rows["lookup"]  # max |out|, bf16 err.
    assert float(rows["embedding"][2]) > 0 and rows["embedding"][-2].endswith("%"), rows["embedding"]
