"""`--precision=autotune` (and `auto` on a bfloat16 CPU): time the candidate policies on the
user's own model, batch and strategy, and keep the fastest one whose loss stays finite.

The policies take turns of equal length for several rounds (`tfmp.timing.alternate`), the
turns of a round interleaved a step of each in turn, and a mixed policy replaces float32
only when its gain is beyond the noise of those rounds (`tfmp.timing.decide`): never
slower than float32 beyond the noise, and about a minute at most per model.
"""

import functools
import json
import os
import statistics
import time

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from tfmp import callbacks, decisions, distribute, files, inputs, loop, loss_scale, precision, timing
from tfmp.app import models
from tfmp.errors import UsageError
from tfmp.precision import Decision

CANDIDATES = ("float32", "mixed_bfloat16", "mixed_float16")
BASELINE = "float32"
CACHE_FILE = "autotune.json"
TRIAL_SECONDS = 45.0  # At most, for the alternating rounds; building and warming up come on top.
MAX_ROUNDS = 12
WARMUP = 3
MAX_SLOWDOWN = 3.0  # A candidate whose warm-up steps are this many times the baseline's takes no turns.


def trial(candidates, build_model, ds, strategy, global_batch, budget_seconds=None, clock=time.perf_counter):
    """Trains each candidate policy in alternating turns; returns (rows, `timing.Verdict`,
    {"warm_up": seconds building and warming up, "rounds": seconds of rounds}).

    Each candidate is built, warmed up (`WARMUP` steps: tracing, allocation), then runs a
    turn of about equal length per round, its steps interleaved with the others' turns,
    until it can no longer win. One whose warm-up alone takes a third of the budget, or
    whose warm-up steps take `MAX_SLOWDOWN` times the baseline's (float16 on most CPUs), is
    cut off; one whose loss is not finite never wins.
    """
    budget_seconds = TRIAL_SECONDS if budget_seconds is None else budget_seconds
    start = clock()
    built, per_step = {}, {}
    baseline = BASELINE if BASELINE in candidates else candidates[0]
    for policy in sorted(candidates, key=lambda p: p != baseline):  # The baseline's pace first.
        built[policy] = c = Candidate(policy, build_model, ds, strategy, global_batch)
        c.warm_up(WARMUP)
        per_step[policy] = statistics.median(c.durations[1:])
        hopeless = per_step[policy] > MAX_SLOWDOWN * per_step[baseline]  # No noise hides a 3x gap.
        c.cut_off = per_step[policy] * 2 > budget_seconds / 3 or hopeless
    warmed_up = clock()
    # Turns sized for two candidates in contention: a third that is clearly slower (float16
    # on most CPUs) gets no turns after the first rounds (`timing.alternate`).
    turn = min(max(budget_seconds / (MAX_ROUNDS * min(len(candidates), 2)), 0.2), 5.0)
    runners = {
        policy: functools.partial(_turn, c, max(2, round(turn / per_step[policy]))) for policy, c in built.items()
    }
    # The turns of a round run interleaved, a step of each candidate in turn: a slow spell
    # of a shared machine falls on all of them. A clear verdict ends the rounds early; a
    # close one gets up to the whole budget.
    rates = timing.alternate(runners, budget_seconds, clock, max_rounds=MAX_ROUNDS, baseline=baseline, interleave=True)
    seconds = {"warm_up": warmed_up - start, "rounds": clock() - warmed_up}
    usable = {p: (r if built[p].finite else [0.0] * len(r)) for p, r in rates.items()}
    verdict = timing.decide(usable, baseline)
    rows = [
        {
            "policy": p,
            "examples_per_second": statistics.median(rates[p]),
            "rounds": rates[p],
            "ratio": verdict.ratios.get(p),
            "steps": len(c.durations),
            "finite": c.finite,
            "cut_off": c.cut_off,
        }
        for p, c in built.items()
    ]
    return rows, verdict, seconds


def _turn(candidate, steps):
    """A candidate's turn in a round (a generator, see `Candidate.turn`); none when cut off."""
    if candidate.cut_off:
        return 0.0
    return (yield from candidate.turn(steps))


def table(rows, chosen):
    """The trial table, for the console."""
    lines = [f"  {'policy':15s} {'examples/s':>11s}  {'vs float32':>10s}  rounds  steps  loss finite"]
    for r in rows:
        mark = "  <- chosen" if r["policy"] == chosen else ""
        note = " (cut off: too slow)" if r["cut_off"] else ""
        ratio = f"{r['ratio']:.2f}x" if r.get("ratio") else "-"
        lines.append(
            f"  {r['policy']:15s} {r['examples_per_second']:11,.0f}  {ratio:>10s}  {len(r.get('rounds', [])):6d}  "
            f"{r['steps']:5d}  {'yes' if r['finite'] else 'NO':11s}{note}{mark}"
        )
    return "\n".join(lines)


