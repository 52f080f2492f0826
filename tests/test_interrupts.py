"""SIGTERM and Ctrl-C during `tfmp.fit` with a checkpoint directory: a checkpoint after the
update under way (or the epoch's end), then `tfmp.Preempted` or `tfmp.Interrupted`, from
which a rerun resumes exactly; a second Ctrl-C stops at once; train.py's one line for Ctrl-C.
(SIGTERM at any moment of a train.py process: tests/test_sigterm.py.)"""

import os
import signal

import keras
import pytest
from conftest import assert_same, regression, regression_data, weights

import tfmp
from tfmp import cli
from tfmp.errors import Interrupted


class Signal(keras.callbacks.Callback):
    """Sends `signum` to this process `times` times as batch `at` ends."""

    def __init__(self, signum, times=1, at=2):
        super().__init__()
        self.signum, self.times, self.at = signum, times, at

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.at:
            for _ in range(self.times):
                os.kill(os.getpid(), self.signum)


@pytest.fixture
def pythons_sigint():
    """Python's own SIGINT handler, as in a terminal: a process started in the background by
    a shell without job control (`cmd &` in a script) inherits SIGINT ignored, and then
    Python installs none and Ctrl-C cannot reach it, nor tfmp's handling."""
    found = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, found)


def fit_signalled(model, directory, signum, times=1, at=2, data=regression_data):
    """tfmp.fit for 2 epochs with checkpoints in `directory`, `signum` sent `times` times as batch `at` ends."""
    callbacks = [Signal(signum, times, at)]
    tfmp.fit(model, data(), epochs=2, checkpoint_dir=str(directory), callbacks=callbacks, verbose=0)


def assert_resumes_as_unbroken(directory, data=regression_data):
    resumed = regression()
    tfmp.fit(resumed, data(), epochs=2, checkpoint_dir=str(directory), verbose=0)
    unbroken = regression()
    tfmp.fit(unbroken, data(), epochs=2, verbose=0)
    assert_same(weights(resumed), weights(unbroken), atol=0)


def unknown_length():
    return regression_data().filter(lambda x, y: True)


@pytest.mark.parametrize(
    "at, data",
    [(2, regression_data), (7, regression_data), (7, unknown_length)],
    ids=["within an epoch", "at its last batch", "at the last batch of an epoch of unknown length"],
)
def test_sigterm_saves_and_raises_preempted(tmp_path, at, data):
    """Resumed from its last batch, the epoch has nothing left and the next one begins."""
    model = regression()
    with pytest.raises(tfmp.Preempted, match="checkpoint saved"):
        fit_signalled(model, tmp_path, signal.SIGTERM, at=at, data=data)
    assert (tmp_path / f"ckpt-{at + 1}.index").exists()
    assert_resumes_as_unbroken(tmp_path, data)


def test_a_sigterm_before_training_stops_after_the_first_update(tmp_path):
    """One that came while the run set up (its exception lost, the flag kept: tfmp.cli)."""
    from tfmp.errors import SIGTERM_RECEIVED

    SIGTERM_RECEIVED.set()
    try:
        with pytest.raises(tfmp.Preempted, match="SIGTERM at batch 1: checkpoint saved"):
            tfmp.fit(regression(), regression_data(), epochs=2, checkpoint_dir=str(tmp_path), verbose=0)
    finally:
        SIGTERM_RECEIVED.clear()
    assert (tmp_path / "ckpt-1.index").exists()


def test_ctrl_c_saves_and_raises_interrupted_and_a_second_stops_at_once(tmp_path, capfd, pythons_sigint):
    model = regression()
    with pytest.raises(tfmp.Interrupted, match="Ctrl-C at batch 3: checkpoint saved") as raised:
        fit_signalled(model, tmp_path, signal.SIGINT)
    assert isinstance(raised.value, KeyboardInterrupt)
    assert "Ctrl-C: saving a checkpoint after this update" in capfd.readouterr().err
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Python's own again.
    assert (tmp_path / "ckpt-3.index").exists()
    assert_resumes_as_unbroken(tmp_path)
    # Twice: the second is Python's KeyboardInterrupt, where it lands (here, in the callback).
    again = tmp_path / "again"
    with pytest.raises(KeyboardInterrupt) as raised:
        fit_signalled(regression(), again, signal.SIGINT, times=2)
    assert not isinstance(raised.value, tfmp.Interrupted) and not list(again.glob("ckpt-3*"))


def test_ctrl_c_in_validation_stops_after_the_epochs_save(tmp_path, pythons_sigint):
    class CtrlC(keras.callbacks.Callback):
        def on_test_batch_end(self, batch, logs=None):
            if batch == 0:
                os.kill(os.getpid(), signal.SIGINT)

    model = regression()
    with pytest.raises(tfmp.Interrupted, match="Ctrl-C at batch 8: checkpoint saved"):
        tfmp.fit(
            model,
            regression_data(),
            validation_data=regression_data(),
            epochs=3,
            checkpoint_dir=str(tmp_path),
            callbacks=[CtrlC()],
            verbose=0,
        )
    assert int(model.optimizer.iterations.numpy()) == 8 and (tmp_path / "ckpt-8.index").exists()


def test_ctrl_c_exits_130_with_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info, cli.user_errors("train.py"):
        raise Interrupted("Ctrl-C at batch 3: checkpoint saved in runs/x/checkpoints; rerun the same command to resume")
    assert exit_info.value.code == 130
    assert capsys.readouterr().err.strip() == (
        "train.py: interrupted: Ctrl-C at batch 3: checkpoint saved in runs/x/checkpoints; rerun the same command to "
        "resume"
    )
    with pytest.raises(SystemExit) as exit_info, cli.user_errors("train.py"):
        raise KeyboardInterrupt  # Outside training, or a second Ctrl-C.
    assert exit_info.value.code == 130 and capsys.readouterr().err.strip() == "train.py: interrupted: Ctrl-C"
