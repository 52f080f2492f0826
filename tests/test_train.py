"""End-to-end: the real train.py binary, and train_and_evaluate under real strategies."""

import csv
import io
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from conftest import GPUS, REPO

from tfmp.app import training
from tfmp.errors import UsageError

METRIC_KEYS = {
    "test_accuracy",
    "test_loss",
    "policy",
    "strategy",
    "replicas",
    "global_batch_size",
    "examples_per_second",
    "epochs",
}


def run_train(*flags, cwd=REPO):
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    return subprocess.run(
        [sys.executable, os.path.join(REPO, "train.py"), *flags],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_train_binary_smoke(tmp_path):
    # float32 asked for: auto's trial (its path depends on the CPU's speed) is tested with
    # injected timings in test_autotune.py.
    result = run_train("--epochs=1", "--steps_per_epoch=4", "--precision=float32", f"--model_dir={tmp_path / 'run'}")
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert METRIC_KEYS <= set(metrics)
    # auto: the one GPU where there is one, else the default (CPU) strategy.
    assert metrics["strategy"] == ("one_device" if GPUS == 1 else "mirrored" if GPUS else "default")
    assert metrics["replicas"] == max(GPUS, 1) and metrics["steps"] == 4
    assert metrics["examples_per_second"] > 0
    # jit_compile=auto: the hardware rule (GPUs: on, CPUs: off), never a timing.
    rule = "auto: GPUs: on (a rule" if tf.config.list_physical_devices("GPU") else "auto: CPUs: off (a rule"
    assert metrics["jit_compile"] is rule.startswith("auto: GPUs") and metrics["jit_compile_reason"].startswith(rule)
    assert f"XLA         {'on' if metrics['jit_compile'] else 'off'} (" in result.stdout
    replicas = metrics["replicas"]
    assert f"({replicas} replica{'' if replicas == 1 else 's'}), 1 epoch x 4 updates" in result.stdout
    for words in ("precision", "strategy", "per-replica batch", "global batch", "learning rate", "test accuracy"):
        assert words in result.stdout
    files = {p.name for p in (tmp_path / "run").iterdir()}
    # No temporary file left; no decisions.json: nothing was left to auto (precision asked
    # for; XLA's "auto" is a rule).
    assert files == {"metrics.json", "history.csv", "training.png", "tensorboard", "checkpoints", "run.json"}
    assert metrics["skipped_steps"] == 0 and metrics["peak_memory_mb"] > 0


def test_model_dir_that_is_a_file(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(UsageError, match="is inside a file"):
        training.train_and_evaluate(training.Config(model_dir=str(blocker / "run"), epochs=1))


def test_a_run_too_short_to_time_says_so(tmp_path):
    """The first step is not timed (tracing); a run of one had said "0 train examples/s" and written 0.0."""
    out = io.StringIO()
    config = training.Config(
        model="cnn", dataset="synthetic", precision="float32", epochs=1, steps_per_epoch=1, model_dir=str(tmp_path)
    )
    metrics = training.train_and_evaluate(config, out=out)
    assert metrics["steps"] == 1 and metrics["examples_per_second"] is None
    assert "(too few steps to time the throughput; 0 skipped steps" in out.getvalue(), out.getvalue()


def test_mirrored_two_replicas_float16(tmp_path):
    config = training.Config(
        model="cnn",
        dataset="synthetic",
        precision="mixed_float16",
        strategy="mirrored",
        batch_size=16,
        epochs=1,
        steps_per_epoch=3,
        model_dir=str(tmp_path),
        loss_scale_initial=2.0**10,
        jit_compile="true",
        verbose=0,
    )
    metrics = training.train_and_evaluate(config)
    replicas = GPUS or 2  # Mirrored over the GPUs, else over conftest's two logical CPU devices.
    assert metrics["jit_compile"] is True  # XLA under MirroredStrategy, with loss scaling.
    assert metrics["replicas"] == replicas and metrics["strategy"] == "mirrored"
    assert metrics["per_replica_batch_size"] == 16 // replicas and metrics["global_batch_size"] == 16
    assert metrics["policy"] == "mixed_float16" and metrics["final_loss_scale"] is not None
    assert np.isfinite(metrics["test_loss"])
    if replicas != 2:
        return
    with pytest.raises(UsageError, match="--batch_size=15 does not divide by the 2 replicas"):
        training.train_and_evaluate(
            training.Config(dataset="synthetic", strategy="mirrored", batch_size=15, model_dir=str(tmp_path / "odd"))
        )


def test_lstm_feeds_cudnn_no_fully_masked_row(tmp_path, cudnn_mask_check):
    """A GPU's cuDNN LSTM refuses a batch with a fully masked row, and the shipped SST-2
    sentences hold two (")" and "(") that hold no word. Every sentence (the stream walks
    one whole permutation of them before the next), and the test set, through the real
    training path with cuDNN's mask check."""
    config = training.Config(
        model="lstm",
        precision="float32",
        batch_size=2048,
        epochs=2,
        vocab_size=200,
        sequence_length=8,
        model_dir=str(tmp_path),
        checkpoint_every=0,
        verbose=0,
    )
    metrics = training.train_and_evaluate(config)
    assert metrics["steps"] * 2048 >= 67349 and cudnn_mask_check  # Every sentence; the check ran.
    assert np.isfinite(metrics["test_loss"])


def short_run(tmp_path, model, steps, **settings):
    """A bundled model's train_and_evaluate on small synthetic data, without XLA (the rule turns it on for
    bfloat16 on a CPU without bfloat16 instructions, where compiling ResNet took 10 of a test's 20 s;
    tests/test_xla.py is XLA's): its metrics."""
    config = training.Config(
        jit_compile="false",
        model=model,
        dataset="synthetic",
        batch_size=8,
        epochs=1,
        steps_per_epoch=steps,
        model_dir=str(tmp_path),
        verbose=0,
        vocab_size=300,
        sequence_length=16,
        **settings,
    )
    return training.train_and_evaluate(config)


@pytest.mark.parametrize("model", ["resnet", "transformer"])
def test_other_models_train(tmp_path, model):
    metrics = short_run(tmp_path, model, 2, precision="mixed_bfloat16")
    assert metrics["steps"] == 2 and np.isfinite(metrics["test_loss"])


@pytest.mark.parametrize("model, rounding, most_bytes", [("lstm", "stochastic", 6.1), ("resnet", "kahan", 8.1)])
def test_bfloat16_weights_train_every_bundled_kind(tmp_path, model, rounding, most_bytes):
    """--precision=bfloat16: the LSTM builds (Keras' orthogonal initializer has no bfloat16
    QR), BatchNormalization's statistics stay float32 (ResNet: 8.1 bytes), and the run
    reports the bytes a parameter its weights and optimizer state take."""
    metrics = short_run(tmp_path, model, 3, precision="bfloat16", bf16_rounding=rounding)
    assert metrics["steps"] == 3 and np.isfinite(metrics["test_loss"]) and metrics["policy"] == "bfloat16"
    assert metrics["bf16_rounding"] == rounding and metrics["bytes_per_parameter"] <= most_bytes


def test_float8_exclude_keeps_its_layers_and_a_name_matching_none_is_said(tmp_path):
    """--float8_exclude of the cnn's one float8 candidate trains it as mixed_bfloat16, to the bit (tfmp.fit quantized
    it anyway); a name matching no layer (--keep_float32's too) is refused before training, naming the flag."""
    # Op determinism: without it oneDNN's bfloat16 kernels gave one of two results, run to run (3 in 10 on a Zen 4).
    excluded = short_run(tmp_path / "a", "cnn", 1, precision="float8", float8_exclude=("dense",), deterministic=True)
    plain = short_run(tmp_path / "b", "cnn", 1, precision="mixed_bfloat16", deterministic=True)
    assert excluded["weights_sha256"] == plain["weights_sha256"]
    for flag, policy in (("float8_exclude", "float8"), ("keep_float32", "mixed_bfloat16")):
        with pytest.raises(UsageError, match=f"--{flag}: 'dens' matches no layer of cnn \\(its layers: conv0a, "):
            short_run(tmp_path / flag, "cnn", 1, precision=policy, **{flag: ("dense", "dens")})


@pytest.mark.slow
def test_default_run_reaches_real_accuracy(tmp_path):
    """The README's main command: cnn on the shipped real digits, auto precision."""
    metrics = training.train_and_evaluate(training.Config(model_dir=str(tmp_path), verbose=0))
    assert metrics["dataset"] == "digits"
    assert metrics["test_accuracy"] >= 0.97, metrics


@pytest.mark.slow
def test_the_resnets_default_run_scores_its_test_set_as_it_trained(tmp_path):
    """`train.py --model=resnet` (float32: no timed choice): the test set is scored with BatchNormalization's moving
    statistics, which must have caught up with the weights in its 186 steps. At Keras' momentum, 0.99, it scored
    chance, 0.11, where its last training batches scored 0.99; at 0.9 and a constant learning rate, 0.92 on an AMD
    EPYC Zen 4, 0.96-0.98 over seeds 0-3 on a Zen 3, and 0.59 on one CI machine, where the run ended on a swing of
    its lagging statistics. Decayed to 0 (--lr_schedule=cosine, the default): 0.991-0.994 over seeds 0-3 on a Zen 3."""
    config = training.Config(model="resnet", precision="float32", model_dir=str(tmp_path), verbose=0)
    metrics = training.train_and_evaluate(config)
    assert metrics["dataset"] == "digits" and metrics["steps"] == 186 and metrics["test_accuracy"] >= 0.9, metrics


def test_training_path_feeds_the_monitor(tmp_path):
    """One loop for the bundled models: tfmp.fit, with its history and TensorBoard scalars."""
    config = training.Config(
        dataset="synthetic",
        precision="mixed_bfloat16",
        batch_size=16,
        epochs=1,
        steps_per_epoch=4,
        verbose=0,
        log_every=1,
        model_dir=str(tmp_path / "run"),
    )
    metrics = training.train_and_evaluate(config)
    assert metrics["steps"] == 4
    assert (tmp_path / "run" / "history.csv").read_text().count("\n") == 5
    assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))


@pytest.mark.parametrize("schedule", ["cosine", "constant"])
def test_the_learning_rate_follows_its_schedule_over_every_update_of_the_run(tmp_path, schedule):
    """--lr_schedule=cosine, the default, decays the rate to 0 over --epochs x an epoch's updates; constant keeps it.
    history.csv's rate is read after each update, as Keras reads it: step s's row holds update s + 1's rate."""
    config = training.Config(
        dataset="synthetic",
        precision="float32",
        batch_size=16,
        epochs=2,
        steps_per_epoch=3,
        learning_rate=0.01,
        lr_schedule=schedule,
        checkpoint_every=0,
        verbose=0,
        log_every=1,
        model_dir=str(tmp_path),
    )
    assert training.train_and_evaluate(config)["lr_schedule"] == schedule
    with open(tmp_path / "history.csv") as f:
        rates = [float(row["learning_rate"]) for row in csv.DictReader(f)]
    decay = [0.5 * (1 + math.cos(math.pi * step / 6)) if schedule == "cosine" else 1.0 for step in range(1, 7)]
    np.testing.assert_allclose(rates, [0.01 * d for d in decay], rtol=1e-5, atol=1e-9)
