"""The numerics doctor: float16 overflow named per layer, keep_float32 fixing it, gradient
underflow and the recommended loss scale, NaN localisation, the PNG, parity over seeds (its
commands: tests/test_doctor_cli.py)."""

import dataclasses
import json

import keras
import numpy as np
import pytest
import tensorflow as tf
import tiny
from conftest import autoencoder

import tfmp
from tfmp import doctor, heads
from tfmp.doctor import measure

rng = np.random.default_rng(0)
X = rng.random((256, 8), dtype=np.float32) * 10
Y = X.sum(1, keepdims=True) / 10


def data(factor=1.0):
    return tf.data.Dataset.from_tensor_slices((X * factor, Y * factor)).batch(32)


def overflowing(initial_scale=None):
    """Its `blowup` layer's outputs reach about 2e5: float16 overflows there, and only there
    (the float32 head `out` takes them back to the targets' scale)."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    x = keras.layers.Dense(16, name="dense")(inputs)
    x = keras.layers.Rescaling(1e4, name="blowup")(x)
    small = keras.initializers.RandomNormal(stddev=1e-5)
    outputs = keras.layers.Dense(1, dtype="float32", kernel_initializer=small, name="out")(x)
    model = keras.Model(inputs, outputs)
    optimizer = keras.optimizers.Adam(1e-4)
    model.compile(tfmp.wrap_optimizer(optimizer, initial_scale=initial_scale) if initial_scale else optimizer, "mse")
    return model


def clean():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
    model.compile(keras.optimizers.Adam(1e-3), "mse")
    return model


def test_overflowing_layer_is_named_and_no_other():
    keras.config.set_dtype_policy("mixed_float16")
    model = overflowing()
    before = [w.numpy() for w in model.weights]
    diagnosis = tfmp.diagnose(model, data(), steps=4)
    assert diagnosis.keep_float32 == ["blowup"]
    records = {r["name"]: r for r in diagnosis.layers}
    assert records["blowup"]["output_max_abs"] > doctor.FLOAT16_MAX and records["dense"]["output_max_abs"] < 1e3
    assert records["blowup"]["compute_dtype"] == "float16" and records["out"]["compute_dtype"] == "float32"
    for a, b in zip(before, [w.numpy() for w in model.weights], strict=True):
        np.testing.assert_array_equal(a, b)  # The user's model is untouched.
    assert "blowup" in diagnosis.table() and "keep in float32: blowup" in diagnosis.table()


def test_keep_float32_makes_float16_training_finite():
    keras.config.set_dtype_policy("mixed_float16")
    with pytest.raises(tfmp.TrainingError, match="first non-finite output: layer 'blowup'.*keep_float32"):
        tfmp.fit(overflowing(), data(), epochs=3, verbose=0)  # Every step overflows: the scale collapses.
    diagnosis = tfmp.diagnose(overflowing(), data(), steps=4)
    with tfmp.keep_float32(diagnosis.keep_float32):
        model = overflowing(initial_scale=diagnosis.recommended_loss_scale)
    assert model.get_layer("blowup").compute_dtype == "float32"
    assert model.get_layer("dense").compute_dtype == "float16"  # The others follow the policy.
    assert all(w.dtype == "float32" for w in model.weights) and heads.audit(model) == []
    history = tfmp.fit(model, data(), epochs=3, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    assert int(model.optimizer.iterations.numpy()) >= 20  # Hardly any of the 24 updates skipped.
    with tfmp.keep_float32(["dense"]):  # Its layers hold the block's policy map; a pooling layer, no path in it.
        pooled = keras.Sequential([keras.Input((8,)), keras.layers.Reshape((8, 1)), keras.layers.MaxPooling1D()])
        pooled.add(keras.layers.Dense(1, name="dense"))
    pooled.compile(keras.optimizers.Adam(1e-4), "mse")
    assert tfmp.diagnose(pooled, data(), steps=1).keep_float32 == []


def test_clean_model_names_nothing():
    keras.config.set_dtype_policy("mixed_float16")
    diagnosis = tfmp.diagnose(clean(), data(), steps=3)
    assert diagnosis.keep_float32 == [] and not any(r["forward_overflow"] for r in diagnosis.layers)
    assert diagnosis.steps == 3 and len(diagnosis.layers) == 2


def test_diagnose_reads_arrays_and_python_data_as_tfmp_fit_does():
    keras.config.set_dtype_policy("mixed_float16")
    from_dataset = tfmp.diagnose(overflowing(), data(), steps=2)
    from_arrays = tfmp.diagnose(overflowing(), (X, Y), steps=2)  # In batches of 32, in order: the same batches.
    assert from_arrays.keep_float32 == from_dataset.keep_float32 == ["blowup"]
    assert [r["output_max_abs"] for r in from_arrays.layers] == [r["output_max_abs"] for r in from_dataset.layers]
    batches = ((X[i : i + 32], Y[i : i + 32]) for i in range(0, 256, 32))
    assert tfmp.diagnose(overflowing(), batches, steps=2).keep_float32 == ["blowup"]
    with pytest.raises(tfmp.UsageError, match="give the targets too"):
        tfmp.diagnose(clean(), X)
    assert tfmp.diagnose(autoencoder(), X, steps=2).layers  # No compiled loss (its layer adds it): inputs alone.
    with pytest.raises(tfmp.UsageError, match="diagnose reads a dataset, .* not a function"):
        tfmp.diagnose(clean(), lambda context: data())
    for steps in (0, 2.0, None):  # Said so, not "got no batches" (0) or a TypeError deep inside.
        with pytest.raises(tfmp.UsageError, match=f"diagnose: steps must be an integer >= 1, got {steps}"):
            tfmp.diagnose(clean(), data(), steps=steps)


def test_tiny_gradients_underflow_at_scale_1_and_the_recommended_scale_lifts_them():
    diagnosis = tfmp.diagnose(clean(), data(1e-5), steps=3)  # Inputs, targets and gradients near 1e-5 and below.
    scale = diagnosis.recommended_loss_scale
    assert scale >= 2**10 and math_is_power_of_two(scale)
    first = diagnosis.layers[0]
    assert first["underflow_at_1"] > 0.0 or first["subnormal_at_1"] > 0.0
    assert first["underflow_at_recommended"] < first["underflow_at_1"] or first["underflow_at_1"] == 0
    assert first["subnormal_at_recommended"] < first["subnormal_at_1"]
    assert max(r["gradient_max_abs"] for r in diagnosis.layers) * scale <= doctor.FLOAT16_MAX


def math_is_power_of_two(value):
    return value == 2.0 ** round(np.log2(value))


def test_outputs_json_table_gradient_histogram_and_a_one_line_repr(tmp_path):
    keras.config.set_dtype_policy("mixed_float16")
    diagnosis = tfmp.diagnose(overflowing(), data(), steps=2)
    assert repr(diagnosis).startswith("Diagnosis(3 layers over 2 float32 steps, keep_float32=['blowup'], recommended")
    long = dataclasses.replace(diagnosis, keep_float32=[f"layer_{i}" for i in range(9)])  # Not 90 KB in a notebook.
    assert "'layer_5', ... 9 in all]" in repr(long) and "\n" not in repr(long) and str(diagnosis) == diagnosis.table()
    json_path, png_path = diagnosis.save(str(tmp_path))
    saved = json.loads(open(json_path).read())
    assert saved["keep_float32"] == ["blowup"] and len(saved["layers"]) == 3
    assert {"layers", "keep_float32", "recommended_loss_scale"} <= set(diagnosis.to_dict())
    assert sum(saved["histogram"]["counts"]) == sum(r["gradient_values"] for r in saved["layers"])
    assert (tmp_path / "gradients.png").stat().st_size > 5000 and png_path.endswith("gradients.png")


def test_a_layer_whose_weights_are_its_cells_shows_no_gradient_of_its_own():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4, 2)), keras.layers.GRU(4, name="gru"), keras.layers.Dense(1, name="out")])
    model.compile(keras.optimizers.Adam(1e-3), "mse")
    diagnosis = tfmp.diagnose(model, (X[:, :8].reshape(-1, 4, 2), Y), steps=2)
    rows = {line.split()[0].split("/", 1)[1]: line.split() for line in diagnosis.table().splitlines()[1:4]}
    assert rows["gru"][3:7] == ["-"] * 4 and rows["gru"][-1] == "-"  # Not "0": the GRU's weights are its cell's.
    assert float(rows["gru/gru_cell"][3]) > 0 and float(rows["out"][3]) > 0


def test_nan_localisation_names_the_layer():
    keras.config.set_dtype_policy("mixed_float16")
    model = tiny.build(tf.distribute.get_strategy())[0]
    model.get_layer("inject").bad_replica.assign(0)  # Its output is inf x: every step skipped.
    replay = "Replay of the failing batch: first non-finite output: layer '[a-z_/]*inject' .*keep_float32"
    with pytest.raises(tfmp.TrainingError, match=replay):
        tfmp.fit(model, tiny.dataset(16).train, steps_per_epoch=20, verbose=0)


def test_nan_localisation_after_the_weights_broke():
    model = tiny.build(tf.distribute.get_strategy())[0]  # float32: the non-finite update was applied.
    model.get_layer("inject").bad_replica.assign(0)
    with pytest.raises(tfmp.TrainingError, match="Replay of the failing batch: the weights are non-finite already"):
        tfmp.fit(model, tiny.dataset(16).train, steps_per_epoch=2, verbose=0)


@pytest.mark.parametrize("policy", ["float32", "mixed_float16"])
def test_nan_localisation_names_the_data_where_the_batch_holds_a_nan(policy):
    """A NaN in the data made the replay blame the weights (float32) or a layer (mixed_float16, whose skipped steps
    keep the weights finite): the batch itself is the cause, in any precision."""
    keras.config.set_dtype_policy(policy)
    x, y = np.ones((32, 4), np.float32), np.ones((32, 1), np.float32)
    x[5, 2], y[6, 0] = np.nan, np.inf
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1, dtype="float32")])
    model.compile(keras.optimizers.SGD(0.01), "mse")
    words = r"Replay of the failing batch: the batch itself holds non-finite values \(1 in its inputs, 1 in its targets"
    with pytest.raises(tfmp.TrainingError, match=words):
        tfmp.fit(model, x, y, batch_size=8, shuffle=False, epochs=40, verbose=0)


def test_diagnose_refuses_a_batch_holding_a_nan():
    """Its figures were NaN throughout and it named nothing (keep_float32=[], loss scale 1)."""
    x, y = np.ones((64, 4), np.float32), np.ones((64, 1), np.float32)
    x[40, 1] = np.nan
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.01), "mse")
    with pytest.raises(tfmp.UsageError, match=r"batch 2 holds non-finite values \(1 in its inputs\): check the input"):
        tfmp.diagnose(model, (x, y), steps=2)


def test_parity_within_and_beyond_noise():
    same = doctor.parity(lambda policy, seed: 0.80 + 0.01 * seed, seeds=3)
    assert same["within_noise"] and same["difference"] == 0.0
    worse = doctor.parity(lambda policy, seed: 0.80 + 0.001 * seed - (0.05 if policy != "float32" else 0), seeds=3)
    assert not worse["within_noise"] and worse["difference"] == pytest.approx(-0.05)
    for kwargs, words in (({"seeds": 1}, "at least 2 seeds"), ({"policies": ("bfloat16",) * 2}, "two different")):
        with pytest.raises(tfmp.UsageError, match=words):
            doctor.parity(lambda policy, seed: 1.0, **kwargs)


class Energy(keras.layers.Layer):
    """A user's weightless layer: sum((50 x)^2), about 1e5 here, beyond float16's 65504."""

    def call(self, x):
        return keras.ops.sum(keras.ops.square(x * 50.0), axis=-1, keepdims=True)


def energy_model():
    """Functional, with a weightless custom layer whose output leaves float16's range and a
    Lambda holding a Python lambda that brings it back (log1p): the doctor must name both."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    x = keras.layers.Dense(16, name="dense")(inputs)
    x = Energy(name="energy")(x)
    x = keras.layers.Lambda(lambda t: keras.ops.log1p(t), name="squash")(x)
    outputs = keras.layers.Dense(1, dtype="float32", name="head")(x)
    model = keras.Model(inputs, outputs)
    model.compile(keras.optimizers.Adam(1e-3), "mse")
    return model


