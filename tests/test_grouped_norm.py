"""The gradient norm's reductions per shape (`gradients.half_squares_all`: under XLA on GPUs,
without XLA on CPUs): the same sums as per gradient, in fewer reductions, and the same training."""

import json
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmp
from tfmp import gradients, loop


def _grads():
    rng = np.random.default_rng(0)
    shapes = [(3, 4), (5,), (3, 4), (), (5,), (2, 2, 2), (0, 3), (0, 3)]
    grads = [tf.constant(rng.normal(size=s).astype(np.float32)) for s in shapes]
    grads[2] = tf.tensor_scatter_nd_update(grads[2], [[1, 1]], [np.inf])  # Grouped with (3, 4) others.
    grads.append(tf.constant(rng.normal(size=(3, 4)).astype(np.float16)))  # Same shape, another dtype.
    sparse = tf.constant(rng.normal(size=(2, 4)).astype(np.float32))
    grads.append(tf.IndexedSlices(sparse, tf.constant([0, 2]), tf.constant([5, 4])))
    return grads


@pytest.mark.parametrize("jit", [False, True])
def test_grouped_sums_are_each_gradients_own_in_its_place(jit):
    grads = _grads()
    expected = [float(tf.nn.l2_loss(tf.cast(gradients.values(g), tf.float32))) for g in grads]
    fn = tf.function(lambda: gradients.half_squares_all(grads, True), jit_compile=jit)
    got = fn().numpy()
    assert got.shape == (len(grads),)
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    assert list(np.isfinite(got)) == [k != 2 for k in range(len(grads))]  # Which one is not finite stays known.
    np.testing.assert_array_equal(gradients.half_squares_all(grads, False), expected)


def _reductions(grads, grouped):
    graph = tf.function(lambda: gradients.half_squares_all(grads, grouped)).get_concrete_function().graph
    types = [op.type for op in graph.get_operations()]
    return types.count("L2Loss"), types.count("Sum")


def test_grouped_makes_one_reduction_a_shape_of_small_gradients(monkeypatch):
    """In the traced graph: per gradient, one L2Loss each; grouped, one reduction a shape (and
    one L2Loss for each gradient alone in its group: here the sparse one, the scalar, the
    float16 one and the (2, 2, 2) one). Gradients over `GROUP_MOST` numbers stay alone."""
    grads = _grads()
    assert _reductions(grads, False) == (len(grads), 0)
    assert _reductions(grads, True) == (4, 3)  # (3, 4) x2, (5,) x2, (0, 3) x2.
    monkeypatch.setattr(gradients, "GROUP_MOST", 8)
    assert _reductions(grads, True) == (6, 2)  # The two (3, 4) ones, of 12 numbers, alone.


def _model(strategy=None):
    keras.utils.set_random_seed(0)
    with (strategy or tf.distribute.get_strategy()).scope():
        model = keras.Sequential([keras.Input((6,)), *[keras.layers.Dense(6, activation="relu") for _ in range(4)]])
        model.add(keras.layers.Dense(3, activation="softmax"))
        model.compile(keras.optimizers.Adam(1e-2), "sparse_categorical_crossentropy")
    return model


@pytest.mark.parametrize("replicas, jit_compile", [(1, True), (2, True), (1, False)])
def test_training_with_the_grouped_norm_matches_per_gradient(monkeypatch, request, replicas, jit_compile):
    """Clipped by the global norm: the same weights, the norm within rounding; under XLA on
    two replicas in the no-merge-call branch that XLA on several GPUs takes."""
    strategy = request.getfixturevalue("no_merge_call") if replicas == 2 else None
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(64, 6)).astype(np.float32), rng.integers(0, 3, 64)
    runs = {}
    for grouped in (False, True):
        monkeypatch.setattr(gradients, "GROUPED", grouped)
        model = _model(strategy)
        fit = {"batch_size": 16, "epochs": 2, "clipnorm": 0.05, "strategy": strategy}
        history = tfmp.fit(model, x, y, **fit, jit_compile=jit_compile, verbose=0)
        assert loop.kept_steps(model)._grouped is grouped  # noqa: SLF001
        runs[grouped] = model.get_weights(), history.history["loss"]
    for a, b in zip(runs[False][0], runs[True][0], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(runs[False][1], runs[True][1], rtol=1e-5)


def test_the_rule_groups_under_xla_on_a_gpu_and_without_xla_on_a_cpu(monkeypatch):
    """Where each reduction would be an op of its own: a GPU kernel under XLA, an op of the
    executor without XLA on a CPU. Under XLA on a CPU per gradient (XLA fuses them there);
    without XLA on a GPU too (not measured)."""
    monkeypatch.setattr(gradients, "GROUPED", None)
    model = _model()
    steps = loop.prepare(model, tf.distribute.get_strategy(), (tf.TensorSpec([None, 6]), tf.TensorSpec([None])))
    gpu = bool(tf.config.list_logical_devices("GPU"))
    steps.compile(True)
    assert steps._grouped is gpu  # noqa: SLF001
    steps.compile(False)
    assert steps._grouped is not gpu  # noqa: SLF001


@pytest.mark.slow  # A whole bench in small, in a process of its own: 25-40 s.
def test_the_bench_times_tfmps_steps_and_keras_and_counts_their_kernels(tmp_path):
    """`python -m tfmp.bench.grouped_norm --smoke`, in its own process (it sets XLA_FLAGS
    to dump the steps' HLO before TensorFlow starts)."""
    command = [sys.executable, "-m", "tfmp.bench.grouped_norm", "--smoke", "--rounds=2", "--steps=2"]
    done = subprocess.run([*command, f"--output_dir={tmp_path}"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((tmp_path / "grouped_norm.json").read_text())
    assert set(result["ms_per_step"]) == {"per gradient", "grouped", "no norm", "keras"}
    assert all(len(rounds) == 2 and min(rounds) > 0 for rounds in result["rounds"].values())
    kernels = {k["variant"]: k for k in result["tfmp_kernels"]}
    assert set(kernels) == {"per gradient", "grouped", "no norm"} and all(k["kernels"] > 10 for k in kernels.values())
    # The diagnostic's step has no sums of squares: fewer kernels, none of them l2_loss.
    assert kernels["no norm"]["L2Loss"] == 0 < kernels["per gradient"]["L2Loss"]
    assert kernels["no norm"]["kernels"] < kernels["grouped"]["kernels"]
    assert done.stdout.strip().splitlines()[-1] in ("grouped_norm: on", "grouped_norm: off")
