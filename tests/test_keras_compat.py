"""The Keras internals tfmp relies on (tfmp/keras_compat.py), a test per behaviour: a Keras
release that changes one of them fails here, by name."""

import keras
import numpy as np
import tensorflow as tf

import tfmp
from tfmp import keras_compat


def _nested():
    block = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="inner")], name="block")
    inputs = keras.Input((4,))
    return keras.Model(inputs, keras.layers.Dense(2, name="out")(block(keras.layers.Dense(4, name="first")(inputs))))


class _Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.a = keras.layers.Dense(3, name="a")
        self.b = keras.layers.Dense(1, name="b")

    def call(self, x):
        return self.b(self.a(x))


def test_sublayers_reach_nested_and_subclassed_layers_parents_first():
    names = [layer.name for layer in keras_compat.sublayers(_nested())]
    assert sorted(names) == ["block", "first", "inner", "out"]  # No InputLayer, not the model itself.
    assert names.index("block") < names.index("inner")
    model = _Subclassed()
    model(np.ones((1, 4), "float32"))
    assert [layer.name for layer in keras_compat.sublayers(model)] == ["a", "b"]


def test_a_layer_casts_its_inputs_and_nested_models_do_not():
    keras.config.set_dtype_policy("mixed_float16")
    block = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="inner")], name="block")
    functional_inputs = keras.Input((3,))
    functional = keras.Model(functional_inputs, keras.layers.Dense(3, name="inner2")(functional_inputs), name="fblock")
    inputs = keras.Input((4,))
    model = keras.Model(inputs, functional(block(keras.layers.Dense(4, name="first")(inputs))))
    layers = keras_compat.sublayers(model)
    casts = {layer.name: keras_compat.casts_inputs(layer) for layer in layers}
    assert casts == {"first": True, "block": False, "inner": True, "fblock": False, "inner2": True}
    seen = {}
    with keras_compat.watching_calls(layers, lambda layer, args, kwargs, outputs: seen.setdefault(layer.name, args)):
        block(np.ones((2, 4), "float32"))
        functional(np.ones((2, 3), "float32"))
    # What each `call` received: cast to float16 by the layers that cast, as it came by the models.
    received = {name: args[0].dtype for name, args in seen.items()}
    assert received == {"block": "float32", "inner": "float16", "fblock": "float32", "inner2": "float16"}


def test_watching_calls_sees_every_call_in_order_and_leaves_the_layers_as_they_were():
    model = _nested()
    layers = keras_compat.sublayers(model)
    started, finished = [], []
    on_call = lambda layer, args, kwargs, outputs: finished.append((layer.name, tuple(outputs.shape)))  # noqa: E731
    with keras_compat.watching_calls(layers, on_call, lambda layer: started.append(layer.name)):
        expected = model(np.ones((2, 4), "float32"))
    assert started == ["first", "block", "inner", "out"]
    assert finished == [("first", (2, 4)), ("inner", (2, 3)), ("block", (2, 3)), ("out", (2, 2))]
    assert not any("call" in layer.__dict__ for layer in layers)
    np.testing.assert_array_equal(model(np.ones((2, 4), "float32")), expected)


def test_policies_swap_and_put_back_the_same_objects():
    keras.config.set_dtype_policy("mixed_bfloat16")
    model = _nested()
    layers = keras_compat.sublayers(model)
    saved = [layer._dtype_policy for layer in layers]  # noqa: SLF001
    with keras_compat.policies([model, *layers], "float32"):
        assert model(np.ones((1, 4), "float32")).dtype == "float32"
    assert all(layer._dtype_policy is policy for layer, policy in zip(layers, saved, strict=True))  # noqa: SLF001
    assert model(np.ones((1, 4), "float32")).dtype == "bfloat16"


def test_set_policy_leaves_a_shared_policy_map_alone():
    keras.config.set_dtype_policy("mixed_float16")
    with tfmp.keep_float32([".*/b"]):
        model = _Subclassed()
        model(np.ones((1, 4), "float32"))
    shared = model.a._dtype_policy  # noqa: SLF001 - the DTypePolicyMap both layers hold.
    assert isinstance(shared, keras.dtype_policies.DTypePolicyMap) and model.b.compute_dtype == "float32"
    keras_compat.set_policy(model.a, "float32")
    assert model.a.compute_dtype == "float32" and len(shared) == 1  # No entry for "a" written into the map.


