"""Choosing between ways to run the same step from timings that a shared machine makes noisy.

The candidates take turns (round 1: A, B, C; round 2: C, B, A; ...), so a slow spell of
the machine falls on all of them. Each round gives every candidate's throughput as a
ratio to the baseline's in the same round; a candidate replaces the baseline only when
its median ratio over at least five rounds (three, if it won each by 1.5x or more) is
above 1 by more than the measured noise of those ratios (and by at least `min_gain`), and
it won most rounds. Otherwise the baseline
stays: a choice that is not clearly faster is not worth its risk (numerics, compile time).
"""

import dataclasses
import math
import statistics

MIN_ROUNDS = 3  # Fewer: no verdict at all (the baseline stays).
MIN_ROUNDS_TO_SWITCH = 5  # A candidate replaces the baseline only on at least this many.
CLEAR_GAIN = 1.5  # Won every round by this much: taken on MIN_ROUNDS rounds.
MIN_GAIN = 0.02  # A candidate must be at least 2% faster than the baseline.
Z = 2.0  # Standard errors the median log-ratio must clear.


@dataclasses.dataclass
class Verdict:
    """A choice and why: per candidate, its median ratio to the baseline and the noise."""

    choice: str
    reason: str
    ratios: dict  # name -> median ratio to the baseline (1.0 for the baseline).
    noise: dict  # name -> the threshold its median ratio had to clear (as a ratio).
    rounds: int


def standard_error(logs):
    """The standard error of the median of `logs` (per-round log-ratios): about 1.25 times
    the standard deviation over sqrt(n). The deviation is the larger of a robust one (1.4826
    median absolute deviations) and the classic one: from a handful of rounds the robust
    one alone can come out near zero (of three rounds, it sees only the closest pair), and
    a trial then took a 4% gain that longer rounds did not confirm."""
    median = statistics.median(logs)
    spread = 1.4826 * statistics.median(abs(x - median) for x in logs)
    if len(logs) > 1:
        spread = max(spread, statistics.stdev(logs))
    return 1.25 * spread / math.sqrt(len(logs))


def median_ratio(a, b):
    """(median of the per-round ratios a[i] / b[i] (rounds that ran back to back), its
    standard error as a fraction); (None, None) with no rounds to compare."""
    logs = [math.log(x / y) for x, y in zip(a, b, strict=True) if x > 0 and y > 0]
    if not logs:
        return None, None
    return math.exp(statistics.median(logs)), standard_error(logs)


def decide(rates, baseline, min_gain=MIN_GAIN, z=Z):
    """Picks the baseline or the candidate clearly faster than it.

    Args:
        rates: {name: [throughput per round]}, rounds aligned across names (round i of
            every name ran back to back). A zero or missing rate (cut off, failed) counts
            against its candidate.
        baseline: the name kept unless another is clearly faster.
        min_gain: the smallest gain worth switching for.
        z: how many standard errors of the median log-ratio the gain must clear.

    Returns:
        A `Verdict`.
    """
    base = rates[baseline]
    rounds = len(base)
    ratios, noise, accepted = {baseline: 1.0}, {baseline: 0.0}, {}
    for name, values in rates.items():
        if name == baseline:
            continue
        pairs = [(v, b) for v, b in zip(values, base, strict=False) if b > 0]
        logs = [math.log(v / b) if v > 0 else -math.inf for v, b in pairs]
        if len(logs) < MIN_ROUNDS or any(math.isinf(x) for x in logs):
            ratios[name], noise[name] = (math.exp(statistics.median(logs)) if logs else 0.0), math.inf
            continue
        median = statistics.median(logs)
        threshold = max(math.log1p(min_gain), z * standard_error(logs))
        wins = sum(x > 0 for x in logs)
        ratios[name], noise[name] = math.exp(median), math.exp(threshold)
        # Five rounds measure the noise; a candidate that won every one of three rounds by a
        # margin no drift of a shared machine explains needs no more (XLA's 3x on a float16
        # CPU step of seconds: the budget holds four rounds).
        clear = min(logs) > math.log(CLEAR_GAIN)
        enough = len(logs) >= MIN_ROUNDS_TO_SWITCH or clear
        if median > threshold and wins * 3 >= 2 * len(logs) and enough:
            accepted[name] = median
    if not accepted:
        others = {k: v for k, v in ratios.items() if k != baseline}
        if rounds < MIN_ROUNDS or not others:
            why = f"{baseline}: too few rounds to tell" if others else f"{baseline}: nothing else to compare"
        else:
            best = max(others, key=others.get)
            verdict = "slower" if ratios[best] < 1 else "within the noise"
            if ratios[best] > noise[best] and rounds < MIN_ROUNDS_TO_SWITCH:
                verdict = f"too few rounds to switch (needs {MIN_ROUNDS_TO_SWITCH})"
            limit = f"needs > {noise[best]:.2f}x" if math.isfinite(noise[best]) else "failed or cut off"
            why = f"{baseline}: {best} ran {ratios[best]:.2f}x, {verdict} ({limit}; median of {rounds} rounds)"
        return Verdict(baseline, why, ratios, noise, rounds)
    choice = max(accepted, key=accepted.get)
    why = f"{choice}: {ratios[choice]:.2f}x {baseline} (median of {rounds} rounds; noise needs > {noise[choice]:.2f}x)"
    return Verdict(choice, why, ratios, noise, rounds)


