"""jit_compile: what XLA cannot compile (a host call, string inputs, a variable on another
device, a kernel op determinism lacks), the fallback to no XLA and the reason it gives."""

import logging
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import GPUS
from tensorflow.python.eager import context
from tensorflow.python.framework import config as tf_config  # No public switch off.
from test_xla import regression_data

import tfmp
from tfmp import xla, xla_kernels


def host_identity(x):
    """`x` through a host (numpy) call, which XLA cannot compile."""
    y = tf.numpy_function(lambda a: a, [x], x.dtype)
    y.set_shape(x.shape)
    return y


class HostIdentity(keras.layers.Layer):
    def call(self, x):
        return host_identity(x)


class HostWhen(keras.layers.Layer):
    """A host call in training only, or in inference only (`training`): the other branch compiles."""

    def __init__(self, training, **kwargs):
        super().__init__(**kwargs)
        self.host_in_training = training

    def call(self, x, training=None):
        return host_identity(x) if bool(training) == self.host_in_training else x


def host_model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8), HostIdentity(), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.01), "mse")
    return model


def test_model_xla_cannot_compile_trains_without_it_after_one_warning(caplog):
    model = host_model()
    with caplog.at_level(logging.WARNING):
        history = tfmp.fit(model, regression_data(), epochs=2, jit_compile=True, verbose=0)
        tfmp.evaluate(model, regression_data(), jit_compile=True)
    assert history.params["jit_compile"] is False
    warnings = [r.getMessage() for r in caplog.records if "XLA" in r.getMessage()]
    assert len(warnings) == 1 and "PyFunc" in warnings[0] and "without XLA" in warnings[0]
    assert "(made at test_xla_fallback.py:" in warnings[0]  # The layer's own line, not Keras' or TensorFlow's.
    assert history.history["loss"][1] < history.history["loss"][0]


class Batches(keras.utils.PyDataset):
    def __init__(self, x, y, batch):
        super().__init__()
        self.x, self.y, self.batch = x, y, batch

    def __len__(self):
        return -(-len(self.x) // self.batch)

    def __getitem__(self, i):
        return self.x[i * self.batch : (i + 1) * self.batch], self.y[i * self.batch : (i + 1) * self.batch]


@pytest.mark.parametrize(("shuffle", "replicas"), [(True, 1), ("batch", 1), (True, 2), ("a PyDataset", 1)])
def test_shuffled_input_refused_at_the_first_step_is_read_again_alike_as_without_xla(
    monkeypatch, mirrored, shuffle, replicas
):
    """A new iterator of shuffled arrays (or a shuffled PyDataset) draws the next order: read again from it, the
    first epoch was another than without XLA (its losses differed). Their dataset is made again, its orders drawn
    from the first: no probe needs to find the refusal up front."""
    monkeypatch.setattr(xla, "_PROBES", {})
    if replicas == 1:  # Several replicas are probed: a refused first step may cancel their collectives.
        monkeypatch.setattr(xla, "probe", lambda *_: pytest.fail("probed up front"))
    rng = np.random.default_rng(1)
    x = rng.random((100, 8), dtype=np.float32)
    with mirrored.scope() if replicas == 2 else tf.distribute.get_strategy().scope():
        refused, plain = host_model(), host_model()

    def fit(model, jit_compile):
        if shuffle == "a PyDataset":  # Shuffled by default, as model.fit shuffles one.
            return tfmp.fit(model, Batches(x, x.sum(1), 16), epochs=2, verbose=0, jit_compile=jit_compile)
        return tfmp.fit(
            model, x, x.sum(1), batch_size=16, epochs=2, verbose=0, shuffle=shuffle, jit_compile=jit_compile
        )

    history = fit(refused, True)
    assert history.params["jit_compile"] is False
    assert history.history == fit(plain, False).history
    for trained, without in zip(refused.weights, plain.weights, strict=True):
        np.testing.assert_array_equal(trained, without)


def test_evaluate_alone_finds_the_refusal_at_its_first_batch_and_evaluates_every_batch(monkeypatch, caplog):
    """No probe runs up front: the first batch, refused, is evaluated again without XLA (the same results)."""
    monkeypatch.setattr(xla, "_PROBES", {})
    monkeypatch.setattr(xla, "probe", lambda *_: pytest.fail("probed up front"))
    with caplog.at_level(logging.WARNING):
        refused = tfmp.evaluate(host_model(), regression_data(), jit_compile=True, return_dict=True)
    assert refused == tfmp.evaluate(host_model(), regression_data(), jit_compile=False, return_dict=True)
    assert len([r for r in caplog.records if "without XLA" in r.getMessage()]) == 1


@pytest.mark.parametrize("replicas", [1, 2])
def test_an_evaluation_xla_cannot_compile_goes_without_it_and_the_update_stays_under_xla(caplog, mirrored, replicas):
    """A layer may take another branch in inference: validation's first batch finds that XLA cannot compile it
    (the up-front probe traces the update only), and evaluation goes on without XLA, every batch counted, the
    update still one XLA computation."""
    with mirrored.scope() if replicas == 2 else tf.distribute.get_strategy().scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8), HostWhen(False), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.01), "mse", jit_compile=False)
    with caplog.at_level(logging.WARNING):
        history = tfmp.fit(model, regression_data(), validation_data=regression_data(), epochs=2, jit_compile=True)
    assert history.params["jit_compile"] is True and tfmp.loop.kept_steps(model).jit_compile is True
    (warning,) = [r.getMessage() for r in caplog.records if "XLA" in r.getMessage()]
    assert "evaluating without XLA" in warning and "PyFunc" in warning
    np.testing.assert_allclose(history.history["val_loss"][-1], model.evaluate(regression_data()), rtol=1e-6)


