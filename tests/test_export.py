"""Export: model.keras and a SavedModel, float32 (or raw strings) in and out, same outputs."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmp.app import export, training


@pytest.mark.parametrize("model, policy", [("cnn", "mixed_bfloat16"), ("lstm", "float32")])
def test_trained_model_exports_and_reloads(tmp_path, model, policy):
    config = training.Config(
        model=model,
        dataset="synthetic",
        precision=policy,
        batch_size=16,
        epochs=1,
        steps_per_epoch=2,
        checkpoint_every=0,
        vocab_size=300,
        sequence_length=12,
        model_dir=str(tmp_path / "run"),
        export_dir=str(tmp_path / "export"),
        verbose=0,
    )
    metrics = training.train_and_evaluate(config)
    tolerance = 1e-5 if policy == "float32" else 2e-3
    assert metrics["export"]["max_difference"] <= tolerance
    keras.config.set_dtype_policy("float32")  # A user reloading elsewhere, under the default policy.
    loaded = tf.saved_model.load(str(tmp_path / "export" / "saved_model"))
    reloaded = keras.models.load_model(tmp_path / "export" / "model.keras")
    (spec,) = loaded.signatures["serving_default"].structured_input_signature[1].values()
    if model == "lstm":
        sample = tf.constant(["w1 w2 w3", "w7 w9", ")"])  # Raw strings in; ")" holds no word.
        assert spec.dtype == tf.string
    else:
        sample = tf.random.uniform((3, 28, 28, 1))
        assert spec.dtype == tf.float32
    served = loaded.serve(sample)
    assert served.dtype == tf.float32 and served.shape[0] == sample.shape[0]
    np.testing.assert_allclose(served.numpy(), np.asarray(reloaded(sample)), atol=tolerance)
    np.testing.assert_allclose(served.numpy().sum(axis=-1), 1.0, rtol=1e-5)
    if model == "lstm":  # The reloaded vectorizer reads a text with no word as [UNK], not as padding.
        vectorizer = next(layer for layer in reloaded.layers if layer.name == "vectorizer")
        assert list(np.asarray(vectorizer(sample))[2][:2]) == [1, 0]


def test_mismatch_is_reported(tmp_path, monkeypatch):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, activation="softmax")])
    monkeypatch.setattr(keras.models, "load_model", lambda path: lambda x, training=False: np.zeros((2, 2)))
    with pytest.raises(Exception, match="predicts differently after reloading"):
        export.export(model, str(tmp_path), np.ones((2, 4), np.float32))
