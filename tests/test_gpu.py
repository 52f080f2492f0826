"""What only a GPU shows: cuDNN's LSTM, XLA compiling tfmp's real step, the no-merge-call
branch, Tensor Cores under the mixed policies, float8 GEMMs, peak GPU memory per policy. Every test is
marked `gpu` and skips, saying so, where TensorFlow sees no GPU (`-m gpu` runs them alone)."""

import keras
import numpy as np
import pytest
import tensorflow as tf
import tiny

import tfmp
from tfmp import data, distribute, inputs
from tfmp.app import models, training
from tfmp.bench import float8_hlo

pytestmark = pytest.mark.gpu


def _trained_bundled_lstm():
    """The bundled lstm after 270 steps over the shipped SST-2 sentences (past every one, two
    of which hold no word), under the global policy; asserts it learned."""
    ds = data.load("sentiment", 256, vocab_size=2000, sequence_length=32, drop_remainder=True)
    keras.utils.set_random_seed(0)
    model = models.compile(models.build("lstm", ds), keras.optimizers.Adam(3e-3))
    history = tfmp.fit(model, ds.train, epochs=1, steps_per_epoch=270, verbose=0)
    assert history.history["accuracy"][-1] > 0.6 and np.isfinite(history.history["loss"]).all()
    return model


def test_lstm_trains_with_cudnn():
    """float32: cuDNN's kernel runs (Keras turns the layer's XLA support off when it does)
    and nothing refuses."""
    assert _trained_bundled_lstm().get_layer("lstm").supports_jit is False  # Set by Keras on cuDNN's path only.


def test_bundled_lstm_trains_in_mixed_bfloat16():
    """mixed_bfloat16: the bundled lstm takes Keras' generic kernel (cuDNN's, in bfloat16,
    stayed at chance on SST-2 on an H100: `tfmp.cudnn`) and learns."""
    keras.config.set_dtype_policy("mixed_bfloat16")
    assert _trained_bundled_lstm().get_layer("lstm").use_cudnn is False


def test_cudnn_bfloat16_lstm_is_why_the_bundled_one_takes_the_generic_kernel():
    """The reason for `tfmp.cudnn.use_cudnn`: cuDNN's LSTM in bfloat16 against Keras' generic
    kernel in bfloat16, same weights, same right-padded masked batch. Where they agree (a
    fixed TensorFlow or cuDNN) this fails, saying so: the rule can then go."""
    keras.config.set_dtype_policy("mixed_bfloat16")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 24, 16)).astype("float32")
    mask = np.arange(24)[np.newaxis, :] < rng.integers(1, 25, size=64)[:, np.newaxis]
    outputs, kernel_grads, weights = {}, {}, None
    for kernel in (True, False):
        layer = keras.layers.LSTM(32, use_cudnn=kernel)
        layer.build((None, 24, 16))
        if weights is None:
            weights = layer.get_weights()
        layer.set_weights(weights)
        with tf.GradientTape() as tape:
            y = tf.cast(layer(x, mask=mask), tf.float32)
            loss = tf.reduce_sum(y * y)
        outputs[kernel] = y.numpy()
        kernel_grads[kernel] = tape.gradient(loss, layer.cell.kernel).numpy()
    gap = np.abs(outputs[True] - outputs[False]).max()
    grad_gap = np.abs(kernel_grads[True] - kernel_grads[False]).max() / np.abs(kernel_grads[False]).max()
    assert gap > 0.05 or grad_gap > 0.1, (
        f"cuDNN's bfloat16 LSTM now agrees with the generic kernel (outputs within {gap:.3f}, the kernel's "
        f"gradient within {grad_gap:.3f} of its largest): tfmp.cudnn.use_cudnn's rule can go"
    )


def test_xla_compiles_tfmps_real_training_step():
    """jit_compile=True on the GPU: the step compiles (no fallback) and trains like no XLA."""
    keras.config.set_dtype_policy("mixed_float16")
    strategy = tf.distribute.get_strategy()
    keras.utils.set_random_seed(0)  # A start of its own, not the generator earlier tests left.
    init = [w.numpy() for w in tiny.build(strategy)[0].weights]
    weights = {}
    for jit in (False, True):
        keras.utils.set_random_seed(0)
        model, _ = tiny.build(strategy)
        model.set_weights(init)
        history = tfmp.fit(model, tiny.dataset(32).make_train, steps_per_epoch=8, jit_compile=jit, verbose=0)
        assert history.params["jit_compile"] is jit
        weights[jit] = [w.numpy() for w in model.weights]
    for a, b in zip(weights[False], weights[True], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-2, atol=1e-3)  # float16 compute, fused differently.