def test_an_update_xla_cannot_compile_falls_back_after_an_evaluation_it_compiled(monkeypatch, caplog, tmp_path):
    """The other way round: evaluation under XLA first, then, with the same steps (a log_dir's, which compute the
    gradients' norm as evaluate's do), an update that XLA refuses at its first step."""
    monkeypatch.setattr(xla, "_PROBES", {})
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8), HostWhen(True), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.01), "mse")
    with caplog.at_level(logging.WARNING):
        evaluated = tfmp.evaluate(model, regression_data(), jit_compile=True)
        steps = tfmp.loop.kept_steps(model)
        history = tfmp.fit(model, regression_data(), epochs=1, jit_compile=True, verbose=0, log_dir=str(tmp_path))
    assert tfmp.loop.kept_steps(model) is steps
    assert [r.getMessage() for r in caplog.records if "training without XLA" in r.getMessage()]
    assert history.params["jit_compile"] is False and int(model.optimizer.iterations.numpy()) == 8
    assert history.history["loss"][0] < evaluated


class HostMean(keras.metrics.Mean):
    """A metric whose update makes a host call: outside the forward and backward passes."""

    def update_state(self, y_true, y_pred, sample_weight=None):
        return super().update_state(host_identity(y_pred))


def test_a_metric_xla_cannot_compile_is_found_up_front_and_a_generator_loses_no_batch(monkeypatch):
    """The probe lowers the metrics' updates too: a generator's first batch, which runs once, is not read by a
    first step that XLA refuses (one of 8 batches went untrained)."""
    monkeypatch.setattr(xla, "_PROBES", {})
    trained = []
    for jit_compile in (True, False):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.01), "mse", metrics=[HostMean()], jit_compile=False)
        batches = (batch for batch in regression_data())
        history = tfmp.fit(model, batches, epochs=1, jit_compile=jit_compile, verbose=0)
        assert int(model.optimizer.iterations.numpy()) == 8 and history.params["jit_compile"] is False
        if jit_compile:  # Refused, with its reason.
            assert "PyFunc" in history.params["jit_compile_reason"]
        trained.append(model.get_weights())
    for with_xla, without in zip(*trained, strict=True):
        np.testing.assert_array_equal(with_xla, without)


