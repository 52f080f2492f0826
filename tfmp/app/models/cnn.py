"""A small convolutional image classifier for any image shape."""

import keras

from tfmp.heads import classification_head


def build(num_classes, input_shape=(28, 28, 1), width=32, dropout=0.25, **_):
    """Two conv blocks, a dense layer and a float32 softmax head.

    Args:
        num_classes: number of classes.
        input_shape: (height, width, channels); inputs are float32 in [0, 1].
        width: filters in the first conv block (doubled in the second).
        dropout: dropout rate before the dense layers.

    Returns:
        A functional `keras.Model` named "cnn".
    """
    inputs = keras.Input(input_shape, name="image")
    x = inputs
    for i, filters in enumerate((width, width * 2)):
        x = keras.layers.Conv2D(filters, 3, padding="same", activation="relu", name=f"conv{i}a")(x)
        x = keras.layers.Conv2D(filters, 3, padding="same", activation="relu", name=f"conv{i}b")(x)
        x = keras.layers.MaxPooling2D(name=f"pool{i}")(x)
    x = keras.layers.Flatten(name="flatten")(x)
    x = keras.layers.Dropout(dropout, name="dropout")(x)
    x = keras.layers.Dense(128, activation="relu", name="dense")(x)
    outputs = classification_head(num_classes)(x)
    return keras.Model(inputs, outputs, name="cnn")
