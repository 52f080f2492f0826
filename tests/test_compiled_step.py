"""What tfmp's compiled step holds: embedding gradients that stay sparse (and train exactly
like dense ones), a count of the ops run outside XLA that does not grow with the variables,
one compiled step for every batch of token ids, and steps kept for a model only while its compile
and settings hold (a fine-tuned base trains after its compile)."""

import gc
import weakref

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import GPUS, assert_same, regression, regression_arrays, regression_data, weights

import tfmp
from tfmp import loop, steps, xla
from tfmp.app import models

# ---- sparse gradients ----


def embedding_model(strategy, vocab=300, **clipping):
    keras.utils.set_random_seed(0)
    with strategy.scope():
        tokens = keras.Input((6,), dtype="int32")
        hidden = keras.layers.Embedding(vocab, 8)(tokens)
        hidden = keras.layers.GlobalAveragePooling1D()(hidden)
        out = keras.layers.Dense(3, activation="softmax", dtype="float32")(hidden)
        model = keras.Model(tokens, out)
        model.compile(tfmp.wrap_optimizer(keras.optimizers.Adam(1e-2, **clipping)), "sparse_categorical_crossentropy")
    return model


def token_data(batch=16, vocab=300):
    rng = np.random.default_rng(3)
    x = rng.integers(0, 20, (128, 6)).astype(np.int32)  # Few distinct ids: many duplicate rows.
    x[:, 0] = rng.integers(0, vocab, 128)
    y = (x[:, 0] % 3).astype(np.int64)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch, drop_remainder=True)


def test_embedding_gradient_leaves_the_replica_sparse():
    model = embedding_model(tf.distribute.get_strategy())
    compiled = loop.prepare(model, tf.distribute.get_strategy(), token_data().element_spec, grad_accum_steps=2)
    batch = next(iter(token_data()))
    grads, *_ = compiled.gradients((batch, batch))
    assert isinstance(grads[0], tf.IndexedSlices)
    assert grads[0].values.shape[0] == 2 * 16 * 6  # Two batches' rows, concatenated, not summed densely.