def test_a_model_of_string_input_is_told_that_xla_takes_no_strings():
    words = np.array([["good"], ["bad"], ["fine"], ["awful"]] * 16)
    lookup = keras.layers.StringLookup(vocabulary=["good", "bad", "fine", "awful"], output_mode="one_hot")
    inputs = keras.Input((1,), dtype="string")
    model = keras.Model(inputs, keras.layers.Dense(1)(lookup(inputs)))
    model.compile(keras.optimizers.SGD(0.1), "mse")
    history = tfmp.fit(model, words, np.arange(64, dtype="float32") % 2, jit_compile=True, verbose=0)
    assert history.params["jit_compile_reason"] == (
        "XLA cannot compile this model: its input holds string tensors, which XLA does not take; "
        "make them numbers in the input pipeline"
    )


class Elsewhere(keras.layers.Layer):
    """Adds a variable kept on the second logical CPU, not the step's device."""

    def build(self, input_shape):
        with tf.device("/CPU:1"):
            self.offset = tf.Variable(0.5, trainable=False)

    def call(self, x):
        return x + self.offset


@pytest.mark.parametrize("found", ["up front", "at the first step"])
def test_a_variable_on_another_device_is_named_with_the_fix(caplog, monkeypatch, found):
    """XLA reads only the step's device (on a GPU, TensorFlow keeps int32 variables on the
    host): the fallback's warning names the variable, where it was made and what to do,
    whether the up-front probe finds it (batches that a new iterator reshuffles) or the first
    step (a dataset's, read again; or a variable the probe's forward and backward passes do
    not read, such as a metric's)."""
    monkeypatch.setattr(xla, "_PROBES", {})
    probed = []
    monkeypatch.setattr(xla, "probe", lambda *a, probe=xla.probe: probed.append(probe(*a)) or probed[-1])
    if found == "at the first step":
        monkeypatch.setattr(xla, "probe", lambda *_: None)

    def data():
        return regression_data().shuffle(8, seed=0) if found == "up front" else regression_data()

    model = keras.Sequential([keras.Input((8,)), Elsewhere(), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.1), "mse")
    with caplog.at_level(logging.WARNING):
        history = tfmp.fit(model, data(), epochs=1, jit_compile=True, verbose=0)
        assert np.isfinite(history.history["loss"][0]) and int(model.optimizer.iterations.numpy()) == 8
        # A second fit keeps the model's steps: it knows the answer and does not compile again.
        again = tfmp.fit(model, data(), epochs=1, jit_compile=True, verbose=0)
    for run in (history, again):  # Up front or at the first step, the params say what was done and why.
        assert run.params["jit_compile"] is False
        assert run.params["jit_compile_reason"].startswith("XLA cannot compile this model: variable ")
        assert "is on CPU:1" in run.params["jit_compile_reason"]
    (warning,) = [r.getMessage() for r in caplog.records if "XLA" in r.getMessage()]  # One, for both fits.
    assert len(probed) == (found == "up front")
    step = "GPU:0" if GPUS else "CPU:0"
    assert f"is on CPU:1, the step on {step}" in warning and "test_xla_fallback.py" in warning, warning
    assert "no tf.device of its own" in warning
    gpu_text = (
        "Trying to access resource Variable/9 (defined @ /m.py:27) located in device /job:localhost/replica:0/"
        "task:0/device:CPU:0 from device /job:localhost/replica:0/task:0/device:GPU:0"
    )
    assert "int64 or float32 if it is int32" in xla_kernels.elsewhere(gpu_text)
    assert xla_kernels.elsewhere("some other failure") is None


