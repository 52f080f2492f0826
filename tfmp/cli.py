"""What the command-line entry points share: a quiet start, one-line errors, exit codes.

Import this module before TensorFlow (it imports neither TensorFlow nor Keras).
"""

import contextlib
import os
import sys

from absl import app, flags, logging

from tfmp.errors import SIGTERM_RECEIVED, PeerLost, Preempted, TrainingError, UsageError, first_line


def wants_logs(argv):
    """Whether `-v`/`--verbosity` was given: then nothing is silenced."""
    return any(a in ("-v", "--verbosity") or a.startswith(("-v=", "--verbosity=")) for a in argv[1:])


def quiet_start(argv, prog):
    """Keeps TensorFlow's C++ log lines off stderr, unless `-v`/`--verbosity` is given.

    TensorFlow writes them (oneDNN and CPU-feature notes, CUDA probing, collective aborts)
    to file descriptor 2 directly, before and regardless of any log level. Here fd 2 goes
    to /dev/null and Python's `sys.stderr` to a copy of the real one: every line tfmp,
    absl or Python prints (errors, warnings, tracebacks) still shows; native ones do not.
    SIGTERM while TensorFlow loads exits 75 at once (nothing has been written yet);
    `sigterm_exits_75` takes over once the run starts.
    """
    import signal

    if wants_logs(argv):
        return
    sys.stderr.flush()
    real = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)
    before, sys.stderr = sys.stderr, os.fdopen(real, "w", buffering=1)
    _follow(before)

    def early(signum, frame):
        line = f"{prog}: preempted: SIGTERM during start-up; nothing was written; rerun the same command\n"
        os.write(real, line.encode())
        os._exit(75)

    signal.signal(signal.SIGTERM, early)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    tf.config.list_physical_devices()  # CUDA probing ("failed call to cuInit") happens here.


def _follow(before):
    """Points the log handlers made before `quiet_start` at the new `sys.stderr`: absl's,
    made when the binary imports absl, holds the stream it found then (fd 2, now
    /dev/null), where every absl warning of the run would vanish."""
    import logging as python_logging

    handlers = list(python_logging.getLogger().handlers)
    if "absl.logging" in sys.modules:
        handlers.append(sys.modules["absl.logging"].get_absl_handler().python_handler)
    for handler in handlers:
        if isinstance(handler, python_logging.StreamHandler) and handler.stream is before:
            handler.setStream(sys.stderr)


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
            error(prog, first_line(e, limit=1000))
        if len(rest) > 1:
            error(prog, f"unexpected argument(s) {' '.join(rest[1:])}: flags take the form --name=value (see --help)")
        if not flags.FLAGS["verbosity"].present:
            logging.set_verbosity(logging.WARNING)  # tfmp's and TensorFlow's INFO lines: with -v 0.
        return rest

    return parse


def read_flags(argv, prog):
    """Reads the flags now, as `app.run` would (--help included), and returns the arguments left:
    an entry point that calls it before importing TensorFlow answers a wrong flag or --help at once."""
    app.define_help_flags()
    return flags_parser(prog)(argv)


def run_read(main, argv):
    """`app.run(main)` for flags `read_flags` has read already into `argv` (no second parse)."""
    app.run(main, argv=argv, flags_parser=lambda _: argv)


@contextlib.contextmanager
def sigterm_exits_75(model_dir):
    """SIGTERM at any moment raises `Preempted` (exit 75). While training, `tfmp.fit`
    puts its own handler in place, which saves a checkpoint first; at any other moment
    (start-up, evaluation, export) the last checkpoint is intact as it is."""
    import signal

    message = (
        f"SIGTERM outside training: the last checkpoint in {model_dir}/checkpoints is intact; rerun the same "
        "command to resume"
    )

    def handler(signum, frame):
        SIGTERM_RECEIVED.set()  # Kept: Python drops an exception raised inside a finalizer.
        if _importing(frame):
            # Raised inside an import that C code started (TensorFlow's nest does), it comes
            # back as a SystemError whose traceback TensorFlow prints, and is lost. The flag
            # stops the run instead: at tfmp.fit's first step, or when this block ends.
            return
        raise Preempted(message)

    SIGTERM_RECEIVED.clear()
    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        dropped = SIGTERM_RECEIVED.is_set()
        SIGTERM_RECEIVED.clear()  # Not left for a later run in this process (a notebook, a test).
    if dropped:  # The block ended as if no SIGTERM had come: its Preempted was dropped.
        raise Preempted(message)


# TensorFlow's nest and its generated op wrappers (gen_*_ops.py, whose eager fast path is C):
# their C code imports modules itself, and a handler run inside that import sees the
# wrapper's own frame as the current one, no frame of the import machinery's (full-suite
# runs' test_sigterm_at_any_moment[setting up]: nest once, gen_math_ops.floor_mod later).
_NEST = os.path.join("tensorflow", "python", "util", "nest_util.py")
_OP_WRAPPERS = os.path.join("tensorflow", "python", "ops", "gen_")


def _importing(frame):
    """Whether `frame` or one that called it runs Python's import machinery, or TensorFlow
    code whose C part may be inside an import it started (nest, the op wrappers)."""
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith("<frozen importlib") or name.endswith(_NEST) or _OP_WRAPPERS in name:
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def user_errors(prog):
    """Ends the process with one line on stderr, no traceback, for the errors a user can act
    on: `UsageError` (exit 2), `TrainingError` (exit 1), `Preempted` (exit 75: rerun),
    `PeerLost` (exit 76: another worker died; rerun), Ctrl-C (exit 130, as a shell's 128 +
    SIGINT; `Interrupted` says which checkpoint training saved)."""
    try:
        yield
    except KeyboardInterrupt as e:
        print(f"{prog}: interrupted: {str(e) or 'Ctrl-C'}", file=sys.stderr, flush=True)
        sys.exit(130)
    except UsageError as e:
        error(prog, e)
    except TrainingError as e:
        print(f"{prog}: training stopped: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
    except PeerLost as e:
        print(f"{prog}: lost a peer: {e}", file=sys.stderr, flush=True)
        sys.exit(76)
    except Exception as e:
        # SIGTERM's `Preempted`, as raised or wrapped: while TensorFlow traces a function,
        # in autograph's StagingError (its context the Preempted); in a Keras layer's call,
        # as a new Preempted whose message adds the layer's name and arguments on several
        # lines. The innermost one holds SIGTERM's own line.
        preempted = _innermost(e, Preempted)
        if preempted is None:
            raise
        print(f"{prog}: preempted: {preempted}", file=sys.stderr, flush=True)
        sys.exit(75)


def _innermost(error, kind):
    """The innermost exception of `kind` among `error` and its causes and contexts (the
    one first raised), or None."""
    seen, found = set(), None
    while error is not None and id(error) not in seen:
        if isinstance(error, kind):
            found = error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return found
