"""RNNs and cuDNN's kernel (a GPU's): a user's model is told before the first step, cuDNN's
refusal of a mask becomes an error that names the layer and the fixes, and a bfloat16 LSTM
of tfmp's own takes Keras' generic kernel."""

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmp
from tfmp import cudnn
from tfmp.app import models
from tfmp.errors import TrainingError


def text_model(use_cudnn="auto", mask_zero=True):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((5,), dtype="int64"),
            keras.layers.Embedding(20, 4, mask_zero=mask_zero),
            keras.layers.LSTM(3, use_cudnn=use_cudnn, name="reader"),
            keras.layers.Dense(2, activation="softmax"),
        ]
    )
    model.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy")
    return model


def tokens(rows):
    x = np.array(rows, np.int64)
    return tf.data.Dataset.from_tensor_slices((x, np.zeros(len(rows), np.int64))).batch(len(rows))


@pytest.mark.parametrize(
    "rows",
    [[[3, 4, 0, 0, 0], [0, 0, 0, 0, 0]], [[3, 4, 0, 0, 0], [0, 0, 0, 5, 6]]],
    ids=["fully_masked_row", "left_padded_row"],
)
def test_cudnn_refusal_names_the_layer_and_the_fixes(cudnn_mask_check, rows):
    with pytest.raises(TrainingError, match=r"layer\(s\) reader run on a GPU.*use_cudnn=False"):
        tfmp.fit(text_model(), tokens(rows), verbose=0)


def test_right_padded_rows_with_a_token_train(cudnn_mask_check):
    history = tfmp.fit(text_model(), tokens([[3, 4, 0, 0, 0], [5, 0, 0, 0, 0]]), epochs=2, verbose=0)
    assert np.isfinite(history.history["loss"]).all() and cudnn_mask_check


def test_warned_before_the_first_step_on_a_gpu_only(monkeypatch, caplog):
    assert cudnn.masked_cudnn_layers(text_model()) == ["reader"]
    assert cudnn.masked_cudnn_layers(text_model(use_cudnn=False)) == []
    assert cudnn.masked_cudnn_layers(text_model(mask_zero=False)) == []
    with caplog.at_level(logging.WARNING):
        if not tf.config.list_physical_devices("GPU"):
            cudnn.warn_before_training(text_model())
            assert not caplog.records  # No cuDNN here: nothing to say.
        real = tf.config.list_physical_devices
        monkeypatch.setattr(
            tf.config, "list_physical_devices", lambda kind=None: ["gpu"] if kind == "GPU" else real(kind)
        )
        cudnn.warn_before_training(text_model())
    (record,) = [r for r in caplog.records if "cuDNN" in r.getMessage()]
    assert "reader" in record.getMessage() and "use_cudnn=False" in record.getMessage()


@pytest.mark.parametrize("policy, bundled", [("float32", "auto"), ("mixed_float16", "auto"), ("mixed_bfloat16", False)])
def test_bfloat16_lstm_takes_the_generic_kernel_and_a_users_is_warned_of_on_a_gpu(monkeypatch, caplog, policy, bundled):
    keras.config.set_dtype_policy(policy)
    assert models.MODELS["lstm"].build(num_classes=2, vocab_size=50).get_layer("lstm").use_cudnn == bundled
    low = policy == "mixed_bfloat16"
    assert cudnn.bfloat16_cudnn_layers(text_model()) == (["reader"] if low else [])
    assert cudnn.bfloat16_cudnn_layers(text_model(use_cudnn=False)) == []
    real = tf.config.list_physical_devices
    monkeypatch.setattr(tf.config, "list_physical_devices", lambda kind=None: ["gpu"] if kind == "GPU" else real(kind))
    with caplog.at_level(logging.WARNING):
        cudnn.warn_before_training(text_model(mask_zero=False))
    said = [r.getMessage() for r in caplog.records if "bfloat16" in r.getMessage()]
    assert len(said) == low and all("reader" in s and "use_cudnn=False" in s for s in said)