def test_no_merge_call_branch_trains_like_one_replica():
    """XLA under a MirroredStrategy over GPUs takes TensorFlow's no-merge-call branch."""
    gpus = [d.name for d in tf.config.list_logical_devices("GPU")]
    keras.utils.set_random_seed(0)  # A start of its own, not the generator earlier tests left.
    init = [w.numpy() for w in tiny.build(tf.distribute.get_strategy())[0].weights]
    out = []
    for strategy in (tf.distribute.get_strategy(), tf.distribute.MirroredStrategy(gpus[:1])):
        keras.utils.set_random_seed(0)
        model, _ = tiny.build(strategy)
        model.set_weights(init)
        history = tfmp.fit(
            model, tiny.dataset(32).make_train, steps_per_epoch=6, strategy=strategy, jit_compile=True, verbose=0
        )
        assert history.params["jit_compile"] is True
        out.append([w.numpy() for w in model.weights])
    for a, b in zip(*out, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("policy, dtype", [("mixed_float16", "f16"), ("mixed_bfloat16", "bf16")])
def test_mixed_policies_run_matmuls_on_tensor_cores(policy, dtype):
    """A Dense layer's matmul in the compiled HLO is a cuBLAS GEMM on 16-bit operands."""
    keras.config.set_dtype_policy(policy)
    layer = keras.layers.Dense(1024)
    layer.build((None, 1024))
    hlo = tf.function(layer, jit_compile=True).experimental_get_compiler_ir(tf.ones((256, 1024)))(stage="optimized_hlo")
    gemms = [line for line in hlo.splitlines() if "__cublas$" in line]
    assert gemms and all(f"{dtype}[" in line for line in gemms), "\n".join(gemms) or hlo[-3000:]


def test_float8_dense_step_runs_a_float8_gemm():
    """A float8 Dense's training step compiles to at least one cuBLASLt float8 GEMM (Ada,
    Hopper and newer: compute capability 8.9). Its GEMMs by kind are printed either way."""
    gpu = tf.config.list_physical_devices("GPU")[0]
    capability = tf.config.experimental.get_device_details(gpu).get("compute_capability", (0, 0))
    if tuple(capability) < (8, 9):
        pytest.skip(f"float8 GEMMs need compute capability 8.9 or newer; this GPU has {capability}")
    found = float8_hlo.probe()
    print({case["case"]: case["gemms"] for case in found})
    dense = found[0]
    assert dense["gemms"]["float8"] >= 1, "\n".join(dense["lines"])


def test_peak_gpu_memory_is_reported_per_policy(tmp_path, capsys):
    peaks = {}
    for policy in ("float32", "mixed_float16", "mixed_bfloat16"):
        tf.config.experimental.reset_memory_stats("GPU:0")
        config = training.Config(
            model="cnn",
            dataset="synthetic",
            precision=policy,
            batch_size=256,
            epochs=1,
            steps_per_epoch=5,
            checkpoint_every=0,
            model_dir=str(tmp_path / policy),
            verbose=0,
        )
        peaks[policy] = training.train_and_evaluate(config)["peak_memory_mb"]
    with capsys.disabled():
        print("\npeak GPU memory (MiB):", {k: round(v, 1) for k, v in peaks.items()})
    assert all(v > 0 for v in peaks.values())
    assert peaks["mixed_bfloat16"] < peaks["float32"]  # 16-bit activations.


def test_a_one_device_strategy_reads_its_stream_from_the_gpu(monkeypatch):
    """Under a OneDeviceStrategy on the GPU (`get_strategy("auto")` on one GPU, train.py's) the training stream
    is prefetched to the GPU, as the strategy's own dataset is for Keras fit, and trains the same weights as
    from host memory."""
    strategy = tf.distribute.OneDeviceStrategy("/gpu:0")
    x = np.random.default_rng(0).normal(size=(64, 8)).astype("float32")
    ds = tf.data.Dataset.from_tensor_slices((x, x[:, :1])).batch(8, drop_remainder=True)
    assert next(inputs.Input(ds, strategy, None, 1, "data").stream(0))[0].device.endswith("GPU:0")

    def fit():
        keras.utils.set_random_seed(0)
        with strategy.scope():
            layers = [keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)]
            model = keras.Sequential(layers)
            model.compile(keras.optimizers.Adam(0.01), "mse")
        tfmp.fit(model, ds, epochs=2, verbose=0, jit_compile=False)
        return [w.numpy() for w in model.weights]

    prefetched = fit()
    monkeypatch.setattr(distribute, "input_device", lambda strategy: None)
    for ours, host in zip(prefetched, fit(), strict=True):
        np.testing.assert_allclose(ours, host, rtol=1e-5, atol=1e-6)
