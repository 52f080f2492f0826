"""A small transformer encoder classifier over token ids."""

import keras
from keras import ops

from tfmp.heads import classification_head


@keras.saving.register_keras_serializable(package="tfmp")
class TokenAndPositionEmbedding(keras.layers.Layer):
    """Token embedding plus a learned position embedding."""

    def __init__(self, vocab_size, sequence_length, embed_dim, **kwargs):
        super().__init__(**kwargs)
        self.vocab_size, self.sequence_length, self.embed_dim = vocab_size, sequence_length, embed_dim
        self.tokens = keras.layers.Embedding(vocab_size, embed_dim, dtype=self.dtype_policy, name="tokens")
        self.positions = keras.layers.Embedding(sequence_length, embed_dim, dtype=self.dtype_policy, name="positions")

    def build(self, input_shape):
        self.tokens.build(input_shape)
        self.positions.build((self.sequence_length,))

    def call(self, ids):
        return self.tokens(ids) + self.positions(ops.arange(ops.shape(ids)[-1]))

    def get_config(self):
        return {
            **super().get_config(),
            "vocab_size": self.vocab_size,
            "sequence_length": self.sequence_length,
            "embed_dim": self.embed_dim,
        }


def _encoder_block(x, num_heads, embed_dim, ff_dim, dropout, name):
    attention = keras.layers.MultiHeadAttention(num_heads, embed_dim // num_heads, name=f"{name}_attention")(x, x)
    x = keras.layers.LayerNormalization(epsilon=1e-6, name=f"{name}_norm1")(
        x + keras.layers.Dropout(dropout, name=f"{name}_drop1")(attention)
    )
    ff = keras.layers.Dense(ff_dim, activation="gelu", name=f"{name}_ff1")(x)
    ff = keras.layers.Dense(embed_dim, name=f"{name}_ff2")(ff)
    return keras.layers.LayerNormalization(epsilon=1e-6, name=f"{name}_norm2")(
        x + keras.layers.Dropout(dropout, name=f"{name}_drop2")(ff)
    )


def build(
    num_classes,
    vocab_size=20000,
    sequence_length=64,
    embed_dim=64,
    num_heads=4,
    ff_dim=128,
    num_layers=2,
    dropout=0.1,
    **_,
):
    """Post-norm encoder blocks, mean pooling and a float32 softmax head.

    Args:
        num_classes: number of classes.
        vocab_size: token ids are in [0, vocab_size).
        sequence_length: length of each padded id sequence.
        embed_dim, num_heads, ff_dim, num_layers, dropout: encoder size.

    Returns:
        A functional `keras.Model` named "transformer" taking int token ids.
    """
    inputs = keras.Input((sequence_length,), dtype="int64", name="tokens")
    x = TokenAndPositionEmbedding(vocab_size, sequence_length, embed_dim, name="embedding")(inputs)
    for i in range(num_layers):
        x = _encoder_block(x, num_heads, embed_dim, ff_dim, dropout, name=f"encoder{i}")
    x = keras.layers.GlobalAveragePooling1D(name="pool")(x)
    outputs = classification_head(num_classes)(x)
    return keras.Model(inputs, outputs, name="transformer")
