"""RNNs on a GPU: Keras' LSTM and GRU run cuDNN's kernel there, which refuses a batch
holding a fully masked row (an empty sequence) or a row not padded on the right, and which,
in bfloat16, did not train.

No CPU ever shows either: Keras takes the cuDNN path only where a GPU is present. tfmp's
own text pipeline never makes such a row (`tfmp.data.Vectorizer` reads a text with no word
as one unknown word); a user's own data may. `tfmp.fit` says so before the first step on a
GPU, for the layers it concerns, and turns cuDNN's error into one that names them.

bfloat16: on an NVIDIA H100 (TensorFlow 2.21.0, cuDNN 9), the bundled lstm on SST-2 under
mixed_bfloat16 ended at 0.509, the share of the majority class, with a loss of ln 2, where
float32 on the same GPU reached 0.829 and mixed_bfloat16 on a CPU, Keras' generic kernel,
0.819. So the bundled lstm takes the generic kernel when it computes in bfloat16
(`use_cudnn`), on every device (a CPU takes it anyway), and `tfmp.fit` warns of a user's
LSTM or GRU that would run cuDNN's kernel in bfloat16 on a GPU.
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


def _on_cudnn(layer):
    """Whether `layer` is an LSTM or GRU that would run cuDNN's kernel on a GPU."""
    return isinstance(layer, _CUDNN_LAYERS) and layer.use_cudnn in ("auto", True) and not layer.recurrent_dropout


def masked_cudnn_layers(model):
    """The names of `model`'s LSTM and GRU layers that would run cuDNN's kernel on a GPU,
    where the model also holds a layer that makes a mask (an Embedding with `mask_zero`,
    a Masking layer); [] where there is none."""
    layers = keras_compat.sublayers(model)
    masks = any(isinstance(layer, _MASKING_LAYERS) and getattr(layer, "mask_zero", True) for layer in layers)
    if not masks:
        return []
    return [layer.name for layer in layers if _on_cudnn(layer)]


def use_cudnn():
    """`use_cudnn` for a bundled LSTM or GRU: False where it computes in bfloat16 (the
    global policy's compute dtype), else Keras' "auto"."""
    return False if keras.config.dtype_policy().compute_dtype == "bfloat16" else "auto"


def bfloat16_cudnn_layers(model):
    """The names of `model`'s LSTM and GRU layers that would run cuDNN's kernel in bfloat16
    on a GPU; [] where there is none."""
    layers = keras_compat.sublayers(model)
    return [layer.name for layer in layers if _on_cudnn(layer) and layer.compute_dtype == "bfloat16"]


def advice(names):
    """What to do about cuDNN's mask rule, for layers `names`."""
    return (
        f"cuDNN's kernel, which layer(s) {', '.join(names)} run on a GPU, refuses a batch holding a fully masked "
        "row (a sequence of padding only: an empty or all-punctuation text) or a row not padded on the right. "
        "Give every row at least one token (tfmp.data.Vectorizer reads a text with no word as [UNK]) and pad on "
        "the right, or build the layer with use_cudnn=False (the generic kernel, slower on a GPU)"
    )


def bfloat16_advice(names):
    """What to do about cuDNN's kernel in bfloat16, for layers `names`."""
    return (
        f"Layer(s) {', '.join(names)} would run cuDNN's LSTM/GRU kernel in bfloat16 on this GPU, which did not "
        "train on an H100 (TensorFlow 2.21: the bundled lstm stayed at chance on SST-2, where float32 reached "
        "0.83). Build the layer with use_cudnn=False (Keras' generic kernel, as on a CPU; tfmp's bundled lstm "
        "does so) or dtype='float32'"
    )


def warn_before_training(model):
    """A warning for `model`'s masked cuDNN layers and one for its bfloat16 cuDNN layers,
    where TensorFlow sees a GPU; returns the masked ones' names."""
    names = masked_cudnn_layers(model)
    if not tf.config.list_physical_devices("GPU"):
        return names
    if names:
        logging.warning("%s.", advice(names))
    low = bfloat16_cudnn_layers(model)
    if low:
        logging.warning("%s.", bfloat16_advice(low))
    return names


def is_mask_error(error):
    """Whether `error` is cuDNN's refusal of a batch's mask."""
    return isinstance(error, ERROR) and CUDNN_MASK_ERROR in str(error)
