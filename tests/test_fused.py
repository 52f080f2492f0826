"""Fused optimizer updates: the same weights and slots as Keras' element-wise update, on one
and two replicas, and Keras' own update wherever the fused kernels do not apply."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import seeded

import tfmp
from tfmp import fused, gradients, loop

# Betas whose 1 - beta float32 gives exactly (0.125, 2^-9): there the fused Adam kernel
# gives Keras' bits, and tfmp uses it; for the defaults it keeps Keras' update.
BETAS = {"beta_1": 0.875, "beta_2": 1 - 2.0**-9}
OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(1e-2, **BETAS),
    "adamw": lambda: keras.optimizers.AdamW(1e-2, weight_decay=0.1, **BETAS),
    "sgd": lambda: keras.optimizers.SGD(0.05),
    "clipped_sgd": lambda: keras.optimizers.SGD(0.05, clipnorm=0.1),  # Its own clip: a norm of the rows summed.
    "momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "nesterov": lambda: keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True),
    "amsgrad": lambda: keras.optimizers.Adam(1e-2, amsgrad=True),  # Not fused: Keras' update.
    "rmsprop": lambda: keras.optimizers.RMSprop(1e-2),  # Keras' update; no kernel to compare with.
}
KERNELS = {"ResourceApplyAdam", "ResourceApplyKerasMomentum", "ResourceApplyGradientDescent"}


class OneHotLookup(keras.layers.Layer):
    """Embedding(rows, width)'s lookup as a one-hot matmul: the same function and initial
    table, with a dense gradient."""

    def __init__(self, rows, width):
        super().__init__()
        self.rows, self.width = rows, width

    def build(self, input_shape):
        self.embeddings = self.add_weight(shape=(self.rows, self.width), initializer="uniform", name="embeddings")

    def call(self, ids):
        return keras.ops.matmul(keras.ops.one_hot(ids, self.rows), self.embeddings)


def _model(optimizer, strategy=None, lookup=keras.layers.Embedding):
    @seeded
    def build():
        tokens = keras.Input((4,), dtype="int32")
        hidden = keras.layers.GlobalAveragePooling1D()(lookup(50, 8)(tokens))  # Embedding's gradient is sparse.
        hidden = keras.layers.Dense(16, activation="relu")(hidden)
        model = keras.Model(tokens, keras.layers.Dense(3, activation="softmax")(hidden))
        model.compile(OPTIMIZERS[optimizer](), "sparse_categorical_crossentropy")
        return model

    return build(strategy)


def _data():
    rng = np.random.default_rng(0)
    x = rng.integers(0, 50, (128, 4)).astype("int32")
    return tf.data.Dataset.from_tensor_slices((x, x[:, 0] % 3)).batch(16)


def _op_types(model):
    """The op types of the model's compiled train step, nested functions included."""
    graph = loop.kept_steps(model)._one[False]._list_all_concrete_functions()[0].graph  # noqa: SLF001 - known length.
    definition = graph.as_graph_def()
    ops = {node.op for node in definition.node}
    for function in definition.library.function:
        ops |= {node.op for node in function.node_def}
    return ops


def _state(model):
    return [v.numpy() for v in model.weights] + [v.numpy() for v in model.optimizer.variables]


# Every optimizer on one replica; each kernel on two (the slots' per-replica handles).
CASES = [(name, 1) for name in OPTIMIZERS if name != "rmsprop"] + [("adam", 2), ("sgd", 2), ("momentum", 2)]


