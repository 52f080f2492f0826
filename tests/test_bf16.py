"""Pure bfloat16 weights and optimizer state (tfmp.bf16): the dtypes and bytes they take,
Keras' own update math run in float32, compensated rounding where nearest stalls, the same
rounding on every replica, and an exact resume."""

import logging
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import weights

import tfmp
from tfmp import bf16, keras_optimizers
from tfmp.errors import UsageError
from tfmp.steps import Steps


@pytest.fixture(autouse=True)
def _rounding_back():
    yield
    tfmp.precision.set_bf16_rounding("kahan", 0)


def regression_data(n=256, batch=32):
    rng = np.random.default_rng(1)
    x = rng.random((n, 8), dtype=np.float32)
    y = (x @ np.arange(8, dtype=np.float32))[:, None]
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)


def mlp(optimizer=None, strategy=None):
    keras.utils.set_random_seed(0)
    with (strategy or tf.distribute.get_strategy()).scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
        model.compile(optimizer or keras.optimizers.Adam(1e-2), "mse")
    return model


@pytest.mark.parametrize("rounding, expected", [("kahan", 8.0), ("stochastic", 6.0), ("nearest", 6.0)])
def test_weights_and_state_are_bfloat16_at_the_bytes_promised(rounding, expected):
    tfmp.configure_precision("bfloat16", rounding=rounding)
    model = mlp()
    Steps(model, tf.distribute.get_strategy(), bf16_rounding=rounding)
    state = [v for v in model.optimizer.variables if len(v.shape)]
    buffers = bf16.buffers(model.optimizer)
    assert all(v.dtype == "bfloat16" for v in model.trainable_variables + state + buffers)
    assert len(buffers) == (4 if rounding == "kahan" else 0)  # One per weight, its shape.
    assert not any("kahan" in v.name for v in state)  # Beside the optimizer's variables, not among them.
    assert bf16.bytes_per_parameter(model, model.optimizer) == expected


def test_float32_weights_with_adam_take_12_bytes():
    tfmp.configure_precision("mixed_bfloat16")
    model = mlp()
    Steps(model, tf.distribute.get_strategy())
    assert bf16.bytes_per_parameter(model, model.optimizer) == 12.0


class Float32Compute(keras.layers.Layer):
    """y = x @ w with w stored in bfloat16 and the product in float32: only the updates'
    rounding can keep it from float32's loss."""

    def build(self, input_shape):
        self.w = self.add_weight(shape=(input_shape[-1], 1), initializer="ones", dtype="bfloat16")

    def call(self, x):
        return tf.matmul(x, tf.cast(self.w, tf.float32))


def least_squares(policy_dtype, rounding, epochs=60):
    tfmp.precision.set_bf16_rounding(rounding, 0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 8)).astype(np.float32)
    w = np.array([[3.0], [-2.5], [1.25], [4.0], [-0.75], [2.0], [-3.5], [1.5]], np.float32)  # Exact in bfloat16.
    data = tf.data.Dataset.from_tensor_slices((x, x @ w)).batch(16)
    keras.utils.set_random_seed(0)
    if policy_dtype == "float32":
        layer = keras.layers.Dense(1, use_bias=False, kernel_initializer="ones")
    else:
        layer = Float32Compute()
    model = keras.Sequential([keras.Input((8,)), layer])
    model.compile(keras.optimizers.SGD(5e-3), "mse")  # Near the optimum, steps below half a bfloat16 ulp.
    return tfmp.fit(model, data, epochs=epochs, verbose=0).history["loss"][-1]


def test_nearest_stalls_where_kahan_reaches_float32s_loss():
    float32 = least_squares("float32", "kahan")
    nearest = least_squares("bfloat16", "nearest")
    kahan = least_squares("bfloat16", "kahan")
    stochastic = least_squares("bfloat16", "stochastic")
    print(f"final loss: float32 {float32:.3g}, nearest {nearest:.3g}, kahan {kahan:.3g}, stochastic {stochastic:.3g}")
    assert float32 < 1e-4
    assert nearest > 1e-2  # Stalled short of the optimum: every update near it rounded away.
    assert kahan <= float32  # The forward pass reads the bfloat16 weight: at the (representable) optimum, 0.
    assert stochastic < 1e-2 * nearest


OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.05),
    "momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "nesterov": lambda: keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True),
    "adam": lambda: keras.optimizers.Adam(1e-2),
    "amsgrad": lambda: keras.optimizers.Adam(1e-2, amsgrad=True),
    "adamw": lambda: keras.optimizers.AdamW(1e-2, weight_decay=0.1),
    "lion": lambda: keras.optimizers.Lion(1e-3),
    "adafactor": lambda: keras.optimizers.Adafactor(1e-2),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_each_optimizer_runs_keras_own_update_in_float32(name):
    """Three steps of Keras' update on float32 weights, and of tfmp's on the same weights in
    bfloat16 with Kahan buffers: weight + buffer stays within float32 rounding of Keras'
    result (Keras' own bfloat16 Adam is 0.001 off after one step: beta_2 = 1.0)."""
    rng = np.random.default_rng(2)
    start = rng.normal(size=(6, 4)).astype(np.float32)
    exact = tf.cast(tf.cast(start, tf.bfloat16), tf.float32).numpy()  # Representable in both.
    grads = [rng.normal(size=(6, 4)).astype(np.float32) for _ in range(3)]
    reference, keras_opt = tf.Variable(exact), OPTIMIZERS[name]()
    keras_opt.build([reference])
    low, ours = tf.Variable(tf.cast(exact, tf.bfloat16)), OPTIMIZERS[name]()
    ours.build([low])
    bf16.build(ours, [low], "kahan")
    step = bf16.update_step(ours, "kahan", 0, fallback=None)
    applier = keras_optimizers.reduced_applier(ours, {id(ours): (step, bf16.weight_decay_filter)})
    for g in grads:
        keras_opt.apply([tf.constant(g)], [reference])
        applier.apply([tf.constant(g)], [low])
    buffer = bf16.buffers(ours)[0]
    held = tf.cast(low, tf.float32) + tf.cast(buffer, tf.float32)
    moved = np.abs(reference.numpy() - exact).max()
    assert moved > 1e-3  # The updates are not lost in the comparison.
    np.testing.assert_allclose(held.numpy(), reference.numpy(), rtol=0, atol=5e-3 * moved)  # Keras in bf16: >= 7e-3.


def test_an_optimizer_without_a_bfloat16_path_is_named():
    tfmp.configure_precision("bfloat16")
    model = mlp(keras.optimizers.RMSprop(1e-3))
    fix = r'configure_precision\("mixed_bfloat16"\), train.py --precision=mixed_bfloat16'
    with pytest.raises(UsageError, match=f"RMSprop is none of them.*{fix}"):
        Steps(model, tf.distribute.get_strategy())


def test_stochastic_rounding_is_unbiased_and_seeded():
    x = tf.fill([20000], 1.0 + 2.0**-10)  # An eighth of the way from 1 to the next bfloat16, 1 + 2^-7.
    seed = tf.constant([7, 3], tf.int64)
    rounded = tf.cast(bf16.round_stochastic(x, seed), tf.float32).numpy()
    assert set(np.unique(rounded)) == {1.0, 1.0 + 2.0**-7}
    assert abs(rounded.mean() - (1.0 + 2.0**-10)) < 2.0**-7 * 0.02
    again = tf.cast(bf16.round_stochastic(x, seed), tf.float32).numpy()
    other = tf.cast(bf16.round_stochastic(x, tf.constant([7, 4], tf.int64)), tf.float32).numpy()
    assert np.array_equal(rounded, again) and not np.array_equal(rounded, other)


def test_random_bits_are_the_same_with_and_without_xla():
    """A resumed run, another replica or another jit_compile setting rounds alike."""
    seed = tf.constant([2**40 + 5, 9], tf.int64)
    eager = bf16.random_bits([300, 7], seed).numpy()
    compiled = tf.function(lambda s: bf16.random_bits([300, 7], s), jit_compile=True)(seed).numpy()
    assert np.array_equal(eager, compiled)
    low = (eager & 0xFFFF).astype(np.float64) / 2**16  # The bits round_stochastic adds: uniform.
    assert abs(low.mean() - 0.5) < 0.02 and abs(low.std() - 12**-0.5) < 0.02
    other = bf16.random_bits([300, 7], tf.constant([5, 9], tf.int64)).numpy()  # The high word counts.
    assert np.mean(eager == other) < 0.01


@pytest.mark.parametrize("jit_compile", [False, True], ids=["no_xla", "xla"])
def test_nearest_value_is_round_to_nearest_even_and_kahans_rest_survives_xla(jit_compile):
    """`nearest_value` against ml_dtypes' float32 -> bfloat16: ties, subnormals, the largest
    finite values (up to inf), infinities, NaN; and what Kahan keeps, x - nearest_value(x),
    is not zero under XLA (a GPU's XLA drops a cast to bfloat16 and back)."""
    import ml_dtypes

    rng = np.random.default_rng(0)
    edges = np.array(
        [0.0, -0.0, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, -(1.0 + 2.0**-8), 1e-40, -3e-39, 3.3895e38, -3.39e38,
         np.finfo(np.float32).max, np.inf, -np.inf],
        np.float32,
    )  # fmt: skip
    x = np.concatenate([edges, (rng.normal(size=4000) * 10.0 ** rng.integers(-30, 30, 4000)).astype(np.float32)])
    fn = tf.function(bf16.nearest_value, jit_compile=True) if jit_compile else bf16.nearest_value
    got = fn(tf.constant(x)).numpy()
    want = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    assert np.array_equal(got.view(np.int32), want.view(np.int32))
    assert np.isnan(fn(tf.constant([np.nan], tf.float32)).numpy()).all()
    rest = tf.function(lambda v: v - bf16.nearest_value(v), jit_compile=jit_compile)(tf.constant(x[12:])).numpy()
    np.testing.assert_array_equal(rest, x[12:] - want[12:])
    assert np.count_nonzero(rest) > 3000


