import logging

import keras
import pytest

import tfmp
from tfmp import loss_scale, precision
from tfmp.errors import UsageError
from tfmp.precision import Hardware


@pytest.mark.parametrize(
    "hardware, expected",
    [
        (Hardware(tpu=True), "mixed_bfloat16"),
        (Hardware(gpu_capability=(8, 0), gpu_name="A100"), "mixed_bfloat16"),  # Same Tensor Core rate, no loss scale.
        (Hardware(gpu_capability=(7, 5), gpu_name="T4"), "mixed_float16"),
        (Hardware(gpu_capability=(7, 0), gpu_name="V100"), "mixed_float16"),
        (Hardware(gpu_capability=(6, 1), gpu_name="P4"), "float32"),
        (Hardware(cpu_flags=("amx_bf16",)), "mixed_bfloat16"),
        (Hardware(cpu_flags=("avx512_bf16",)), "mixed_bfloat16"),
        (Hardware(), "float32"),
        (Hardware(tpu=True, cpu_flags=("amx_bf16",)), "mixed_bfloat16"),
        (Hardware(gpu_capability=(9, 0), gpu_name="H100", cpu_flags=("amx_bf16",)), "mixed_bfloat16"),
    ],
)
def test_auto_choice(hardware, expected):
    decision = precision.resolve_policy("auto", hardware)
    assert decision.policy == expected
    assert decision.reason.startswith("auto: ")


def test_configure_sets_global_policy_and_returns_name():
    assert precision.configure_precision("mixed_float16", Hardware(gpu_capability=(8, 0))) == "mixed_float16"
    assert keras.config.dtype_policy().name == "mixed_float16"
    assert loss_scale.needs_loss_scaling()
    assert precision.configure_precision("mixed_bfloat16", Hardware()) == "mixed_bfloat16"
    assert precision.compute_dtype() == "bfloat16"
    assert not loss_scale.needs_loss_scaling()
    # A Keras policy object, as keras.config.set_dtype_policy takes one (it was an unknown precision).
    assert precision.configure_precision(keras.DTypePolicy("mixed_float16"), Hardware(gpu_capability=(8, 0))) == (
        "mixed_float16"
    )


def test_auto_prints_its_choice_and_reason_on_one_line_and_an_asked_for_policy_nothing(capsys):
    t4 = Hardware(gpu_capability=(7, 5), gpu_name="T4")
    assert precision.configure_precision("auto", t4) == "mixed_float16"
    decision = precision.resolve_policy("auto", t4)
    assert capsys.readouterr().out == f"tfmp: precision mixed_float16 ({decision.reason})\n"
    assert "T4" in decision.reason
    precision.configure_precision("auto", Hardware(), verbose=False)
    precision.configure_precision("mixed_bfloat16", Hardware())
    assert capsys.readouterr().out == ""


def test_compute_dtype_of_a_policy_name():
    names = ("float32", "mixed_float16", "mixed_bfloat16", "float8")
    assert [precision.compute_dtype(n) for n in names] == ["float32", "float16", "bfloat16", "bfloat16"]
    with pytest.raises(UsageError, match="unknown policy 'float4'"):
        precision.compute_dtype("float4")


@pytest.mark.parametrize("hardware", [Hardware(), Hardware(gpu_capability=(6, 0)), Hardware(tpu=True)])
def test_float16_where_slow_warns(hardware):
    decision = precision.resolve_policy("mixed_float16", hardware)
    assert decision.policy == "mixed_float16"
    assert "slower" in decision.warning or "bfloat16" in decision.warning


def test_float16_on_modern_gpu_does_not_warn():
    assert precision.resolve_policy("mixed_float16", Hardware(gpu_capability=(8, 6))).warning is None


def test_unknown_policy_names_choices():
    with pytest.raises(UsageError, match="'float4'.*auto, mixed_float16, mixed_bfloat16, float32, float8"):
        precision.configure_precision("float4")


@pytest.mark.parametrize("names", [3, [3], {"dense": True}])
def test_keep_float32_names_what_it_takes(names):
    """A number, or a list holding one, was a TypeError from inside `re`; a dict was read as its keys."""
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, name="dense")])
    with pytest.raises(UsageError, match=r"keep_float32 takes layer names or regular expressions \(a str or a list"):
        tfmp.keep_float32(model, names)


