"""Test set-up: two logical CPU devices (for real 2-replica strategies) and a clean policy."""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

# Must happen before TensorFlow initializes its runtime, i.e. before any test runs an op.
_cpus = tf.config.list_physical_devices("CPU")
tf.config.set_logical_device_configuration(_cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The real datasets (MNIST digits, SST-2 in TFDS format) beside the checkout, where present.
SHARED_DATASETS = os.path.join(os.path.dirname(REPO), "shared", "datasets")
NO_SHARED_DATASETS = pytest.mark.skipif(
    not os.path.isdir(SHARED_DATASETS), reason=f"no real datasets at {SHARED_DATASETS}"
)

from tfmp import precision  # noqa: E402

# On a CPU without bfloat16 instructions (AMD EPYC Zen 3: AVX2 only) mixed_bfloat16 runs
# emulated, 7x or more float32's step time: tests that train under it there keep to a few
# small steps, and those that would train long skip with this reason.
BFLOAT16_EMULATED = precision.bfloat16_is_emulated()
EMULATED = "bfloat16 is emulated on this CPU (no amx_bf16 or avx512_bf16 flag in /proc/cpuinfo)"


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` skip, saying so, where TensorFlow sees no GPU."""
    if tf.config.list_physical_devices("GPU"):
        return
    skip = pytest.mark.skip(reason="needs a GPU: TensorFlow sees none on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _short_trials(monkeypatch):
    """In-process runs time their precision and XLA choices for a few seconds, not half a
    minute: the tests check how the choice is made, not this machine's speed."""
    from tfmp import xla
    from tfmp.app import autotune

    monkeypatch.setattr(autotune, "TRIAL_SECONDS", 3.0)
    monkeypatch.setattr(xla, "AUTO_BUDGET_SECONDS", 2.0)


@pytest.fixture(autouse=True)
def _reset_policy():
    """Every test starts and ends under float32 with fresh Keras state."""
    keras.config.set_dtype_policy("float32")
    yield
    keras.config.set_dtype_policy("float32")
    keras.backend.clear_session()


@pytest.fixture(scope="session")
def mirrored():
    """A real MirroredStrategy over the two logical CPU devices, with its default
    (collective) all-reduce.

    One per session: each new MirroredStrategy numbers its collective instances from the
    same start, and two strategies over the same devices in one process collide.
    """
    return tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
