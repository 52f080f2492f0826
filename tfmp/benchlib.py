"""The measuring parts of `tfmp.bench` and `--precision=autotune`: each returns plain figures."""

import functools
import os
import platform
import statistics
import tempfile
import time

import keras
import numpy as np
import tensorflow as tf
from absl import logging

import models
from tfmp import callbacks, data, loop, loss_scale, training

_DTYPES = {"float32": "float32", "mixed_bfloat16": "bfloat16", "mixed_float16": "float16"}
DEFAULT_DATA = {"image": "digits", "text": "sentiment"}


def compute_dtype(policy):
    """The compute dtype of a policy name."""
    return _DTYPES[policy]


def device_name():
    """The accelerator's name, or the CPU's model name."""
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        return tf.config.experimental.get_device_details(gpus[0]).get("device_name", "GPU")
    if tf.config.list_logical_devices("TPU"):
        return "TPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        model = platform.processor() or "CPU"
    return f"{model} ({os.cpu_count()} cores)"


def matmul_peaks(policies, n=2048, budget_seconds=20.0):
    """Measured FLOP/s of an n x n matmul in each policy's compute dtype.

    Returns:
        {policy: {"flops": FLOP/s, "cut_off": bool}}. A dtype whose first matmul runs past
        `budget_seconds` (float16 on many CPUs) is measured on that one run only.
    """
    peaks = {}
    for policy in policies:
        dtype = compute_dtype(policy)
        a = tf.random.uniform((n, n), dtype=tf.float32)
        a, b = tf.cast(a, dtype), tf.cast(tf.transpose(a), dtype)
        matmul = tf.function(lambda x, y: tf.reduce_sum(tf.cast(tf.matmul(x, y)[0, :1], tf.float32)))
        start = time.perf_counter()
        matmul(a, b).numpy()  # Trace and warm up.
        first = time.perf_counter() - start
        times = [first]
        while first < budget_seconds and sum(times[1:]) < 2.0 and len(times) < 50:
            start = time.perf_counter()
            matmul(a, b).numpy()
            times.append(time.perf_counter() - start)
        seconds = statistics.median(times[1:]) if len(times) > 1 else first
        peaks[policy] = {"flops": 2 * n**3 / seconds, "cut_off": first >= budget_seconds}
    return peaks


def flops_per_example(model):
    """Training FLOPs per example: the forward pass at batch 1, counted by the TF profiler, times 3."""
    from tensorflow.python.profiler import model_analyzer, option_builder  # Only the v1 profiler counts.

    spec = tf.TensorSpec((1, *model.inputs[0].shape[1:]), model.inputs[0].dtype)
    graph = tf.function(lambda x: model(x, training=False)).get_concrete_function(spec).graph
    options = option_builder.ProfileOptionBuilder.float_operation()
    options["output"] = "none"
    forward = model_analyzer.profile(graph, options=options).total_float_ops
    return 3 * forward  # Backward is about twice the forward.


