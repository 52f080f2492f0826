"""jit_compile: XLA in tfmp's steps under strategies, "auto" and "autotune". What XLA cannot
compile, and the fallback: test_xla_fallback.py. What the compiled step holds (sparse
gradients, ops outside XLA): test_compiled_step.py."""

import keras
import numpy as np
import pytest
import tensorflow as tf
import tiny
from conftest import GPUS

import tfmp
from tfmp import calls, cpuinfo, loop, tf_compat, xla
from tfmp.errors import UsageError


def regression_data(batch=32):
    rng = np.random.default_rng(1)
    x = rng.random((256, 8), dtype=np.float32)
    return tf.data.Dataset.from_tensor_slices((x, x.sum(1, keepdims=True))).batch(batch, drop_remainder=True)


@pytest.mark.parametrize("replicas", [1, 2])
def test_xla_trains_like_no_xla_with_loss_scaling_accumulation_and_clipping(mirrored, replicas):
    keras.config.set_dtype_policy("mixed_float16")
    strategy = mirrored if replicas == 2 else tf.distribute.get_strategy()
    # A seeded start, not whatever the tests before left in the generator: from some starts a
    # unit whose gradient is at float16's rounding level gets Adam updates of opposite sign
    # from the two fusions (0.006 apart after 4 updates), however correct both loops are.
    keras.utils.set_random_seed(0)
    init = [w.numpy() for w in tiny.build(strategy)[0].weights]
    results = {}
    for jit in (False, True):
        keras.utils.set_random_seed(0)
        model, optimizer = tiny.build(strategy)
        model.set_weights(init)
        history = tfmp.fit(
            model,
            tiny.dataset(32).make_train,
            steps_per_epoch=8,
            strategy=strategy,
            grad_accum_steps=2,
            clipnorm=0.5,
            jit_compile=jit,
            verbose=0,
        )
        assert history.params["jit_compile"] is jit
        assert isinstance(optimizer, tfmp.LossScaleOptimizer)
        results[jit] = [w.numpy().astype(np.float32) for w in model.weights], int(optimizer.iterations.numpy())
    (no_xla, steps_a), (with_xla, steps_b) = results[False], results[True]
    assert steps_a == steps_b == 4
    for a, b in zip(no_xla, with_xla, strict=True):
        np.testing.assert_allclose(a, b, atol=2e-3)  # float16 compute, fused differently by XLA.


def _train_tiny(policy, jit_compile, lean, steps_count=10):
    """tiny's weights after `steps_count` updates under `policy`, each called on
    TensorFlow's single-threaded executor (`lean`) or on the default one; and whether it
    still is."""

    def choose(compiled):
        compiled._lean = lean  # noqa: SLF001

    model, compiled = tiny.steps_after(tf.distribute.get_strategy(), jit_compile, steps_count, policy, choose)
    return [w.numpy() for w in model.weights], compiled._lean  # noqa: SLF001


# Steps never takes that executor where a GPU is visible: there the step's graph spans the
# host (the input pipeline) and the GPU, and a refusal may come after the input was read.
CPU_ONLY = pytest.mark.skipif(bool(GPUS), reason="tfmp takes the single-threaded executor on CPU-only machines alone")


@CPU_ONLY
@pytest.mark.parametrize("policy", ["float32", "mixed_float16"])
def test_the_xla_step_on_one_cpu_runs_on_the_single_threaded_executor_to_the_same_bits(policy):
    _, chosen = tiny.steps_after(tf.distribute.get_strategy(), False, 0, policy)
    chosen.compile(True)
    assert chosen._lean is not bool(tf.config.list_logical_devices("GPU"))  # noqa: SLF001
    chosen.compile(False)
    assert not chosen._lean  # noqa: SLF001
    default, _ = _train_tiny(policy, True, lean=False)
    lean, kept = _train_tiny(policy, True, lean=True)
    assert kept
    for a, b in zip(default, lean, strict=True):
        np.testing.assert_array_equal(a, b)


