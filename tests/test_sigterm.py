"""SIGTERM at any moment of a run ends it with exit status 75 and one stderr line: while
TensorFlow loads, while the run sets up, while it trains (a checkpoint first), and wherever
the handler's exception lands: in a finalizer that drops it, in an import that C code
started, inside tracing or a Keras layer that wraps it."""

import os
import signal
import time

import pytest
from conftest import train_process

from tfmp import cli

SMALL = ["--dataset=synthetic", "--epochs=1", "--batch_size=16", "--precision=float32"]


def _sigterm_handled(pid):
    """Whether process `pid` has a SIGTERM handler installed (bit 15 of SigCgt)."""
    with open(f"/proc/{pid}/status") as f:
        caught = next(line for line in f if line.startswith("SigCgt:")).split()[1]
    return bool(int(caught, 16) >> (signal.SIGTERM - 1) & 1)


# Each phase is waited for, not guessed from the wall clock: a slower machine reaches it later.
PHASES = {
    "loading": lambda process, model_dir: _sigterm_handled(process.pid),  # Its flags read, TensorFlow loads.
    "setting up": lambda process, model_dir: (model_dir / "run.json").exists(),  # Lock taken; model, XLA next.
    "training": lambda process, model_dir: list((model_dir / "checkpoints").glob("ckpt-2.index")),
}


@pytest.mark.parametrize("phase", list(PHASES))
def test_sigterm_at_any_moment_exits_75_with_one_line(tmp_path, phase):
    model_dir = tmp_path / "run"
    process = train_process(*SMALL, "--steps_per_epoch=100000", "--checkpoint_every=2", f"--model_dir={model_dir}")
    try:
        deadline = time.monotonic() + 300
        while not PHASES[phase](process, model_dir):
            assert process.poll() is None and time.monotonic() < deadline, f"never reached {phase}"
            time.sleep(0.01)
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=300)
    finally:
        process.kill()
    assert process.returncode == 75, err[-2000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "preempted: SIGTERM" in lines[0], err


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # The dropped exception.
def test_sigterm_whose_exception_a_finalizer_drops_still_preempts(tmp_path):
    """SIGTERM's handler runs wherever the main thread is; inside a `__del__` Python prints
    its exception and drops it (one full-suite run waited 300 s for a set-up-time SIGTERM).
    The run still stops: training at its first step, otherwise at the block's end."""
    from tfmp import guards
    from tfmp.errors import Preempted

    class Finalizer:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGTERM)  # The handler's raise lands in here.

    with pytest.raises(Preempted, match="SIGTERM outside training"), cli.sigterm_exits_75(str(tmp_path)):
        Finalizer()
        stop = guards.Stop()
        with guards.signals_set(stop, active=True):
            assert stop.cause == "SIGTERM"  # tfmp.fit saves a checkpoint and raises at its first step.
    assert not guards.SIGTERM_RECEIVED.is_set()  # Nothing left for a later run in this process.
    with cli.sigterm_exits_75(str(tmp_path)):
        pass


@pytest.mark.parametrize("where", ["import machinery", "nest", "op wrapper"])
def test_sigterm_during_an_import_is_not_raised_there(tmp_path, capfd, where):
    """Raised inside an import that C code started, SIGTERM's exception comes back as a
    SystemError with a traceback on stderr (full-suite runs: TensorFlow's nest importing
    lazily, the handler seeing the import machinery's frame once, nest's own another time,
    and gen_math_ops.floor_mod's, whose eager fast path is C, a third). There the handler
    only sets the flag; the block's end raises."""
    import tensorflow as tf

    from tfmp.errors import Preempted

    # Code whose frame reads as Python's frozen importlib's, TensorFlow's nest's or an op
    # wrapper's. Its loop lets the handler run while that frame is the current one.
    python = os.path.join(os.path.dirname(tf.__file__), "python")
    files = {
        "import machinery": "<frozen importlib._bootstrap>",
        "nest": os.path.join(python, "util", "nest_util.py"),
        "op wrapper": os.path.join(python, "ops", "gen_math_ops.py"),
    }
    source = "os.kill(os.getpid(), signal.SIGTERM)\nfor _ in range(100000):\n    pass"
    importing = compile(source, files[where], "exec")
    reached = False
    with pytest.raises(Preempted, match="SIGTERM outside training"), cli.sigterm_exits_75(str(tmp_path)):
        exec(importing, {"os": os, "signal": signal})  # No exception here, in the "import".
        reached = cli.SIGTERM_RECEIVED.is_set()
    assert reached and "Traceback" not in capfd.readouterr().err
    with pytest.raises(Preempted), cli.sigterm_exits_75(str(tmp_path)):
        os.kill(os.getpid(), signal.SIGTERM)  # Anywhere else: raised where it lands.
        time.sleep(5)


def test_preempted_wrapped_by_tracing_still_exits_75_with_one_line(capsys):
    """SIGTERM's Preempted raised while TensorFlow traces comes out as autograph's error,
    with the Preempted as its context."""
    from tfmp import cli
    from tfmp.errors import Preempted

    with pytest.raises(SystemExit) as exit_info, cli.user_errors("train.py"):
        try:
            raise Preempted("SIGTERM outside training")
        except Preempted:
            raise RuntimeError("in user code: ... Preempted") from None  # As autograph re-raises it.
    assert exit_info.value.code == 75
    assert capsys.readouterr().err.strip() == "train.py: preempted: SIGTERM outside training"
    with pytest.raises(ValueError), cli.user_errors("train.py"):
        raise ValueError("not a preemption")


def test_preempted_inside_a_keras_layer_still_exits_75_with_one_line(capsys):
    """A Keras layer re-raises what its call raised as a new exception of the same class,
    its message grown by the layer's name and arguments (a CI run of
    test_sigterm_at_any_moment_exits_75_with_one_line printed seven lines)."""
    import keras
    import numpy as np

    from tfmp import cli
    from tfmp.errors import Preempted

    class Interrupted(keras.layers.Layer):
        def call(self, x):
            raise Preempted("SIGTERM outside training")

    with pytest.raises(SystemExit) as exit_info, cli.user_errors("train.py"):
        Interrupted()(np.zeros((2, 3), "float32"))
    assert exit_info.value.code == 75
    assert capsys.readouterr().err.strip() == "train.py: preempted: SIGTERM outside training"