def test_forgetting_compiled_functions_makes_fit_trace_with_the_new_dtype():
    keras.config.set_dtype_policy("mixed_float16")
    model = _nested()
    model.compile("sgd", "mse")
    x, y = np.ones((4, 4), "float32"), np.ones((4, 2), "float32")
    model.fit(x, y, verbose=0)
    assert model.train_function is not None
    keras_compat.forget_compiled_functions(model)
    assert model.train_function is None and model.predict_function is None
    model.fit(x, y, verbose=0)
    assert model.train_function is not None


def _compiled_model():
    model = _nested()
    model.compile(keras.optimizers.Adam(1e-3), "mse", metrics=["mae"])
    return model


def test_symbolic_build_builds_model_loss_metrics_and_optimizer():
    model = _compiled_model()
    spec = (tf.TensorSpec((None, 4)), tf.TensorSpec((None, 2)))
    keras_compat.symbolic_build(model, spec)
    assert model.optimizer.built and model.metrics_variables  # What a step needs before it traces.
    loss, metrics = keras_compat.compiled(model)
    assert loss is not None and metrics is not None
    assert keras_compat.compiled(_nested()) == (None, None)


class _HostResult(keras.metrics.MeanSquaredError):
    def result(self):
        return tf.numpy_function(lambda a: a, [super().result()], tf.float32, stateful=False)  # No static shape.


def test_symbolic_build_builds_the_rest_past_a_metric_result_of_no_static_shape():
    """Keras' build reads each metric's result, and fails on one of no static shape (model.fit on one device
    builds its metrics at the first step instead)."""
    model = _nested()
    model.compile(keras.optimizers.Adam(1e-3), "mse", metrics=[_HostResult()])
    spec = (tf.TensorSpec((None, 4)), tf.TensorSpec((None, 2)))
    keras_compat.symbolic_build(model, spec)
    assert model.optimizer.built and model.metrics_variables and keras_compat.compiled(model)[0] is not None


def test_compute_loss_is_the_compiled_loss_plus_regularization():
    model = _compiled_model()
    x, y = np.ones((4, 4), "float32"), np.zeros((4, 2), "float32")
    y_pred = keras_compat.call(model, x, training=True)
    loss = keras_compat.compute_loss(model, x, y, y_pred, None, training=True)
    np.testing.assert_allclose(float(loss), float(np.mean(np.square(np.asarray(y_pred)))), rtol=1e-6)


def test_compute_loss_sums_the_losses_layers_add_in_float32():
    """Under mixed_float16 an activity regularizer's loss is float16: Keras' own sum of it
    with the float32 compiled loss fails; tfmp's adds it in float32, and leaves the model
    as it was."""
    keras.config.set_dtype_policy("mixed_float16")
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(3, activity_regularizer=keras.regularizers.L2(0.5))(inputs)
    model = keras.Model(inputs, keras.layers.Dense(2, dtype="float32")(hidden))
    model.compile("sgd", "mse")
    x, y = np.ones((4, 4), "float32"), np.zeros((4, 2), "float32")
    y_pred = keras_compat.call(model, x, training=True)
    (penalty,) = model.losses
    assert penalty.dtype == "float16"
    loss = keras_compat.compute_loss(model, x, y, y_pred, None, training=True)
    assert loss.dtype == "float32" and "_aggregate_additional_loss" not in vars(model)
    expected = np.mean(np.square(np.asarray(y_pred))) + float(penalty)
    np.testing.assert_allclose(float(loss), expected, rtol=1e-3)


def test_compute_loss_of_the_models_own_is_its_replicas_share_on_replicas(mirrored):
    """On 2 replicas Keras divides its compiled loss by 2 (`scale_loss_for_distribution`), not a term an override of
    `compute_loss` adds; tfmp turns Keras' division off while the override runs and halves the whole: a replica's
    value is half its loss as one device's, the compiled part and the own term alike. Keras left as it was."""

    class Own(keras.Model):
        def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
            return super().compute_loss(x, y, y_pred, sample_weight, training) + keras.ops.mean(keras.ops.abs(y_pred))

    with mirrored.scope():
        inputs = keras.Input((4,))
        model = Own(inputs, keras.layers.Dense(2, kernel_initializer="ones")(inputs))
        model.compile("sgd", "mse")
    x, y = np.ones((4, 4), "float32"), np.zeros((4, 2), "float32")
    original = keras.src.losses.loss.scale_loss_for_distribution

    @tf.function
    def replica_losses():
        return mirrored.run(lambda: keras_compat.compute_loss(model, x, y, model(x), None, training=True))

    values = mirrored.experimental_local_results(replica_losses())
    # Each output is 4: mse 16, mean |y_pred| 4; Keras' division alone gave 16 / 2 + 4 = 12.
    np.testing.assert_allclose([float(v) for v in values], [10.0, 10.0])
    assert keras.src.losses.loss.scale_loss_for_distribution is original