@CPU_ONLY
def test_the_first_step_runs_on_the_executor_of_the_steps_after_it(monkeypatch):
    # Each executor instantiates the step anew: a first step on the default executor, then the others on the
    # single-threaded one, instantiated it twice (40-550 ms once a fit on the report's smoke models).
    executors, single_threaded = [], calls.single_threaded

    def recorded(call):
        out = single_threaded(call)
        executors.append("single-threaded" if out[1] else "default")
        return out

    monkeypatch.setattr(calls, "single_threaded", recorded)
    _, compiled = tiny.steps_after(tf.distribute.get_strategy(), True, 3)
    assert compiled._lean  # noqa: SLF001
    assert executors == ["single-threaded"] * 3


@CPU_ONLY
def test_a_step_the_single_threaded_executor_refuses_runs_on_the_default_one():
    # Without XLA, loss scaling's cond becomes a Switch, which that executor does not take.
    default, _ = _train_tiny("mixed_float16", False, lean=False)
    fallen_back, kept = _train_tiny("mixed_float16", False, lean=True)
    assert not kept
    for a, b in zip(default, fallen_back, strict=True):
        np.testing.assert_array_equal(a, b)


def test_auto_is_a_rule_that_never_times(monkeypatch):
    """The default takes the same path on every run: by the hardware, never by a timing."""

    def never(*_):
        raise AssertionError("auto timed the step")

    monkeypatch.setattr(xla, "measure", never)
    monkeypatch.setattr(xla, "_VERDICTS", {})
    history = tfmp.fit(tiny_regression(), regression_data(), epochs=1, verbose=0)
    gpu = bool(tf.config.list_physical_devices("GPU"))
    assert history.params["jit_compile"] is gpu
    assert history.params["jit_compile_reason"].startswith(f"auto: {'GPUs: on' if gpu else 'CPUs: off'} (a rule")


def test_autotune_follows_the_measurement(monkeypatch, capsys):
    verdicts = iter(
        [
            {xla.OFF: [100.0] * 5, xla.ON: [140.0, 139.0, 141.0, 140.0, 140.0]},
            {xla.OFF: [100.0] * 5, xla.ON: [97.0, 99.0, 96.0, 98.0, 97.0]},
        ]
    )
    monkeypatch.setattr(xla, "measure", lambda *_: next(verdicts))
    monkeypatch.setattr(xla, "_VERDICTS", {})
    data = regression_data()
    faster = tfmp.fit(tiny_regression(), data, epochs=1, verbose=2, jit_compile="autotune")
    printed = capsys.readouterr().out  # The timing's cost is said before it runs, then the choice.
    assert printed.index("XLA: timing the step with and without XLA for up to") < printed.index("XLA: on (autotune:")
    monkeypatch.setattr(xla, "_VERDICTS", {})
    slower = tfmp.fit(tiny_regression(), data, epochs=1, verbose=0, jit_compile="autotune")
    assert faster.params["jit_compile"] is True and slower.params["jit_compile"] is False


def test_a_resumed_run_keeps_the_choice_autotune_made_at_its_start(monkeypatch, tmp_path, caplog):
    timings = iter(
        [
            {xla.OFF: [100.0] * 5, xla.ON: [140.0, 139.0, 141.0, 140.0, 140.0]},  # The first run: XLA wins.
            {xla.OFF: [100.0] * 5, xla.ON: [60.0] * 5},  # Would lose now; the resumed run keeps it.
        ]
    )
    monkeypatch.setattr(xla, "measure", lambda *_: next(timings))
    monkeypatch.setattr(xla, "_VERDICTS", {})
    run = {"checkpoint_dir": str(tmp_path), "verbose": 0, "jit_compile": "autotune"}
    first = tfmp.fit(tiny_regression(), regression_data(), epochs=1, **run)
    monkeypatch.setattr(xla, "_VERDICTS", {})
    resumed = tfmp.fit(tiny_regression(), regression_data(), epochs=2, **run)
    assert first.params["jit_compile"] is True and resumed.params["jit_compile"] is True
    assert next(timings)[xla.ON] == [60.0] * 5  # Not measured again.
    assert resumed.params["jit_compile_reason"].startswith(f"as recorded in {tmp_path / 'decisions.json'}: autotune")
    assert resumed.params["dtype_policy"] == "float32"
    # Asked for explicitly, another choice trains; one line says that it differs.
    with caplog.at_level("WARNING"):
        other = tfmp.fit(
            tiny_regression(), regression_data(), epochs=3, checkpoint_dir=str(tmp_path), jit_compile=False
        )
    assert other.params["jit_compile"] is False
    (line,) = [r.getMessage() for r in caplog.records if "recorded" in r.getMessage()]
    assert line.startswith("XLA: no XLA, where") and "recorded XLA" in line and "will not match" in line


