"""The benchmark's runs: each policy trained by tfmp.fit and by plain Keras `model.fit`, in
alternating rounds, and the rows, table and comparisons made from them."""

import functools
import json
import math
import os
import statistics
import tempfile
import time

import keras
import numpy as np
import tensorflow as tf

from tfmp import bf16, callbacks, float8, loop, loss_scale, precision, timing
from tfmp.app import autotune, models
from tfmp.bench import lockstep, measure, realsize
from tfmp.bench.tables import CONV_MODELS, TRAINERS

# The GPU report's optimizers, by name.
OPTIMIZERS = {
    "sgd": functools.partial(keras.optimizers.SGD, momentum=0.9),
    "adam": keras.optimizers.Adam,
}


class FitRunner:
    """One model under one policy, trained a turn at a time by `tfmp.fit` or `model.fit`.

    Each turn is one call of fit for `steps + 1` steps; its first step is not timed (a new
    iterator, callbacks set up), the others are, from one batch begin to the next (see
    `callbacks.Throughput`).
    """

    def __init__(self, trainer, policy, build, dataset, batch_size, jit_compile, optimizer=keras.optimizers.Adam):
        keras.config.set_dtype_policy(precision.FLOAT8_BASE if policy == "float8" else policy)
        keras.utils.set_random_seed(0)
        self.model = build()
        if policy == "float8" and trainer == "tfmp":
            float8.quantize(self.model)  # tfmp's choice of layers: the heads stay in bfloat16.
        elif policy == "float8":
            self.model.quantize("float8")  # As a Keras user does: every Dense and EinsumDense.
        optimizer = optimizer(1e-3)
        # Keras wraps its own LossScaleOptimizer under mixed_float16, as a Keras user gets it;
        # its XLA is set as asked where asked (True or False), else left to Keras ("auto").
        keras_jit = jit_compile if isinstance(jit_compile, bool) and trainer == "keras" else "auto"
        models.compile(
            self.model, loss_scale.wrap_optimizer(optimizer) if trainer == "tfmp" else optimizer, jit_compile=keras_jit
        )
        self.trainer, self.policy, self.dataset, self.batch_size = trainer, policy, dataset, batch_size
        self.jit_compile = jit_compile
        self.rates, self.step_times, self.loss, self.memory, self.jit_used = [], [], math.nan, 0, None

    def run(self, steps, timer=None):
        """Trains `steps` timed steps; returns their examples/second. `timer` (by default a
        `callbacks.Throughput` leaving out the first step) times them."""
        timer = timer or callbacks.Throughput(self.batch_size, warmup_steps=1)
        if tf.config.list_physical_devices("GPU"):
            tf.config.experimental.reset_memory_stats("GPU:0")
        if self.trainer == "tfmp":
            history = loop.fit(
                self.model,
                self.dataset,
                steps_per_epoch=steps + 1,
                callbacks=[timer],
                jit_compile=self.jit_compile,
                verbose=0,
            )
            self.jit_used = history.params["jit_compile"]
        else:
            history = self.model.fit(
                self.dataset, steps_per_epoch=steps + 1, epochs=1, verbose=0, callbacks=[timer], shuffle=False
            )
            self.jit_used = bool(self.model.jit_compile)
        self.loss = float(history.history["loss"][-1])
        self.memory = max(self.memory, measure.memory_bytes())
        self.step_times += timer.step_times
        return timer.examples_per_second


def _model_and_data(name, batch_size):
    """(build, dataset) for a bundled model (its shipped data) or a real-size one (synthetic)."""
    if name in realsize.MODELS:
        return realsize.MODELS[name], realsize.synthetic(name, batch_size)
    ds = measure.bench_data(models.MODELS[name].kind, batch_size)
    return functools.partial(models.build, name, ds), ds.train


_LOOPS = {"tfmp": "tfmp.fit", "keras": "Keras fit"}


def _progress(line):
    """One progress line: no stretch of the bench is silent for long (a GPU warm-up with XLA
    can take minutes)."""
    print(f"bench: {line}", flush=True)


def _steps_text(steps):
    return ", ".join(f"{policy} {n} step{'s' * (n != 1)} x {len(TRAINERS)} loops" for policy, n in steps.items())


