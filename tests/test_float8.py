"""float8: Keras' float8 layers trained by tfmp.fit, their scales and amax histories the
maximum over replicas (and micro-batches), never clipped, untouched by a skipped update,
checkpointed with the model; the policy, the audit, the doctor."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmp
from tfmp import float8, keras_compat, loop, precision

rng = np.random.default_rng(0)
X = rng.normal(size=(8, 8)).astype(np.float32)
X[4:] *= 100  # The second replica's half of each global batch is 100x larger.
Y = rng.integers(0, 4, 8)


def build(strategy=None):
    """Two hidden Dense layers (float8) and a head (left in bfloat16)."""
    with (strategy or tf.distribute.get_strategy()).scope():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((8,))
        x = keras.layers.Dense(16, activation="relu", name="hidden")(inputs)
        x = keras.layers.Dense(16, activation="relu", name="hidden2")(x)
        outputs = keras.layers.Dense(4, name="head")(x)
        model = keras.Model(inputs, outputs)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        model.compile(keras.optimizers.SGD(0.01, momentum=0.9), loss)
    return model


def data(batch=8, repeat=3):
    return tf.data.Dataset.from_tensor_slices((X, Y)).batch(batch).repeat(repeat)


def state(model, strategy=None):
    """Every float8 scale and amax history, by path: a value per replica."""
    local = (strategy or tf.distribute.get_strategy()).experimental_local_results
    return {v.path: [np.asarray(r) for r in local(v.value)] for v in model.variables if float8.is_state(v)}


def test_policy_quantizes_hidden_layers_not_the_head(caplog):
    with caplog.at_level("WARNING"):
        assert tfmp.configure_precision("float8") == "float8"
    assert keras.config.dtype_policy().name == "mixed_bfloat16" and precision.float8_enabled()
    emulated = any("float8 on a CPU is emulated" in r.getMessage() for r in caplog.records)
    assert emulated is not bool(tf.config.list_physical_devices("GPU"))
    model = build()
    history = tfmp.fit(model, data(), epochs=2, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    rows = {r["path"]: r for r in tfmp.audit(model).layers}
    assert rows["hidden"]["float8"] and rows["hidden2"]["float8"] and not rows["head"]["float8"]
    assert rows["hidden"]["compute_dtype"] == "bfloat16"
    histories = {path: value[0] for path, value in state(model).items() if "amax_history" in path}
    assert len(histories) == 6 and all(np.any(v != 0) for v in histories.values())  # Recorded while training.
    assert "float8" in tfmp.audit(model).table()
    kept = build()  # Every candidate excluded by hand: tfmp.fit keeps that, not quantizing them all.
    assert float8.quantize(kept, exclude=["hidden.*"]) == []
    tfmp.fit(kept, data(), epochs=1, verbose=0)
    assert float8.quantized_layers(kept) == [] and not state(kept)


@pytest.mark.parametrize("strategy_name", ["mirrored", "no_merge_call"])
def test_amax_history_and_scales_are_the_maximum_over_replicas(request, strategy_name):
    """Replica 1's half of each batch is 100x larger: Keras would keep replica 0's amax.
    Also where replicas never merge (XLA on GPUs and TPUs)."""
    mirrored = request.getfixturevalue(strategy_name)
    tfmp.configure_precision("float8")
    one, two = build(), build(mirrored)
    for updates, rtol in ((1, 1e-6), (3, 2**-7)):  # Later, the weights differ in bfloat16's last bit.
        tfmp.fit(one, data(repeat=1), epochs=updates, initial_epoch=updates - 1, jit_compile=False, verbose=0)
        tfmp.fit(two, data(repeat=1), epochs=updates, initial_epoch=updates - 1, jit_compile=False, verbose=0)
        single, per_replica = state(one), state(two, mirrored)
        assert set(single) == set(per_replica) and len(single) == 12  # 2 layers x (3 scales + 3 histories).
        for path, (value,) in single.items():
            first, second = per_replica[path]
            np.testing.assert_array_equal(first, second, err_msg=path)  # The same on both replicas.
            np.testing.assert_allclose(first, value, rtol=rtol, err_msg=path)  # As one replica on the global batch.
        assert single["hidden/inputs_amax_history"][0].max() > 100  # Replica 1's values, unseen by replica 0.
        if updates == 1:  # bfloat16 sums in another order; later a float8 rounding may flip too.
            for a, b in zip(one.trainable_weights, two.trainable_weights, strict=True):
                np.testing.assert_allclose(
                    np.asarray(a.value), np.asarray(b.value), rtol=1e-2, atol=1e-3, err_msg=a.path
                )


def test_accumulated_micro_batches_take_their_maximum():
    tfmp.configure_precision("float8")
    whole, halves = build(), build()
    for updates, rtol in ((1, 1e-6), (3, 2**-7)):  # Later, the weights differ in bfloat16's last bit.
        fit = dict(epochs=updates, initial_epoch=updates - 1, jit_compile=False, verbose=0)
        tfmp.fit(whole, data(repeat=1), **fit)
        tfmp.fit(halves, data(batch=4, repeat=1), grad_accum_steps=2, **fit)
        for path, (value,) in state(whole).items():
            np.testing.assert_allclose(state(halves)[path][0], value, rtol=rtol, err_msg=path)


def test_clipping_leaves_the_float8_state_alone():
    tfmp.configure_precision("float8")
    free, clipped = build(), build()
    tfmp.fit(free, data(repeat=1), epochs=1, jit_compile=False, verbose=0)
    tfmp.fit(clipped, data(repeat=1), epochs=1, clipnorm=1e-6, jit_compile=False, verbose=0)
    for path, (value,) in state(free).items():  # Clipped by 1e-6 it would be near 0 (or the norm inf).
        np.testing.assert_array_equal(state(clipped)[path][0], value, err_msg=path)
    moved = [
        np.abs(a.numpy() - b.numpy()).max()
        for a, b in zip(free.trainable_weights, clipped.trainable_weights, strict=True)
    ]
    assert max(moved) > 1e-4  # The weights were clipped.


def test_a_skipped_update_leaves_the_float8_state_untouched():
    keras.config.set_dtype_policy("mixed_float16")  # float8 on float16: loss scaling, skips.
    model = build()
    assert sorted(float8.quantize(model)) == ["hidden", "hidden2"]
    tfmp.fit(model, data(repeat=1), epochs=1, jit_compile=False, verbose=0)
    before, iterations = state(model), int(model.optimizer.iterations.numpy())
    bad = X.copy()
    bad[0, 0] = 1e6  # inf in float16: the update overflows and is skipped.
    tfmp.fit(model, tf.data.Dataset.from_tensor_slices((bad, Y)).batch(8), epochs=1, jit_compile=False, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == iterations  # Skipped.
    for path, value in state(model).items():
        np.testing.assert_array_equal(value[0], before[path][0], err_msg=path)


def test_resume_restores_the_float8_state_exactly(tmp_path):
    tfmp.configure_precision("float8")
    unbroken = build()
    tfmp.fit(unbroken, data(batch=4, repeat=1), epochs=3, jit_compile=False, verbose=0)
    first = build()
    tfmp.fit(first, data(batch=4, repeat=1), epochs=2, checkpoint_dir=str(tmp_path), jit_compile=False, verbose=0)
    resumed = build()
    tfmp.fit(resumed, data(batch=4, repeat=1), epochs=3, checkpoint_dir=str(tmp_path), jit_compile=False, verbose=0)
    for a, b in zip(unbroken.variables, resumed.variables, strict=True):
        np.testing.assert_array_equal(np.asarray(a.value), np.asarray(b.value), err_msg=a.path)


class Subclassed(keras.Model):
    """`build()`'s three layers in a subclassed model without a `build` method: its first call builds them."""

    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(16, activation="relu", name="hidden")
        self.hidden2 = keras.layers.Dense(16, activation="relu", name="hidden2")
        self.head = keras.layers.Dense(4, name="head", dtype="float32")

    def call(self, x, training=None):  # Keras hands it on to the layers inside.
        return self.head(self.hidden2(self.hidden(x)))