@pytest.mark.parametrize("optimizer, replicas", CASES)
def test_same_weights_and_slots_as_keras_update(mirrored, monkeypatch, optimizer, replicas):
    strategy = mirrored if replicas == 2 else None
    model = _model(optimizer, strategy)
    tfmp.fit(model, _data(), epochs=2, verbose=0)
    assert "update_step" not in vars(model.optimizer)  # The override is gone after the step.
    expected_kernels = set() if optimizer == "amsgrad" else KERNELS & _op_types(model)
    assert (optimizer == "amsgrad") == (not expected_kernels)

    monkeypatch.setattr(fused, "update_step", lambda optimizer, **_: None)  # Keras' element-wise update.
    reference = _model(optimizer, strategy)
    tfmp.fit(reference, _data(), epochs=2, verbose=0)
    assert not KERNELS & _op_types(reference)
    for a, b in zip(_state(model), _state(reference), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert int(model.optimizer.iterations.numpy()) == 16


def test_only_keras_own_update_formulas_are_replaced():
    class Custom(keras.optimizers.Adam):
        def update_step(self, gradient, variable, learning_rate):
            super().update_step(gradient, variable, learning_rate)

    assert fused.update_step(Custom()) is None
    assert fused.update_step(keras.optimizers.RMSprop()) is None
    assert fused.update_step(keras.optimizers.Adam(amsgrad=True)) is None
    assert fused.update_step(keras.optimizers.AdamW(**BETAS)) is not None


def test_adam_is_fused_only_where_the_kernel_rounds_as_keras_does():
    # TensorFlow's kernel computes 1 - beta in float32: 0.100000024 for 0.9, where Keras has 0.1.
    assert fused.update_step(keras.optimizers.Adam()) is None
    assert fused.update_step(keras.optimizers.Adam(beta_1=0.9, beta_2=1 - 2.0**-9)) is None
    assert fused.update_step(keras.optimizers.Adam(**BETAS)) is not None
    assert fused.update_step(keras.optimizers.Adam(), exact=False) is not None  # The benchmark's timing.
    assert fused.update_step(keras.optimizers.SGD(momentum=0.9)) is not None


@pytest.mark.parametrize(
    "optimizer, replicas, clipnorm, deduplicated",
    [
        ("adam", 1, None, False),
        ("momentum", 1, None, False),
        ("amsgrad", 1, None, False),
        ("sgd", 1, None, False),
        ("sgd", 2, None, False),
        ("sgd", 1, 1.0, True),
        ("clipped_sgd", 1, None, True),
        ("adam", 2, None, True),
    ],
)
def test_embedding_gradient_dense_at_once_where_nothing_gains_from_sparse(
    mirrored, optimizer, replicas, clipnorm, deduplicated
):
    # On one replica Adam and momentum make the embedding's gradient dense anyway (fused or
    # Keras' own update, as amsgrad's): it is made dense first, not deduplicated. Plain SGD
    # updates the rows looked up only, and two replicas all-gather the rows: those keep it
    # sparse, an id's rows summed where the norm (a clip) or the update (Adam's) needs it.
    model = _model(optimizer, mirrored if replicas == 2 else None)
    tfmp.fit(model, _data(), steps_per_epoch=1, clipnorm=clipnorm, verbose=0)
    ops = _op_types(model)
    assert ("TensorScatterMin" in ops) == deduplicated  # Each index's first row, for the sum.
    assert not ops & {"Unique", "TopKV2"}  # XLA: a loop over every index; a dynamic module.


def test_an_embedding_under_plain_sgd_trains_to_model_fits_bits():
    """Keras' SGD scatters an id's rows apart; summed first (for a norm nothing reads) they rounded
    otherwise."""
    ours, theirs = _model("sgd"), _model("sgd")
    tfmp.fit(ours, _data(), epochs=2, jit_compile=False, verbose=0)
    theirs.fit(_data(), epochs=2, verbose=0)
    for a, b in zip(_state(ours), _state(theirs), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("optimizer, replicas", [("adam", 1), ("amsgrad", 1), ("rmsprop", 1), ("rmsprop", 2)])
def test_an_embedding_trains_as_its_dense_gradient_says(mirrored, optimizer, replicas):
    """Keras' update squares a tf.IndexedSlices row by row: an id looked up twice in a batch
    gets g1^2 + g2^2 where its gradient's square is (g1 + g2)^2, and model.fit's Adam, RMSprop,
    Adagrad, Ftrl, Adafactor and Lamb train an Embedding otherwise than the same model with a
    dense lookup. tfmp.fit applies the sum: its Embedding trains as the one-hot matmul does.
    (That matmul broadcasts: its gradient's shape is known only as it runs, which tfmp's
    packing for the all-reduce could not take before `gradients.shaped`.)"""
    strategy = mirrored if replicas == 2 else None
    sparse, dense = _model(optimizer, strategy), _model(optimizer, strategy, OneHotLookup)
    assert all(np.array_equal(a, b) for a, b in zip(sparse.get_weights(), dense.get_weights(), strict=True))
    tfmp.fit(sparse, _data(), epochs=2, verbose=0)
    tfmp.fit(dense, _data(), epochs=2, verbose=0)
    for a, b in zip(_state(sparse), _state(dense), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_deduplicate_sums_the_rows_of_an_index_in_one_static_computation():
    """The norm of a sparse gradient is its dense tensor's. Under XLA the deduplication
    takes no loop over the indices (tf.unique's lowering: 16,384 iterations for a batch of
    token ids), no dynamic shape (argsort's lowering has them, and XLA's dynamic padder then
    inlines dropout's random numbers into every consumer) and no shape that depends on the
    ids (they would become a compile-time constant: a compilation for every batch)."""
    values = tf.constant([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0], [9.0, 10.0]])
    indices = tf.constant([3, 1, 3, 0, 1])

    def dedupe(values, indices):
        g = gradients.deduplicate(tf.IndexedSlices(values, indices, tf.constant([5, 2])))
        return g.values, g.indices

    compiled = tf.function(dedupe, jit_compile=True)
    dense = tf.convert_to_tensor(tf.IndexedSlices(values, indices, tf.constant([5, 2])))
    for fn in (dedupe, compiled):
        rows, ids = fn(values, indices)
        np.testing.assert_array_equal(tf.scatter_nd(ids[:, None], rows, [5, 2]), dense)
        nonzero = ids.numpy()[np.any(rows.numpy() != 0, axis=1)]
        assert sorted(nonzero) == [0, 1, 3]  # One row an index holds its sum; the others are zero.
        np.testing.assert_allclose(gradients.half_squares(tf.IndexedSlices(rows, ids)), tf.nn.l2_loss(dense))
    hlo = compiled.experimental_get_compiler_ir(values, indices)(stage="hlo")
    assert hlo == compiled.experimental_get_compiler_ir(values, tf.constant([2, 2, 2, 2, 2]))(stage="hlo")
    assert "set-dimension-size" not in hlo
    optimized = compiled.experimental_get_compiler_ir(values, indices)(stage="optimized_hlo")
    loops = [line for line in optimized.splitlines() if " while(" in line]
    if tuple(int(p) for p in tf.__version__.split(".")[:2]) < (2, 21):
        # XLA's CPU backend expanded every scatter (segment sums included) to a loop then.
        loops = [line for line in loops if "known_trip_count" not in line or 'op_type="Unique"' in line]
    assert not loops, loops


def test_a_sparse_step_compiles_once_for_every_batch():
    """tfmp.fit's compiled step keeps an embedding's gradient sparse (plain SGD): its HLO is
    the same whatever the token ids, and has no dynamic shape."""
    model = _model("sgd")
    tfmp.fit(model, _data(), steps_per_epoch=1, verbose=0, jit_compile=True)
    steps = loop.kept_steps(model)
    x, y = next(iter(_data()))
    hlo = [steps._step.experimental_get_compiler_ir(((ids, y),))(stage="hlo") for ids in (x, x * 0 + 7)]  # noqa: SLF001
    assert hlo[0] == hlo[1]
    assert "set-dimension-size" not in hlo[0]