def test_nearest_warns_what_it_loses(caplog):
    with caplog.at_level(logging.WARNING):
        tfmp.configure_precision("bfloat16", rounding="nearest")
    assert any("drops every update smaller than half a bfloat16 step" in r.getMessage() for r in caplog.records)
    with pytest.raises(UsageError, match="unknown rounding 'up'"):
        tfmp.configure_precision("bfloat16", rounding="up")


def test_accumulation_sums_bfloat16_gradients_in_float32():
    tfmp.configure_precision("bfloat16")
    model = mlp()
    steps = Steps(model, tf.distribute.get_strategy(), grad_accum_steps=2)
    batches = tuple(iter(regression_data()))[:2]
    grads, *_ = steps.replica_gradients(batches)
    assert all(g.dtype == tf.float32 for g in grads)


@pytest.mark.parametrize("rounding", ["kahan", "stochastic"])
def test_every_replica_rounds_alike_and_matches_one_device(mirrored, rounding):
    tfmp.configure_precision("bfloat16", rounding=rounding, seed=3)
    two = mlp(strategy=mirrored)
    tfmp.fit(two, regression_data(), epochs=2, verbose=0)
    for variable in two.weights + [v for v in [*two.optimizer.variables, *bf16.buffers(two.optimizer)] if len(v.shape)]:
        copies = [np.asarray(tf.cast(c, tf.float32)) for c in variable.value.values]
        assert all(np.array_equal(copies[0], c) for c in copies[1:]), variable.name
    one = mlp()
    tfmp.fit(one, regression_data(), epochs=2, verbose=0)
    for a, b in zip(weights(two), weights(one), strict=True):
        np.testing.assert_allclose(np.float32(a), np.float32(b), rtol=0.05, atol=0.05)