def settled(rates, baseline, min_gain=MIN_GAIN, z=Z):
    """Whether more rounds would not change `decide`'s verdict: a candidate already wins, or
    every candidate is clearly below the gain worth having (its median plus the noise
    threshold under 1 + min_gain)."""
    verdict = decide(rates, baseline, min_gain, z)
    if verdict.choice != baseline:
        return True
    return all(_cannot_win(verdict, n, min_gain) for n in rates if n != baseline)


def _cannot_win(verdict, name, min_gain):
    """Failed or cut off, or under 1 + min_gain even with the noise added to its median."""
    return math.isinf(verdict.noise[name]) or verdict.ratios[name] * verdict.noise[name] < 1 + min_gain


def in_turn(runners, round_index):
    """(name, runner) pairs in this round's order: as given in even rounds, reversed in odd
    ones, so that no runner always goes first or always follows the same other (a turn
    right after another model's can run a few percent faster or slower)."""
    order = list(runners.items())
    return order if round_index % 2 == 0 else order[::-1]


def alternate(runners, budget_seconds, clock, min_rounds=MIN_ROUNDS, max_rounds=12, baseline=None, interleave=False):
    """Runs `runners` ({name: fn() -> throughput}) in turns (`in_turn`) until the budget is spent.

    At least `min_rounds` rounds run (unless one round alone overruns the budget, then
    what was measured is returned); rounds stop at `max_rounds`, when another would
    overrun the budget at the pace of the last round, or, given a `baseline`, as soon as
    the verdict against it is `settled`: a clear case takes a few rounds, a close one all
    the budget allows. Given a `baseline`, a candidate that cannot win any more (`losing`)
    gets no further turns, leaving the time to the ones still in contention.

    With `interleave`, each runner is a generator function whose turn yields after each of
    its steps and returns its throughput; the turns of a round then run at once, a step of
    each in turn (`interleaved`), so that the ratios of a round compare steps that ran a
    fraction of a second apart (turns of seconds one after the other differ by 25% and
    more on a shared machine).

    Returns:
        {name: [throughput per round]}; a dropped candidate's list is shorter.
    """
    rates = {name: [] for name in runners}
    active = dict(runners)
    start = last = clock()
    for round_index in range(max_rounds):
        order = in_turn(active, round_index)
        if interleave:
            for name, rate in interleaved([(name, run()) for name, run in order]).items():
                rates[name].append(rate)
        else:
            for name, run in order:
                rates[name].append(run())
        now = clock()
        spent, per_round, last = now - start, now - last, now
        enough = round_index + 1 >= min_rounds
        if enough and (spent + per_round > budget_seconds or (baseline and settled(rates, baseline))):
            break
        if spent > budget_seconds:
            break
        if baseline and enough:
            active = {n: run for n, run in active.items() if n == baseline or not losing(rates, baseline, n)}
    return rates


def interleaved(turns):
    """Runs generator turns ([(name, generator)]) a step of each in turn, in the given
    order, until every one has returned; {name: what it returned}."""
    results, live = {}, list(turns)
    while live:
        for name, turn in list(live):
            try:
                next(turn)
            except StopIteration as stop:
                results[name] = stop.value
                live.remove((name, turn))
    return results


def losing(rates, baseline, name, min_gain=MIN_GAIN, z=Z):
    """Whether candidate `name` cannot replace the baseline: on at least `MIN_ROUNDS` rounds
    it failed, or its median ratio is below 1 + min_gain even after adding the noise."""
    if len(rates[name]) < MIN_ROUNDS:
        return False
    return _cannot_win(decide({baseline: rates[baseline], name: rates[name]}, baseline, min_gain, z), name, min_gain)
