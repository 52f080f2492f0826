"""Masked RNNs on a GPU: Keras' LSTM and GRU run cuDNN's kernel there, which refuses a
batch holding a fully masked row (an empty sequence) or a row not padded on the right.

No CPU ever shows it: Keras takes the cuDNN path only where a GPU is present. tfmp's own
text pipeline never makes such a row (`tfmp.data.Vectorizer` reads a text with no word as
one unknown word); a user's own data may. `tfmp.fit` says so before the first step on a
GPU, for the layers it concerns, and turns cuDNN's error into one that names them.
"""

import keras
import tensorflow as tf
from absl import logging

from tfmp import keras_compat

# The start of the message of Keras' check (`_assert_valid_mask`) on cuDNN's path.
ERROR = tf.errors.InvalidArgumentError  # What the check raises.
CUDNN_MASK_ERROR = "You are passing a RNN mask that does not correspond to right-padded sequences"
_CUDNN_LAYERS = (keras.layers.LSTM, keras.layers.GRU)
_MASKING_LAYERS = (keras.layers.Embedding, keras.layers.Masking)


def masked_cudnn_layers(model):
    """The names of `model`'s LSTM and GRU layers that would run cuDNN's kernel on a GPU,
    where the model also holds a layer that makes a mask (an Embedding with `mask_zero`,
    a Masking layer); [] where there is none."""
    layers = keras_compat.sublayers(model)
    masks = any(isinstance(layer, _MASKING_LAYERS) and getattr(layer, "mask_zero", True) for layer in layers)
    if not masks:
        return []
    return [
        layer.name
        for layer in layers
        if isinstance(layer, _CUDNN_LAYERS) and layer.use_cudnn in ("auto", True) and not layer.recurrent_dropout
    ]


def advice(names):
    """What to do about cuDNN's mask rule, for layers `names`."""
    return (
        f"cuDNN's kernel, which layer(s) {', '.join(names)} run on a GPU, refuses a batch holding a fully masked "
        "row (a sequence of padding only: an empty or all-punctuation text) or a row not padded on the right. "
        "Give every row at least one token (tfmp.data.Vectorizer reads a text with no word as [UNK]) and pad on "
        "the right, or build the layer with use_cudnn=False (the generic kernel, slower on a GPU)"
    )


def warn_before_training(model):
    """One warning naming `model`'s masked cuDNN layers, where TensorFlow sees a GPU."""
    names = masked_cudnn_layers(model)
    if names and tf.config.list_physical_devices("GPU"):
        logging.warning("%s.", advice(names))
    return names


def is_mask_error(error):
    """Whether `error` is cuDNN's refusal of a batch's mask."""
    return isinstance(error, ERROR) and CUDNN_MASK_ERROR in str(error)