class Subclassed(keras.Model):
    """A subclassed model; its `scale` sublayer's outputs reach about 2e5."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(16, name="dense")
        self.scale = keras.layers.Rescaling(1e4, name="scale")
        small = keras.initializers.RandomNormal(stddev=1e-5)  # Back to the targets' scale, as in `overflowing`.
        self.head = keras.layers.Dense(1, dtype="float32", kernel_initializer=small, name="head")

    def call(self, x):
        return self.head(self.scale(self.dense(x)))


def _state(model):
    """What diagnose must leave as it found it."""
    layers = [model, *model._flatten_layers(include_self=False)]  # noqa: SLF001 - what the doctor touched.
    return {
        "weights": [w.numpy().copy() for w in model.weights],
        "policies": [layer._dtype_policy for layer in layers],  # noqa: SLF001 - the same objects.
        "shadowed": [layer for layer in layers if "call" in layer.__dict__],
        "iterations": int(model.optimizer.iterations.numpy()),
        "prediction": model.predict(X[:8], verbose=0),
    }


def _assert_same_state(before, after):
    for a, b in zip(before["weights"], after["weights"], strict=True):
        np.testing.assert_array_equal(a, b)
    assert all(a is b for a, b in zip(before["policies"], after["policies"], strict=True))
    assert after["shadowed"] == [] and before["iterations"] == after["iterations"]
    np.testing.assert_array_equal(before["prediction"], after["prediction"])


def test_doctor_to_fix_on_a_model_with_a_lambda_and_a_weightless_layer():
    keras.config.set_dtype_policy("mixed_float16")
    model = energy_model()
    before = _state(model)
    diagnosis = tfmp.diagnose(model, data(), steps=4)
    _assert_same_state(before, _state(model))
    # The layer whose output leaves float16's range, and the Lambda that would cast it back
    # to float16 before reducing it; not the Dense layers around them.
    assert diagnosis.keep_float32 == ["energy", "squash"]
    records = {r["name"]: r for r in diagnosis.layers}
    assert records["energy"]["forward_overflow"] and not records["energy"]["input_overflow"]
    assert records["squash"]["input_overflow"] and records["squash"]["output_max_abs"] < 20
    assert "casts a value beyond float16" in diagnosis.table()

    # The energy layer alone is not enough: the Lambda computes in float16 and casts 1e5 to inf.
    tfmp.keep_float32(model, ["energy"])
    with pytest.raises(tfmp.TrainingError, match="non-finite"):
        tfmp.fit(model, data(), epochs=2, verbose=0)

    model = energy_model()
    kept = tfmp.keep_float32(model, diagnosis.keep_float32)  # On the built model: one line.
    assert sorted(kept) == ["energy", "squash"]
    dtypes = {r["path"]: r["compute_dtype"] for r in tfmp.audit(model).layers}
    assert dtypes == {"dense": "float16", "energy": "float32", "squash": "float32", "head": "float32"}
    scale = diagnosis.recommended_loss_scale
    model.compile(tfmp.wrap_optimizer(keras.optimizers.Adam(1e-3), initial_scale=scale), "mse")
    history = tfmp.fit(model, data(), epochs=3, verbose=0)
    assert np.isfinite(history.history["loss"]).all() and history.history["loss"][-1] < history.history["loss"][0]
    assert int(model.optimizer.iterations.numpy()) >= 20  # Hardly any of the 24 updates skipped.


def test_diagnose_subclassed_and_nested_models():
    keras.config.set_dtype_policy("mixed_float16")
    model = Subclassed()
    model.compile(keras.optimizers.Adam(1e-4), "mse")
    model(X[:2])
    before = _state(model)
    diagnosis = tfmp.diagnose(model, data(), steps=2)
    _assert_same_state(before, _state(model))
    assert [r["name"] for r in diagnosis.layers] == ["subclassed/dense", "subclassed/scale", "subclassed/head"]
    assert diagnosis.keep_float32 == ["subclassed/scale"]  # The float32 head takes its output as it is.
    assert tfmp.keep_float32(model, diagnosis.keep_float32) == ["subclassed/scale"]
    assert model.scale.compute_dtype == "float32" and model.dense.compute_dtype == "float16"
    assert "subclassed/scale                 Rescaling              float32" in tfmp.audit(model).table()

    keras.utils.set_random_seed(0)
    block = keras.Sequential([keras.Input((16,)), keras.layers.Rescaling(1e4, name="blowup")], name="block")
    inputs = keras.Input((8,))
    small = keras.initializers.RandomNormal(stddev=1e-5)
    outputs = keras.layers.Dense(1, dtype="float32", kernel_initializer=small, name="out")(
        block(keras.layers.Dense(16, name="dense")(inputs))
    )
    nested = keras.Model(inputs, outputs)
    nested.compile(keras.optimizers.Adam(1e-4), "mse")
    diagnosis = tfmp.diagnose(nested, data(), steps=2)
    names = [r["name"] for r in diagnosis.layers]
    assert names == ["dense", "block", "block/blowup", "out"] or names == ["dense", "block", "blowup", "out"]
    assert diagnosis.keep_float32 == [names[2]]  # The layer inside, not the model holding it.


def test_diagnose_a_subclassed_model_never_called():
    """Built first, as model.fit builds it: built by its first call, watched, it recorded
    symbolic tensors, and diagnose failed converting them."""
    keras.config.set_dtype_policy("mixed_float16")
    model = Subclassed()
    model.compile(keras.optimizers.Adam(1e-4), "mse")
    diagnosis = tfmp.diagnose(model, data(), steps=2)
    assert [r["name"].rsplit("/", 1)[-1] for r in diagnosis.layers] == ["dense", "scale", "head"]
    assert [name.rsplit("/", 1)[-1] for name in diagnosis.keep_float32] == ["scale"]


def test_keep_float32_on_a_built_model_refuses_unknown_names():
    model = energy_model()
    with pytest.raises(tfmp.UsageError, match="'energyy' matches no layer"):
        tfmp.keep_float32(model, ["energyy"])
    with pytest.raises(tfmp.UsageError, match="not a regular expression"):
        tfmp.keep_float32(model, ["("])


def test_keep_float32_on_a_loaded_model_makes_it_train(tmp_path):
    keras.config.set_dtype_policy("mixed_float16")
    overflowing().save(tmp_path / "model.keras")
    loaded = keras.models.load_model(tmp_path / "model.keras")
    diagnosis = tfmp.diagnose(loaded, data(), steps=2)
    assert tfmp.keep_float32(loaded, diagnosis.keep_float32) == ["blowup"]
    assert loaded.get_layer("blowup").compute_dtype == "float32" and tfmp.audit(loaded) == []
    loaded.compile(tfmp.wrap_optimizer(keras.optimizers.Adam(1e-4), diagnosis.recommended_loss_scale), "mse")
    history = tfmp.fit(loaded, data(), epochs=2, verbose=0)
    assert np.isfinite(history.history["loss"]).all()


def test_diagnose_a_model_built_under_a_mirrored_strategy(mirrored):
    keras.config.set_dtype_policy("mixed_float16")
    with mirrored.scope():
        model = overflowing()
    before = [w.numpy().copy() for w in model.weights]
    diagnosis = tfmp.diagnose(model, data(), steps=3)
    assert diagnosis.keep_float32 == ["blowup"] and diagnosis.steps == 3
    for a, b in zip(before, model.weights, strict=True):
        np.testing.assert_array_equal(a, b.numpy())


def test_the_updates_bfloat16_weights_would_lose_to_nearest_rounding_per_layer():
    """Adam's first steps move every weight by about the learning rate: 1e-4 is far below
    half a bfloat16 step of the weights of 100 in `large`, and above it for `small`'s."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(4, kernel_initializer=keras.initializers.Constant(100.0), name="large"),
            keras.layers.Dense(1, kernel_initializer=keras.initializers.Constant(1e-3), name="small"),
        ]
    )
    model.compile(keras.optimizers.Adam(1e-4), "mse")
    diagnosis = tfmp.diagnose(model, data(), steps=2)
    lost = {r["name"].split("/")[-1]: r["bfloat16_nearest_dropped"] for r in diagnosis.layers}
    assert lost["large"] == 32 / 36 and lost["small"] < 0.1, lost  # Its kernel's 32, not its 4 biases (at 0).
    assert "bf16 lost: weights stored in bfloat16 would lose up to" in diagnosis.table()
    assert doctor.nearest_drops(np.float32([100.0, 1.0]), np.float32([100.0001, 1.5])).tolist() == [1, 2]


