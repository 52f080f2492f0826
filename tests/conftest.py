"""Test set-up: two logical CPU devices (for real 2-replica strategies) and a clean policy."""

import json
import os
import socket
import subprocess
import sys
import weakref

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# On a GPU, each pytest-xdist worker takes GPU memory as it needs it, not all of it.
os.environ.setdefault("TF_FORCE_GPU_ALLOW_GROWTH", "true")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
from keras.src.trainers import epoch_iterator as keras_epochs  # noqa: E402 - Keras fit's epoch iterator.

# Must happen before TensorFlow initializes its runtime, i.e. before any test runs an op.
_cpus = tf.config.list_physical_devices("CPU")
tf.config.set_logical_device_configuration(_cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2)

# Tests compare float32 results to 1e-5 or closer. On Ampere and newer GPUs TensorFlow runs
# float32 matmuls as TF32 (a 10-bit mantissa) by default, which differs by 1e-4: float32
# here means float32. (No effect on CPUs.)
tf.config.experimental.enable_tensor_float_32_execution(False)
# What the strategy selector and the precision rule find on this machine's devices.
GPUS = len(tf.config.list_physical_devices("GPU"))

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The real datasets (MNIST digits, SST-2 in TFDS format) beside the checkout, where present.
SHARED_DATASETS = os.path.join(os.path.dirname(REPO), "shared", "datasets")
NO_SHARED_DATASETS = pytest.mark.skipif(
    not os.path.isdir(SHARED_DATASETS), reason=f"no real datasets at {SHARED_DATASETS}"
)

from tfmp import calls, precision  # noqa: E402

pytest_plugins = ["failure_log"]  # TFMP_FAILURES=FILE: each failure's report there as it happens.

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
def _op_determinism_as_found():
    """A test that turns TensorFlow's op determinism on (`deterministic=True` runs) leaves it
    off for the next: it is process-wide, and under it XLA refuses some gradients (TF 2.18:
    MaxPool's), so a later test in the same pytest-xdist worker would train without XLA."""
    from tensorflow.python.framework import config as tf_config  # No public switch off.

    from tfmp import tf_compat

    was = tf_compat.op_determinism()
    yield
    if not was:
        tf_config.disable_op_determinism()


@pytest.fixture
def deterministic_gpu():
    """On a GPU, TensorFlow's deterministic kernels for the test: its default ones (atomic
    reductions, cuDNN's algorithm search) differ from run to run, so two runs compared bit
    for bit need them. Nothing on a CPU, whose kernels already are. (`_op_determinism_as_found`
    turns them off after.)"""
    if GPUS:
        tf.config.experimental.enable_op_determinism()


@pytest.fixture(autouse=True)
def _reset_policy():
    """Every test starts and ends under float32 with fresh Keras state. Without Keras' full
    garbage collection after each test: in a worker that has run hundreds of tests it walks
    every graph and function they left, 1.7 s a test, a third of the suite's time; Python's
    own collector still frees them as it goes."""
    keras.config.set_dtype_policy("float32")
    yield
    keras.config.set_dtype_policy("float32")
    keras.backend.clear_session(free_memory=False)


@pytest.fixture(scope="session")
def _keras_epoch_iterators():
    """Every epoch iterator Keras' fit, evaluate and predict make in this worker (a weak set)."""
    made = weakref.WeakSet()
    init = keras_epochs.EpochIterator.__init__

    def tracked(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.add(self)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(keras_epochs.EpochIterator, "__init__", tracked)
        yield made


@pytest.fixture(autouse=True)
def _keras_iterators_let_go(_keras_epoch_iterators):
    """After each test, the tf.data iterators of Keras' epoch iterators are deleted on a thread of their own
    (`tfmp.calls.let_go`, as tfmp.fit deletes its own). Keras leaves each epoch iterator in a reference cycle with
    its generator, which holds the iterator; Python's collector frees it later, on the thread that happens to
    allocate, and deleting a tuned iterator then waits out its tuning thread's sleep: measured 8.8-39.9 s of one
    worker's test stalled at a time (the gdb backtrace: RootDataset::Iterator's destructor waiting for the thread
    running Model::OptimizeLoop), about a minute of a fast suite's run on an AMD EPYC Zen 4."""
    yield
    held = []
    for epochs in list(_keras_epoch_iterators):
        held += [epochs._epoch_iterator, epochs._current_iterator]
        epochs._epoch_iterator = epochs._current_iterator = None  # A later epoch makes new ones.
    calls.let_go(held)


@pytest.fixture(scope="session")
def mirrored():
    """A real MirroredStrategy over the two logical CPU devices, with its default
    (collective) all-reduce; one per session, made once (tests/test_one_process.py makes
    new ones)."""
    return tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])


@pytest.fixture(scope="session")
def no_merge_call():
    """A MirroredStrategy whose replicas never merge (what XLA on GPUs and TPUs use), made
    on the two logical CPU devices the way TensorFlow's own tests make one."""
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    strategy.extended._use_merge_call = lambda: False
    return strategy