def test_auto_turns_xla_on_for_float16_compute_on_any_device(monkeypatch):
    """On CPUs too: the loop-cost tables measured XLA 2.3-5.8x faster under mixed_float16 on an Intel Xeon."""
    monkeypatch.setattr(xla, "measure", lambda *_: pytest.fail("auto timed the step"))
    keras.config.set_dtype_policy("mixed_float16")
    history = tfmp.fit(tiny_regression(), regression_data(), epochs=1, verbose=0)
    gpu = bool(tf.config.list_physical_devices("GPU"))
    assert history.params["jit_compile"] is True
    assert history.params["jit_compile_reason"].startswith("auto: GPUs: on" if gpu else "auto: CPUs: on for float16")


@pytest.mark.skipif(bool(GPUS), reason="the CPU rule")
@pytest.mark.parametrize("flags", [(), ("avx512_bf16",)])
def test_auto_turns_xla_on_for_bfloat16_compute_only_where_the_cpu_emulates_it(monkeypatch, flags):
    """Without bfloat16 instructions (an AMD EPYC Zen 3) TensorFlow emulates bfloat16 op by op, and XLA ran the
    bundled models' mixed_bfloat16 steps 2.8-8.4x faster there; with them, XLA stays off as in float32."""
    monkeypatch.setattr(xla, "measure", lambda *_: pytest.fail("auto timed the step"))
    monkeypatch.setattr(cpuinfo, "bf16_flags", lambda: flags)
    keras.config.set_dtype_policy("mixed_bfloat16")
    history = tfmp.fit(tiny_regression(), regression_data(), epochs=1, verbose=0)
    assert history.params["jit_compile"] is (not flags)
    expected = "auto: CPUs: off" if flags else "auto: CPUs: on for emulated bfloat16 compute"
    assert history.params["jit_compile_reason"].startswith(expected)
    keras.config.set_dtype_policy("float32")  # A float32 model on the emulating CPU: off.
    history = tfmp.fit(tiny_regression(), regression_data(), epochs=1, verbose=0)
    assert history.params["jit_compile_reason"].startswith("auto: CPUs: off")


def test_auto_and_autotune_turn_xla_off_where_the_shapes_vary_beyond_the_batch(monkeypatch):
    """Sequences padded per batch (padded_batch): XLA compiles the step anew for each length (mixed_float16 on this
    CPU, 20 batches of 3-39 tokens: 4.8 s against 0.4 without it), and a timing of one shape would not see that:
    "auto" and "autotune" say off and why, without timing; jit_compile=True still compiles."""
    monkeypatch.setattr(xla, "measure", lambda *_: pytest.fail("timed a step whose shapes vary"))
    keras.config.set_dtype_policy("mixed_float16")  # Where "auto" says on, on any device.
    rng = np.random.default_rng(0)
    lengths = rng.integers(3, 12, 64)
    tokens = [rng.integers(1, 50, n).astype(np.int32) for n in lengths]
    data = tf.data.Dataset.from_generator(
        lambda: ((t, np.float32(len(t) % 2)) for t in tokens),
        output_signature=(tf.TensorSpec((None,), tf.int32), tf.TensorSpec((), tf.float32)),
    ).padded_batch(16)

    def model():
        keras.utils.set_random_seed(0)
        embed = keras.layers.Embedding(50, 8, mask_zero=True)
        layers = [
            keras.Input((None,), dtype="int32"),
            embed,
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(1),
        ]
        built = keras.Sequential(layers)
        built.compile(keras.optimizers.SGD(0.01), "mse")
        return built

    for choice in ("auto", "autotune"):
        history = tfmp.fit(model(), data, epochs=1, verbose=0, jit_compile=choice)
        assert history.params["jit_compile"] is False
        reason = history.params["jit_compile_reason"]
        assert reason.startswith(f"{choice}: off: the data's shapes vary beyond the batch ((None, None))"), reason
    assert tfmp.fit(model(), data, epochs=1, verbose=0, jit_compile=True).params["jit_compile"] is True