@pytest.mark.parametrize("strategy", ["one device", "mirrored"])
def test_a_model_of_bfloat16_weights_is_measured_and_updated_as_tfmp_fit_would(monkeypatch, request, strategy):
    """Its float32 pass casts the bfloat16 weights (Keras would hand them to float32 ops uncast: an error), its steps
    update them as tfmp.fit does (Keras' own update rounds Adam's beta_2 to 1 and moves nothing), and the column of
    updates nearest rounding would lose is left out: they are compensated. The model is as it was afterwards, on one
    device and under a MirroredStrategy (the update reduces the gradients over its replicas)."""
    tfmp.configure_precision("bfloat16")
    keras.utils.set_random_seed(0)
    with (request.getfixturevalue("mirrored") if strategy == "mirrored" else tf.distribute.get_strategy()).scope():
        layers = [keras.layers.Reshape((8, 1)), keras.layers.Conv1D(4, 3), keras.layers.Flatten()]
        model = keras.Sequential([keras.Input((8,)), *layers, keras.layers.Dense(1)])  # Conv1D: no mixed dtypes.
        model.compile(keras.optimizers.Adam(1e-3), "mse")
    before = [np.asarray(v) for v in model.variables]
    moved, apply = [], measure._apply  # noqa: SLF001

    def watched(strategy, optimizer, grads, variables, **kw):
        old = [np.asarray(v) for v in variables]
        apply(strategy, optimizer, grads, variables, **kw)
        moved.append(all(np.any(np.asarray(v) != o) for v, o in zip(variables, old, strict=True)))

    monkeypatch.setattr(measure, "_apply", watched)
    diagnosis = tfmp.diagnose(model, data(), steps=3)
    assert moved == [True] * 3  # Every weight, every step.
    assert [r["bfloat16_nearest_dropped"] for r in diagnosis.layers if r["gradient_values"]] == [None, None]
    assert "bf16 lost" not in str(diagnosis).split("\n", 1)[1]  # Only the header names it.
    for v, value in zip(model.variables, before, strict=True):
        np.testing.assert_array_equal(np.asarray(v), value)
