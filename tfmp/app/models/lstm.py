"""An embedding + LSTM sentiment classifier over token ids."""

import keras

from tfmp import bf16, cudnn
from tfmp.heads import classification_head


def build(num_classes, vocab_size=20000, sequence_length=64, embed_dim=64, units=64, **_):
    """Embedding (id 0 is padding and masked), one LSTM, a float32 softmax head. The LSTM
    takes Keras' generic kernel where it computes in bfloat16 (cuDNN's did not train:
    `tfmp.cudnn`), as a CPU does anyway.

    Args:
        num_classes: number of classes.
        vocab_size: token ids are in [0, vocab_size).
        sequence_length: length of each padded id sequence.
        embed_dim: embedding width.
        units: LSTM units.

    Returns:
        A functional `keras.Model` named "lstm" taking int token ids.
    """
    inputs = keras.Input((sequence_length,), dtype="int64", name="tokens")
    x = keras.layers.Embedding(vocab_size, embed_dim, mask_zero=True, name="embedding")(inputs)
    # Keras' default orthogonal initializer fails for bfloat16 weights (--precision=bfloat16).
    x = keras.layers.LSTM(units, recurrent_initializer=bf16.Orthogonal(), use_cudnn=cudnn.use_cudnn(), name="lstm")(x)
    x = keras.layers.Dropout(0.3, name="dropout")(x)
    outputs = classification_head(num_classes)(x)
    return keras.Model(inputs, outputs, name="lstm")
