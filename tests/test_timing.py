"""The decision rule behind auto/autotune and jit_compile="auto", on injected timings."""

import itertools

import pytest

from tfmp import timing


def test_clear_gain_is_taken():
    rates = {"float32": [100, 98, 103, 101, 99], "bf16": [150, 149, 152, 147, 151]}
    verdict = timing.decide(rates, "float32")
    assert verdict.choice == "bf16"
    assert verdict.ratios["bf16"] == pytest.approx(1.5, rel=0.02)
    assert "bf16: 1.50x float32" in verdict.reason


def test_gain_within_noise_keeps_baseline():
    # bf16 is 4% faster on the median, but rounds swing by +-15%: not beyond the noise.
    rates = {"float32": [100, 100, 100, 100, 100], "bf16": [125, 90, 104, 118, 88]}
    verdict = timing.decide(rates, "float32")
    assert verdict.choice == "float32"
    assert "within the noise" in verdict.reason


def test_same_gain_with_little_noise_is_taken():
    rates = {"float32": [100, 100, 100, 100, 100], "bf16": [104.5, 104, 105, 103.5, 104]}
    assert timing.decide(rates, "float32").choice == "bf16"


def test_gain_below_minimum_keeps_baseline():
    rates = {"float32": [100] * 6, "bf16": [101.5] * 6}
    verdict = timing.decide(rates, "float32")
    assert verdict.choice == "float32"


def test_slower_candidate_is_named_slower():
    verdict = timing.decide({"float32": [100] * 4, "bf16": [80] * 4}, "float32")
    assert verdict.choice == "float32"
    assert "slower" in verdict.reason and "0.80x" in verdict.reason


def test_one_lucky_round_does_not_win():
    # A huge gain in one round of five (a slow spell during float32's turn) is not a win.
    rates = {"float32": [100, 100, 60, 100, 100], "bf16": [99, 100, 150, 98, 101]}
    assert timing.decide(rates, "float32").choice == "float32"


def test_fastest_of_several_clear_winners():
    rates = {"float32": [100] * 5, "bf16": [130, 131, 129, 130, 130], "f16": [160, 158, 161, 159, 160]}
    assert timing.decide(rates, "float32").choice == "f16"


def test_failed_or_cut_off_candidate_never_wins():
    rates = {"float32": [100] * 5, "f16": [500, 0.0, 500, 500, 500]}
    verdict = timing.decide(rates, "float32")
    assert verdict.choice == "float32"
    assert "failed or cut off" in verdict.reason


def test_too_few_rounds_keep_baseline():
    assert timing.decide({"float32": [100, 100], "bf16": [200, 200]}, "float32").choice == "float32"
    verdict = timing.decide({"float32": [100] * 4, "bf16": [140] * 4}, "float32")
    assert verdict.choice == "float32" and "too few rounds to switch" in verdict.reason


def test_a_gap_beyond_any_drift_switches_on_three_rounds():
    # XLA on a float16 CPU step: about 3x in every round, and only four rounds fit the budget.
    assert timing.decide({"off": [100] * 3, "on": [290, 310, 300]}, "off").choice == "on"
    # One round under 1.5x: five rounds are needed, as for any smaller gain.
    assert timing.decide({"off": [100] * 3, "on": [290, 140, 300]}, "off").choice == "off"


def test_three_close_rounds_are_not_a_measure_of_noise():
    # Three rounds that happen to agree (1.04, 1.05, 1.13): the robust spread of three sees
    # only the closest pair; the classic one sees the third, and five rounds are needed.
    rates = {"float32": [100] * 3, "bf16": [104, 105, 113]}
    assert timing.standard_error([0.039, 0.049, 0.122]) > 0.03
    assert timing.decide(rates, "float32").choice == "float32"


def test_alternate_takes_turns_in_alternating_order_and_keeps_to_the_budget():
    clock = itertools.count(0.0, 1.0)  # Each call of the clock is one second later.
    order = []

    def runner(name):
        def run():
            order.append(name)
            next(clock)  # A turn takes one second.
            return 1.0

        return run

    rates = timing.alternate({"a": runner("a"), "b": runner("b")}, 10.0, lambda: next(clock))
    assert order[:6] == ["a", "b", "b", "a", "a", "b"]  # No runner always goes first.
    assert len(rates["a"]) == len(rates["b"]) >= timing.MIN_ROUNDS
    # Rounds take about 3 ticks of the clock; the last one must not overrun the budget by much.
    assert len(rates["a"]) <= 4


