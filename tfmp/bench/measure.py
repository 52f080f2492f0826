"""The measuring parts of `tfmp.bench`: peaks, FLOPs, memory, input rate; each returns plain figures."""

import os
import statistics
import time

import tensorflow as tf

from tfmp import data, precision, tf_compat
from tfmp.app import models


def matmul_peaks(policies, n=2048, budget_seconds=20.0):
    """Measured FLOP/s of an n x n matmul in each policy's compute dtype.

    Returns:
        {policy: {"flops": FLOP/s, "cut_off": bool}}. A dtype whose first matmul runs past
        `budget_seconds` (float16 on many CPUs) is measured on that one run only.
    """
    peaks = {}
    for policy in policies:
        dtype = precision.compute_dtype(policy)  # float8: its bfloat16 base (no float8 matmul op).
        a = tf.random.uniform((n, n), dtype=tf.float32)
        a, b = tf.cast(a, dtype), tf.cast(tf.transpose(a), dtype)
        matmul = tf.function(lambda x, y: tf.reduce_sum(tf.cast(tf.matmul(x, y)[0, :1], tf.float32)))
        peaks[policy] = _peak(lambda a=a, b=b, matmul=matmul: matmul(a, b).numpy(), budget_seconds)
        peaks[policy]["flops"] *= 2 * n**3
    return peaks


# Peak sizes (matmul n; conv batch, size, channels): on a GPU, work that fills the device
# (a 2048 matmul is launch-bound on an H100: the same 39 TFLOP/s in every dtype); on a CPU,
# what a shared 2-core machine times in seconds.
PEAK_SIZES = {
    "gpu": {"matmul": 8192, "conv": {"batch": 128, "size": 56, "channels": 256}},
    "cpu": {"matmul": 2048, "conv": {"batch": 32, "size": 56, "channels": 64}},
}


def peak_sizes():
    """PEAK_SIZES for this machine: "gpu" where TensorFlow sees one, else "cpu"."""
    return PEAK_SIZES["gpu" if tf.config.list_physical_devices("GPU") else "cpu"]


def conv_peaks(policies, batch=32, size=56, channels=64, budget_seconds=20.0):
    """Measured FLOP/s of a 3x3 convolution (same padding), forward and backward, in each
    policy's compute dtype: {policy: {"flops": FLOP/s, "cut_off": bool}}."""
    peaks = {}
    for policy in policies:
        dtype = precision.compute_dtype(policy)  # float8: its bfloat16 base (no float8 matmul op).
        x = tf.cast(tf.random.uniform((batch, size, size, channels)), dtype)
        kernel = tf.cast(tf.random.uniform((3, 3, channels, channels)) * 0.1, dtype)

        @tf.function
        def step(x, kernel):
            with tf.GradientTape() as tape:
                tape.watch([x, kernel])
                y = tf.nn.conv2d(x, kernel, 1, "SAME")
                loss = tf.reduce_sum(tf.cast(y, tf.float32))
            dx, dk = tape.gradient(loss, [x, kernel])
            return tf.reduce_sum(tf.cast(dx[0, 0, 0], tf.float32)) + tf.reduce_sum(tf.cast(dk[0, 0, 0], tf.float32))

        peaks[policy] = _peak(lambda x=x, kernel=kernel, step=step: step(x, kernel).numpy(), budget_seconds)
        peaks[policy]["flops"] *= 3 * 2 * batch * size * size * channels * channels * 9  # Forward + 2 backward.
    return peaks


def _peak(call, budget_seconds):
    """{"flops": calls/second (median of up to 2 s of calls after a warm-up), "cut_off"}."""
    start = time.perf_counter()
    call()
    first = time.perf_counter() - start
    times = [first]
    while first < budget_seconds and sum(times[1:]) < 2.0 and len(times) < 50:
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times[1:]) if len(times) > 1 else first
    return {"flops": 1.0 / seconds, "cut_off": first >= budget_seconds}


def flops_per_example(model):
    """Training FLOPs per example: the forward pass at batch 1, counted by the TF profiler, times 3."""
    spec = tf.TensorSpec((1, *model.inputs[0].shape[1:]), model.inputs[0].dtype)
    graph = tf.function(lambda x: model(x, training=False)).get_concrete_function(spec).graph
    return 3 * tf_compat.float_ops(graph)  # Backward is about twice the forward.


def memory_bytes():
    """Peak GPU memory since the last reset, else this process's resident memory now."""
    if tf.config.list_physical_devices("GPU"):
        return tf.config.experimental.get_memory_info("GPU:0")["peak"]
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


_DATA_CACHE = {}


def bench_data(kind, batch_size):
    """The model kind's shipped real dataset, repeated, built once per (kind, batch)."""
    key = (kind, batch_size)
    if key not in _DATA_CACHE:
        _DATA_CACHE[key] = data.load(models.DEFAULT_DATASETS[kind], batch_size, repeat=True, drop_remainder=True)
    return _DATA_CACHE[key]


def input_rate(dataset, batch_size, batches=200, warmup=100):
    """Examples/second the input pipeline alone delivers, after `warmup` batches (cache filled)."""
    iterator = iter(dataset)
    for _ in range(warmup):
        next(iterator)
    start = time.perf_counter()
    for _ in range(batches):
        next(iterator)
    return batches * batch_size / (time.perf_counter() - start)