def test_compute_loss_weighs_each_outputs_logged_loss_as_one_batch_or_by_its_share():
    """Keras' per-output loss trackers are the compiled loss's `metrics`, updated with `sample_weight` the batch's
    static size (4; the first call builds them); while tfmp computes the loss a batch counts 1, or its `share`."""
    model = keras.Model(inputs := keras.Input((4,)), {name: keras.layers.Dense(1, name=name)(inputs) for name in "ab"})
    model.compile("sgd", {"a": "mse", "b": "mse"})
    x, y = np.ones((4, 4), "float32"), {name: np.zeros((4, 1), "float32") for name in "ab"}
    for share in (None, None, tf.constant(0.5)):
        keras_compat.compute_loss(model, x, y, model(x), None, training=True, share=share)
    assert keras_compat.logs_per_output(model) and not keras_compat.logs_per_output(_compiled_model())
    counts = [(float(t.count), "update_state" in vars(t)) for t in model._compile_loss.metrics]  # noqa: SLF001
    assert counts == [(5.5, False), (5.5, False)]  # Keras' 4 for the first, 1, then 0.5; its own method back.


def test_producer_and_output_layers_walk_back_from_the_outputs():
    inputs = keras.Input((4,))
    logits = keras.layers.Dense(3, name="logits")(inputs)
    model = keras.Model(inputs, keras.layers.Activation("softmax", name="softmax")(logits))
    assert keras_compat.producer(model.outputs[0]).name == "softmax"
    assert [layer.name for layer in keras_compat.output_layers(model)] == ["logits"]  # Past the weightless softmax.


def test_loss_tracker_is_the_metric_fit_reports_as_loss():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    tracker = keras_compat.loss_tracker(model)
    tracker.update_state(3.0)
    assert float(model.metrics[0].result()) == 3.0 and model.metrics[0] is tracker  # What fit reports as loss.


def test_paths_looked_up_are_the_built_layers_paths():
    policy_map = keras.dtype_policies.DTypePolicyMap(keras.DTypePolicy("float32"), {"x": keras.DTypePolicy("float32")})
    original = keras.dtype_policies.DTypePolicyMap.__getitem__
    with keras_compat.paths_looked_up() as paths:
        layer = keras.layers.Dense(2, dtype=policy_map, name="probe")
        layer.build((None, 3))
        assert layer.compute_dtype == "float32"
    assert paths == {"probe"}  # Not the map's own key "x".
    assert keras.dtype_policies.DTypePolicyMap.__getitem__ is original


def test_quantize_only_the_layers_given():
    keras.config.set_dtype_policy("mixed_bfloat16")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, name="a"), keras.layers.Dense(2, name="b")])
    keras_compat.quantize(model, [model.get_layer("a")], "float8")
    assert [layer.quantization_mode for layer in model.layers] == ["float8", None]
    assert model(np.ones((2, 4), "float32")).shape == (2, 2)


def test_backup_epoch_is_the_epoch_backup_and_restore_restored(tmp_path):
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    backup = keras.callbacks.BackupAndRestore(str(tmp_path))
    backup.set_model(model)
    backup.on_epoch_end(2)  # Saves the weights and "the next epoch is 3".
    assert keras_compat.backup_epoch(model) is None
    backup.on_train_begin()
    assert keras_compat.backup_epoch(model) == 3
    assert keras_compat.backup_epoch(model) is None  # Taken.


