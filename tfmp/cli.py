"""What the command-line entry points share: a quiet start, one-line errors, exit codes.

Import this module before TensorFlow (it imports neither TensorFlow nor Keras).
"""

import contextlib
import os
import sys

from absl import flags, logging

from tfmp.errors import PeerLost, Preempted, TrainingError, UsageError


def wants_logs(argv):
    """Whether `-v`/`--verbosity` was given: then nothing is silenced."""
    return any(a in ("-v", "--verbosity") or a.startswith(("-v=", "--verbosity=")) for a in argv[1:])


@contextlib.contextmanager
def native_logs_silenced(active=True):
    """Sends file descriptor 2 to /dev/null while TensorFlow loads and probes its devices.

    TensorFlow's C++ start-up lines (oneDNN, CPU features, CUDA probing, the absl
    "before InitializeLog" notice) are written there before any log level applies, so
    `TF_CPP_MIN_LOG_LEVEL` cannot hide them. Python's own errors raised in the block are
    printed after it, on the restored stderr.
    """
    if not active:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def quiet_start(argv, prog):
    """Loads TensorFlow and lists its devices with the C++ start-up lines silenced, unless
    `-v`/`--verbosity` asks for everything. SIGTERM meanwhile exits 75 at once (nothing
    has been written yet); `sigterm_exits_75` takes over once the run starts."""
    import signal

    stderr = os.dup(2)  # The real one: fd 2 goes to /dev/null while TensorFlow loads.

    def early(signum, frame):
        line = f"{prog}: preempted: SIGTERM during start-up; nothing was written; rerun the same command\n"
        os.write(stderr, line.encode())
        os._exit(75)

    signal.signal(signal.SIGTERM, early)
    verbose = wants_logs(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "0" if verbose else "2")
    with native_logs_silenced(not verbose):
        import tensorflow as tf

        tf.config.list_physical_devices()  # CUDA probing ("failed call to cuInit") happens here.


def error(prog, message, status=2):
    """Prints one line `PROG: error: MESSAGE` on stderr and exits with `status`."""
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    sys.exit(status)


def flags_parser(prog):
    """An absl `flags_parser` that turns every flag error, and stray arguments, into one
    line and exit status 2 (absl prints a FATAL banner and usage, and exits 1)."""

    def parse(argv):
        try:
            rest = flags.FLAGS(argv)
        except flags.Error as e:
            error(prog, str(e).splitlines()[0] if str(e).strip() else type(e).__name__)
        if len(rest) > 1:
            error(prog, f"unexpected argument(s) {' '.join(rest[1:])}: flags take the form --name=value (see --help)")
        if not flags.FLAGS["verbosity"].present:
            logging.set_verbosity(logging.WARNING)  # tfmp's and TensorFlow's INFO lines: with -v 0.
        return rest

    return parse


@contextlib.contextmanager
def sigterm_exits_75(model_dir):
    """SIGTERM at any moment raises `Preempted` (exit 75). While training, `tfmp.fit`
    puts its own handler in place, which saves a checkpoint first; at any other moment
    (start-up, evaluation, export) the last checkpoint is intact as it is."""
    import signal

    def handler(signum, frame):
        raise Preempted(
            f"SIGTERM outside training: the last checkpoint in {model_dir}/checkpoints is intact; rerun the same "
            "command to resume"
        )

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def user_errors(prog):
    """Ends the process with one line on stderr, no traceback, for the errors a user can act
    on: `UsageError` (exit 2), `TrainingError` (exit 1), `Preempted` (exit 75: rerun),
    `PeerLost` (exit 76: another worker died; rerun)."""
    try:
        yield
    except UsageError as e:
        error(prog, e)
    except TrainingError as e:
        print(f"{prog}: training stopped: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
    except Preempted as e:
        print(f"{prog}: preempted: {e}", file=sys.stderr, flush=True)
        sys.exit(75)
    except PeerLost as e:
        print(f"{prog}: lost a peer: {e}", file=sys.stderr, flush=True)
        sys.exit(76)
