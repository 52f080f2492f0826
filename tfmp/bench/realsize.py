"""Real-size models for the benchmark, on synthetic data: figures comparable with published ones.

ResNet-50 at 224x224x3 (NVIDIA DeepLearningExamples' ResNet-50 v1.5 benchmark) and a
BERT-base-sized encoder (12 layers, width 768, 12 heads, 3072 feed-forward, sequence 128,
vocabulary 30,522). Weights are random: these measure speed and memory, not accuracy.
"""

import keras
import numpy as np
import tensorflow as tf

from tfmp.app.models import transformer
from tfmp.bench import bench_flags
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


def synthetic(name, batch_size, seed=0, image_size=224, sequence_length=128):
    """An endless dataset of one random batch of the model's input and labels."""
    rng = np.random.default_rng(seed)
    if name == "resnet50":
        x = rng.random((batch_size, image_size, image_size, 3), dtype=np.float32)
        y = rng.integers(0, 1000, batch_size)
    else:
        x = rng.integers(0, 30522, (batch_size, sequence_length))
        y = rng.integers(0, 2, batch_size)
    return tf.data.Dataset.from_tensors((x, y)).repeat()


def smoke_conv(num_classes=1000):
    """ResNet-50's stand-in in smoke runs: a convolution, BatchNormalization and the float32
    head, on 32x32 images."""
    inputs = keras.Input((32, 32, 3))
    x = keras.layers.Conv2D(8, 3, padding="same")(inputs)
    x = keras.layers.ReLU()(keras.layers.BatchNormalization()(x))
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, classification_head(num_classes)(x), name="resnet50_smoke")


def smoke_encoder(num_classes=2):
    """The encoders' stand-in in smoke runs: their layer kinds (an embedding, an EinsumDense
    as attention's projections are, LayerNormalization, a GELU feed-forward) at width 32,
    on sequences of 16; quick to compile."""
    ids = keras.Input((16,), dtype="int32")
    x = keras.layers.Embedding(30522, 32)(ids)
    x = keras.layers.EinsumDense("btd,de->bte", output_shape=(None, 32))(x)
    x = keras.layers.LayerNormalization(epsilon=1e-6)(x)
    x = keras.layers.Dense(32)(keras.layers.Dense(64, activation="gelu")(x))
    x = keras.layers.GlobalAveragePooling1D()(x)
    return keras.Model(ids, classification_head(num_classes)(x), name="encoder_smoke")


MODELS = {"resnet50": resnet50, "bert_base": bert_base, "encoder_4096": encoder_4096}
GPU_MODELS, BATCH_SIZES = bench_flags.GPU_MODELS, bench_flags.BATCH_SIZES  # Named where the flags are defined.
SMOKE = {"resnet50": smoke_conv, "bert_base": smoke_encoder, "encoder_4096": smoke_encoder}  # Same inputs, tiny.
SMOKE_INPUTS = {"image_size": 32, "sequence_length": 16}
