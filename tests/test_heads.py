import keras
import numpy as np
import pytest

import tfmp


@pytest.mark.parametrize(
    "policy, compute", [("mixed_float16", "float16"), ("mixed_bfloat16", "bfloat16"), ("float32", "float32")]
)
def test_head_logits_in_policy_softmax_in_float32(policy, compute):
    keras.config.set_dtype_policy(policy)
    inputs = keras.Input((8,))
    head = tfmp.classification_head(3, name="head")
    model = keras.Model(inputs, head(keras.layers.Dense(4)(inputs)))
    assert head.logits.compute_dtype == compute
    assert head.logits.kernel.dtype == "float32"
    assert head.softmax.compute_dtype == "float32"
    probs = model(np.random.rand(5, 8).astype("float32"))
    assert probs.dtype == "float32"
    np.testing.assert_allclose(np.sum(probs, axis=-1), 1.0, rtol=1e-6)
    assert tfmp.audit(model) == []


def test_audit_finds_low_precision_output_and_softmax():
    keras.config.set_dtype_policy("mixed_float16")
    inputs = keras.Input((8,))
    probs = keras.layers.Dense(3, activation="softmax", name="bad_probs")(inputs)
    logits = keras.layers.Dense(2, name="logits16")(inputs)
    problems = tfmp.audit(keras.Model(inputs, [probs, logits]))
    assert any("bad_probs" in p and "float16, not float32" in p for p in problems)
    assert any("bad_probs computes softmax in float16" in p for p in problems)
    assert all("tfmp.keep_float32(model, 'bad_probs')" in p for p in problems if "bad_probs" in p)
    assert any("logits16" in p for p in problems)
    assert len(problems) == 3


def test_audit_finds_sigmoid_cast_to_float32_after_the_fact():
    keras.config.set_dtype_policy("mixed_bfloat16")
    inputs = keras.Input((8,))
    x = keras.layers.Dense(1, activation="sigmoid", name="sig")(inputs)
    model = keras.Sequential([inputs, keras.layers.Dense(1, activation="sigmoid", name="sig2")])
    problems = tfmp.audit(model)
    assert any("sig2 computes sigmoid in bfloat16" in p for p in problems)
    del x


@pytest.mark.parametrize("num_classes", [1, 0, 2.5, "10", True])
def test_head_rejects_what_is_not_two_classes_or_more(num_classes):
    with pytest.raises(tfmp.UsageError, match=f"^num_classes must be an integer >= 2, got {num_classes!r}$"):
        tfmp.classification_head(num_classes)


def test_a_model_made_before_the_policy_is_named_by_the_audit_and_by_fit(caplog):
    """Its layers took float32 when made: tfmp.fit trained it in float32 under mixed_bfloat16 without a word."""
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(2)])
    model.compile("sgd", "mse")
    assert tfmp.audit(model) == []
    tfmp.configure_precision("mixed_bfloat16")
    words = f"the policy is mixed_bfloat16, but every layer of {model.name} computes in float32"
    assert [p[: len(words)] for p in tfmp.audit(model)] == [words]
    with caplog.at_level("WARNING"):
        tfmp.fit(model, np.ones((8, 4), "float32"), np.ones((8, 2), "float32"), verbose=0)
    assert words in caplog.text
    made_after = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(2, dtype="float32")])
    assert tfmp.audit(made_after) == []  # One layer in bfloat16 is enough (the head in float32 is the rule).


@pytest.mark.parametrize(
    ("made", "now", "does"),
    [
        ("mixed_float16", "mixed_bfloat16", "16-bit layer of {} computes in float16"),  # A loss scale too.
        ("mixed_bfloat16", "bfloat16", "16-bit layer of {} computes in bfloat16 with float32 weights"),  # Not half.
        ("bfloat16", "mixed_bfloat16", "16-bit layer of {} computes in bfloat16 with bfloat16 weights"),
    ],
)
def test_a_model_made_under_another_16_bit_policy_is_named_too(made, now, does):
    """Each trained in the precision it was made in, without a word: only float32 layers were named."""
    tfmp.configure_precision(made)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(2, dtype="float32")])
    assert tfmp.audit(model) == []
    tfmp.configure_precision(now)
    words = f"the policy is {now}, but every {does.format(model.name)}: a layer takes the policy in force"
    assert [p[: len(words)] for p in tfmp.audit(model)] == [words]
    tfmp.configure_precision("float32")  # The default: a model made in another precision trains in its own.
    assert tfmp.audit(model) == []


def test_float16_weights_are_named_by_the_audit_and_by_fit(caplog):
    """A layer given dtype="float16" (not "mixed_float16") keeps float16 weights, which the optimizer updates in
    float16: Adam's second moment underflows, small changes round away (a Dense regression with Adam ended 5 epochs
    at 3.3-3.5x the loss it reached with float32 weights)."""
    tfmp.configure_precision("mixed_float16")
    mixed = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(2, dtype="float32")])
    assert tfmp.audit(mixed) == []
    frozen = keras.layers.Dense(8, dtype="float16", trainable=False)  # Not updated: nothing rounds away.
    model = keras.Sequential([keras.Input((4,)), frozen, keras.layers.Dense(8, dtype="float16"), keras.layers.Dense(2)])
    model.compile("adam", "mse")
    words = f"2 trainable weights of {model.name} stored in float16 ({model.layers[1].kernel.path}, "
    (problem,) = [p for p in tfmp.audit(model) if "stored in float16" in p]
    assert problem.startswith(words) and "dtype='mixed_float16'" in problem, problem
    with caplog.at_level("WARNING"):
        tfmp.fit(model, np.ones((8, 4), "float32"), np.ones((8, 2), "float32"), verbose=0)
    assert words in caplog.text


def test_the_audit_and_the_doctor_print_each_layer_path_whole():
    """Paths longer than the column (a wrapped RNN's, 32-64 characters here) are printed whole, not cut to a
    prefix that several layers share."""
    keras.utils.set_random_seed(0)
    encoder = keras.layers.Bidirectional(keras.layers.LSTM(3, name="encoder_lstm"), name="bidirectional_encoder")
    model = keras.Sequential([keras.Input((6, 2)), encoder, keras.layers.Dense(1, name="out")], name="long_names")
    model.compile("adam", "mse")
    x = np.random.default_rng(0).random((16, 6, 2), dtype=np.float32)
    diagnosis = tfmp.diagnose(model, (x, x[:, 0, :1]), steps=1)
    for table, paths in (
        (tfmp.audit(model).table(), [r["path"] for r in tfmp.audit(model).layers]),
        (diagnosis.table(), [r["name"] for r in diagnosis.layers]),
    ):
        assert max(map(len, paths)) > 32 and len(set(paths)) == len(paths) == 6
        assert [line.split()[0] for line in table.splitlines()[1:7]] == paths
