"""Real-size models for the benchmark, on synthetic data: figures comparable with published ones.

ResNet-50 at 224x224x3 (NVIDIA DeepLearningExamples' ResNet-50 v1.5 benchmark) and a
BERT-base-sized encoder (12 layers, width 768, 12 heads, 3072 feed-forward, sequence 128,
vocabulary 30,522). Weights are random: these measure speed and memory, not accuracy.
"""

import keras
import numpy as np
import tensorflow as tf

from tfmp.app.models import transformer
from tfmp.heads import classification_head


def resnet50(num_classes=1000):
    """Keras' ResNet-50 (no downloaded weights) with a float32 softmax head."""
    base = keras.applications.ResNet50(weights=None, include_top=False, input_shape=(224, 224, 3), pooling="avg")
    return keras.Model(base.input, classification_head(num_classes)(base.output), name="resnet50")


def _encoder(num_classes, width, heads, layers):
    """The bundled encoder on BERT's vocabulary and sequence length, feed-forward 4x wide."""
    return transformer.build(
        num_classes,
        vocab_size=30522,
        sequence_length=128,
        embed_dim=width,
        num_heads=heads,
        ff_dim=4 * width,
        num_layers=layers,
        dropout=0.1,
    )


def bert_base(num_classes=2):
    """The bundled encoder at BERT-base size (about 110M parameters)."""
    return _encoder(num_classes, width=768, heads=12, layers=12)


def encoder_4096(num_classes=2):
    """A wider encoder, where the matmuls dominate: 4 layers of width 4096 (32 heads,
    16384 feed-forward), sequence 128."""
    return _encoder(num_classes, width=4096, heads=32, layers=4)


def synthetic(name, batch_size, seed=0):
    """An endless dataset of one random batch of the model's input and labels."""
    rng = np.random.default_rng(seed)
    if name == "resnet50":
        x = rng.random((batch_size, 224, 224, 3), dtype=np.float32)
        y = rng.integers(0, 1000, batch_size)
    else:
        x = rng.integers(0, 30522, (batch_size, 128))
        y = rng.integers(0, 2, batch_size)
    return tf.data.Dataset.from_tensors((x, y)).repeat()


MODELS = {"resnet50": resnet50, "bert_base": bert_base, "encoder_4096": encoder_4096}
GPU_MODELS = ("resnet50", "bert_base")  # The bench's default on a GPU.
BATCH_SIZES = {"resnet50": 128, "bert_base": 64, "encoder_4096": 64}  # Its defaults, the GPU sizes.