def test_auto_follows_a_choice_the_models_compile_made(monkeypatch):
    """As model.fit: a model compiled with jit_compile=True where Keras' own "auto" says off
    (a CPU) trains with XLA, one compiled with False where it says on (a GPU) without;
    compiled as "auto" would have, tfmp's rule decides (XLA under a strategy, say)."""
    monkeypatch.setattr(xla, "measure", lambda *_: pytest.fail("auto timed the step"))
    for keras_auto in (False, True):  # Keras' "auto" on this machine: off as on a CPU, on as on a GPU.
        monkeypatch.setattr(keras.Model, "_resolve_auto_jit_compile", lambda self, on=keras_auto: on)
        for chosen in (True, False):
            model = tiny_regression()
            model.compile(keras.optimizers.SGD(0.01), "mse", jit_compile=chosen)
            history = tfmp.fit(model, regression_data(), epochs=1, verbose=0)
            reason = history.params["jit_compile_reason"]
            if chosen == keras_auto:
                assert reason.startswith("auto: "), reason
            else:
                assert history.params["jit_compile"] is chosen
                said = f"{'on' if chosen else 'off'}: the model was compiled with jit_compile={chosen}"
                assert reason.startswith(said), reason


def test_autotune_under_op_determinism_is_a_rule_not_a_timing(monkeypatch):
    """Reruns must match bit for bit: a timing could turn XLA on in one run and off in the next."""

    def never(*_):
        raise AssertionError("measured under op determinism")

    monkeypatch.setattr(xla, "measure", never)
    monkeypatch.setattr(xla, "_VERDICTS", {})
    monkeypatch.setattr(tf_compat, "op_determinism", lambda: True)
    history = tfmp.fit(tiny_regression(), regression_data(), epochs=1, verbose=0, jit_compile="autotune")
    assert history.params["jit_compile"] is bool(tf.config.list_physical_devices("GPU"))


def tiny_regression():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.01), "mse")
    return model


def test_measuring_leaves_the_model_as_it_was():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(8),
            keras.layers.BatchNormalization(),
            keras.layers.Dropout(0.5),
            keras.layers.Dense(1),
        ]
    )
    model.compile(keras.optimizers.SGD(0.01), "mse", metrics=["mae"])
    compiled = loop.prepare(model, tf.distribute.get_strategy(), regression_data().element_spec)
    before = [v.numpy().copy() for v in model.variables]
    batches = (xla.replica_batch(regression_data().element_spec, 1),)
    rates = xla.measure(compiled, batches, budget_seconds=1.0)
    assert len(rates[xla.ON]) == len(rates[xla.OFF]) >= 3 and min(rates[xla.ON] + rates[xla.OFF]) > 0
    for a, b in zip(before, model.variables, strict=True):
        np.testing.assert_array_equal(a, b.numpy())


def test_bad_jit_compile_is_a_usage_error():
    with pytest.raises(UsageError, match="jit_compile"):
        tfmp.fit(tiny_regression(), regression_data(), jit_compile="yes", verbose=0)