@pytest.mark.parametrize(
    "replicas, policy, clipping",
    [
        (1, "float32", {}),
        (2, "float32", {}),
        (1, "mixed_float16", {}),
        (2, "mixed_float16", {}),
        # The optimizer's own clipping alone, of the rows' sum (Keras' clips each row apart).
        (2, "float32", {"clipnorm": 0.02}),
        (2, "float32", {"clipvalue": 0.002}),
    ],
)
def test_sparse_gradients_train_exactly_like_dense(mirrored, replicas, policy, clipping):
    keras.config.set_dtype_policy(policy)
    strategy = mirrored if replicas == 2 else tf.distribute.get_strategy()
    data = token_data()
    if replicas == 2:
        data = strategy.experimental_distribute_dataset(data)
    results = {}
    for sparse in (True, False):
        model = embedding_model(strategy, **clipping)
        # One update kernel for both (a dense gradient would take the fused one): only the
        # sparse handling differs. Fused against Keras' update: tests/test_fused.py.
        clipnorm = None if clipping else 0.05
        compiled = steps.Steps(
            model, strategy, grad_accum_steps=2, clipnorm=clipnorm, sparse=sparse, fused_updates=False
        )
        iterator = iter(data)
        for _ in range(3):
            out = compiled.train(iterator)
        results[sparse] = [w.numpy() for w in model.weights], out["grad_norm"]
    (sparse_w, sparse_norm), (dense_w, dense_norm) = results[True], results[False]
    np.testing.assert_allclose(sparse_norm, dense_norm, rtol=1e-5)
    for a, b in zip(sparse_w, dense_w, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


# ---- what runs outside XLA ----


def update_graph(layers, strategy, optimizer, jit_compile=True):
    """The traced (not run) one-update step of a `layers`-deep Dense model."""
    with strategy.scope():
        dense = [keras.layers.Dense(8, activation="relu") for _ in range(layers)]
        model = keras.Sequential([keras.Input((8,)), *dense, keras.layers.Dense(1)])
        model.compile(optimizer(1e-3), "mse")
    data = regression_data(drop_remainder=True)
    compiled = loop.prepare(model, strategy, data.element_spec)
    compiled.compile(jit_compile)
    if strategy.num_replicas_in_sync > 1:
        data = strategy.experimental_distribute_dataset(data)
    return compiled.update_graph(iter(data))


@pytest.mark.parametrize("strategy_name", ["one_device", "mirrored"])
def test_ops_outside_xla_per_step_do_not_grow_with_the_variables(request, strategy_name):
    """With XLA, the whole update is one XLA computation on one device; under a strategy only
    the all-reduce of one packed vector sits between two per replica. Counted, not timed:
    the ops the step's graph runs outside XLA at 15 and 150 Dense layers (32 and 302
    variables, ResNet-50 has 320) are the same, for float32 with SGD and for mixed_float16
    (loss scaling) with Adam (two slots a variable). Tracing is this test's time: Keras'
    own Adam builds its update at about 34 ms a variable."""
    strategy = request.getfixturevalue("mirrored") if strategy_name == "mirrored" else tf.distribute.get_strategy()
    counts = {}
    for policy, optimizer in (("float32", keras.optimizers.SGD), ("mixed_float16", keras.optimizers.Adam)):
        for layers in (15, 150):
            keras.config.set_dtype_policy(policy)
            counts[policy, optimizer.__name__, layers] = xla.ops_outside_xla(update_graph(layers, strategy, optimizer))
            keras.backend.clear_session(free_memory=False)
    for policy, optimizer, layers in counts:
        if layers == 15:
            assert counts[policy, optimizer, 15] == counts[policy, optimizer, 150], counts
    assert max(counts.values()) <= (5 if strategy_name == "one_device" else 80), counts
    # Without XLA the same count grows with the variables: the counter sees into the calls.
    keras.config.set_dtype_policy("float32")
    assert xla.ops_outside_xla(update_graph(15, strategy, keras.optimizers.Adam, jit_compile=False)) > 500


@pytest.mark.parametrize("jit_compile", [True, False], ids=["xla", "no_xla"])
def test_the_step_is_traced_without_autograph(monkeypatch, jit_compile):
    """AutoGraph converts no function of a tfmp.fit run (updates, several a call, under
    loss scaling and clipping, and evaluation): converting tfmp's own took 3.5 s of every
    process's first step (DECISIONS.md); the loop of several updates is a tf.while_loop."""
    from tensorflow.python.autograph.impl import api

    converted = []
    real = api._convert_actual  # noqa: SLF001 - where AutoGraph converts a function, once per function.
    monkeypatch.setattr(api, "_convert_actual", lambda entity, ctx: converted.append(entity) or real(entity, ctx))
    keras.config.set_dtype_policy("mixed_float16")
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])
    model.compile(keras.optimizers.Adam(1e-3), "mse")
    data = regression_data(drop_remainder=True)
    history = tfmp.fit(
        model, data, epochs=2, steps_per_execution=3, clipnorm=1.0, validation_data=data, jit_compile=jit_compile
    )
    assert len(history.history["val_loss"]) == 2
    assert converted == []


@pytest.mark.parametrize("name, precision", [("lstm", "float32"), ("transformer", "float32"), ("lstm", "bfloat16")])
def test_token_models_compile_one_step_for_every_batch(name, precision):
    """No shape in the compiled step depends on the token ids (masks, sparse gradients,
    rounding): else XLA makes the ids a compile-time constant and compiles a step for every
    new batch. The step's HLO for two different batches is the same."""
    if name == "lstm" and GPUS:
        pytest.skip("on a GPU Keras' LSTM is cuDNN's kernel, which XLA cannot compile: tfmp.fit trains it without")
    tfmp.configure_precision(precision)
    try:
        keras.utils.set_random_seed(0)
        model = models.compile(
            models.MODELS[name].build(2, vocab_size=50, sequence_length=8), keras.optimizers.SGD(0.1)
        )
        ids = np.random.default_rng(0).integers(0, 50, (2, 4, 8))
        ids[1, :, 5:] = 0  # Padding: the lstm masks it.
        labels = tf.constant([0, 1, 0, 1])
        data = tf.data.Dataset.from_tensor_slices((ids[0], labels)).batch(4)
        compiled = loop.prepare(model, tf.distribute.get_strategy(), data.element_spec)
        compiled.compile(True)
        step = compiled._step  # noqa: SLF001
        hlo = [step.experimental_get_compiler_ir(((tf.constant(x), labels),))(stage="hlo") for x in ids]
    finally:
        tfmp.configure_precision("float32")
        keras.backend.clear_session(free_memory=False)
    assert hlo[0] == hlo[1]


