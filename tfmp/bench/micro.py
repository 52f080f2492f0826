"""The benchmark's small measurements: each training loop's own cost per step, the Adam
update (Keras' element-wise ops against tfmp's fused kernels), and the transformer step
with its embedding gradient dense or sparse."""

import functools
import math
import statistics
import time

import keras
import numpy as np
import tensorflow as tf

from tfmp import fused, inputs, loop, steps, timing
from tfmp.app import models
from tfmp.bench import realsize
from tfmp.bench.runs import FitRunner
from tfmp.bench.tables import TRAINERS


def _calls_per_second(fn, calls):
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return calls / (time.perf_counter() - start)


def loop_overhead(rounds, steps_per_turn=100):
    """Milliseconds per step of tfmp.fit and of Keras fit on a model whose step costs almost
    nothing (a 16-32-10 MLP, batch 32): what each training loop adds to every step, the
    only difference left where both run the same kernels. Medians over alternating rounds."""
    keras.backend.clear_session()
    rng = np.random.default_rng(0)
    x = rng.random((1024, 16), dtype=np.float32)
    dataset = tf.data.Dataset.from_tensor_slices((x, rng.integers(0, 10, len(x)))).batch(32).repeat()

    def build():
        layers = [keras.layers.Dense(32, activation="relu"), keras.layers.Dense(10, activation="softmax")]
        return keras.Sequential([keras.Input((16,)), *layers])

    runners = {t: FitRunner(t, "float32", build, dataset, 32, jit_compile=False) for t in TRAINERS}
    for runner in runners.values():
        runner.run(5)  # Trace and warm up.
    times = {t: [] for t in TRAINERS}
    for round_index in range(rounds):
        for trainer, runner in timing.in_turn(runners, round_index):
            runner.step_times = []
            runner.run(steps_per_turn)
            times[trainer].append(1e3 * statistics.median(runner.step_times))
    return {"rounds": rounds, **{f"{t}_ms": statistics.median(v) for t, v in times.items()}}


def update_times(name, rounds=5, calls_per_turn=3):
    """Milliseconds per Adam update of a real-size model's weights (float32 gradients),
    Keras' element-wise update against tfmp's fused kernels, in alternating rounds."""
    keras.backend.clear_session()
    keras.config.set_dtype_policy("float32")
    variables = realsize.MODELS[name]().trainable_variables
    grads = [tf.random.normal(v.shape, stddev=1e-3) for v in variables]
    runs = {}
    for kind in ("keras", "fused"):
        optimizer = keras.optimizers.Adam(1e-4)
        optimizer.build(variables)
        if kind == "fused":
            optimizer.update_step = fused.update_step(optimizer, exact=False)  # The kernel itself.
        apply = tf.function(functools.partial(optimizer.apply, grads, variables))
        apply()  # Trace.
        runs[kind] = functools.partial(_calls_per_second, apply, calls_per_turn)
    rates = timing.alternate(runs, math.inf, time.perf_counter, rounds, rounds)
    return {
        "model": name,
        "parameters": sum(int(np.prod(v.shape)) for v in variables),
        **{f"{kind}_ms": 1e3 / statistics.median(rates[kind]) for kind in runs},
    }


def sparse_steps(vocab_sizes, strategy, batch_size=128, sequence_length=64, rounds=5, steps_per_turn=10):
    """Milliseconds per training step of the bundled transformer under `strategy`, with its
    embedding gradient densified (as before) and kept sparse, in alternating rounds, per
    vocabulary size."""
    results = []
    for vocab in vocab_sizes:
        keras.backend.clear_session()
        keras.config.set_dtype_policy("float32")
        rng = np.random.default_rng(0)
        x = rng.integers(0, vocab, (batch_size, sequence_length))
        dataset = tf.data.Dataset.from_tensors((x, rng.integers(0, 2, batch_size))).repeat()
        runs = {}
        for sparse in (False, True):
            keras.utils.set_random_seed(0)
            with strategy.scope():
                model = models.compile(
                    models.MODELS["transformer"].build(2, vocab_size=vocab, sequence_length=sequence_length),
                    keras.optimizers.Adam(1e-3),
                )
            loop.prepare(model, strategy, dataset.element_spec)  # Builds the model and optimizer.
            compiled = steps.Steps(model, strategy, sparse=sparse)
            iterator = inputs.Input(dataset, strategy, 1, 1, "data").stream(0)  # tfmp.fit's input path.
            compiled.train(iterator)  # Trace.
            step = functools.partial(compiled.train, iterator)
            runs["sparse" if sparse else "dense"] = functools.partial(_calls_per_second, step, steps_per_turn)
        rates = timing.alternate(runs, math.inf, time.perf_counter, rounds, rounds)
        results.append(
            {
                "vocab_size": vocab,
                "replicas": strategy.num_replicas_in_sync,
                "dense_ms": 1e3 / statistics.median(rates["dense"]),
                "sparse_ms": 1e3 / statistics.median(rates["sparse"]),
                "speedup": timing.median_ratio(rates["sparse"], rates["dense"])[0],
            }
        )
    return results
