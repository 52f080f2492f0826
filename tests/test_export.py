"""Export: model.keras and a SavedModel, float32 (or raw strings) in and out, same outputs."""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import REPO

import tfmp
from tfmp.app import export, training


def config_for(tmp_path, model, policy):
    return training.Config(
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


# The transformer in float8: its attention's float8 projections reload (tfmp.float8).
@pytest.mark.parametrize("model, policy", [("cnn", "mixed_bfloat16"), ("lstm", "float32"), ("transformer", "float8")])
def test_trained_model_exports_and_reloads(tmp_path, model, policy):
    metrics = training.train_and_evaluate(config_for(tmp_path, model, policy))
    tolerance = {"float32": 1e-5, "float8": 1e-2}.get(policy, 2e-3)  # As tfmp.app.export allows.
    assert metrics["export"]["max_difference"] <= tolerance
    keras.config.set_dtype_policy("float32")  # A user reloading elsewhere, under the default policy.
    loaded = tf.saved_model.load(str(tmp_path / "export" / "saved_model"))
    reloaded = keras.models.load_model(tmp_path / "export" / "model.keras")
    (spec,) = loaded.signatures["serving_default"].structured_input_signature[1].values()
    if model != "cnn":
        sample = tf.constant(["w1 w2 w3", "w7 w9", ")"])  # Raw strings in; ")" holds no word.
        assert spec.dtype == tf.string
    else:
        sample = tf.random.uniform((3, 28, 28, 1))
        assert spec.dtype == tf.float32
    served = loaded.serve(sample)
    assert served.dtype == tf.float32 and served.shape[0] == sample.shape[0]
    np.testing.assert_allclose(served.numpy(), np.asarray(reloaded(sample)), atol=tolerance)
    np.testing.assert_allclose(served.numpy().sum(axis=-1), 1.0, rtol=1e-5)
    if model == "transformer":  # In a new process, as GUIDE.md says: its embedding's class, its float8 layers.
        code = "import sys, keras, tfmp.app.models.transformer\nmodel = keras.models.load_model(sys.argv[1])\n"
        code += "print(sum(getattr(layer, 'quantization_mode', None) == 'float8' for layer in model._flatten_layers()))"
        env = {**os.environ, "PYTHONPATH": REPO, "TF_CPP_MIN_LOG_LEVEL": "3"}
        path = str(tmp_path / "export" / "model.keras")
        result = subprocess.run([sys.executable, "-c", code, path], env=env, capture_output=True, text=True)
        assert result.returncode == 0 and result.stdout.split()[-1] == "12", result.stderr[-1500:]  # 2 x (4 + 2).
    if model == "lstm":  # The reloaded vectorizer reads a text with no word as [UNK], not as padding.
        vectorizer = next(layer for layer in reloaded.layers if layer.name == "vectorizer")
        assert list(np.asarray(vectorizer(sample))[2][:2]) == [1, 0]


def test_a_failed_export_loses_no_figure(tmp_path, monkeypatch):
    def fail(*args):
        raise OSError("disk full")

    monkeypatch.setattr(export, "export", fail)
    with pytest.raises(OSError, match="disk full"):
        training.train_and_evaluate(config_for(tmp_path, "cnn", "float32"))
    with open(tmp_path / "run" / "metrics.json") as f:
        assert json.load(f)["test_accuracy"] >= 0  # Written before the export.


def test_mismatch_is_reported(tmp_path, monkeypatch):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, activation="softmax")])
    monkeypatch.setattr(keras.models, "load_model", lambda path: lambda x, training=False: np.zeros((2, 2)))
    with pytest.raises(Exception, match="predicts differently after reloading"):
        export.export(model, str(tmp_path), np.ones((2, 4), np.float32))


RELOAD = """import sys
{imports}
model = keras.models.load_model(sys.argv[1])
print(type(model.optimizer).__name__, type(model.layers[-1]).__name__)
"""


@pytest.mark.parametrize(
    "imports",
    [
        "import keras, tfmp",
        "import tfmp, keras",
        "import tfmp, tensorflow, keras",  # TensorFlow's import imports Keras partway through.
        "import tfmp\ntfmp.set_seed(0)\nimport keras",  # A name first: Keras loads within tfmp's import.
        "import tfmp.keras_compat, keras",  # It imports Keras before it defines what tfmp.bf16 takes from it.
    ],
)
def test_a_keras_file_with_tfmps_classes_reloads_in_a_new_process_after_import_tfmp(tmp_path, imports):
    """Keras finds a class a `.keras` file names ("tfmp>ClassificationHead") only once its
    module has run; `import tfmp` loads no TensorFlow, yet a new process that imports tfmp
    before Keras or after (TensorFlow's import imports Keras partway through), or uses one of
    its names first, reloads tfmp's head and its loss-scale optimizer."""
    keras.config.set_dtype_policy("mixed_float16")
    inputs = keras.Input((4,))
    model = keras.Model(inputs, tfmp.classification_head(3)(keras.layers.Dense(8)(inputs)))
    model.compile(tfmp.wrap_optimizer(keras.optimizers.Adam()), "sparse_categorical_crossentropy")
    model.save(tmp_path / "model.keras")
    env = {**os.environ, "PYTHONPATH": REPO, "TF_CPP_MIN_LOG_LEVEL": "3"}
    script = RELOAD.format(imports=imports)
    result = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "model.keras")], env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-1500:]
    assert result.stdout.split() == ["LossScaleOptimizer", "ClassificationHead"]
