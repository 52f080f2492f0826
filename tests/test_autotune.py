"""--precision=autotune: a timed trial on the user's model; the fastest finite policy wins."""

import dataclasses
import io
import itertools
import json

import keras
import pytest
from conftest import Poison

from tfmp import timing
from tfmp.app import models, training
from tfmp.errors import UsageError
from tfmp.heads import classification_head


def dense_model(overflow_in_float16=False):
    def build(num_classes, input_shape, **_):
        inputs = keras.Input(input_shape)
        x = keras.layers.Flatten()(inputs)
        x = keras.layers.Dense(64, activation="relu")(x)
        if overflow_in_float16:  # 1e6 is finite in float32 and bfloat16, inf in float16.
            x = Poison(1e6, first=0, name="big")(x)
        return keras.Model(inputs, classification_head(num_classes)(x))

    return models.Entry("image", build)


def run(tmp_path, model="tiny"):
    out = io.StringIO()
    config = training.Config(
        model=model,
        dataset="synthetic",
        precision="autotune",
        batch_size=32,
        epochs=1,
        steps_per_epoch=3,
        checkpoint_every=0,
        model_dir=str(tmp_path),
        verbose=0,
    )
    return training.train_and_evaluate(config, out=out), out.getvalue()


def test_autotune_times_every_policy_and_caches(tmp_path, monkeypatch):
    monkeypatch.setitem(models.MODELS, "tiny", dense_model())
    metrics, out = run(tmp_path)
    cache = json.loads((tmp_path / "autotune.json").read_text())
    (entry,) = cache.values()
    rows = {r["policy"]: r for r in entry["rows"]}
    assert set(rows) == {"float32", "mixed_bfloat16", "mixed_float16"}
    # The rounds alternated, and the choice is the rule's verdict on them.
    rounds = {p: r["rounds"] for p, r in rows.items()}
    assert len(rounds["float32"]) >= timing.MIN_ROUNDS
    for policy, values in rounds.items():  # Every policy ran; one with fewer rounds had lost.
        assert timing.MIN_ROUNDS <= len(values) <= len(rounds["float32"])
        if len(values) < len(rounds["float32"]):
            assert timing.losing({p: r[: len(values)] for p, r in rounds.items()}, "float32", policy)
    assert metrics["policy"] == entry["policy"] == timing.decide(rounds, "float32").choice
    assert "autotune, measured now" in out and "<- chosen" in out and "examples/s" in out
    # Its cost said before it ran.
    assert out.index("precision: timing float32, mixed_bfloat16, mixed_float16 on the model") < out.index("<- chosen")
    keras.backend.clear_session(free_memory=False)
    again, out = run(tmp_path)  # The same command in the same directory: the recorded decision.
    assert again["policy"] == metrics["policy"] and "as recorded in" in out and "autotune, measured now" in out


def test_autotune_skips_a_policy_whose_loss_is_not_finite(tmp_path, monkeypatch):
    monkeypatch.setitem(models.MODELS, "tiny", dense_model(overflow_in_float16=True))
    metrics, _ = run(tmp_path)
    rows = {r["policy"]: r for r in next(iter(json.loads((tmp_path / "autotune.json").read_text()).values()))["rows"]}
    assert not rows["mixed_float16"]["finite"] and rows["float32"]["finite"]
    assert metrics["policy"] != "mixed_float16"


def test_unknown_precision_lists_autotune():
    with pytest.raises(UsageError, match="unknown --precision='fast'.*float32, float8, bfloat16, autotune"):
        training.validate(training.Config(precision="fast"))


def test_auto_on_a_bfloat16_cpu_measures_float32_against_bfloat16_once_per_directory(tmp_path, monkeypatch, caplog):
    from tfmp import precision, xla

    monkeypatch.setattr(precision, "detect_hardware", lambda: precision.Hardware(cpu_flags=("amx_bf16",)))
    monkeypatch.setitem(models.MODELS, "tiny", dense_model())
    # Injected timings: the path taken does not depend on this CPU's speed.
    monkeypatch.setattr(FakeCandidate, "RATES", {"float32": [100, 101, 99], "mixed_bfloat16": [150, 149, 151]})
    monkeypatch.setattr(training.autotune, "Candidate", FakeCandidate)
    monkeypatch.setattr(xla, "measure", lambda *_: {xla.OFF: [100.0] * 5, xla.ON: [140.0, 139.0, 141.0, 140.0, 140.0]})
    monkeypatch.setattr(xla, "_VERDICTS", {})
    config = training.Config(
        model="tiny",
        dataset="synthetic",
        precision="auto",
        jit_compile="autotune",
        batch_size=32,
        epochs=1,
        steps_per_epoch=2,
        checkpoint_every=0,
        model_dir=str(tmp_path),
        verbose=0,
    )
    metrics = training.train_and_evaluate(config, out=io.StringIO())
    (entry,) = json.loads((tmp_path / "autotune.json").read_text()).values()
    assert [r["policy"] for r in entry["rows"]] == ["float32", "mixed_bfloat16"]
    assert metrics["policy"] == entry["policy"] == "mixed_bfloat16" and metrics["jit_compile"] is True
    assert metrics["policy_reason"].startswith("auto: CPU with bfloat16")
    recorded = json.loads((tmp_path / "decisions.json").read_text())
    assert recorded["precision"]["value"] == "mixed_bfloat16" and recorded["jit_compile"]["value"] is True
    # A rerun in the same directory takes both decisions again, whatever a new trial would say.
    monkeypatch.setattr(training.autotune, "trial", None)  # Would fail if called.
    monkeypatch.setattr(xla, "measure", None)
    keras.backend.clear_session(free_memory=False)
    again = training.train_and_evaluate(config, out=io.StringIO())
    assert again["policy"] == metrics["policy"] and again["jit_compile"] == metrics["jit_compile"]
    assert again["policy_reason"].startswith("as recorded in") and "CPU with bfloat16" in again["policy_reason"]
    assert again["jit_compile_reason"].startswith("as recorded in")
    other = "float32" if metrics["policy"] != "float32" else "mixed_bfloat16"
    keras.backend.clear_session(free_memory=False)
    with caplog.at_level("WARNING"):
        training.train_and_evaluate(dataclasses.replace(config, precision=other), out=io.StringIO())
    (line,) = [r.getMessage() for r in caplog.records if "recorded" in r.getMessage()]
    assert line.startswith(f"precision: {other}, where") and "will not match" in line
    monkeypatch.setattr(precision, "detect_hardware", lambda: precision.Hardware(gpu_capability=(8, 0)))
    assert precision.auto_trial_candidates() is None  # On accelerators the hardware rule decides.