# ---- an update only where a batch was read ----


@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("jit_compile", [False, True], ids=["no XLA", "XLA"])
def test_the_read_past_an_epochs_end_updates_nothing(mirrored, replicas, jit_compile):
    """A dataset of unknown length ends its epoch with a read that fails. The step that
    tried it must change nothing: without XLA, TensorFlow runs the ops that take no input
    from the read (the iteration count, dropout's seed) unless they wait for it. Keras fit
    counts one update too many each such epoch."""

    def train(data):
        keras.utils.set_random_seed(0)
        with (mirrored if replicas == 2 else tf.distribute.get_strategy()).scope():
            inputs = keras.Input((8,))
            hidden = keras.layers.Dropout(0.3)(keras.layers.Dense(16, activation="relu")(inputs))
            model = keras.Model(inputs, keras.layers.Dense(1)(hidden))
            model.compile(keras.optimizers.Adam(1e-2), "mse")
        tfmp.fit(model, data, epochs=3, jit_compile=jit_compile, verbose=0)
        return model

    known = train(regression_data())
    unknown = train(regression_data().filter(lambda x, y: True))
    assert int(unknown.optimizer.iterations.numpy()) == int(known.optimizer.iterations.numpy()) == 3 * 8
    for a, b in zip(unknown.weights, known.weights, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


# ---- the gradients' norm, only where something reads it ----

_NORM_OPS = {"L2Loss", "Square"}  # half_squares_all's, per gradient or one a shape (SGD's update has neither).


@pytest.mark.parametrize(
    ("policy", "clipnorm", "logged", "norm"),
    [
        ("float32", None, False, False),  # Nothing reads it: left out.
        ("float32", None, True, True),  # The log_dir's history.csv and TensorBoard: grad_norm.
        ("float32", 1.0, False, True),  # Clipping needs it.
        ("mixed_float16", None, False, True),  # Loss scaling's finite check needs it.
    ],
)
def test_the_step_passes_over_the_gradients_for_their_norm_only_where_something_needs_it(
    tmp_path, policy, clipnorm, logged, norm
):
    """Keras fit makes no pass over the gradients for a norm; tfmp.fit makes one where its log, a clip or a
    loss scale reads the result. Counted in the traced step (without XLA, the ops themselves); the weights
    are the same either way."""
    keras.config.set_dtype_policy(policy)
    trained = []
    for log_dir in (str(tmp_path / "run") if logged else None, str(tmp_path / "other")):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(1e-2, momentum=0.9), "mae")  # (mse would square too.)
        tfmp.fit(model, regression_data(), epochs=1, clipnorm=clipnorm, log_dir=log_dir, jit_compile=False, verbose=0)
        trained.append([w.numpy() for w in model.weights])
        if log_dir is None or logged:
            compiled = loop.kept_steps(model)
            graph = compiled.update_graph(iter(regression_data()))
            assert compiled.grad_norm is norm and bool(_NORM_OPS & {op.type for op in graph.get_operations()}) is norm
    for a, b in zip(*trained, strict=True):
        np.testing.assert_array_equal(a, b)


