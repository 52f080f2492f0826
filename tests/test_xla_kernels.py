"""An op XLA has no kernel for, or a variable on another device, found in the traced step before its first call
reads a batch (`tfmp.xla_kernels`): a custom optimizer's host call, which the probe up front does not lower."""

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf
from test_xla import regression_data

import tfmp
from tfmp import tf_compat, xla, xla_kernels


class HostSGD(keras.optimizers.SGD):
    """SGD whose update reads its learning rate through the host: XLA has no kernel for the call."""

    def update_step(self, gradient, variable, learning_rate):
        rate = tf.numpy_function(np.float32, [tf.cast(learning_rate, tf.float32)], tf.float32, stateful=False)
        variable.assign_sub(tf.cast(tf.reshape(rate, []), variable.dtype) * gradient)


def trained(strategy, given, jit_compile):
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
        model.compile(HostSGD(0.01), "mse", jit_compile=False)
    data = regression_data() if given == "a dataset" else (batch for batch in regression_data())
    history = tfmp.fit(model, data, verbose=0, jit_compile=jit_compile)
    return history, model.get_weights()


@pytest.mark.parametrize("given", ["a generator", "a dataset"])
@pytest.mark.parametrize("replicas", [1, 2])
def test_an_optimizer_xla_cannot_compile_is_found_before_the_first_step_reads_a_batch(
    monkeypatch, caplog, mirrored, replicas, given
):
    """The probe lowers the forward and backward passes and the learning rate, not the update: the host call was
    found by the first step's failed compile, after it read its batches, and a generator's first batch went
    untrained (weights unlike those without XLA), on 2 replicas too, where the refusal came mid-step."""
    monkeypatch.setattr(xla, "_PROBES", {})
    strategy = mirrored if replicas == 2 else tf.distribute.get_strategy()
    with caplog.at_level(logging.WARNING):
        history, with_xla = trained(strategy, given, jit_compile=True)
    assert history.params["jit_compile"] is False
    made_at = f"(made at test_xla_kernels.py:{_line('rate = tf.numpy_function')})"
    assert history.params["jit_compile_reason"].endswith(f"no XLA kernel for PyFuncStateless {made_at}")
    assert sum("XLA cannot compile this model" in r.getMessage() for r in caplog.records) == 1
    _, without = trained(strategy, given, jit_compile=False)
    for ours, theirs in zip(with_xla, without, strict=True):
        np.testing.assert_array_equal(ours, theirs)


COUNTS = tf.Variable(0.0)  # One device's, made outside any strategy: CPU:0's.


class CountingSGD(keras.optimizers.SGD):
    """SGD that counts its updates in a variable of CPU:0, which XLA cannot read on CPU:1."""

    def update_step(self, gradient, variable, learning_rate):
        COUNTS.assign_add(1.0)  # The line named.
        super().update_step(gradient, variable, learning_rate)


def test_on_2_replicas_an_update_reading_a_variable_of_one_device_is_refused_before_any_replica_runs(mirrored):
    """XLA refused the update on CPU:1 only, at the first step, after CPU:0's had run: its copies of the weights
    took a step CPU:1's never took (0.02-0.13 apart after 2 epochs, the loss unlike that without XLA), and the
    step ran again on both without XLA (CPU:0 counted 132 updates, not 128)."""
    runs = []
    for jit_compile in (True, False):
        COUNTS.assign(0.0)
        keras.utils.set_random_seed(0)
        with mirrored.scope():
            model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8), keras.layers.Dense(1)])
            model.compile(CountingSGD(0.01), "mse")
        history = tfmp.fit(model, regression_data(), epochs=2, verbose=0, strategy=mirrored, jit_compile=jit_compile)
        runs.append((history, model.weights, COUNTS.numpy()))
    (refused, weights, counts), (plain, plain_weights, plain_counts) = runs
    read_at = f"(read at test_xla_kernels.py:{_line('COUNTS.assign_add(1.0)')})"
    assert refused.params["jit_compile_reason"] == (
        f"XLA cannot compile this model: variable Variable {read_at} is on CPU:0, the step on CPU:1, and XLA reads "
        "only the step's: make it with no tf.device of its own"
    )
    assert refused.history == plain.history and counts == plain_counts == 2 * 4 * 2 * 8  # Replicas, weights, epochs.
    for ours, theirs in zip(weights, plain_weights, strict=True):
        copies = mirrored.experimental_local_results(ours.value)
        for copy in copies:  # Each replica's copy of each weight.
            np.testing.assert_array_equal(copy, theirs.numpy())