def test_results_in_order_are_model_evaluates_list():
    """The results' order without return_dict, from the logs by name: the loss, then each
    output's loss and metrics in the model's order, whatever order the logs are in."""
    inputs = keras.Input((4,))
    outputs = {"b": keras.layers.Dense(1, name="b")(inputs), "a": keras.layers.Dense(2, name="a")(inputs)}
    model = keras.Model(inputs, outputs)  # Named as their keys: Keras 3.10 matches metrics to layer names.
    model.compile("sgd", {"b": "mse", "a": "mse"}, metrics={"a": ["mae", "mse"], "b": ["mape"]})
    x, y = np.ones((8, 4), "float32"), {"b": np.zeros((8, 1), "float32"), "a": np.zeros((8, 2), "float32")}
    logs = model.evaluate(x, y, verbose=0, return_dict=True)
    shuffled = dict(sorted(logs.items(), reverse=True))
    assert keras_compat.results_in_order(model, shuffled) == model.evaluate(x, y, verbose=0)
    assert len(model.evaluate(x, y, verbose=0)) == len(logs) == 6


def test_compiled_jit_compile_is_a_choice_that_auto_would_not_have_made(mirrored):
    """compile(jit_compile=X) where Keras' own "auto" would not give X here, else None; under a
    strategy Keras' "auto" is off, so a model compiled there with "auto" made no choice."""
    for strategy in (tf.distribute.get_strategy(), mirrored):
        with strategy.scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
        assert keras_compat.compiled_jit_compile(model) is None
        auto = bool(model.jit_compile)
        assert not auto or strategy is not mirrored  # Keras turns XLA off under any strategy.
        model.compile("sgd", "mse", jit_compile=not auto)
        assert keras_compat.compiled_jit_compile(model) is (not auto)
        model.compile("sgd", "mse", jit_compile=auto)
        assert keras_compat.compiled_jit_compile(model) is None


class _Counter(keras_compat.Saveable):
    """State a `.keras` file keeps beside an optimizer's: a number, saved and put back."""

    def __init__(self, value):
        self.value = value

    def _obj_type(self):
        return "Metric"

    def save_own_variables(self, store):
        store["0"] = np.array(self.value)

    def load_own_variables(self, store):
        self.value = float(store["0"][()]) if len(store.keys()) else None


def test_a_saveable_attribute_of_an_optimizer_is_saved_and_loaded_beside_it(tmp_path):
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile("adam", "mse")
    model.optimizer.build(model.trainable_variables)
    object.__setattr__(model.optimizer, "_extra", _Counter(3.0))  # As tfmp.bf16 attaches its buffers.
    model.save(tmp_path / "model.keras")
    object.__setattr__(model.optimizer, "_extra", _Counter(0.0))
    model.load_weights(tmp_path / "model.keras")
    assert model.optimizer._extra.value == 3.0  # noqa: SLF001
    plain = keras.models.load_model(tmp_path / "model.keras")  # An optimizer without it: the entry is left unread.
    assert not hasattr(plain.optimizer, "_extra") and len(plain.optimizer.variables) == len(model.optimizer.variables)
    plain.save(tmp_path / "plain.keras")
    model.load_weights(tmp_path / "plain.keras")  # A file without the entry: an empty store.
    assert model.optimizer._extra.value is None  # noqa: SLF001


def test_the_compiled_losses_are_found_in_the_compiled_loss():
    """tfmp.scalar_losses finds a compiled loss's own losses by walking what it holds; a Keras that keeps them
    elsewhere fails here."""
    from tfmp import scalar_losses

    def batch_mean(y_true, y_pred):
        return keras.ops.mean(keras.ops.square(y_true - y_pred))

    inputs = keras.Input((3,))
    model = keras.Model(inputs, {"a": keras.layers.Dense(1)(inputs), "b": keras.layers.Dense(1)(inputs)})
    summed = keras.losses.MeanAbsoluteError(reduction="sum")
    model.compile("sgd", {"a": batch_mean, "b": summed})
    spec = (tf.TensorSpec((None, 3)), {"a": tf.TensorSpec((None, 1)), "b": tf.TensorSpec((None, 1))})
    keras_compat.symbolic_build(model, spec)
    found = scalar_losses._losses_in(keras_compat.compiled(model)[0], scalar_losses._MEANS)  # noqa: SLF001
    assert [getattr(loss, "fn", None) for loss in found] == [batch_mean]  # Not the summed one.
    assert scalar_losses._losses_in(keras_compat.compiled(model)[0], ("sum",)) == [summed]  # noqa: SLF001