class FakeCandidate:
    """Stands in for autotune.Candidate: each turn returns the next injected rate."""

    RATES = {}
    STEP_SECONDS = {}  # Per policy; default 0.01.
    FINITE = ("float32", "mixed_bfloat16")

    def __init__(self, policy, *args):
        self.rates = itertools.cycle(self.RATES[policy])
        self.step = self.STEP_SECONDS.get(policy, 0.01)
        self.durations, self.finite, self.cut_off = [], policy in self.FINITE, False
        self.turns, self.policy = 0, policy
        FakeCandidate.made[policy] = self

    made, log = {}, []

    def warm_up(self, steps):
        self.durations += [self.step] * steps

    def turn(self, steps):
        self.turns += 1
        for _ in range(steps):
            self.durations.append(self.step)
            FakeCandidate.log.append(self.policy)
            yield
        return next(self.rates)


@pytest.mark.parametrize(
    "rates, chosen",
    [
        # bfloat16 clearly faster every round: taken.
        ({"float32": [100, 104, 98, 101, 99], "mixed_bfloat16": [131, 137, 128, 133, 130]}, "mixed_bfloat16"),
        # 5% faster on the median but swinging +-20% round to round: float32 stays.
        ({"float32": [100] * 5, "mixed_bfloat16": [125, 84, 105, 121, 86]}, "float32"),
        # float16 fastest but its loss is not finite: never chosen.
        ({"float32": [100] * 5, "mixed_bfloat16": [99] * 5, "mixed_float16": [400] * 5}, "float32"),
    ],
)
def test_trial_decides_on_alternating_rounds(rates, chosen, monkeypatch, tmp_path):
    from tfmp.app import autotune

    monkeypatch.setattr(FakeCandidate, "RATES", rates)
    monkeypatch.setattr(FakeCandidate, "log", [])
    monkeypatch.setattr(autotune, "Candidate", FakeCandidate)
    clock = itertools.count(0.0, 2.5)  # Each round takes 2.5 s: five or six rounds in the budget.
    decision = autotune.autotune(
        "k", None, None, None, 32, str(tmp_path), tuple(rates), budget_seconds=15, clock=lambda: next(clock)
    )
    assert decision.policy == chosen
    assert "autotune, measured now: " + chosen in decision.reason.splitlines()[0]
    # The turns of a round ran a step of each policy in turn (steps of 0.01 s: 62 each).
    assert FakeCandidate.log[: 2 * len(rates)] == list(rates) * 2


def test_a_policy_far_slower_in_warm_up_takes_no_turns(monkeypatch, tmp_path):
    from tfmp.app import autotune

    rates = {"float32": [100] * 12, "mixed_bfloat16": [131, 137, 128, 133, 130] * 3, "mixed_float16": [900] * 12}
    monkeypatch.setattr(FakeCandidate, "RATES", rates)
    monkeypatch.setattr(FakeCandidate, "FINITE", tuple(rates))
    monkeypatch.setattr(FakeCandidate, "STEP_SECONDS", {"mixed_float16": 0.01 * (autotune.MAX_SLOWDOWN + 1)})
    monkeypatch.setattr(autotune, "Candidate", FakeCandidate)
    clock = itertools.count(0.0, 2.5)
    decision = autotune.autotune(
        "k", None, None, None, 32, str(tmp_path), tuple(rates), budget_seconds=15, clock=lambda: next(clock)
    )
    # Its turns would have won (900 examples/s): it never ran one, and is not chosen.
    assert decision.policy == "mixed_bfloat16" and FakeCandidate.made["mixed_float16"].turns == 0
    assert "cut off" in decision.reason