@pytest.mark.parametrize("read", ["by epoch", "as a stream", "by epoch on 2 replicas", "2 updates a call of 2"])
def test_compile_failure_at_run_time_falls_back_on_the_batches_it_read(monkeypatch, caplog, request, read):
    """A dataset's first step finds the failure (no probe runs up front), falls back instead of crashing, and trains
    on the batches the failed step had read, read again from the input (they were lost: other weights than without
    XLA): one, or a call's 2 updates of 2 accumulated batches each."""
    monkeypatch.setattr(xla, "probe", lambda *_: None)  # (A probe would not run here anyway.)
    monkeypatch.setattr(xla, "_PROBES", {})
    strategy = request.getfixturevalue("mirrored") if "replicas" in read else tf.distribute.get_strategy()
    with strategy.scope():
        model, plain = host_model(), host_model()
    kw = {"epochs": 2, "steps_per_epoch": 5} if read == "as a stream" else {"epochs": 1}  # 8 batches an epoch.
    if read == "2 updates a call of 2":
        kw.update(steps_per_execution=2, grad_accum_steps=2)
    with caplog.at_level(logging.WARNING):
        history = tfmp.fit(model, regression_data(), jit_compile=True, verbose=0, **kw)
    assert any("without XLA" in r.getMessage() for r in caplog.records) and history.params["jit_compile"] is False
    assert history.history == tfmp.fit(plain, regression_data(), jit_compile=False, verbose=0, **kw).history
    for trained, without in zip(model.weights, plain.weights, strict=True):
        np.testing.assert_array_equal(trained, without)


class HostSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """A learning rate read on the host: tf.numpy_function's output has no shape."""

    def __call__(self, step):
        return tf.numpy_function(lambda s: np.float32(0.01 / (1.0 + s)), [step], tf.float32)

    def get_config(self):
        return {}


@pytest.mark.parametrize(("jit_compile", "given"), [(False, "a dataset"), (True, "a dataset"), (True, "a generator")])
def test_a_learning_rate_schedule_on_the_host_trains_as_in_keras_fit(monkeypatch, jit_compile, given):
    """Its learning rate, of no shape, is a step output: it failed to pack ("unknown rank"). Under XLA, which refuses
    the host call in the optimizer: a dataset's first step falls back and reads its batch again; a generator's is
    read once, and the probe, which lowers the learning rate too, finds the refusal before it (1 of 8 batches
    went untrained)."""
    monkeypatch.setattr(xla, "_PROBES", {})
    weights = []
    for fit in ("keras", "tfmp"):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(HostSchedule()), "mse", jit_compile=False)
        data = regression_data() if given == "a dataset" else (batch for batch in regression_data())
        if fit == "keras":
            model.fit(data, verbose=0)
        else:
            tfmp.fit(model, data, verbose=0, jit_compile=jit_compile)
        weights.append(model.get_weights())
    for ours, theirs in zip(*weights, strict=True):
        np.testing.assert_array_equal(ours, theirs)


def test_on_2_replicas_a_learning_rate_xla_cannot_compile_is_found_up_front(monkeypatch, mirrored):
    """Several replicas are probed (a refused first step may cancel their collectives); the probe lowers the
    learning rate too, which it missed."""
    monkeypatch.setattr(xla, "_PROBES", {})
    found = []
    monkeypatch.setattr(xla, "probe", lambda *args, probe=xla.probe: found.append(probe(*args)) or found[-1])
    weights = []
    for jit_compile in (True, False):
        keras.utils.set_random_seed(0)
        with mirrored.scope():
            model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
            model.compile(keras.optimizers.SGD(HostSchedule()), "mse", jit_compile=False)
        history = tfmp.fit(model, regression_data(), verbose=0, jit_compile=jit_compile)
        assert history.params["jit_compile"] is False
        weights.append(model.get_weights())
    assert len(found) == 1 and "PyFunc" in found[0]
    for with_xla, without in zip(*weights, strict=True):
        np.testing.assert_array_equal(with_xla, without)


