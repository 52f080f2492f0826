"""`--precision=autotune`: time the candidate policies on the user's own model, batch and
strategy, and keep the fastest one whose loss stays finite."""

import json
import os
import time

from absl import logging

from tfmp import benchlib, precision
from tfmp.precision import Decision

CANDIDATES = ("float32", "mixed_bfloat16", "mixed_float16")
CACHE_FILE = "autotune.json"
MARGIN = 0.03  # A mixed policy must beat float32 by this much in the trial to be chosen.


def _trial(policy, build_model, ds, strategy, global_batch, steps, warmup, budget_seconds):
    """Trains `warmup + steps` steps under `policy`; returns a row of figures."""
    candidate = benchlib.Candidate(policy, build_model, ds, strategy, global_batch)
    candidate.run(steps, warmup, time.perf_counter() + budget_seconds)
    times = candidate.durations
    timed = times[warmup:] if len(times) > warmup + 1 else times[1:] or times
    return {
        "policy": policy,
        "examples_per_second": len(timed) * global_batch / sum(timed),
        "steps": len(times),
        "finite": candidate.finite,
        "cut_off": len(times) < warmup + steps,
    }


def choose(rows, margin=MARGIN):
    """The fastest policy with a finite loss; float32 unless another beats it by `margin`.

    A short trial measures with a few percent of noise: a mixed policy that is not clearly
    faster is not worth its numerical risk, and keeping float32 then keeps the choice
    from ever being slower than float32.
    """
    safe = {r["policy"]: r["examples_per_second"] for r in rows if r["finite"]}
    if not safe:
        return "float32"
    fastest = max(safe, key=safe.get)
    if "float32" in safe and safe[fastest] < safe["float32"] * (1 + margin):
        return "float32"
    return fastest


def table(rows, chosen):
    """The trial table, for the console."""
    lines = [f"  {'policy':15s} {'examples/s':>11s}  steps  loss finite"]
    for r in rows:
        mark = "  <- chosen" if r["policy"] == chosen else ""
        note = " (cut off by the time budget)" if r["cut_off"] else ""
        lines.append(
            f"  {r['policy']:15s} {r['examples_per_second']:11,.0f}  {r['steps']:5d}  "
            f"{'yes' if r['finite'] else 'NO':11s}{note}{mark}"
        )
    return "\n".join(lines)


def autotune(
    key,
    build_model,
    ds,
    strategy,
    global_batch,
    cache_dir,
    candidates=CANDIDATES,
    steps=10,
    warmup=3,
    budget_seconds=20.0,
):
    """Chooses the fastest candidate policy with a finite loss, or reads the cached choice.

    Args:
        key: what the choice depends on besides the device, e.g. "cnn|digits|batch=128|default".
        build_model: builds the model under the global policy (called inside the strategy).
        ds: the run's `Data`.
        strategy: the run's strategy.
        global_batch: the global batch size.
        cache_dir: where autotune.json keeps choices per (device, key).
        candidates, steps, warmup, budget_seconds: the trial.

    Returns:
        A `precision.Decision` (not yet applied) whose reason holds the trial table.
    """
    device = benchlib.device_name()
    cache_key = f"{device}|{key}"
    path = os.path.join(cache_dir, CACHE_FILE)
    cache = {}
    if os.path.exists(path):
        with open(path) as f:
            cache = json.load(f)
    if cache_key in cache:
        entry = cache[cache_key]
        return Decision(entry["policy"], f"autotune, cached in {path}:\n{table(entry['rows'], entry['policy'])}")
    rows = [_trial(p, build_model, ds, strategy, global_batch, steps, warmup, budget_seconds) for p in candidates]
    chosen = choose(rows)
    cache[cache_key] = {"policy": chosen, "rows": rows, "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
    os.makedirs(cache_dir, exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(cache, f, indent=2)
    os.replace(path + ".tmp", path)
    logging.info("Autotune chose %s", chosen)
    return Decision(chosen, f"autotune, measured now:\n{table(rows, chosen)}", precision.resolve_policy(chosen).warning)
