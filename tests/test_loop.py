"""tfmp's loop (tfmp.fit): same weights on 1 replica, 2 replicas and 2 worker processes;
gradient accumulation; clipping over all-reduced gradients; overflow on one replica."""

import json
import os
import signal
import time

import keras
import numpy as np
import pytest
import tensorflow as tf
import tiny
from conftest import REPO, assert_same, start_workers, wait_all

from tfmp import inputs, loop, run
from tfmp.steps import Steps

STEPS, BATCH = 5, 32


@pytest.fixture(scope="module")
def init():
    keras.utils.set_random_seed(0)
    model, _ = tiny.build(tf.distribute.get_strategy())
    return [w.numpy() for w in model.weights]


@pytest.fixture(scope="module")
def one_replica(init):
    return tiny.train(tf.distribute.get_strategy(), init, STEPS, BATCH)[0]


def test_training_moves_weights(init, one_replica):
    assert max(np.abs(a - b).max() for a, b in zip(init, one_replica, strict=True)) > 1e-3


def test_two_replicas_match_one(mirrored, init, one_replica):
    assert_same(tiny.train(mirrored, init, STEPS, BATCH)[0], one_replica)


def test_grad_accumulation_matches_full_batch(mirrored, init, one_replica):
    assert_same(tiny.train(tf.distribute.get_strategy(), init, STEPS, BATCH // 2, grad_accum_steps=2)[0], one_replica)
    assert_same(tiny.train(mirrored, init, STEPS, BATCH // 2, grad_accum_steps=2)[0], one_replica)


def test_clipping_over_replicas_matches_one_replica(mirrored, init, one_replica):
    clipped_one = tiny.train(tf.distribute.get_strategy(), init, STEPS, BATCH, clipnorm=0.05)[0]
    clipped_two = tiny.train(mirrored, init, STEPS, BATCH, clipnorm=0.05)[0]
    assert_same(clipped_two, clipped_one)
    # The clip was active: the clipped run differs from the unclipped one.
    assert max(np.abs(a - b).max() for a, b in zip(clipped_one, one_replica, strict=True)) > 1e-3


@pytest.mark.parametrize("bad_replica", [0, 1])
def test_overflow_on_one_replica_skips_everywhere(mirrored, bad_replica):
    keras.config.set_dtype_policy("mixed_float16")
    model, optimizer = tiny.build(mirrored, schedule=True)
    ds = tiny.dataset(BATCH)
    runner = loop.prepare(model, mirrored, ds.train.element_spec)
    assert isinstance(runner, Steps) and runner.optimizer is model.optimizer is optimizer
    iterator = inputs.Input(ds.make_train, mirrored, 4, 1, "data").stream(0)
    runner.train(iterator)
    before = [w.numpy() for w in model.weights]
    lr_before = float(optimizer.learning_rate)
    scale_before = float(optimizer.dynamic_scale.numpy())
    model.get_layer("inject").bad_replica.assign(bad_replica)
    logs = runner.train(iterator)
    assert not np.isfinite(float(logs["grad_norm"]))
    assert run.first_non_finite_gradient(runner, logs["finite"]) is not None
    assert_same([w.numpy() for w in model.weights], before, atol=0)
    for w in model.trainable_weights:
        local = mirrored.experimental_local_results(w.value)
        np.testing.assert_array_equal(local[0].numpy(), local[1].numpy())
    assert int(optimizer.iterations.numpy()) == 1
    assert float(optimizer.learning_rate) == lr_before  # The schedule did not advance.
    assert float(optimizer.dynamic_scale.numpy()) == scale_before / 2
    model.get_layer("inject").bad_replica.assign(-1)
    runner.train(iterator)
    assert int(optimizer.iterations.numpy()) == 2 and float(optimizer.learning_rate) < lr_before
    assert all(np.isfinite(w.numpy()).all() for w in model.weights)


def test_two_worker_processes_match_one_replica(tmp_path, init, one_replica):
    np.savez(tmp_path / "init.npz", *init)
    script = os.path.join(REPO, "tests", "tiny.py")
    processes = start_workers(
        lambda i: [script, str(tmp_path / "init.npz"), str(tmp_path / f"w{i}.npz"), str(STEPS), str(BATCH)]
    )
    for code, _, err in wait_all(processes):
        assert code == 0, err[-3000:]
    for i in range(2):
        assert_same(list(np.load(tmp_path / f"w{i}.npz").values()), one_replica)


def agreeing_fingerprints(results):
    """Checks every worker of a train.py cluster succeeded and ended with the same weights."""
    for code, _, err in results:
        assert code == 0, err[-3000:]
    fingerprints = [
        line.split("weights ")[1][:12]
        for _, out, _ in results
        for line in out.splitlines()
        if line.startswith("test accuracy")
    ]
    assert len(fingerprints) == len(results) and len(set(fingerprints)) == 1
    return fingerprints


def test_two_worker_train_binary(tmp_path):
    model_dir = tmp_path / "run"
    flags = [
        "--strategy=multi_worker",
        "--dataset=synthetic",
        "--epochs=1",
        "--steps_per_epoch=3",
        "--batch_size=16",
        f"--model_dir={model_dir}",
        "--precision=float32",
    ]
    results = wait_all(start_workers(lambda i: [os.path.join(REPO, "train.py"), *flags]))
    fingerprints = agreeing_fingerprints(results)
    assert "2 replicas" in results[0][1]
    assert {p.name for p in model_dir.iterdir()} == {
        "metrics.json",
        "history.csv",
        "training.png",
        "tensorboard",
        "checkpoints",
        "run.json",  # No decisions.json: float32 asked for, and XLA's "auto" is a rule.
    }
    assert len(list((model_dir / "checkpoints").glob("ckpt-*.index"))) == 1  # The chief's final checkpoint only.
    metrics = json.loads((model_dir / "metrics.json").read_text())
    assert metrics["workers"] == 2 and metrics["weights_sha256"].startswith(fingerprints[0])
    assert "tfmp-worker-" in results[1][1]  # The other worker wrote to its temporary place.


@pytest.mark.slow
def test_two_workers_preempted_then_resumed(tmp_path):
    """SIGTERM to one worker: TensorFlow's preemption handling saves on both and both exit 75;
    rerunning the same command resumes both from the chief's checkpoint, and they agree."""
    model_dir = tmp_path / "run"
    flags = [
        "--strategy=multi_worker",
        "--dataset=synthetic",
        "--epochs=1",
        "--steps_per_epoch=300",
        "--batch_size=16",
        "--checkpoint_every=20",
        f"--model_dir={model_dir}",
        "--precision=float32",
    ]
    processes = start_workers(lambda i: [os.path.join(REPO, "train.py"), *flags])
    first = model_dir / "checkpoints" / "ckpt-20.index"
    for _ in range(1200):
        if first.exists() or any(p.poll() is not None for p in processes):
            break
        time.sleep(0.1)
    processes[0].send_signal(signal.SIGTERM)
    for code, _, err in wait_all(processes):
        assert code == 75, err[-3000:]
        assert "preempted: SIGTERM: checkpoint saved" in err and "Traceback" not in err
    saved = max(int(p.name[5:-6]) for p in (model_dir / "checkpoints").glob("ckpt-*.index"))
    assert 20 <= saved < 300
    results = wait_all(start_workers(lambda i: [os.path.join(REPO, "train.py"), *flags]))
    fingerprint = agreeing_fingerprints(results)[0]
    metrics = json.loads((model_dir / "metrics.json").read_text())
    assert metrics["resumed_from_step"] == saved and metrics["steps"] == 300
    assert metrics["weights_sha256"].startswith(fingerprint)
