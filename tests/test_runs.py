"""Trustworthy runs of train.py: every bad input and fault ends with one stderr line, the
right exit status and an untouched --model_dir; one run per directory; resume refuses
changed settings; SIGTERM in the final evaluation exits 75 (at any other moment:
test_sigterm.py); the precision trial leaves the weights alone. Most cases run train.py's
main in this process (fast); a few run it as a process, where TensorFlow's own start-up
output could show."""

import json
import os
import shutil
import signal
import sys
import time

import pytest
from absl import flags
from conftest import GPUS, NO_SHARED_DATASETS, SHARED_DATASETS, entry_point_process, train_process

from tfmp import checkpoint, cli, run_directory
from tfmp.app import training

SMALL = ["--dataset=synthetic", "--epochs=1", "--steps_per_epoch=2", "--batch_size=16", "--precision=float32"]


def run_main(*args):
    """train.py's flag parsing and main in this process; returns the exit status."""
    import train  # noqa: F401 - defines the flags (once per process).

    flags.FLAGS.unparse_flags()
    try:
        argv = cli.flags_parser("train.py")(["train.py", *args])
        sys.modules["train"].main(argv)
    except SystemExit as e:
        return e.code
    return 0


def snapshot(directory):
    """Names, sizes and modification times of everything below `directory` (None if absent)."""
    if not os.path.exists(directory):
        return None
    return sorted(
        (os.path.relpath(os.path.join(root, name), directory), os.stat(os.path.join(root, name)).st_mtime_ns)
        for root, dirs, files in os.walk(directory)
        for name in dirs + files
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished run directory with checkpoints, run.json and metrics (2 epochs)."""
    directory = tmp_path_factory.mktemp("trained") / "run"
    config = training.Config(
        dataset="synthetic",
        precision="float32",
        epochs=2,
        steps_per_epoch=2,
        batch_size=16,
        checkpoint_every=2,
        model_dir=str(directory),
        verbose=0,
    )
    training.train_and_evaluate(config)
    return directory


def _as_an_older_run(d):
    """The run.json of a tfmp before --lr_schedule, whose rate was constant."""
    settings = json.loads((d / "run.json").read_text())
    del settings["lr_schedule"]
    (d / "run.json").write_text(json.dumps(settings))


def _garbage_checkpoint(d):
    (d / "checkpoints" / "checkpoint").write_bytes(bytes(range(256)) * 2)


# (case id, flags, words in the one error line, how to prepare an existing run directory)
CASES = [
    ("unknown model", ["--model=vgg"], "--model=vgg", None),
    ("unknown precision", ["--precision=float4"], "--precision=float4", None),
    ("unknown strategy", ["--strategy=gpus"], "--strategy=gpus", None),
    ("unknown lr scaling", ["--lr_scaling=cubic"], "--lr_scaling=cubic", None),
    ("unknown lr schedule", ["--lr_schedule=linear"], "--lr_schedule=linear", None),
    ("unknown resume", ["--resume=maybe"], "maybe", None),
    ("unknown bf16 rounding", ["--precision=bfloat16", "--bf16_rounding=up"], "--bf16_rounding=up", None),
    ("unknown flag", ["--no_such_flag=1"], "no_such_flag", None),
    ("batch not a number", ["--batch_size=abc"], "--batch_size=abc", None),
    ("lr not a number", ["--learning_rate=fast"], "--learning_rate=fast", None),
    ("epochs not an integer", ["--epochs=1.5"], "--epochs=1.5", None),
    ("stray argument", ["extra"], "unexpected argument", None),
    ("batch 0", ["--batch_size=0"], "--batch_size must be >= 1", None),
    ("batch negative", ["--batch_size=-4"], "--batch_size must be >= 1", None),
    ("epochs 0", ["--epochs=0"], "--epochs must be >= 1", None),
    ("steps per epoch 0", ["--steps_per_epoch=0"], "--steps_per_epoch must be >= 1", None),
    ("accumulation 0", ["--grad_accum_steps=0"], "--grad_accum_steps must be >= 1", None),
    ("steps per execution 0", ["--steps_per_execution=0"], "--steps_per_execution", None),
    ("log every 0", ["--log_every=0"], "--log_every", None),
    ("checkpoint every negative", ["--checkpoint_every=-1"], "--checkpoint_every", None),
    ("dataset directory missing", ["--dataset=/tmp/no_such_tfds_dir/1.0.0", "--nodownload"], "no_such_tfds_dir", None),
    ("lr negative", ["--learning_rate=-1"], "--learning_rate must be a positive finite", None),
    ("lr zero", ["--learning_rate=0"], "--learning_rate must be a positive finite", None),
    ("lr nan", ["--learning_rate=nan"], "--learning_rate must be a positive finite", None),
    ("lr inf", ["--learning_rate=inf"], "--learning_rate must be a positive finite", None),
    ("clipnorm zero", ["--clipnorm=0"], "--clipnorm", None),
    ("clipnorm nan", ["--clipnorm=nan"], "--clipnorm", None),
    ("clipnorm negative", ["--clipnorm=-1"], "--clipnorm", None),
    ("loss scale inf", ["--loss_scale_initial=inf"], "--loss_scale_initial", None),
    ("loss scale zero", ["--loss_scale_initial=0"], "--loss_scale_initial", None),
    ("loss scale growth 0", ["--loss_scale_growth_steps=0"], "--loss_scale_growth_steps", None),
    ("base batch negative", ["--lr_scaling=sqrt", "--base_batch_size=-1"], "--base_batch_size", None),
    ("vocabulary 0", ["--model=lstm", "--vocab_size=0"], "--vocab_size", None),
    ("sequence 0", ["--model=lstm", "--sequence_length=0"], "--sequence_length", None),
    ("tpu name unknown", ["--strategy=tpu", "--tpu=no-such-tpu"], "--strategy=tpu: no TPU found", None),
    ("tpu missing", ["--strategy=tpu", "--tpu=local"], "--strategy=tpu: no TPU found", None),
    ("multi worker without TF_CONFIG", ["--strategy=multi_worker"], "--strategy=multi_worker needs TF_CONFIG", None),
    ("dataset unknown", ["--dataset=no_such_set", "--nodownload"], "no_such_set", None),
    ("text model on images", ["--model=lstm", "--dataset=digits"], "takes text input", None),
    ("batch beyond memory", ["--batch_size=1000000000"], "more than half of this host", None),
    ("export dir is a file", ["--export_dir=/etc/hostname"], "is a file, not a directory", None),
    ("model dir unwritable", ["--model_dir=/proc/tfmp_run"], "cannot be written", None),
    ("export dir unwritable", ["--export_dir=/proc/tfmp_export"], "--export_dir=/proc/tfmp_export", None),
    ("checkpoint state garbage", [], "is unreadable", _garbage_checkpoint),
    ("settings changed", ["--batch_size=32"], "batch_size 16 -> 32", "copy"),
    ("seed and precision changed", ["--seed=3", "--precision=mixed_bfloat16"], "seed 0 -> 3", "copy"),
    ("schedule changed", ["--lr_schedule=constant", "--resume=force"], "resume with --lr_schedule=cosine", "copy"),
    ("an older run's constant rate", [], "resume with --lr_schedule=constant", _as_an_older_run),
    ("fewer epochs than done", ["--epochs=1"], "has trained 2 epochs already", "copy"),
    ("precision a checkpoint cannot carry", ["--precision=float8", "--resume=force"], "--precision=float32,", "copy"),
    ("forced into another model", ["--model=resnet", "--resume=force"], "does not load into this model", "copy"),
    ("directory in use", [], "is in use by pid", "lock"),
]


@pytest.mark.parametrize("name, args, words, prepare", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_exit_2_and_nothing_written(tmp_path, capsys, trained, name, args, words, prepare):
    model_dir = tmp_path / "run"
    flags_ = [*SMALL, "--epochs=2", f"--model_dir={model_dir}", "--checkpoint_every=2"]
    lock = None
    if prepare is not None:
        shutil.copytree(trained, model_dir)
        if callable(prepare):
            prepare(model_dir)
        elif prepare == "lock":
            lock = run_directory.RunLock(str(model_dir)).__enter__()
    before = snapshot(model_dir)
    given = [a.split("=")[0] for a in args]
    try:
        status = run_main(*[f for f in flags_ if f.split("=")[0] not in given], *args)
    finally:
        if lock is not None:
            lock.__exit__(None, None, None)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert status == 2, err
    assert len(lines) == 1 and lines[0].startswith("train.py: error: ") and words in lines[0], err
    after = snapshot(model_dir)
    if lock is not None:  # Our lock file itself is gone again.
        before = [e for e in before if e[0] != ".lock"]
    assert after == before


@pytest.mark.parametrize(
    "args, words",
    [
        (
            ["--grad_accum_steps=1000"],
            "--grad_accum_steps=1000: an epoch of 512 examples holds no full update of 16000 examples "
            "(--batch_size=16 x --grad_accum_steps=1000); the largest --grad_accum_steps that fits is 32",
        ),
        (["--batch_size=1000"], "--batch_size=1000: an epoch of 512 examples holds no full update"),
        (["--batch_size=1000"], "the largest --batch_size that fits is 512"),
        (["--batch_size=1000", "--grad_accum_steps=2"], "fits is 512 with --grad_accum_steps=1"),
    ],
)
def test_an_epoch_shorter_than_an_update_names_the_flag_and_the_largest_value_that_fits(tmp_path, capsys, args, words):
    flags_ = [f for f in SMALL if not f.startswith("--steps_per_epoch")]  # 512 synthetic examples an epoch.
    given = [a.split("=")[0] for a in args]
    status = run_main(*[f for f in flags_ if f.split("=")[0] not in given], f"--model_dir={tmp_path / 'run'}", *args)
    err = capsys.readouterr().err.strip()
    assert status == 2 and words in err, err
    assert not (tmp_path / "run").exists()


def test_tf_config_faults(monkeypatch, capsys, tmp_path):
    for value, words in [
        ("{not json", "not valid JSON"),
        ('{"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, "task": {"type": "worker", "index": 5}}', "worker:5"),
        ('{"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, "task": {"type": "ps", "index": 0}}', "ps:0"),
    ]:
        monkeypatch.setenv("TF_CONFIG", value)
        assert run_main(*SMALL, f"--model_dir={tmp_path / 'run'}") == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and words in lines[0]
        assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "args, words",
    [
        (["--model=vgg"], "--model=vgg"),
        (["--batch_size=abc"], "--batch_size=abc"),
        (["extra"], "unexpected argument"),
        (["--learning_rate=nan"], "--learning_rate"),
        pytest.param(  # One CPU device in a fresh process; valid where there is a GPU.
            ["--strategy=mirrored"],
            "--strategy=mirrored needs GPUs",
            marks=pytest.mark.skipif(GPUS > 0, reason="a GPU"),
        ),
    ],
)
def test_a_process_prints_exactly_one_line(tmp_path, args, words):
    """No TensorFlow start-up lines, no absl banner or usage: the one error line."""
    _, err = train_process(*SMALL, f"--model_dir={tmp_path / 'run'}", *args).communicate(timeout=300)
    assert err.splitlines() == [err.strip()] and err.startswith("train.py: error: ") and words in err, err
    assert not (tmp_path / "run").exists()


def test_a_wrong_flag_and_help_are_answered_before_tensorflow_loads():
    """train.py's flags come from modules that load no TensorFlow, and it loads once they are
    read: a wrong flag or --help answers at once (it took 5 s on 2 CPU cores)."""
    for flag, status, said in (("--model=vgg", 2, "train.py: error: flag --model=vgg"), ("--help", 1, "--model:")):
        result = entry_point_process("runpy.run_path('train.py', run_name='__main__')", flag)
        assert result.returncode == status and said in result.stdout + result.stderr, result
        assert result.stdout.splitlines()[-1] == "tensorflow loaded: False", result


def test_a_healthy_run_is_quiet(tmp_path):
    process = train_process(*SMALL, f"--model_dir={tmp_path / 'run'}")
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0 and err == "", err[-2000:]
    assert "test accuracy" in out and "I0000" not in out


def test_a_runs_own_warning_reaches_stderr(tmp_path):
    """Its absl warnings show where TensorFlow's start-up lines do not (absl's handler held fd 2,
    which the quiet start sends to /dev/null): here a flag the run leaves unread."""
    process = train_process(*SMALL, f"--model_dir={tmp_path / 'run'}", "--float8_exclude=head")
    _, err = process.communicate(timeout=300)
    lines = err.splitlines()
    assert process.returncode == 0 and len(lines) == 1, err[-2000:]
    assert lines[0].endswith("--float8_exclude has no effect: the policy is float32, not float8"), err


def test_second_run_on_a_directory_refuses_and_a_killed_run_leaves_no_lock(tmp_path):
    model_dir = tmp_path / "run"
    slow = ["--dataset=synthetic", "--epochs=1", "--steps_per_epoch=100000", "--batch_size=16"]
    first = train_process(*slow, "--precision=float32", f"--model_dir={model_dir}")
    try:
        for _ in range(1200):
            if (model_dir / "run.json").exists() or first.poll() is not None:
                break
            time.sleep(0.05)
        assert first.poll() is None
        second = train_process(*slow, "--precision=float32", f"--model_dir={model_dir}")
        _, err = second.communicate(timeout=300)
        assert second.returncode == 2 and err.count("\n") == 1
        assert f"is in use by pid {first.pid}" in err
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=60)
    finally:
        first.kill()
    assert run_main(*SMALL, f"--model_dir={model_dir}", "--resume=force") == 0  # The lock died with its process.


def test_changed_settings_resume_with_force_and_more_epochs_continue(trained, tmp_path, capsys):
    model_dir = tmp_path / "run"
    shutil.copytree(trained, model_dir)
    assert run_main(*SMALL, "--epochs=3", "--checkpoint_every=2", f"--model_dir={model_dir}") == 0
    metrics = json.loads((model_dir / "metrics.json").read_text())
    assert metrics["resumed_from_step"] == 4 and metrics["steps"] == 6
    assert run_main(*SMALL, "--epochs=4", "--batch_size=32", "--resume=force", f"--model_dir={model_dir}") == 0
    assert json.loads((model_dir / "run.json").read_text())["batch_size"] == 32


def test_a_finished_run_run_again_says_so_and_keeps_its_training_figures(trained, tmp_path, capsys):
    model_dir = tmp_path / "run"
    shutil.copytree(trained, model_dir)
    before = json.loads((model_dir / "metrics.json").read_text())
    capsys.readouterr()
    args = ["--dataset=synthetic", "--epochs=2", "--steps_per_epoch=2", "--batch_size=16", "--precision=float32"]
    assert run_main(*args, "--checkpoint_every=2", f"--model_dir={model_dir}") == 0
    out = capsys.readouterr().out
    assert "resumed     from batch 4 of 4: nothing left to train (more --epochs train on)" in out
    assert "(nothing left to train: its 4 batches ran before;" in out and "train examples/s" not in out
    after = json.loads((model_dir / "metrics.json").read_text())
    assert before["examples_per_second"] > 0 and after["steps"] == before["steps"] == 4
    for key in ("examples_per_second", "train_seconds", "weights_sha256", "test_accuracy"):
        assert after[key] == before[key], key


def test_sigterm_during_final_evaluation_exits_75(tmp_path, capsys, monkeypatch):
    evaluate = training.evaluation.evaluate

    def terminated_evaluate(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(training.evaluation, "evaluate", terminated_evaluate)
    assert run_main(*SMALL, f"--model_dir={tmp_path / 'run'}", "--checkpoint_every=1") == 75
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "preempted: SIGTERM outside training" in lines[0]
    latest = checkpoint.latest(str(tmp_path / "run" / "checkpoints"))
    assert checkpoint.step_of(latest) == 2


def test_same_seed_same_weights_whatever_the_precision_trial_did(tmp_path, monkeypatch):
    """A fresh run (the auto trial builds and steps its candidates, on CPUs with bfloat16), a
    run with the trial's cache present, and an explicit run of the chosen policy end with the
    same weights. The rounds' rates are injected (bfloat16 wins): the path taken does not
    depend on this CPU's speed."""
    from tfmp import timing

    def rounds(runners, *args, **kwargs):
        return {p: [150.0 if p == "mixed_bfloat16" else 100.0] * 5 for p in runners}

    monkeypatch.setattr(timing, "alternate", rounds)
    common = dict(
        dataset="synthetic", epochs=1, steps_per_epoch=3, batch_size=16, seed=5, deterministic=True, verbose=0
    )
    fresh = training.train_and_evaluate(training.Config(model_dir=str(tmp_path / "a"), **common))
    cached_dir = tmp_path / "b"
    if (tmp_path / "a" / "autotune.json").exists():
        cached_dir.mkdir()
        shutil.copy(tmp_path / "a" / "autotune.json", cached_dir)
    cached = training.train_and_evaluate(training.Config(model_dir=str(cached_dir), **common))
    explicit = training.train_and_evaluate(
        training.Config(model_dir=str(tmp_path / "c"), **{**common, "precision": fresh["policy"]})
    )
    assert fresh["policy"] == cached["policy"] == explicit["policy"]
    assert fresh["weights_sha256"] == cached["weights_sha256"] == explicit["weights_sha256"]


SHARED_MNIST = os.path.join(SHARED_DATASETS, "mnist_t10k", "1.0.0")


@NO_SHARED_DATASETS
@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_damaged_record_file_is_refused_before_training(tmp_path, capsys, damage):
    prepared = tmp_path / "mnist_t10k" / "1.0.0"
    shutil.copytree(SHARED_MNIST, prepared)
    (train,) = prepared.glob("*-train.tfrecord-*")
    train.chmod(0o644)
    data = bytearray(train.read_bytes())
    if damage == "truncate":
        data = data[: len(data) * 2 // 3]
    else:
        data[len(data) // 2] ^= 0x10  # One bit in the middle of a record.
    train.write_bytes(bytes(data))
    model_dir = tmp_path / "run"
    assert run_main(f"--dataset={prepared}", "--epochs=1", "--steps_per_epoch=2", f"--model_dir={model_dir}") == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "corrupt record file" in lines[0], lines
    assert not model_dir.exists()
