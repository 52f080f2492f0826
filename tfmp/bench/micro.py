"""The benchmark's small measurements: each training loop's own cost per step, evaluation's
per batch, the norm's reductions per gradient or one a shape, the Adam update (Keras'
element-wise ops against tfmp's fused kernels), the transformer step with its embedding
gradient dense or sparse, and the wait between a fit's end and its return."""

import functools
import math
import statistics
import time

import keras
import numpy as np
import tensorflow as tf

from tfmp import evaluation, fused, gradients, inputs, loop, precision, steps, timing
from tfmp.app import models
from tfmp.bench import lockstep, realsize
from tfmp.bench.runs import FitRunner
from tfmp.bench.tables import TRAINERS


def _calls_per_second(fn, calls):
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return calls / (time.perf_counter() - start)


LOOP_POLICIES = ("float32", "mixed_bfloat16", "mixed_float16")
LOOP_OPTIMIZERS = {"SGD": keras.optimizers.SGD, "Adam": keras.optimizers.Adam}


def _mlp_data():
    rng = np.random.default_rng(0)
    x = rng.random((1024, 16), dtype=np.float32)
    return tf.data.Dataset.from_tensor_slices((x, rng.integers(0, 10, len(x)))).batch(32).repeat()


def _mlp(layers):
    """`layers` Dense layers of width 16: 2 variables a layer, each step's math small."""
    hidden = [keras.layers.Dense(16, activation="relu") for _ in range(layers - 1)]
    return keras.Sequential([keras.Input((16,)), *hidden, keras.layers.Dense(10, activation="softmax")])


def _lockstep_rounds(runners, rounds, steps_per_turn):
    """{name: [median ms a step, per round]}: `runners` ({name: FitRunner}, warmed) trained
    in lockstep, a step of each in turn, the order changed every round."""
    times = {name: [] for name in runners}
    for round_index in range(rounds):
        order = timing.in_turn(runners, round_index)
        for _, runner in order:
            runner.step_times = []
        lockstep.run([runner for _, runner in order], steps_per_turn)
        for name, runner in order:
            times[name].append(1e3 * statistics.median(runner.step_times))
    return times


def loop_costs(rounds, layers=150, steps_per_turn=30, say=print):
    """Milliseconds per step of tfmp.fit and of Keras fit on a deep, narrow MLP (`layers`
    Dense layers of width 16, batch 32: 2 variables a layer, each step's math small), where
    the loops' own cost per variable shows: 12 cells, float32 / mixed_bfloat16 /
    mixed_float16 x XLA on / off x SGD / Adam, the same setting in both loops.

    In each of `rounds` rounds both loops train `steps_per_turn` steps in lockstep (a step
    of each in turn, `lockstep.run`; the other loop first every other round), so that a
    slow spell of a shared machine falls on both. A cell's ms are the medians over the
    rounds of each loop's median step time; its speedup, the median of the per-round
    ratios (Keras' ms over tfmp's), as the bench's other ratios are."""
    machine = {"device": precision.device_name(), "versions": f"TensorFlow {tf.__version__}, Keras {keras.__version__}"}
    say(f"loop cost on {machine['device']}, {machine['versions']}: {rounds} lockstep rounds a cell")
    dataset, build, cells = _mlp_data(), functools.partial(_mlp, layers), []
    for policy in LOOP_POLICIES:
        for xla_on in (False, True):
            for name, optimizer in LOOP_OPTIMIZERS.items():
                keras.backend.clear_session()
                runners = {t: FitRunner(t, policy, build, dataset, 32, xla_on, optimizer) for t in TRAINERS}
                for runner in runners.values():
                    runner.run(3)  # Trace, compile and warm up.
                times = _lockstep_rounds(runners, rounds, steps_per_turn)
                ratios = [k / t for k, t in zip(times["keras"], times["tfmp"], strict=True)]
                cell = {"policy": policy, "xla": xla_on, "optimizer": name}
                cell.update({f"{t}_ms": statistics.median(v) for t, v in times.items()})
                cell["speedup"] = statistics.median(ratios)
                cell["speedup_rounds"] = ratios
                cells.append(cell)
                say(
                    f"loop cost, {policy}, XLA {'on' if xla_on else 'off'}, {name}: tfmp.fit {cell['tfmp_ms']:.2f} ms, "
                    f"Keras fit {cell['keras_ms']:.2f} ms per step ({cell['speedup']:.2f}x; rounds "
                    + ", ".join(f"{r:.2f}" for r in ratios)
                    + ")"
                )
    geomean = math.exp(statistics.fmean(math.log(c["speedup"]) for c in cells))
    return {"rounds": rounds, "layers": layers, "variables": 2 * layers, "cells": cells, "geomean": geomean, **machine}