def test_detect_this_machine():
    """Whatever this machine is: the flags are /proc/cpuinfo's, the GPUs TensorFlow's, and
    auto follows the rule for them."""
    import tensorflow as tf

    hardware = precision.detect_hardware()
    with open("/proc/cpuinfo") as f:
        words = set(f.read().split())
    assert set(hardware.cpu_flags) == {"amx_bf16", "avx512_bf16"} & words
    assert (hardware.gpu_capability is not None) == bool(tf.config.list_physical_devices("GPU"))
    if hardware.gpu_capability is None and not hardware.tpu:
        expected = "mixed_bfloat16" if hardware.cpu_flags else "float32"
        assert precision.configure_precision("auto") == expected
        assert precision.bfloat16_is_emulated() == (not hardware.cpu_flags)


@pytest.mark.parametrize(
    "hardware, emulated",
    [
        (Hardware(), True),  # AMD EPYC Zen 3: AVX2 only.
        (Hardware(cpu_flags=("avx512_bf16",)), False),
        (Hardware(cpu_flags=("amx_bf16", "avx512_bf16")), False),
        (Hardware(gpu_capability=(8, 0)), False),
        (Hardware(tpu=True), False),
    ],
)
def test_bfloat16_asked_for_where_emulated_warns_with_the_missing_flags(hardware, emulated):
    decision = precision.resolve_policy("mixed_bfloat16", hardware)
    assert decision.policy == "mixed_bfloat16" and precision.bfloat16_is_emulated(hardware) == emulated
    if emulated:
        assert "amx_bf16" in decision.warning and "avx512_bf16" in decision.warning and "emulated" in decision.warning
    else:
        assert decision.warning is None


@pytest.mark.gpu
def test_auto_on_this_gpu_follows_its_compute_capability():
    hardware = precision.detect_hardware()
    capability = hardware.gpu_capability
    expected = "mixed_bfloat16" if capability >= (8, 0) else "mixed_float16" if capability >= (7, 0) else "float32"
    assert precision.configure_precision("auto") == expected
    assert "{}.{}".format(*capability) in precision.resolve_policy("auto").reason


def _nets(n=3):
    return keras.Sequential([keras.Input((4,))] + [keras.layers.Dense(4, name=f"net_{i}") for i in range(n)])


def _keep_float32_warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("keep_float32:")]


def test_keep_float32_block_whose_names_match_no_layer_warns_once_with_the_real_names(caplog):
    keras.config.set_dtype_policy("mixed_float16")
    with caplog.at_level(logging.WARNING), tfmp.keep_float32(["layer_norm.*", "logits"]):
        model = _nets()
    (message,) = _keep_float32_warnings(caplog)
    assert "'layer_norm.*', 'logits' matched no layer built in the block" in message
    assert "net_0" in message and "follow mixed_float16" in message
    assert [layer.compute_dtype for layer in model.layers] == ["float16"] * 3


def test_keep_float32_block_matches_names_inside_a_sequential_and_nests(caplog):
    keras.config.set_dtype_policy("mixed_float16")
    with caplog.at_level(logging.WARNING):
        with tfmp.keep_float32(["net_0"]), tfmp.keep_float32(["net_2"]):
            model = _nets()  # Paths "sequential_N/net_i": the name matches.
        with tfmp.keep_float32(["net_1", "logits"]):
            partly = _nets()
        with tfmp.keep_float32(["nothing_yet"]):
            keras.layers.Dense(3)  # Not built in the block: its path is not known yet.
    assert [layer.compute_dtype for layer in model.layers] == ["float32", "float16", "float32"]
    assert [layer.compute_dtype for layer in partly.layers] == ["float16", "float32", "float16"]
    (message,) = _keep_float32_warnings(caplog)
    assert message.startswith("keep_float32: 'logits' matched no layer")
    assert keras.config.dtype_policy().name == "mixed_float16"


def test_keep_float32_block_covers_the_layers_inside_a_named_one():
    """An LSTM's weights are its cell's (path lstm/lstm_cell): naming the LSTM keeps them float32."""
    keras.config.set_dtype_policy("mixed_float16")
    with tfmp.keep_float32(["recurrent"]):
        model = keras.Sequential([keras.Input((4, 3)), keras.layers.LSTM(5, name="recurrent"), keras.layers.Dense(2)])
    lstm = model.get_layer("recurrent")
    assert lstm.cell.compute_dtype == "float32" and lstm.compute_dtype == "float32"
    assert model.layers[-1].compute_dtype == "float16"