class Untrained(Subclassed):
    def call(self, x):  # Keras' train step calls it without `training`, and the layers inside have none.
        return self.head(self.hidden2(self.hidden(x)))


def test_a_subclassed_model_not_yet_built_is_built_then_quantized(mirrored):
    """Its layers exist only once it is called: tfmp.fit builds them from the data, as model.fit
    does, before it quantizes them and builds the optimizer (it asked the user to build it)."""
    tfmp.configure_precision("float8")
    with mirrored.scope():
        keras.utils.set_random_seed(0)
        model = Subclassed()
        model.compile(keras.optimizers.SGD(0.01), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    assert not model.built
    tfmp.fit(model, data(repeat=1), epochs=1, jit_compile=False, verbose=0)
    assert sorted(layer.name for layer in float8.quantized_layers(model)) == ["hidden", "hidden2"]
    histories = {path: value for path, value in state(model, mirrored).items() if "inputs_amax_history" in path}
    for path, (first, second) in histories.items():
        np.testing.assert_array_equal(first, second, err_msg=path)
    assert histories[f"{model.hidden.path}/inputs_amax_history"][0].max() > 100  # Replica 1's values.


def test_the_doctor_before_the_fit_of_a_subclassed_model_not_yet_built():
    """The doctor built the model as model.fit does, its optimizer too, and float8 could not quantize it after."""
    tfmp.configure_precision("float8")
    model = Subclassed()
    model.compile(keras.optimizers.SGD(0.01), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    diagnosis = tfmp.diagnose(model, data(repeat=1), steps=1)
    assert [r["name"] for r in diagnosis.float8] == [model.hidden.path, model.hidden2.path]
    tfmp.fit(model, data(repeat=1), epochs=1, jit_compile=False, verbose=0)
    assert sorted(layer.name for layer in float8.quantized_layers(model)) == ["hidden", "hidden2"]


def test_float8_layers_never_called_in_training_are_warned_of(caplog):
    """A model whose call takes no `training`: Keras' train step calls it without one, and its float8 layers'
    input and kernel scales never move (model.fit leaves them at 1.0 too)."""
    tfmp.configure_precision("float8")
    for cls in (Subclassed, Untrained):
        keras.utils.set_random_seed(0)
        model = cls()
        model.compile(keras.optimizers.SGD(0.01), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        caplog.clear()
        with caplog.at_level("WARNING"):
            tfmp.fit(model, data(repeat=1), epochs=1, jit_compile=False, verbose=0)
        warned = [r.getMessage() for r in caplog.records if "takes no `training`" in r.getMessage()]
        recorded = state(model)[f"{model.hidden.path}/inputs_amax_history"][0].max()
        assert (recorded > 100, len(warned)) == ((True, 0) if cls is Subclassed else (False, 1)), (recorded, warned)


def test_the_doctor_on_a_model_in_float8_leaves_its_scales_out_of_the_update():
    """Its scales and amax histories have no gradient in the doctor's float32 pass: Keras'
    optimizer warned at every step that they had none."""
    tfmp.configure_precision("float8")
    model = build()
    tfmp.fit(model, data(repeat=1), epochs=1, jit_compile=False, verbose=0)
    before = state(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        diagnosis = tfmp.diagnose(model, data(repeat=1), steps=1)
    assert [r["name"] for r in diagnosis.float8] == ["hidden", "hidden2"]
    assert not [w for w in caught if "Gradients do not exist" in str(w.message)]
    for path, value in state(model).items():
        np.testing.assert_array_equal(value[0], before[path][0], err_msg=path)


def test_quantize_refuses_a_model_whose_optimizer_is_built():
    keras.config.set_dtype_policy("mixed_bfloat16")
    model = build()
    model.fit(X, Y, epochs=1, verbose=0)
    with pytest.raises(tfmp.UsageError, match="optimizer .* was built"):
        float8.quantize(model)
    for call, name in ((float8.quantize, "float8.quantize"), (tfmp.audit, "audit")):
        with pytest.raises(tfmp.UsageError, match=f"^{name} takes a [kK]eras.*, got str$"):  # Not an AttributeError.
            call("model")


def test_doctor_names_the_layer_float8_would_flush():
    """`hidden` takes features near 1e-4 beside features near 10: under a scale set by the
    largest, E4M3 flushes the small ones to zero. `hidden2` is fine."""
    tfmp.configure_precision("float8")
    model = build()
    wide = rng.normal(size=(64, 8)).astype(np.float32)
    wide[:, :4] *= 1e-4
    wide[:, 4:] *= 10
    batches = tf.data.Dataset.from_tensor_slices((wide, rng.integers(0, 4, 64))).batch(16)
    diagnosis = tfmp.diagnose(model, batches, steps=4)
    records = {r["name"]: r for r in diagnosis.float8}
    assert set(records) == {"hidden", "hidden2"}  # Not the head.
    assert records["hidden"]["inputs_flushed"] > 0.1 and records["hidden"]["inputs_amax"] > 10
    assert records["hidden2"]["inputs_flushed"] < 0.01
    assert diagnosis.keep_bfloat16 == ["hidden"] and "leave in bfloat16 (float8 exclude): hidden" in diagnosis.table()
    with pytest.raises(tfmp.UsageError, match="float8 exclude: 'hiden' matches no layer of"):
        float8.quantize(model, exclude=["hidden2", "hiden"])  # A typo would leave hidden in float8.
    assert float8.quantize(model, exclude=diagnosis.keep_bfloat16) == ["hidden2"]
    history = tfmp.fit(model, batches, epochs=2, verbose=0)
    assert np.isfinite(history.history["loss"]).all()


def test_auto_never_picks_float8_and_float8_says_where_it_is_emulated():
    hopper = precision.Hardware(gpu_capability=(9, 0), gpu_name="H100")
    assert precision.resolve_policy("auto", hopper).policy == "mixed_bfloat16"
    assert precision.resolve_policy("float8", hopper).warning is None  # float8 units: no warning.
    ampere = precision.resolve_policy("float8", precision.Hardware(gpu_capability=(8, 0), gpu_name="A100"))
    assert "compute capability 8.0 (float8 units need 8.9 or more)" in ampere.warning
    assert "on a CPU is emulated" in precision.resolve_policy("float8", precision.Hardware()).warning


def test_the_gradient_norm_leaves_the_float8_state_out():
    """Clipping and the NaN guard use the norm of the weights' gradients only: the new
    amax histories (values near 100 here) are not gradients."""
    tfmp.configure_precision("float8")
    model, twin = build(), build()
    for m in (model, twin):
        float8.quantize(m)
    steps = loop.prepare(model, tf.distribute.get_strategy(), data().element_spec)
    reported = float(steps.train(iter(data()))["grad_norm"])
    loop.prepare(twin, tf.distribute.get_strategy(), data().element_spec)

    @tf.function  # Keras' float8 custom gradients want a graph.
    def gradients():
        with tf.GradientTape() as tape:
            loss = keras_compat.compute_loss(twin, X, Y, twin(X, training=True), None, training=True)
        return tape.gradient(loss, twin.trainable_variables)

    grads = gradients()
    weights = [g for g, v in zip(grads, twin.trainable_variables, strict=True) if not float8.is_state(v)]
    state = [g for g, v in zip(grads, twin.trainable_variables, strict=True) if float8.is_state(v)]
    np.testing.assert_allclose(reported, float(tf.linalg.global_norm(weights)), rtol=1e-2)
    assert float(tf.linalg.global_norm(weights + state)) > 2 * reported  # Counting the state would show.


def test_float8_ends_when_another_policy_is_set():
    tfmp.configure_precision("float8")
    assert precision.float8_enabled()
    keras.config.set_dtype_policy("mixed_bfloat16")  # The same base, set by hand: not float8.
    assert not precision.float8_enabled()
    model = build()
    tfmp.fit(model, data(), epochs=1, verbose=0)
    assert not float8.quantized_layers(model)


def test_a_float8_attention_saves_and_reloads(tmp_path):
    """MultiHeadAttention's projections, made in its build, reload in float8 with their state (Keras alone: "expected
    2 variables, but received 0"); the reloaded model predicts as the trained one."""
    tfmp.configure_precision("float8")
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4, 8))
    x = keras.layers.MultiHeadAttention(2, 4, name="attention")(inputs, inputs)
    model = keras.Model(inputs, keras.layers.Dense(4, name="head")(keras.layers.Flatten()(x)))
    model.compile(keras.optimizers.Adam(1e-3), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = rng.normal(size=(16, 4, 8)).astype(np.float32)
    tfmp.fit(model, x, rng.integers(0, 4, 16), batch_size=8, epochs=1, verbose=0)
    model.save(tmp_path / "model.keras")
    reloaded = keras.models.load_model(tmp_path / "model.keras")
    paths = ["attention/attention_output", "attention/key", "attention/query", "attention/value"]
    assert sorted(layer.path for layer in float8.quantized_layers(reloaded)) == paths
    np.testing.assert_array_equal(reloaded.predict(x, verbose=0), model.predict(x, verbose=0))
    assert all(np.any(v != 0) for path, v in state(reloaded).items() if "amax_history" in path)


def test_a_frozen_layer_and_one_with_lora_stay_in_bfloat16():
    """A frozen layer's float8 scales never moved from 1 (Keras updates them as gradients): its inputs of 1000
    saturated at E4M3's 448. Keras' float8 call has no LoRA: fit failed to build the model."""
    tfmp.configure_precision("float8")
    model = build()
    assert [layer.name for layer in float8.candidates(model)] == ["hidden", "hidden2"]
    model.get_layer("hidden").trainable = False
    model.get_layer("hidden2").enable_lora(2)
    tfmp.fit(model, data(), epochs=1, verbose=0)
    assert not float8.quantized_layers(model)
    assert model.get_layer("hidden").compute_dtype == model.get_layer("hidden2").compute_dtype == "bfloat16"


def test_a_layer_frozen_after_float8_is_warned_of(caplog):
    """Frozen once in float8, its scales stop where they are (1 if it never trained): tfmp.fit says so, naming it."""
    tfmp.configure_precision("float8")
    model = build()
    float8.quantize(model)
    model.get_layer("hidden2").trainable = False
    model.compile(keras.optimizers.Adam(1e-3), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with caplog.at_level("WARNING"):
        tfmp.fit(model, data(), epochs=1, verbose=0)
    (warning,) = [r.getMessage() for r in caplog.records if "are frozen" in r.getMessage()]
    assert warning.startswith(f"float8 layers {model.get_layer('hidden2').path} are frozen"), warning
    assert all(float(np.max(v)) == 1.0 for v in model.get_layer("hidden2").weights if "scale" in v.path)


@keras.saving.register_keras_serializable("tfmp_tests")
class Block(keras.layers.Layer):
    """A block as GUIDE.md asks of a layer making float8 sublayers in `__init__`: each with the block's policy and
    a name of its own."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.attention = keras.layers.MultiHeadAttention(2, 4, dtype=self.dtype_policy, name="attention")
        dense = [keras.layers.Dense(8, dtype=self.dtype_policy, name=f"dense{i}") for i in range(2)]
        self.feed_forward = keras.Sequential(dense, name="feed_forward")

    def call(self, x):
        return self.feed_forward(x + self.attention(x, x))


def test_a_float8_layer_inside_a_custom_block_reloads(tmp_path):
    """The sublayers a block makes in `__init__` reload in float8 when the block hands them its policy and names
    them (Keras alone: "expected 2 variables, but received 0"), in the process that saved them too."""
    tfmp.configure_precision("float8")
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4, 8))
    x = keras.layers.Flatten()(Block(name="block")(inputs))
    model = keras.Model(inputs, keras.layers.Dense(4, name="head")(x))
    model.compile(keras.optimizers.Adam(1e-3), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = rng.normal(size=(16, 4, 8)).astype(np.float32)
    tfmp.fit(model, x, rng.integers(0, 4, 16), batch_size=8, epochs=1, verbose=0)
    model.save(tmp_path / "model.keras")
    reloaded = keras.models.load_model(tmp_path / "model.keras")
    assert len(float8.quantized_layers(reloaded)) == len(float8.quantized_layers(model)) == 6
    np.testing.assert_array_equal(reloaded.predict(x, verbose=0), model.predict(x, verbose=0))
