"""Export a trained model as `.keras` and SavedModel, float32 (or raw strings) in and out."""

import os

import keras
import numpy as np
import tensorflow as tf

from tfmp import float8
from tfmp.errors import TrainingError


def serving_model(model, vectorizer=None):
    """The model to export: `model` itself, or for text models one that takes raw strings."""
    if vectorizer is None:
        return model
    text = keras.Input(shape=(), dtype="string", name="text")
    return keras.Model(text, model(vectorizer(text)), name=f"{model.name}_serving")


def export(model, export_dir, sample, vectorizer=None):
    """Writes `model.keras` and `saved_model/` into `export_dir`, reloads both and checks
    they predict what the trained model predicts on `sample`.

    Args:
        model: the trained Keras model.
        export_dir: the directory to write (created).
        sample: a batch of inputs (float32 images, or raw strings for text models).
        vectorizer: the adapted `TextVectorization` of a text model.

    Returns:
        {"keras": path, "saved_model": path, "max_difference": float}.

    Raises:
        TrainingError: a reloaded model predicts something else.
    """
    os.makedirs(export_dir, exist_ok=True)
    serving = serving_model(model, vectorizer)
    keras_path = os.path.join(export_dir, "model.keras")
    saved_path = os.path.join(export_dir, "saved_model")
    serving.save(keras_path)
    serving.export(saved_path, format="tf_saved_model", verbose=False)
    expected = np.asarray(serving(sample, training=False))
    reloaded_keras = np.asarray(keras.models.load_model(keras_path)(sample, training=False))
    loaded = tf.saved_model.load(saved_path)  # Keep a reference: its variables die with it.
    served = loaded.serve(tf.constant(sample))
    if served.dtype != tf.float32:
        raise TrainingError(f"the SavedModel in {saved_path} returns {served.dtype.name}, not float32")
    difference = max(np.abs(expected - reloaded_keras).max(), np.abs(expected - served.numpy()).max())
    # Reloaded graphs may fuse 16-bit ops differently: allow bfloat16's ~3 digits there. Under float8 such a
    # difference can move a value across a float8 rounding step (2^-3 relative): the transformer's SavedModel read
    # up to 3.3e-3 from the trained model (TensorFlow 2.18; its .keras file 0).
    tolerance = 1e-5 if keras.config.dtype_policy().compute_dtype == "float32" else 2e-3
    tolerance = 1e-2 if float8.quantized_layers(model) else tolerance
    if difference > tolerance:
        raise TrainingError(f"the exported model predicts differently after reloading (max difference {difference})")
    return {"keras": keras_path, "saved_model": saved_path, "max_difference": float(difference)}