@pytest.mark.parametrize(
    "rounding, jit_compile, replicas", [("kahan", False, 1), ("stochastic", True, 1), ("stochastic", False, 2)]
)
def test_resume_continues_as_the_unbroken_run(tmp_path, mirrored, rounding, jit_compile, replicas, deterministic_gpu):
    strategy = mirrored if replicas == 2 else tf.distribute.get_strategy()
    tfmp.configure_precision("bfloat16", rounding=rounding, seed=5)
    unbroken = mlp(strategy=strategy)
    tfmp.fit(unbroken, regression_data(), epochs=2, verbose=0, jit_compile=jit_compile)
    first = mlp(strategy=strategy)
    tfmp.fit(first, regression_data(), epochs=1, verbose=0, checkpoint_dir=str(tmp_path), jit_compile=jit_compile)
    resumed = mlp(strategy=strategy)  # A new process would build these anew.
    tfmp.fit(resumed, regression_data(), epochs=2, verbose=0, checkpoint_dir=str(tmp_path), jit_compile=jit_compile)
    assert resumed.optimizer.iterations.numpy() == unbroken.optimizer.iterations.numpy() == 16
    for a, b in zip(weights(resumed), weights(unbroken), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_keras_file_restores_the_optimizer_and_the_buffers_where_the_loader_has_them(tmp_path):
    """Keras restores an optimizer's state only into one with as many variables as the file
    holds, and `keras.models.load_model` builds a plain Adam: the Kahan buffers, beside the
    optimizer's variables, do not cost it its step count and moments. `model.load_weights`
    into a model tfmp.fit trained restores the buffers too; a file without them zeroes them."""
    tfmp.configure_precision("bfloat16", rounding="kahan")
    model = mlp()
    tfmp.fit(model, regression_data(), epochs=1, verbose=0)
    path = str(tmp_path / "model.keras")
    model.save(path)
    kahan = [b.numpy() for b in bf16.buffers(model.optimizer)]
    assert len(kahan) == 4 and any(np.abs(np.float32(k)).max() > 0 for k in kahan)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = keras.models.load_model(path)
    assert not [w for w in caught if "Skipping variable loading" in str(w.message)]
    assert int(loaded.optimizer.iterations.numpy()) == 8
    for a, b in zip(loaded.optimizer.variables, model.optimizer.variables, strict=True):
        np.testing.assert_array_equal(np.float32(a.numpy()), np.float32(b.numpy()))
    tfmp.fit(loaded, regression_data(), epochs=1, verbose=0)  # Trains on from there, its buffers from zero.
    assert int(loaded.optimizer.iterations.numpy()) == 16 and len(bf16.buffers(loaded.optimizer)) == 4

    for buffer in bf16.buffers(model.optimizer):
        buffer.assign(tf.ones(buffer.shape, buffer.dtype))
    model.load_weights(path)
    for a, b in zip(bf16.buffers(model.optimizer), kahan, strict=True):
        np.testing.assert_array_equal(np.float32(a.numpy()), np.float32(b))
    plain, keras_own = str(tmp_path / "plain.weights.h5"), mlp()
    keras_own.optimizer.build(keras_own.trainable_variables)  # Keras' own optimizer: no buffers in its file.
    keras_own.save_weights(plain)
    model.load_weights(plain)
    assert all(not np.float32(b.numpy()).any() for b in bf16.buffers(model.optimizer))


def test_a_checkpoint_without_buffers_resumes_with_them_at_zero(tmp_path):
    """A checkpoint saved under stochastic rounding (or by a tfmp that kept the buffers among
    the optimizer's variables) holds none: resumed under kahan, they start at zero."""
    tfmp.configure_precision("bfloat16", rounding="stochastic", seed=5)
    tfmp.fit(mlp(), regression_data(), epochs=1, verbose=0, checkpoint_dir=str(tmp_path))
    tfmp.configure_precision("bfloat16", rounding="kahan", seed=5)
    resumed = mlp()
    tfmp.fit(resumed, regression_data(), epochs=2, verbose=0, checkpoint_dir=str(tmp_path))
    assert int(resumed.optimizer.iterations.numpy()) == 16 and len(bf16.buffers(resumed.optimizer)) == 4
    names = {name.split("/")[0] for name, _ in tf.train.list_variables(tf.train.latest_checkpoint(str(tmp_path)))}
    assert "kahan" in names  # Saved from then on.


def test_batch_norm_statistics_in_bfloat16_are_warned_and_the_bundled_models_keep_them_float32(caplog):
    tfmp.configure_precision("bfloat16")
    x = np.random.default_rng(0).normal(5.0, 1.0, size=(256, 8)).astype(np.float32)
    data = tf.data.Dataset.from_tensor_slices((x, x[:, :1])).batch(32)
    norms = {}
    for name, dtype in (("stuck", None), ("kept", bf16.statistics_policy())):
        keras.utils.set_random_seed(0)
        norm = keras.layers.BatchNormalization(dtype=dtype, name=name)
        model = keras.Sequential([keras.Input((8,)), norm, keras.layers.Dense(1)])
        model.compile(keras.optimizers.Adam(1e-3), "mse")
        with caplog.at_level(logging.WARNING):
            tfmp.fit(model, data, epochs=40, verbose=0)
        norms[name] = norm
    warned = [r.getMessage() for r in caplog.records if "moving statistics in bfloat16" in r.getMessage()]
    assert len(warned) == 1 and "stuck" in warned[0] and "kept" not in warned[0]
    assert norms["kept"].moving_mean.dtype == "float32" and norms["kept"].compute_dtype == "bfloat16"
    # 320 updates at momentum 0.99 from 0 towards 5: 96% of the way in float32. In bfloat16
    # a move of 1% of the gap rounds away once below half a step of ~4 (1/64): stuck ~1.5 short.
    expected = 5 * (1 - 0.99**320)
    np.testing.assert_allclose(np.asarray(norms["kept"].moving_mean), expected, rtol=0.05)  # Sample means vary.
    assert float(np.asarray(norms["stuck"].moving_mean, np.float32).mean()) < expected - 0.5


def test_auto_and_autotune_never_pick_pure_bfloat16():
    """Pure bfloat16 is a user's choice for memory, not a speed pick."""
    from tfmp.app import autotune
    from tfmp.precision import Hardware

    machines = [
        Hardware(tpu=True),
        Hardware(gpu_capability=(9, 0), gpu_name="H100"),
        Hardware(gpu_capability=(7, 5), gpu_name="T4"),
        Hardware(cpu_flags=("amx_bf16",)),
        Hardware(),
    ]
    assert all(tfmp.precision.resolve_policy("auto", h).policy != "bfloat16" for h in machines)
    assert "bfloat16" not in autotune.CANDIDATES
    # None where auto times nothing (no bfloat16 instructions, a GPU, a TPU): the machines
    # listed, not this one, which may be any of them.
    trials = [tfmp.precision.auto_trial_candidates(h) for h in machines]
    assert trials[3] == ("float32", "mixed_bfloat16")
    assert all("bfloat16" not in (t or ()) for t in trials)
