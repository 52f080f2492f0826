"""Every bundled model under every policy: float32 variables, policy compute, float32 output."""

import keras
import numpy as np
import pytest

import tfmp
from tfmp.app import models

POLICIES = {"mixed_float16": "float16", "mixed_bfloat16": "bfloat16", "float32": "float32"}
SMALL = {
    "cnn": {"input_shape": (28, 28, 1)},
    "resnet": {"input_shape": (32, 32, 3), "depth": 8, "width": 8},
    "lstm": {"vocab_size": 100, "sequence_length": 12},
    "transformer": {"vocab_size": 100, "sequence_length": 12},
}


def _batch(name, n=4):
    rng = np.random.default_rng(0)
    kwargs = SMALL[name]
    if models.MODELS[name].kind == "image":
        return rng.random((n, *kwargs["input_shape"]), dtype=np.float32)
    return rng.integers(1, kwargs["vocab_size"], size=(n, kwargs["sequence_length"]))


def test_registry_is_complete():
    assert set(models.MODELS) == {"cnn", "resnet", "lstm", "transformer"}
    for name, entry in models.MODELS.items():  # help() on a build, before its module loads, says where it is.
        assert entry.build.__qualname__ == f"{name}.build" and f"tfmp.app.models.{name}.build`" in entry.build.__doc__


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", list(SMALL))
def test_dtypes_under_policy(name, policy):
    keras.config.set_dtype_policy(policy)
    model = models.MODELS[name].build(num_classes=3, **SMALL[name])
    assert all(v.dtype == "float32" for v in model.weights), [v.path for v in model.weights if v.dtype != "float32"]
    computing = [layer for layer in model._flatten_layers(include_self=False) if layer.weights]
    compute_dtypes = {layer.compute_dtype for layer in computing}
    # Every layer with weights computes in the policy's dtype, except the float32 softmax.
    assert compute_dtypes <= {POLICIES[policy], "float32"}
    assert any(layer.compute_dtype == POLICIES[policy] for layer in computing)
    head = model.get_layer("head")
    assert head.logits.compute_dtype == POLICIES[policy] and head.softmax.compute_dtype == "float32"
    out = model(_batch(name), training=False)
    assert out.dtype == "float32" and tuple(out.shape) == (4, 3)
    assert np.isfinite(np.asarray(out)).all()
    assert tfmp.audit(model) == []


@pytest.mark.parametrize("name", list(SMALL))
def test_one_training_step_moves_weights(name):
    keras.config.set_dtype_policy("mixed_bfloat16")
    model = models.MODELS[name].build(num_classes=3, **SMALL[name])
    model.compile(keras.optimizers.Adam(1e-2), "sparse_categorical_crossentropy")
    before = [w.numpy().copy() for w in model.trainable_weights]
    x = _batch(name, 8)
    loss = model.train_on_batch(x, np.arange(8) % 3)
    assert np.isfinite(loss)
    assert any(not np.array_equal(b, w.numpy()) for b, w in zip(before, model.trainable_weights, strict=False))


def test_resnet_depth_must_be_6n_plus_2():
    with pytest.raises(ValueError, match="6n\\+2"):
        models.resnet.build(10, depth=21)
