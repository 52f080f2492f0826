import keras
import pytest

from tfmp import precision
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
    assert precision.needs_loss_scaling()
    assert precision.configure_precision("mixed_bfloat16", Hardware()) == "mixed_bfloat16"
    assert precision.compute_dtype() == "bfloat16"
    assert not precision.needs_loss_scaling()


@pytest.mark.parametrize("hardware", [Hardware(), Hardware(gpu_capability=(6, 0)), Hardware(tpu=True)])
def test_float16_where_slow_warns(hardware):
    decision = precision.resolve_policy("mixed_float16", hardware)
    assert decision.policy == "mixed_float16"
    assert "slower" in decision.warning or "bfloat16" in decision.warning


def test_float16_on_modern_gpu_does_not_warn():
    assert precision.resolve_policy("mixed_float16", Hardware(gpu_capability=(8, 6))).warning is None


def test_unknown_policy_names_choices():
    with pytest.raises(UsageError, match="'float8'.*auto, mixed_float16, mixed_bfloat16, float32"):
        precision.configure_precision("float8")


def test_detect_this_machine():
    hardware = precision.detect_hardware()
    with open("/proc/cpuinfo") as f:
        words = set(f.read().split())
    assert set(hardware.cpu_flags) == {"amx_bf16", "avx512_bf16"} & words
    assert hardware.gpu_capability is None and not hardware.tpu  # The test machines are CPU-only.
    expected = "mixed_bfloat16" if hardware.cpu_flags else "float32"
    assert precision.configure_precision("auto") == expected