def test_an_evaluate_between_two_fits_keeps_the_compiled_update(tmp_path):
    """As Keras keeps `train_function` while `evaluate` makes its own: a fit under XLA, an evaluate without
    it, with other settings than the fit's (accumulation, clipping), then a fit again traces (and compiles)
    the update once. tfmp built its steps again for the evaluate, and again for the fit, each time. A log_dir
    changes nothing here either: the clip needs the gradients' norm with it or without."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
    model.compile(keras.optimizers.Adam(1e-2), "mse")
    settings = dict(grad_accum_steps=2, clipnorm=1.0, jit_compile=True, verbose=0)
    tfmp.fit(model, regression_data(), epochs=1, **settings)
    compiled = loop.kept_steps(model)
    update = compiled._one[False]  # noqa: SLF001 - the traced update, one per choice of XLA.
    traced = update.experimental_get_tracing_count()
    tfmp.evaluate(model, regression_data(), verbose=0)
    assert not compiled.jit_compile  # The evaluate ran without XLA (its default), on the same steps.
    tfmp.fit(model, regression_data(), epochs=2, initial_epoch=1, **settings)
    assert loop.kept_steps(model) is compiled and compiled._one[False] is update  # noqa: SLF001
    assert compiled.jit_compile and update.experimental_get_tracing_count() == traced == 1
    assert int(model.optimizer.iterations.numpy()) == 8  # 2 epochs of 8 batches, 2 a update.
    tfmp.fit(model, regression_data(), epochs=3, initial_epoch=2, log_dir=str(tmp_path), **settings)
    assert loop.kept_steps(model) is compiled and update.experimental_get_tracing_count() == 1


@pytest.mark.parametrize("jit_compile", [False, True])
def test_a_model_is_freed_after_its_fit_as_after_model_fit(mirrored, jit_compile):
    """A sweep trains model after model in one process: each must go once the user lets go of it, its
    optimizer's state (and on a GPU its memory) with it. The compiled steps kept for a second fit held every
    model tfmp.fit or tfmp.evaluate had seen."""
    made = []
    for strategy in (tf.distribute.get_strategy(), mirrored):
        with strategy.scope():
            model = regression()
        tfmp.fit(
            model,
            regression_data(),
            epochs=1,
            validation_data=regression_data(),
            jit_compile=jit_compile,
            strategy=strategy,
            verbose=0,
        )
        tfmp.evaluate(model, regression_data(), strategy=strategy, verbose=0)
        made.append(weakref.ref(model))
        del model
    gc.collect()
    assert [ref() for ref in made] == [None, None]


# ---- fine-tuning: a frozen base, then unfrozen ----


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_base_unfrozen_and_compiled_again_trains_as_under_model_fit(mirrored, replicas):
    """Transfer learning's two phases: the head alone, then the whole model after `base.trainable = True` and a
    `compile`, then frozen again. The steps kept from the first phase must not train the second (their
    variables were the head's); without a `compile` Keras fit keeps its step, the base frozen, and so does tfmp."""
    strategy = mirrored if replicas == 2 else tf.distribute.get_strategy()
    x, y = regression_arrays()
    moved = {}
    for fit in ("keras", "tfmp"):
        keras.utils.set_random_seed(0)
        with strategy.scope():
            base = keras.Sequential([keras.layers.Dense(16, activation="relu"), keras.layers.Dense(16)], name="base")
            inputs = keras.Input((8,))
            model = keras.Model(inputs, keras.layers.Dense(1)(base(inputs)))
        trace = []
        for trainable, recompile in ((False, True), (True, False), (True, True), (False, True)):
            base.trainable = trainable
            if recompile:
                with strategy.scope():
                    model.compile(tfmp.wrap_optimizer(keras.optimizers.Adam(1e-2)), "mse")
            before = [w.numpy() for w in base.weights]
            if fit == "keras":
                model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
            else:
                tfmp.fit(model, x, y, batch_size=32, epochs=1, shuffle=False, strategy=strategy, verbose=0)
            trace.append(any(np.any(a != w.numpy()) for a, w in zip(before, base.weights, strict=True)))
        moved[fit] = (trace, weights(model))
    assert moved["keras"][0] == moved["tfmp"][0] == [False, False, True, False]
    assert_same(moved["keras"][1], moved["tfmp"][1], atol=0 if replicas == 1 else 1e-5)