def _memory_bytes():
    """Peak GPU memory since the last reset, else this process's resident memory now."""
    if tf.config.list_physical_devices("GPU"):
        return tf.config.experimental.get_memory_info("GPU:0")["peak"]
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _MemoryPeak(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.peak = _memory_bytes()

    def on_train_batch_end(self, batch, logs=None):
        self.peak = max(self.peak, _memory_bytes())


_DATA_CACHE = {}


def bench_data(kind, batch_size):
    """The model kind's shipped real dataset, repeated, built once per (kind, batch)."""
    key = (kind, batch_size)
    if key not in _DATA_CACHE:
        _DATA_CACHE[key] = data.load(DEFAULT_DATA[kind], batch_size, repeat=True, drop_remainder=True)
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


def build_model(name, source, ds):
    """Builds registry model `name` for the data's shape, under the global policy."""
    entry = models.MODELS[name]
    if entry.kind == "image":
        return entry.build(source.num_classes, input_shape=source.image_shape)
    return entry.build(
        source.num_classes,
        vocab_size=ds.vectorizer.vocabulary_size(),
        sequence_length=ds.train.element_spec[0].shape[-1],
    )


def time_fit(model, dataset, batch_size, steps, warmup, budget_seconds=None):
    """Trains `warmup + steps` steps with `model.fit`; returns (Throughput, memory peak, loss)."""
    timer = callbacks.Throughput(batch_size, warmup, budget_seconds)
    memory = _MemoryPeak()
    if tf.config.list_physical_devices("GPU"):
        tf.config.experimental.reset_memory_stats("GPU:0")
    history = model.fit(dataset, steps_per_epoch=warmup + steps, epochs=1, verbose=0, callbacks=[timer, memory])
    return timer, memory.peak, history.history["loss"][-1]


class Candidate:
    """One policy's model, optimizer and input, trained by tfmp's loop, timed step by step.

    Shared by the benchmark and by `--precision=autotune`'s trial.

    Args:
        policy: the dtype policy to build under.
        build_model: builds the model under the global policy (called in the strategy's scope).
        ds: the `Data` to train on.
        strategy: the strategy to train under.
        global_batch: examples per step.
    """

    def __init__(self, policy, build_model, ds, strategy, global_batch):
        keras.config.set_dtype_policy(policy)
        with strategy.scope():
            self.model = models.compile(build_model(), loss_scale.wrap_optimizer(keras.optimizers.Adam(1e-3)))
        self.steps = loop.prepare(self.model, strategy, ds.train.element_spec)
        self.global_batch = global_batch
        self.iterator = iter(ds.distribute(strategy))
        self.step_times, self.cut_off, self.loss, self.memory = [], False, float("nan"), 0.0
        self.durations, self.finite = [], True  # Every step's seconds, warm-up included.

    def _step(self):
        start = time.perf_counter()
        self.loss = float(self.steps.train(self.iterator)["step_loss"])
        self.durations.append(time.perf_counter() - start)
        self.finite = self.finite and bool(np.isfinite(self.loss))
        return self.durations[-1]

    def run(self, steps, warmup, deadline):
        """Runs `warmup` untimed then `steps` timed steps, stopping at `deadline`; returns
        this round's examples/second (0.0 when no step was timed)."""
        for _ in range(warmup):
            self._step()
            if time.perf_counter() > deadline:
                self.cut_off = True
                return 0.0
        times = []
        for _ in range(steps):
            times.append(self._step())
            self.memory = max(self.memory, _memory_bytes())
            if time.perf_counter() > deadline:
                self.cut_off = True
                break
        self.step_times += times
        return len(times) * self.global_batch / sum(times) if times else 0.0


def bench_model(name, policies, batch_size, steps, warmup, budget_seconds, peaks, rounds=2):
    """Benchmarks one model under each policy. Returns a row dict of figures per policy.

    The policies take turns for `rounds` rounds, so that a slow spell of a shared machine
    does not fall on one policy; each row reports its best round (the least disturbed),
    like `timeit`. A policy that runs past `budget_seconds` is cut off and not run again.
    """
    keras.backend.clear_session()
    kind = models.MODELS[name].kind
    ds = bench_data(kind, batch_size)
    rate_in = input_rate(ds.train, batch_size)
    build = functools.partial(build_model, name, ds.source, ds)
    candidates = {p: Candidate(p, build, ds, tf.distribute.get_strategy(), batch_size) for p in policies}
    rates = {p: [] for p in policies}
    for _ in range(rounds):
        for policy, c in candidates.items():
            if not c.cut_off:
                if tf.config.list_physical_devices("GPU"):
                    tf.config.experimental.reset_memory_stats("GPU:0")
                rates[policy].append(
                    c.run(steps, warmup if not c.step_times else 1, time.perf_counter() + budget_seconds)
                )
    rows = []
    for policy, c in candidates.items():
        rate, times = max(rates[policy] or [0.0]), c.step_times
        flops = flops_per_example(c.model)
        rows.append(
            {
                "model": name,
                "policy": policy,
                "examples_per_second": rate,
                "rounds": rates[policy],
                "step_ms_median": 1e3 * statistics.median(times) if times else None,
                "step_ms_spread": 1e3 * (statistics.quantiles(times, n=10)[-1] - statistics.quantiles(times, n=10)[0])
                if len(times) > 2
                else 0.0,
                "steps_timed": len(times),
                "cut_off": c.cut_off,
                "final_loss": c.loss,
                "peak_memory_mb": c.memory / 2**20,
                "train_flops_per_example": flops,
                "mfu": flops * rate / peaks[policy]["flops"] if peaks[policy]["flops"] else None,
                "input_examples_per_second": rate_in,
                "input_over_train": rate_in / rate if rate else None,
            }
        )
    return rows


def add_speedups(rows):
    """Adds each row's speedup over the same model's float32 row (None without one)."""
    base = {r["model"]: r["examples_per_second"] for r in rows if r["policy"] == "float32"}
    for r in rows:
        b = base.get(r["model"])
        r["speedup_vs_float32"] = r["examples_per_second"] / b if b else None


def overhead(name, policy, batch_size, steps, warmup, repeats=3):
    """Examples/second of plain `model.fit` vs `tfmp.training`, same model, policy and data.

    The runs alternate, `repeats` of each; `ratio` compares the best run of each (the
    least disturbed by the rest of the machine), `median_ratio` their medians.
    """
    kind = models.MODELS[name].kind
    plain, tfmp_rates = [], []
    for _ in range(repeats):
        keras.backend.clear_session()
        keras.config.set_dtype_policy(policy)
        ds = bench_data(kind, batch_size)
        model = build_model(name, ds.source, ds)
        # Hand-written Keras: Keras wraps its own LossScaleOptimizer under mixed_float16.
        model.compile(keras.optimizers.Adam(1e-3), keras.losses.SparseCategoricalCrossentropy(), metrics=["accuracy"])
        plain.append(time_fit(model, ds.train, batch_size, steps, warmup)[0].examples_per_second)
        keras.backend.clear_session()
        with tempfile.TemporaryDirectory() as model_dir:
            config = training.Config(
                model=name,
                dataset=DEFAULT_DATA[kind],
                precision=policy,
                batch_size=batch_size,
                epochs=1,
                steps_per_epoch=warmup + steps,
                model_dir=model_dir,
                verbose=0,
                strategy="default",
                warmup_steps=warmup,
            )
            tfmp_rates.append(training.train_and_evaluate(config, out=open(os.devnull, "w"))["examples_per_second"])
        logging.info("overhead run: plain %.0f, tfmp %.0f ex/s", plain[-1], tfmp_rates[-1])
    return {
        "model": name,
        "policy": policy,
        "plain": plain,
        "tfmp": tfmp_rates,
        "plain_median": statistics.median(plain),
        "tfmp_median": statistics.median(tfmp_rates),
        "median_ratio": statistics.median(tfmp_rates) / statistics.median(plain),
        "plain_best": max(plain),
        "tfmp_best": max(tfmp_rates),
        "ratio": max(tfmp_rates) / max(plain),  # Best run against best run, as for the policy rows.
    }


def table(rows):
    """The console table."""
    head = ("model", "policy", "ex/s", "speedup", "step ms (med, spread)", "MFU", "peak MB", "input ex/s", "in/train")
    lines = []
    for r in rows:
        speed = f"{r['speedup_vs_float32']:.2f}x" if r.get("speedup_vs_float32") else "-"
        step = f"{r['step_ms_median']:.1f} ({r['step_ms_spread']:.1f})" if r["step_ms_median"] else "-"
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
        note = " CUT OFF" if r["cut_off"] else ""
        lines.append(
            (
                r["model"],
                r["policy"] + note,
                f"{r['examples_per_second']:,.0f}",
                speed,
                step,
                mfu,
                f"{r['peak_memory_mb']:,.0f}",
                f"{r['input_examples_per_second']:,.0f}",
                f"{r['input_over_train']:.1f}x" if r["input_over_train"] else "-",
            )
        )
    widths = [max(len(str(x)) for x in col) for col in zip(head, *lines, strict=False)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*head), *(fmt.format(*line) for line in lines)])