@pytest.fixture
def cudnn_mask_check(monkeypatch):
    """Keras' LSTM and GRU check their masks as on a GPU, where they run cuDNN's kernel:
    a batch holding a fully masked row, or a row not padded on the right, fails with
    cuDNN's error (Keras' own check, `_assert_valid_mask`); then they run the generic
    kernel, as on this CPU. Returns the list of the masks checked."""
    import importlib

    from keras.src import backend

    rnn = importlib.import_module("keras.src.backend.tensorflow.rnn")  # The module, not its function `rnn`.
    checked = []

    def as_on_a_gpu(kernel, mask_at):
        def fn(*args, **kwargs):
            mask = args[mask_at]
            if mask is not None:
                rnn._assert_valid_mask(mask)  # noqa: SLF001 - the check cuDNN's path makes.
                checked.append(mask)
            return kernel(*args, **kwargs)

        return fn

    # Their CPU versions raise NotImplementedError: the layer then runs the generic kernel. The
    # layers call `backend.lstm` up to Keras 3.15 and `backend.rnn.lstm` (a module) after it.
    kernels = backend if hasattr(backend, "lstm") else backend.rnn
    monkeypatch.setattr(kernels, "lstm", as_on_a_gpu(kernels.lstm, 3))
    monkeypatch.setattr(kernels, "gru", as_on_a_gpu(kernels.gru, 2))
    return checked


# Helpers the test files share (import them from conftest).


def seeded(build):
    """`build`, seeded and built in a strategy's scope (default: the current one)."""

    def wrapped(strategy=None):
        keras.utils.set_random_seed(0)
        with (strategy or tf.distribute.get_strategy()).scope():
            return build()

    return wrapped


@seeded
def regression():
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="relu", kernel_regularizer=keras.regularizers.L2(1e-3)),
            keras.layers.Dense(1),
        ]
    )
    model.compile(keras.optimizers.Adam(1e-2), "mse", metrics=["mae"])
    return model


class Reconstruction(keras.layers.Layer):
    """Adds the mean squared error of its second input against its first: the model's loss."""

    def call(self, inputs):
        x, reconstructed = inputs
        self.add_loss(keras.ops.mean(keras.ops.square(x - reconstructed)))
        return reconstructed


@seeded
def autoencoder():
    inputs = keras.Input((8,))
    code = keras.layers.Dense(3, activation="relu")(inputs)
    model = keras.Model(inputs, Reconstruction()([inputs, keras.layers.Dense(8)(code)]))
    model.compile(keras.optimizers.SGD(0.1))  # No compiled loss: its layer adds it.
    return model


def regression_arrays(n=256):
    rng = np.random.default_rng(1)
    x = rng.random((n, 8), dtype=np.float32)
    return x, (x @ np.arange(8, dtype=np.float32))[:, None]


def regression_data(batch=32, n=256, drop_remainder=False):
    return tf.data.Dataset.from_tensor_slices(regression_arrays(n)).batch(batch, drop_remainder=drop_remainder)


def weights(model):
    return [w.numpy() for w in model.weights]


def assert_same(a, b, atol=1e-5):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(x, y, rtol=0, atol=atol)


def entry_point_process(run, *args):
    """Runs the entry point `run` starts (a runpy call: `runpy.run_module('tfmp.doctor', run_name='__main__',
    alter_sys=True)`) with `args`, from the checkout, in a process of its own; the last line it prints says whether
    TensorFlow had been loaded when it ended: 'tensorflow loaded: False' for an answer given before."""
    code = f"import runpy, sys\ntry:\n    {run}\nfinally:\n    print('tensorflow loaded:', 'tensorflow' in sys.modules)"
    return subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, capture_output=True, text=True, timeout=60)


def train_process(*args, env=None):
    """train.py as a process of its own, its output piped (where TensorFlow's start-up output
    or a signal's delivery matter); returns the Popen."""
    return subprocess.Popen(
        [sys.executable, os.path.join(REPO, "train.py"), *args],
        cwd=REPO,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def free_ports(n):
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def start_workers(args_for, n=2, cwd=REPO):
    """Starts n worker processes of one cluster on 127.0.0.1; returns them."""
    workers = [f"127.0.0.1:{p}" for p in free_ports(n)]
    processes = []
    for index in range(n):
        tf_config = {"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}}
        env = {**os.environ, "TF_CONFIG": json.dumps(tf_config), "TF_CPP_MIN_LOG_LEVEL": "2"}
        processes.append(
            subprocess.Popen(
                [sys.executable, *args_for(index)],
                cwd=cwd,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    return processes


def wait_all(processes, timeout=300):
    results = []
    try:
        for p in processes:
            out, err = p.communicate(timeout=timeout)
            results.append((p.returncode, out, err))
    finally:
        for p in processes:
            p.kill()
    return results


class Poison(keras.layers.Layer):
    """Multiplies its input by `factor` during training calls number `first` to `last`."""

    def __init__(self, factor, first, last=10**9, **kwargs):
        super().__init__(**kwargs)
        self.factor, self.first, self.last = factor, first, last

    def build(self, input_shape):
        self.calls = self.add_weight(shape=(), initializer="zeros", dtype="int32", trainable=False, name="calls")

    def call(self, x, training=False):
        if training:
            self.calls.assign_add(1)
        bad = tf.logical_and(self.calls >= self.first, self.calls <= self.last)
        return x * tf.cast(tf.where(bad, self.factor, 1.0), x.dtype)