def test_the_line_reading_a_variable_of_another_device_is_named_as_its_file_is():
    """The read site is the last frame of the reader's own code, its file's name untouched ("made" in it stays)."""
    devices = "located in device /job:localhost/device:CPU:0 from device /job:localhost/device:CPU:1"
    frames = 'The op is created at: \nFile "/u/handmade_opt.py", line 5, in update_step\n'
    text = f"Trying to access resource V (read in XLA function f) {devices}\n{frames}"
    assert xla_kernels.elsewhere(text).startswith(
        "variable V (read at handmade_opt.py:5) is on CPU:0, the step on CPU:1"
    )
    assert xla_kernels.elsewhere(text.replace(frames, "")).startswith("variable V (read in XLA function f) is on CPU:0")


def traced(fn, *args):
    """A concrete function calling `fn` under XLA, as a step calls its compiled stages."""
    compiled = tf.function(fn, jit_compile=True, autograph=False)
    return tf.function(lambda *a: compiled(*a), autograph=False).get_concrete_function(*args)


def test_an_op_without_an_xla_kernel_is_named_with_the_line_that_made_it():
    """`tf.print` formats its string (StringFormat, the first op of it) and prints it: XLA compiles neither."""

    def printed(x):
        tf.print(x)  # The line named.
        return x * 2.0

    with pytest.raises(xla_kernels.Unsupported) as raised:
        xla_kernels.check(traced(printed, tf.constant(1.0)), "XLA_CPU_JIT")
    assert xla.is_compile_failure(raised.value)
    assert (
        xla.reason(raised.value)
        == f"no XLA kernel for StringFormat (made at test_xla_kernels.py:{_line('tf.print(x)')})"
    )


def test_a_string_input_is_named_as_xla_names_it():
    """XLA reads a function's inputs first: a string input is its `_Arg` refused, whatever op takes it."""
    with pytest.raises(xla_kernels.Unsupported) as raised:
        xla_kernels.check(traced(tf.strings.length, tf.constant(["a"])), "XLA_CPU_JIT")
    assert xla.reason(raised.value).startswith("its input holds string tensors, which XLA does not take")


def test_a_kernel_that_does_not_take_the_ops_dtype_is_no_kernel():
    """XLA compiles Cumsum, but not of int8, which TensorFlow's CPU kernel takes."""
    assert np.int8 not in {tf.as_dtype(t).as_numpy_dtype for _, types in _constraints("Cumsum") for t in types}
    xla_kernels.check(traced(tf.math.cumsum, tf.constant([1.0])), "XLA_CPU_JIT")
    with pytest.raises(xla_kernels.Unsupported, match="on XLA_CPU_JIT: Cumsum"):
        xla_kernels.check(traced(tf.math.cumsum, tf.constant([1], tf.int8)), "XLA_CPU_JIT")


def test_a_host_call_outside_xla_and_loops_and_branches_under_it_are_read():
    """Only what XLA compiles counts (a host call beside it runs on the host); a loop's body and a branch are read."""
    host = lambda x: tf.ensure_shape(tf.numpy_function(np.negative, [x], tf.float32, stateful=False), x.shape)  # noqa: E731
    compiled = tf.function(lambda x: x * 2.0, jit_compile=True, autograph=False)
    beside = tf.function(lambda x: compiled(host(x)), autograph=False).get_concrete_function(tf.constant(1.0))
    xla_kernels.check(beside, "XLA_CPU_JIT")
    in_loop = lambda x: tf.while_loop(lambda i, y: i < 2, lambda i, y: (i + 1, host(y)), (0, x))[1]  # noqa: E731
    in_branch = lambda x: tf.cond(x > 0.0, lambda: host(x), lambda: x)  # noqa: E731
    for fn in (in_loop, in_branch):
        with pytest.raises(xla_kernels.Unsupported, match="PyFuncStateless"):
            xla_kernels.check(traced(fn, tf.constant(1.0)), "XLA_CPU_JIT")


def test_the_devices_xla_compiles_for():
    assert xla_kernels.device_type(tf.distribute.OneDeviceStrategy("/cpu:0")) == "XLA_CPU_JIT"
    assert xla_kernels.device_type(tf.distribute.get_strategy()) in ("XLA_CPU_JIT", "XLA_GPU_JIT")
    assert xla_kernels.check(traced(tf.math.cumsum, tf.constant([1], tf.int8)), None) is None  # Not read: a TPU's.


def _constraints(op):
    return [c for kernel in tf_compat.xla_kernels("XLA_CPU_JIT")[op] for c in kernel]


def _line(text):
    """The line of this file holding `text`, after this function's own."""
    lines = open(__file__).read().splitlines()
    return next(i for i, line in enumerate(lines, 1) if text in line and "_line(" not in line)