def evaluation_costs(rounds=7, layers=150, batches=300, say=print):
    """Seconds of tfmp.evaluate and of model.evaluate over `batches` batches of 32 on `loop_costs`' MLP, float32,
    XLA off and on, the two called in turn `rounds` times (the other first every other round); a cell's speed is
    the median of the per-round ratios (Keras' seconds over tfmp's). Where the per-batch call shows:
    `tfmp.calls.OfBatches`."""
    say(f"evaluation cost on {precision.device_name()}: {rounds} alternating rounds a cell, {batches} batches")
    rng, cells = np.random.default_rng(0), []
    x = rng.random((32 * batches, 16), dtype=np.float32)
    dataset = tf.data.Dataset.from_tensor_slices((x, rng.integers(0, 10, len(x)))).batch(32).cache()
    for xla_on in (False, True):
        keras.backend.clear_session()
        model = _mlp(layers)
        model.compile("sgd", "sparse_categorical_crossentropy", metrics=["accuracy"], jit_compile=xla_on)
        runs = {
            "keras": functools.partial(model.evaluate, dataset, verbose=0),
            "tfmp": functools.partial(evaluation.evaluate, model, dataset, jit_compile=xla_on, verbose=0),
        }
        times = {name: [] for name in runs}
        for run in runs.values():
            run()  # Trace, compile, fill the cache.
        for round_index in range(rounds):
            for name, run in timing.in_turn(runs, round_index):
                times[name].append(1.0 / _calls_per_second(run, 1))
        ratios = [k / t for k, t in zip(times["keras"], times["tfmp"], strict=True)]
        cell = {"xla": xla_on, **{f"{n}_ms_per_batch": 1e3 * statistics.median(t) / batches for n, t in times.items()}}
        cells.append({**cell, "speedup": statistics.median(ratios), "speedup_rounds": ratios})
        say(
            f"evaluation cost, XLA {'on' if xla_on else 'off'}: tfmp.evaluate {cell['tfmp_ms_per_batch']:.2f} ms, "
            f"model.evaluate {cell['keras_ms_per_batch']:.2f} ms a batch ({statistics.median(ratios):.2f}x; rounds "
            + ", ".join(f"{r:.2f}" for r in ratios)
            + ")"
        )
    return cells


class _Ended(keras.callbacks.Callback):
    def on_train_end(self, logs=None):
        self.at = time.perf_counter()


def end_waits(rounds=4, batches=5000, say=print):
    """{"keras": [...], "tfmp": [...]}: seconds from a fit's last callback (`on_train_end`) to its return, model.fit
    and tfmp.fit called in turn `rounds` times (the other first every other round), each one epoch of `batches`
    batches of 8 through a map and a prefetch that tf.data tunes (AUTOTUNE). Deleting such an iterator may wait
    for tf.data's tuning thread (`tfmp.calls.let_go`): Keras fit waits so before it returns, tfmp.fit does not."""
    say(f"a fit's end to its return on {precision.device_name()}: {rounds} alternating rounds, {batches} batches")
    rng = np.random.default_rng(0)
    x = rng.random((8 * batches, 8), dtype=np.float32)
    data = tf.data.Dataset.from_tensor_slices((x, x[:, :1])).map(lambda a, b: (2 * a, b), tf.data.AUTOTUNE)
    data = data.batch(8).prefetch(tf.data.AUTOTUNE)
    fits, waits = {}, {}
    for name in ("keras", "tfmp"):
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(64), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
        fits[name] = functools.partial(model.fit, data) if name == "keras" else functools.partial(loop.fit, model, data)
        waits[name] = []
    for round_index in range(rounds):
        for name, fit in timing.in_turn(fits, round_index):
            ended = _Ended()
            fit(epochs=1, verbose=0, callbacks=[ended])
            waits[name].append(time.perf_counter() - ended.at)
        say(f"round {round_index + 1}: " + ", ".join(f"{n} {w[-1]:.2f} s" for n, w in waits.items()))
    for name, seconds in waits.items():
        say(f"{name}: median {statistics.median(seconds):.2f} s, most {max(seconds):.2f} s from its end to its return")
    return waits


def norm_costs(rounds=5, layers=150, steps_per_turn=30, jit_compile=False, policies=LOOP_POLICIES, say=print):
    """tfmp.fit's step with the norm's reductions per gradient and one a shape
    (`gradients.GROUPED`), and Keras fit's, in lockstep on `loop_costs`' MLP, for each of
    its policies and optimizers: the measurement behind `Steps`' rule on this device.
    Returns each cell's ms a step and its speed grouped / per gradient (the median of the
    per-round ratios)."""
    say(
        f"norm cost on {precision.device_name()}, XLA {'on' if jit_compile else 'off'}: {rounds} lockstep rounds a cell"
    )
    dataset, build, cells = _mlp_data(), functools.partial(_mlp, layers), []
    for policy in policies:
        for name, optimizer in LOOP_OPTIMIZERS.items():
            keras.backend.clear_session()
            runners = {}
            for variant, grouped in (("keras", None), ("per gradient", False), ("grouped", True)):
                trainer = "keras" if grouped is None else "tfmp"
                runners[variant] = FitRunner(trainer, policy, build, dataset, 32, jit_compile, optimizer)
                with gradients.forced_grouping(grouped):  # Read when tfmp's step is compiled, in its first run.
                    runners[variant].run(3)
                if grouped is not None:  # The step took the variant asked for.
                    assert loop.kept_steps(runners[variant].model)._grouped is grouped  # noqa: SLF001
            times = _lockstep_rounds(runners, rounds, steps_per_turn)
            ratios = [p / g for p, g in zip(times["per gradient"], times["grouped"], strict=True)]
            cell = {"policy": policy, "optimizer": name, **{f"{v} ms": statistics.median(t) for v, t in times.items()}}
            cell.update({"speed grouped / per gradient": statistics.median(ratios), "rounds": ratios})
            cells.append(cell)
            say(
                f"norm cost, {policy}, {name}: "
                + ", ".join(f"{v} {cell[f'{v} ms']:.2f} ms" for v in runners)
                + f"; grouped / per gradient {cell['speed grouped / per gradient']:.3f}x (rounds "
                + ", ".join(f"{r:.3f}" for r in ratios)
                + ")"
            )
    return cells


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
