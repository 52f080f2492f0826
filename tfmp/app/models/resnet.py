"""A CIFAR-style ResNet (He et al. 2016, section 4.2) of depth 6n+2."""

import keras

from tfmp import bf16
from tfmp.heads import classification_head


def _batch_norm(name):
    # Float32 moving statistics under --precision=bfloat16 (bf16.statistics_policy). Momentum 0.9, PyTorch's
    # default (0.1 in its convention): Keras' 0.99 keeps 15% of the initial variance of 1 after the
    # default run's 186 steps, and the model, 0.99 accurate on its training batches, scored chance (0.11) on the test.
    return keras.layers.BatchNormalization(momentum=0.9, dtype=bf16.statistics_policy(), name=name)


def _block(x, filters, stride, name):
    shortcut = x
    y = keras.layers.Conv2D(filters, 3, stride, padding="same", use_bias=False, name=f"{name}_conv1")(x)
    y = _batch_norm(f"{name}_bn1")(y)
    y = keras.layers.ReLU(name=f"{name}_relu1")(y)
    y = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False, name=f"{name}_conv2")(y)
    y = _batch_norm(f"{name}_bn2")(y)
    if stride != 1 or shortcut.shape[-1] != filters:
        shortcut = keras.layers.Conv2D(filters, 1, stride, use_bias=False, name=f"{name}_proj")(shortcut)
        shortcut = _batch_norm(f"{name}_proj_bn")(shortcut)
    return keras.layers.ReLU(name=f"{name}_out")(keras.layers.Add(name=f"{name}_add")([shortcut, y]))


def build(num_classes, input_shape=(32, 32, 3), depth=20, width=16, **_):
    """Three stages of residual blocks (width, 2*width, 4*width filters).

    Args:
        num_classes: number of classes.
        input_shape: (height, width, channels); inputs are float32 in [0, 1].
        depth: total layers, 6n+2 (20, 32, 44, 56, 110).
        width: filters of the first stage.

    Returns:
        A functional `keras.Model` named "resnet{depth}".

    Raises:
        ValueError: if depth is not of the form 6n+2.
    """
    if depth < 8 or (depth - 2) % 6:
        raise ValueError(f"resnet depth must be 6n+2 (8, 14, 20, 32, ...), got {depth}")
    blocks = (depth - 2) // 6
    inputs = keras.Input(input_shape, name="image")
    x = keras.layers.Conv2D(width, 3, padding="same", use_bias=False, name="stem_conv")(inputs)
    x = _batch_norm("stem_bn")(x)
    x = keras.layers.ReLU(name="stem_relu")(x)
    for stage in range(3):
        for block in range(blocks):
            stride = 2 if stage > 0 and block == 0 else 1
            x = _block(x, width * 2**stage, stride, name=f"stage{stage}_block{block}")
    x = keras.layers.GlobalAveragePooling2D(name="pool")(x)
    outputs = classification_head(num_classes)(x)
    return keras.Model(inputs, outputs, name=f"resnet{depth}")