def plot(rows, path):
    """A bar chart of examples/second per model and policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["model"] for r in rows))
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    width = 0.8 / len(policies)
    fig, ax = plt.subplots(figsize=(8, 4))
    for i, policy in enumerate(policies):
        values = [
            next((r["examples_per_second"] for r in rows if r["model"] == n and r["policy"] == policy), 0)
            for n in names
        ]
        ax.bar(np.arange(len(names)) + i * width, values, width, label=policy)
    ax.set_xticks(np.arange(len(names)) + width * (len(policies) - 1) / 2, names)
    ax.set_ylabel("training examples / second")
    ax.set_title(f"tfmp bench: {device_name()}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def policy_choices(rows, names, policies, batch_size):
    """Per model: the fastest policy measured, what `auto` and `autotune` pick, and how fast
    their picks ran in this benchmark, relative to the fastest and to float32."""
    from tfmp import autotune, precision  # autotune imports this module.

    trial = precision.auto_trial_candidates()
    choices = []
    for name in names:
        speed = {r["policy"]: r["examples_per_second"] for r in rows if r["model"] == name}
        keras.backend.clear_session()
        ds = bench_data(models.MODELS[name].kind, batch_size)
        with tempfile.TemporaryDirectory() as cache_dir, tempfile.TemporaryDirectory() as auto_dir:
            build = functools.partial(build_model, name, ds.source, ds)
            strategy = tf.distribute.get_strategy()
            auto = (
                autotune.autotune(name, build, ds, strategy, batch_size, auto_dir, trial).policy
                if trial
                else precision.resolve_policy("auto").policy
            )
            tuned = autotune.autotune(name, build, ds, strategy, batch_size, cache_dir, candidates=policies).policy
        fastest = max(speed, key=speed.get)
        base = speed.get("float32") or float("nan")
        choices.append(
            {
                "model": name,
                "fastest": fastest,
                "auto": auto,
                "autotune": tuned,
                "auto_vs_fastest": speed.get(auto, 0.0) / speed[fastest],
                "autotune_vs_fastest": speed[tuned] / speed[fastest],
                "auto_vs_float32": speed.get(auto, 0.0) / base,
                "autotune_vs_float32": speed[tuned] / base,
            }
        )
    return choices