def maxpool_model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4, 4, 1)), keras.layers.Conv2D(2, 3), keras.layers.MaxPooling2D()])
    model.add(keras.layers.Flatten())
    model.add(keras.layers.Dense(1))
    model.compile(keras.optimizers.SGD(0.01), "mse")
    return model


def images(batches=2):
    for _ in range(batches):
        yield np.ones((8, 4, 4, 1), "float32"), np.ones((8, 1), "float32")


def arrays():
    return np.ones((16, 4, 4, 1), "float32"), np.ones((16, 1), "float32")


ALIKE = {"batch_size": 8, "shuffle": False}  # Read alike by every iterator: a refusal is left to the first step.


def test_what_xla_refused_under_op_determinism_is_tried_again_without_it(monkeypatch, caplog):
    """Whether XLA compiles a model can hang on op determinism (no deterministic XLA MaxPool
    gradient): a refusal found with it on, and kept for models alike, is no answer for a run
    with it off."""
    monkeypatch.setattr(xla, "_PROBES", {})
    tf.config.experimental.enable_op_determinism()  # conftest turns it off again after the test.
    with caplog.at_level(logging.WARNING):
        refused = tfmp.fit(maxpool_model(), *arrays(), **ALIKE, jit_compile=True, verbose=0)
        # A model alike is told, not tried again: one warning.
        kept = tfmp.fit(maxpool_model(), *arrays(), **ALIKE, jit_compile=True, verbose=0)
    assert len([r for r in caplog.records if "XLA cannot compile" in r.getMessage()]) == 1
    tf_config.disable_op_determinism()
    compiled = tfmp.fit(maxpool_model(), *arrays(), **ALIKE, jit_compile=True, verbose=0)
    assert refused.params["jit_compile"] is False and kept.params["jit_compile"] is False
    assert compiled.params["jit_compile"] is True


@pytest.mark.parametrize("given", ["arrays", "shuffled arrays", "a generator"])
def test_a_maxpool_under_op_determinism_is_told_which_switch_keeps_xla_off(monkeypatch, given):
    """TensorFlow's XLA bridge has no deterministic MaxPool gradient and says "GPU" on every
    device; the reason names the op and the switch, not a GPU a CPU run does not have. The
    first step finds it, and its batch is read again without XLA: arrays', shuffled ones' from
    their dataset made again, a generator's from the batches it kept (before, the probe traced
    the step up front for a generator, whose batches run once; without it, a batch went
    untrained). And none needs a global seed, which model.fit
    needs only to shuffle arrays (TensorFlow finds the device to lower for by running a random
    op, which op determinism refuses unseeded)."""
    probed = []
    monkeypatch.setattr(xla, "probe", lambda *a, probe=xla.probe: probed.append(1) or probe(*a))
    monkeypatch.setattr(xla, "_PROBES", {})
    model = maxpool_model()
    seed = context.global_seed()
    tf.config.experimental.enable_op_determinism()  # conftest turns it off again after the test.
    tf.random.set_seed(None)
    given_arrays = dict(zip(("x", "y"), arrays(), strict=True), batch_size=8, shuffle=given == "shuffled arrays")
    data = given_arrays if "arrays" in given else {"x": images()}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # Not TensorFlow's of a deprecated argument either.
            history = tfmp.fit(model, **data, jit_compile=True, verbose=0)
    finally:
        tf.random.set_seed(seed)
    assert history.params["jit_compile_reason"] == (
        "XLA cannot compile this model: MaxPool gradient ops have no deterministic XLA implementation, and op "
        "determinism is on (train.py's --deterministic, or tf.config.experimental.enable_op_determinism())"
    )
    assert not probed  # A first step that may refuse is not traced twice.
    assert int(model.optimizer.iterations.numpy()) == 2  # Every batch trained, none lost to the refusal.