def bench_model(name, policies, batch_size, rounds, round_seconds, max_steps, peaks, jit_compile="auto"):
    """Benchmarks one model: every policy, trained by tfmp and by Keras, in alternating rounds.

    Every policy gets one turn per round, each turn about `round_seconds` divided among
    them (from 1 to `max_steps` timed steps, by the step time seen while warming up), and
    every round runs: no policy is cut off. In a round every fit (each policy by tfmp.fit
    and by Keras fit) trains at once in lockstep, a step of each in turn (`lockstep.run`),
    so that tfmp / Keras and bf16 / float32 compare steps that ran one after the other, not
    turns seconds apart. Returns one row per policy.
    """
    keras.backend.clear_session()
    build, dataset = _model_and_data(name, batch_size)
    rate_in = measure.input_rate(dataset, batch_size) if name not in realsize.MODELS else None
    runners = {(p, t): FitRunner(t, p, build, dataset, batch_size, jit_compile) for p in policies for t in TRAINERS}
    pairs = {p: [runners[(p, t)] for t in TRAINERS] for p in policies}
    turn = round_seconds / len(pairs)
    steps = {}
    began = time.perf_counter()
    for policy, pair in pairs.items():  # Warm up one at a time: trace, compile (XLA's "auto" measures here).
        per_step = 0.0
        for runner in pair:
            _progress(f"{name} {policy} {_LOOPS[runner.trainer]}: warming up (trace, compile, 2 steps)")
            start = time.perf_counter()
            runner.run(1)
            step = statistics.median(runner.step_times) if runner.step_times else time.perf_counter() - start
            per_step += step
            _progress(
                f"{name} {policy} {_LOOPS[runner.trainer]}: warm in {time.perf_counter() - start:.1f} s, "
                f"{1e3 * step:.1f} ms a step"
            )
            runner.step_times = []
        steps[policy] = int(np.clip(round(turn / per_step), 1, max_steps))
    _progress(f"{name}: warm-up {time.perf_counter() - began:.0f} s; {rounds} rounds of " + _steps_text(steps))
    began = time.perf_counter()
    for round_index in range(rounds):
        # The order is reversed every other round: no fit always steps first.
        order = [r for pair in pairs.values() for r in pair]
        order = order if round_index % 2 == 0 else order[::-1]
        for runner, rate in zip(order, lockstep.run(order, [steps[r.policy] for r in order]), strict=True):
            runner.rates.append(rate)
        elapsed = time.perf_counter() - began
        eta = elapsed / (round_index + 1) * (rounds - round_index - 1)
        _progress(f"{name}: round {round_index + 1}/{rounds} done, {elapsed:.0f} s so far, ETA {eta:.0f} s")
    base = runners.get(("float32", "tfmp"))
    rows = []
    for policy in policies:
        ours, theirs = runners[(policy, "tfmp")], runners[(policy, "keras")]
        flops = measure.flops_per_example(ours.model)
        rate = statistics.median(ours.rates)
        speedup, speedup_error = timing.median_ratio(ours.rates, base.rates) if base else (None, None)
        versus_keras, keras_error = timing.median_ratio(ours.rates, theirs.rates)
        possible = {
            op: peak[policy]["flops"] / peak["float32"]["flops"] if "float32" in peak else None
            for op, peak in peaks.items()
        }
        bound = possible["conv" if name in CONV_MODELS else "matmul"]
        rows.append(
            {
                "model": name,
                "policy": policy,
                "batch_size": batch_size,
                "examples_per_second": rate,
                "rounds": ours.rates,
                "speedup_vs_float32": speedup,
                "speedup_vs_float32_error": speedup_error,  # Standard error of that median, a fraction.
                "possible_speedup": possible,
                "share_of_possible_gain": (speedup - 1) / (bound - 1) if speedup and bound and bound > 1.1 else None,
                "keras_fit_examples_per_second": statistics.median(theirs.rates),
                "keras_fit_rounds": theirs.rates,
                "tfmp_vs_keras_fit": versus_keras,
                "tfmp_vs_keras_fit_error": keras_error,  # Standard error of that median, a fraction.
                "jit_compile": {"tfmp": ours.jit_used, "keras": theirs.jit_used},
                "step_ms_median": 1e3 * statistics.median(ours.step_times),
                "steps_timed": len(ours.step_times),
                "final_loss": ours.loss,
                "peak_memory_mb": ours.memory / 2**20,
                # Weights and optimizer state as tfmp.fit keeps them (bfloat16: half of float32's).
                "state_mb": bf16.state_bytes(ours.model, ours.model.optimizer) / 2**20,
                "train_flops_per_example": flops,
                "mfu": flops * rate / peaks["matmul"][policy]["flops"],
                "input_examples_per_second": rate_in,
            }
        )
    return rows


def policy_choices(rows, names, policies, batch_size, runs=3, trial_seconds=None):
    """Per model: what `--precision=autotune`'s trial picks in `runs` independent trials,
    and how fast its picks ran in this benchmark's rounds, relative to the fastest."""
    choices = []
    for name in names:
        # Relative speeds from the per-round ratios to float32 (rounds ran back to back), the
        # robust measure; the medians of raw rates can disagree when rounds are noisy.
        speed = {r["policy"]: r["speedup_vs_float32"] or r["examples_per_second"] for r in rows if r["model"] == name}
        fastest = max(speed, key=speed.get)
        error = {r["policy"]: r.get("speedup_vs_float32_error") or 0.0 for r in rows if r["model"] == name}
        picks = []
        for _ in range(runs):
            keras.backend.clear_session()
            ds = measure.bench_data(models.MODELS[name].kind, batch_size)
            build = functools.partial(models.build, name, ds)
            with tempfile.TemporaryDirectory() as cache_dir:
                start = time.perf_counter()
                strategy = tf.distribute.get_strategy()
                decision = autotune.autotune(
                    name, build, ds, strategy, batch_size, cache_dir, policies, budget_seconds=trial_seconds
                )
                with open(os.path.join(cache_dir, autotune.CACHE_FILE)) as f:
                    (entry,) = json.load(f).values()
                picks.append(
                    {
                        "policy": decision.policy,
                        "vs_fastest": speed[decision.policy] / speed[fastest],
                        # The rounds' own standard error of that share (float32's is 0: the baseline).
                        "vs_fastest_error": math.hypot(error[decision.policy], error[fastest]),
                        "vs_float32": speed[decision.policy] / speed["float32"] if "float32" in speed else None,
                        "seconds": time.perf_counter() - start,
                        "warm_up_seconds": entry["seconds"]["warm_up"],  # Building and warming up.
                        "rounds_seconds": entry["seconds"]["rounds"],
                        "reason": decision.reason.splitlines()[0],
                    }
                )
        choices.append({"model": name, "fastest": fastest, "fastest_error": error[fastest], "picks": picks})
    return choices