def test_median_ratio_and_its_error():
    ratio, error = timing.median_ratio([2.0, 2.2, 1.8, 2.0], [1.0, 1.0, 1.0, 1.0])
    assert ratio == pytest.approx(2.0, rel=0.01) and 0 < error < 0.1
    assert timing.median_ratio([3.0] * 5, [1.0] * 5) == (pytest.approx(3.0), 0.0)
    assert timing.median_ratio([], []) == (None, None)


def test_alternate_stops_after_one_round_that_overruns():
    ticks = iter([0.0, 100.0, 200.0])
    rates = timing.alternate({"a": lambda: 1.0}, 10.0, lambda: next(ticks))
    assert rates == {"a": [1.0]}


def test_a_clear_case_stops_early_a_close_one_uses_the_budget():
    def runners(gain):
        return {"float32": lambda: 100.0, "bf16": lambda: 100.0 * gain}

    clock = itertools.count(0.0, 1.0)
    clear = timing.alternate(runners(1.3), 100.0, lambda: next(clock), baseline="float32")
    assert len(clear["bf16"]) == timing.MIN_ROUNDS_TO_SWITCH  # Won beyond doubt: no more rounds.
    slower = timing.alternate(runners(0.7), 100.0, lambda: next(clock), baseline="float32")
    assert len(slower["bf16"]) == timing.MIN_ROUNDS  # Clearly slower: no more rounds either.
    noisy = iter([100.0, 104.0, 97.0, 103.0] * 10)
    close = timing.alternate(
        {"float32": lambda: 100.0, "bf16": lambda: next(noisy)}, 100.0, lambda: next(clock), baseline="float32"
    )
    assert len(close["bf16"]) == 12  # Undecided: every round the budget allows.


def test_a_candidate_that_cannot_win_gets_no_more_turns():
    turns = []

    def runner(name, values):
        values = iter(values)
        return lambda: turns.append(name) or next(values)

    close = [100.0, 104.0, 97.0, 103.0] * 3
    runners = {
        "float32": runner("float32", [100.0] * 12),
        "bf16": runner("bf16", close),
        "fp16": runner("fp16", [30.0, 31.0, 29.0] + [300.0] * 9),  # Would win later; never asked.
    }
    clock = itertools.count(0.0, 1.0)
    rates = timing.alternate(runners, 100.0, lambda: next(clock), baseline="float32")
    assert len(rates["fp16"]) == timing.MIN_ROUNDS and turns.count("fp16") == timing.MIN_ROUNDS
    assert len(rates["float32"]) == len(rates["bf16"]) == 12  # The close contest gets every round.
    assert timing.decide(rates, "float32").choice == "float32"
    # 10% slower on three steady rounds: its median plus the noise is under the 2% worth having.
    assert timing.losing({"float32": [100.0] * 3, "x": [90.0] * 3}, "float32", "x")
    assert not timing.losing({"float32": [100.0] * 3, "x": [100.0, 90.0, 110.0]}, "float32", "x")  # Could win.
    assert not timing.losing({"float32": [100.0] * 2, "x": [10.0] * 2}, "float32", "x")  # Too few rounds.


def test_interleaved_turns_take_a_step_each_in_turn():
    log = []

    def turn(name, steps, rate):
        for _ in range(steps):
            log.append(name)
            yield
        return rate

    results = timing.interleaved([("a", turn("a", 3, 1.0)), ("b", turn("b", 1, 2.0)), ("c", turn("c", 2, 3.0))])
    assert log == ["a", "b", "c", "a", "c", "a"]  # b's one step done, the others go on.
    assert results == {"a": 1.0, "b": 2.0, "c": 3.0}


def test_alternate_interleaves_the_turns_of_a_round_in_alternating_order():
    log = []

    def runner(name, rate):
        def run():
            for _ in range(2):
                log.append(name)
                yield
            return rate

        return run

    clock = itertools.count(0.0, 1.0)
    rates = timing.alternate(
        {"a": runner("a", 1.0), "b": runner("b", 2.0)}, 100.0, lambda: next(clock), max_rounds=2, interleave=True
    )
    assert log == ["a", "b", "a", "b", "b", "a", "b", "a"]  # Round 2 starts with b.
    assert rates == {"a": [1.0, 1.0], "b": [2.0, 2.0]}
