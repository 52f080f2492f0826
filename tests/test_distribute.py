import json

import pytest
import tensorflow as tf
from conftest import GPUS

from tfmp import distribute
from tfmp.errors import UsageError


def test_default_and_one_device_never_none():
    default = distribute.get_strategy("default")
    assert default is tf.distribute.get_strategy()
    assert default.num_replicas_in_sync == 1
    one = distribute.get_strategy("one_device")
    assert isinstance(one, tf.distribute.OneDeviceStrategy)
    assert distribute.strategy_name(one) == "one_device"


def test_auto_follows_the_devices_and_prints_why(capsys):
    expected = "mirrored" if GPUS > 1 else "one_device" if GPUS else "default"
    assert distribute.strategy_name(distribute.get_strategy("auto")) == expected
    why = {"mirrored": f"{GPUS} GPUs", "one_device": "one GPU, /", "default": "no GPU or TPU"}[expected]
    assert capsys.readouterr().out.startswith(f"tfmp: strategy {expected} ({why}"), "auto says what it chose, and why"
    distribute.get_strategy("auto", verbose=False)
    distribute.get_strategy("default")  # Asked for by name: nothing to explain.
    assert capsys.readouterr().out == ""


def test_auto_under_tf_config_is_multi_worker_without_listing_devices(monkeypatch):
    # A multi-worker strategy must exist before TensorFlow's runtime starts, which listing devices would do.
    monkeypatch.setattr(distribute, "_tf_config_workers", lambda: 3)
    monkeypatch.setattr(tf.config, "list_logical_devices", lambda *a: pytest.fail("listed devices"))
    assert distribute._auto_strategy(None) == ("multi_worker", "TF_CONFIG names 3 workers")


def test_mirrored_over_the_gpus_else_the_logical_cpus():
    strategy = distribute.get_strategy("mirrored")
    assert strategy.num_replicas_in_sync == (GPUS or 2)  # conftest makes two logical CPU devices.
    assert all(("GPU" if GPUS else "CPU") in d for d in strategy.extended.worker_devices)
    assert distribute.strategy_name(strategy) == "mirrored"
    assert distribute.is_chief(strategy)


@pytest.mark.parametrize("host", ["bare", "markers"])
def test_tpu_missing_is_one_clear_error(monkeypatch, host):
    # Bare: said before TensorFlow's TPU start. Markers (a TPU VM's device files, say, but no TPU that
    # TensorFlow can start): TensorFlow's own failure, in one line.
    if host == "markers":
        monkeypatch.setattr(distribute, "_tpu_present", lambda: True)
    with pytest.raises(UsageError) as e:
        distribute.get_strategy("tpu", tpu="local", flags=True)
    message = str(e.value)
    assert "no TPU found" in message and "--tpu=local" in message and "\n" not in message
    assert ("shows no TPU device" in message) == (host == "bare"), message
    assert message.startswith("--strategy=tpu:") and "pick --strategy=auto" in message, message


def test_tpu_missing_under_auto_names_auto_and_tpu():
    # --strategy=auto with --tpu given goes to a TPU: the error names the flags the user gave, and the way out.
    with pytest.raises(UsageError) as e:
        distribute.get_strategy("auto", tpu="local", flags=True)
    message = str(e.value)
    assert message.startswith("--strategy=auto with --tpu=local picks tpu:") and "no TPU found" in message, message
    assert "leave --tpu=local out" in message and "pick --strategy=auto" not in message, message


def test_a_library_caller_is_told_the_arguments_not_train_py_flags(monkeypatch):
    # tfmp.get_strategy called from Python has no --strategy flag to change: its refusals name its arguments.
    monkeypatch.delenv("TF_CONFIG", raising=False)
    cases = [
        (("tpu", "local"), "tfmp.get_strategy('tpu'): no TPU found", "use tpu='local', else tpu='NAME_OR_GRPC"),
        (("auto", "local"), "tfmp.get_strategy('auto', tpu='local') picks tpu:", "or leave tpu='local' out"),
        (("multi_worker", None), "tfmp.get_strategy('multi_worker') needs TF_CONFIG", "BUILD.md"),
    ]
    monkeypatch.setattr(tf.config, "list_logical_devices", lambda kind=None: [])  # A host with one device.
    cases.append((("mirrored", None), "tfmp.get_strategy('mirrored') needs GPUs", "tfmp.get_strategy('default')"))
    for (name, tpu), start, way in cases:
        with pytest.raises(UsageError) as e:
            distribute.get_strategy(name, tpu=tpu)
        message = str(e.value)
        assert message.startswith(start) and way in message and "--" not in message, message


def test_multi_worker_needs_tf_config(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(UsageError, match="TF_CONFIG"):
        distribute.get_strategy("multi_worker")
    monkeypatch.setenv("TF_CONFIG", "{not json")
    with pytest.raises(UsageError, match="not valid JSON"):
        distribute.get_strategy("multi_worker")


def test_tf_config_workers(monkeypatch):
    cluster = {"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, "task": {"type": "worker", "index": 0}}
    monkeypatch.setenv("TF_CONFIG", json.dumps(cluster))
    assert distribute._tf_config_workers() == 2


def test_unknown_strategy():
    with pytest.raises(UsageError, match="'gpus'.*auto, default, one_device, mirrored, multi_worker, tpu"):
        distribute.get_strategy("gpus")


def test_batch_plan_splits_and_scales():
    plan = distribute.plan_batch(256, 2, 0.1, "linear", base_batch=128)
    assert (plan.per_replica, plan.effective_batch) == (128, 256)
    assert plan.learning_rate == pytest.approx(0.2)
    plan = distribute.plan_batch(256, 4, 0.1, "sqrt", base_batch=64, grad_accum_steps=4)
    assert plan.effective_batch == 1024
    assert plan.learning_rate == pytest.approx(0.4)
    assert distribute.plan_batch(64, 1, 0.1).learning_rate == pytest.approx(0.1)
    table = plan.table()
    assert "per-replica batch           64" in table and "effective batch per update  1024" in table
    assert "learning rate               0.4 (sqrt scaling of 0.1 at batch 64)" in table
    assert "0.1 (as given, not scaled with the batch)" in distribute.plan_batch(64, 1, 0.1).table()


def test_batch_that_does_not_divide_quotes_both_numbers():
    with pytest.raises(UsageError, match="global batch size 127 does not divide by the 2 replicas.*126 or 128"):
        distribute.plan_batch(127, 2, 0.1)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"global_batch": 0, "replicas": 1, "learning_rate": 0.1}, "global batch size must be >= 1"),
        (
            {"global_batch": 8, "replicas": 1, "learning_rate": 0.1, "lr_scaling": "cubic"},
            "'cubic'.*none, linear, sqrt",
        ),
        (
            {"global_batch": 8, "replicas": 1, "learning_rate": 0.1, "grad_accum_steps": 0},
            "grad_accum_steps must be >= 1",
        ),
    ],
)
def test_bad_batch_settings(kwargs, match):
    with pytest.raises(UsageError, match=match):
        distribute.plan_batch(**kwargs)
