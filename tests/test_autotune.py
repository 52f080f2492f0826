"""--precision=autotune: a timed trial on the user's model; the fastest finite policy wins."""

import io
import json

import keras
import pytest
from test_monitor import Poison

import models
from tfmp import training
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
    fastest = max((r for r in rows.values() if r["finite"]), key=lambda r: r["examples_per_second"])
    if fastest["examples_per_second"] < rows["float32"]["examples_per_second"] * 1.03:
        fastest = rows["float32"]  # Not clearly faster: float32 stays.
    assert metrics["policy"] == entry["policy"] == fastest["policy"]
    assert "autotune, measured now" in out and "<- chosen" in out and "examples/s" in out
    keras.backend.clear_session()
    again, out = run(tmp_path)
    assert again["policy"] == metrics["policy"] and "autotune, cached in" in out


def test_autotune_skips_a_policy_whose_loss_is_not_finite(tmp_path, monkeypatch):
    monkeypatch.setitem(models.MODELS, "tiny", dense_model(overflow_in_float16=True))
    metrics, _ = run(tmp_path)
    rows = {r["policy"]: r for r in next(iter(json.loads((tmp_path / "autotune.json").read_text()).values()))["rows"]}
    assert not rows["mixed_float16"]["finite"] and rows["float32"]["finite"]
    assert metrics["policy"] != "mixed_float16"


def test_unknown_precision_lists_autotune():
    with pytest.raises(UsageError, match="unknown precision 'fast'.*float32, autotune"):
        training.validate(training.Config(precision="fast"))


def test_auto_on_a_bfloat16_cpu_measures_float32_against_bfloat16(tmp_path, monkeypatch):
    from tfmp import precision

    monkeypatch.setattr(precision, "detect_hardware", lambda: precision.Hardware(cpu_flags=("amx_bf16",)))
    monkeypatch.setitem(models.MODELS, "tiny", dense_model())
    config = training.Config(
        model="tiny",
        dataset="synthetic",
        precision="auto",
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
    assert metrics["policy"] == entry["policy"] and metrics["policy_reason"].startswith("auto: CPU with bfloat16")
    monkeypatch.setattr(precision, "detect_hardware", lambda: precision.Hardware(gpu_capability=(8, 0)))
    assert precision.auto_trial_candidates() is None  # On accelerators the hardware rule decides.


def test_choice_rule():
    from tfmp.autotune import choose

    def rows(**rates):
        return [{"policy": p, "examples_per_second": r, "finite": r > 0} for p, r in rates.items()]

    assert choose(rows(float32=100, mixed_bfloat16=300, mixed_float16=0)) == "mixed_bfloat16"
    assert choose(rows(float32=100, mixed_bfloat16=102)) == "float32"  # Within the trial's noise.
    assert choose(rows(float32=100, mixed_bfloat16=90, mixed_float16=104)) == "mixed_float16"
    assert choose(rows(float32=0, mixed_bfloat16=0)) == "float32"