def autotune(key, build_model, ds, strategy, global_batch, cache_dir, candidates=CANDIDATES, say=None, **trial_kwargs):
    """Chooses the fastest candidate policy with a finite loss, or reads the cached choice.

    Args:
        key: what the choice depends on besides the device, e.g. "cnn|digits|batch=128|default".
        build_model: builds the model under the global policy (called inside the strategy).
        ds: the run's `Data`.
        strategy: the run's strategy.
        global_batch: the global batch size.
        cache_dir: where autotune.json keeps choices per (device, key).
        candidates: the policies to time.
        say: hears what the trial will cost before it runs (e.g. `print`).
        **trial_kwargs: passed to `trial` (budget_seconds, clock).

    Returns:
        A `precision.Decision` (not yet applied) whose reason holds the verdict and the table.
    """
    device = precision.device_name()
    cache_key = f"{device}|{key}"
    path = os.path.join(cache_dir, CACHE_FILE)
    cache = {}
    if os.path.exists(path):
        with open(path) as f:
            cache = json.load(f)
    if cache_key in cache and "reason" in cache[cache_key]:
        entry = cache[cache_key]
        how = f"autotune, cached in {path}: {entry['reason']}"
        return Decision(entry["policy"], f"{how}\n{table(entry['rows'], entry['policy'])}")
    if say is not None:
        budget = trial_kwargs.get("budget_seconds") or TRIAL_SECONDS
        say(f"precision: timing {', '.join(candidates)} on the model, up to {budget:g} s of rounds after warm-up")
    rows, verdict, seconds = trial(candidates, build_model, ds, strategy, global_batch, **trial_kwargs)
    chosen = verdict.choice
    cache[cache_key] = {
        "policy": chosen,
        "reason": verdict.reason,
        "rows": rows,
        "seconds": seconds,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    files.write_json(path, cache)
    logging.info("Autotune chose %s", chosen)
    how = f"autotune, measured now: {verdict.reason}"
    return Decision(chosen, f"{how}\n{table(rows, chosen)}", precision.resolve_policy(chosen).warning)


# What train.py's --precision=auto | autotune decides, and when it is decided.


def before_data(config, model_dir, one_host):
    """(the decision, or None where a timed trial on the model decides it; the policies
    that trial times, if any; the decision recorded for --model_dir, if any).

    What "auto" or "autotune" decided for this --model_dir before is taken again, on one
    host (several must all decide alike)."""
    recorded = decisions.recorded(model_dir, "precision")
    reuse = recorded if one_host and config.precision in ("auto", precision.AUTOTUNE) else None
    if reuse:
        decision = precision.resolve_policy(reuse["value"])._replace(reason=decisions.reused_reason(model_dir, reuse))
    else:
        trial = precision.auto_trial_candidates() if config.precision == "auto" else None
        if config.precision == precision.AUTOTUNE or trial:
            return None, trial, recorded
        decision = precision.resolve_policy(config.precision)
    precision.apply_policy(decision)
    return decision, None, recorded


def by_trial(config, trial, build_model, ds, strategy, plan, model_dir, say):
    """The policy a timed trial on the model picks (autotune, or auto on a bfloat16 CPU), applied."""
    if plan.workers > 1 and not trial:
        raise UsageError("--precision=autotune times one host; on several workers pick a policy or use auto")
    if trial and plan.workers > 1:  # Workers could measure differently: keep the hardware rule.
        decision = precision.resolve_policy("auto")
    else:
        key = f"{config.model}|{ds.source.name}|batch={plan.effective_batch}|{distribute.strategy_name(strategy)}"
        candidates = {"candidates": trial} if trial else {}
        decision = autotune(
            key,
            build_model,
            ds,
            strategy,
            plan.global_batch,
            model_dir,
            budget_seconds=config.trial_seconds,
            say=say,
            **candidates,
        )
        if trial:
            how = decision.reason[len("autotune, ") :]
            decision = decision._replace(
                reason=f"auto: CPU with bfloat16 support, whose gain depends on the model; {how}"
            )
    precision.apply_policy(decision)
    return decision


# Without tf.data's autotuning, whose thread made deleting an iterator that had run for the
# half minute of a trial wait 12-25 s (in three of four trials, seen on 2 CPU cores: a
# trial of 45 s took 60-85). The parallel maps then run on every core; every candidate
# reads the same pipeline, so the comparison stays even.
_TRIAL_INPUT = tf.data.Options()
_TRIAL_INPUT.autotune.enabled = False


class Candidate:
    """One policy's model, optimizer and input, trained by tfmp's loop, timed step by step
    (`--precision=autotune`'s trial).

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
        trial_input = inputs.Input(lambda c: ds.make_train(c).with_options(_TRIAL_INPUT), strategy, 1, 1, "data")
        self.iterator = trial_input.stream(0)  # tfmp.fit's own input path, repeated.
        self.cut_off, self.loss = False, float("nan")
        self.durations, self.finite = [], True  # Every step's seconds, warm-up included.

    def _step(self):
        start = time.perf_counter()
        self.loss = float(self.steps.train(self.iterator)["step_loss"])
        self.durations.append(time.perf_counter() - start)
        self.finite = self.finite and bool(np.isfinite(self.loss))
        return self.durations[-1]

    def warm_up(self, steps):
        """Runs `steps` untimed steps (tracing, allocation)."""
        for _ in range(steps):
            self._step()

    def turn(self, steps):
        """A generator: `steps` timed steps, yielding after each (for `timing.interleaved`);
        returns their examples/second."""
        times = []
        for _ in range(steps):
            times.append(self._step())
            yield
        return callbacks.examples_per_second(times, self.global_batch)
