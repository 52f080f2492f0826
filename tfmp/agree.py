"""That every worker of a job trains one model alike, checked before any collective of training.

Each worker decides the "auto" choices by its own hardware (a GPU or none, bfloat16 instructions or none), and
each runs its own command (`python -m tfmp.launch --hosts=...` on every host, or one TF_CONFIG per worker). A
worker whose choices or arguments differ from the others' would, unchecked, train one model under two
precisions, hang in a collective the others never reach (another `grad_accum_steps`, another model), or, with
another `clipnorm` or learning rate, apply other updates to its copy of the mirrored weights, which nothing
compares again. `check` gathers every worker's choices and settings as text, once, and raises one error on every
worker alike, naming what differs.
"""

import hashlib
import json

import numpy as np
import tensorflow as tf

from tfmp import distribute, tf_compat
from tfmp.errors import UsageError

_TEXT_BYTES = 64  # Of each choice's or setting's text.


def _digest(value):
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:10]


def _text(value):
    """`value` as at most _TEXT_BYTES bytes that still tell apart texts alike in their first _TEXT_BYTES: a longer
    text keeps its head and ends in a digest of the whole."""
    text = str(value).encode()
    if len(text) <= _TEXT_BYTES:
        return text
    tail = b"..#" + _digest(str(value)).encode()
    return text[: _TEXT_BYTES - len(tail)] + tail


def settings(steps, epochs, steps_per_epoch):
    """The arguments of a fit (its `Steps`, epochs and steps per epoch) that every worker must share, as text ({what:
    value}): the model's variables (their number, values, and a digest of their shapes and dtypes), the optimizer
    (its class, learning rate, and a digest of its configuration but its name, which Keras numbers per process),
    the update and the run's length."""
    shapes = [(tuple(v.shape), str(v.dtype)) for v in steps.model.weights]
    inner = getattr(steps.optimizer, "inner_optimizer", steps.optimizer)
    try:
        config = {k: v for k, v in inner.get_config().items() if k != "name"}
    except (NotImplementedError, TypeError, ValueError) as e:  # A custom schedule without get_config, say.
        config = {"unreadable": type(e).__name__}
    rate = config.get("learning_rate")
    if isinstance(rate, (int, float)):
        rate = f"{rate:g}"
    elif isinstance(rate, dict):  # A schedule, serialized.
        rate = f"a {rate.get('class_name', 'schedule')}"
    else:
        rate = "unknown"
    return {
        "the model": f"{len(shapes)} variables of {sum(int(np.prod(s)) for s, _ in shapes)} values {_digest(shapes)}",
        "the optimizer": f"{type(inner).__name__}, learning rate {rate}, {_digest(config)}",
        "the update": f"grad_accum_steps {steps.grad_accum_steps}, clipnorm {steps.clipnorm}, steps_per_execution "
        f"{steps.steps_per_execution}",
        "the run": f"epochs {epochs}, steps_per_epoch {steps_per_epoch}",
    }


def check(strategy, decided, how, given=dict):
    """Raises UsageError on every worker alike unless all made the same choices `decided` ({what: the choice, as
    text}; `how`: what makes them agree) and were given the same settings, `given()` (see `settings`; called only
    with several workers). One all-gather, which every worker must reach at the same point; nothing on one worker."""
    workers = distribute.num_workers(strategy)
    if workers == 1:
        return
    mine = {name: _text(text) for name, text in {**decided, **given()}.items()}
    names = sorted(mine)
    row = np.zeros((1, len(names), _TEXT_BYTES), np.int32)
    for i, name in enumerate(names):
        row[0, i, : len(mine[name])] = list(mine[name])

    @tf_compat.function(autograph=False)
    def gather(row):
        return strategy.gather(strategy.run(lambda: tf.identity(row)), axis=0)

    rows = gather(tf.constant(row)).numpy().astype(np.uint8)  # A row per replica, every worker's.
    seen = {name: {bytes(r[i]).rstrip(b"\0") for r in rows} for i, name in enumerate(names)}
    message = differences(workers, mine, seen, decided, how)
    if message:
        raise UsageError(message)


def differences(workers, mine, seen, decided, how):
    """The error for `mine` ({what: this worker's text}) against `seen` ({what: every worker's texts}), or None
    where all agree: the choices `decided` by each worker's hardware, then the settings given."""

    def listed(names):
        return "; ".join(
            f"{name}: {mine[name].decode(errors='replace')} here, "
            f"{' and '.join(sorted(t.decode(errors='replace') for t in seen[name] - {mine[name]}))}"
            " elsewhere"
            for name in sorted(names)
            if seen[name] != {mine[name]}
        )

    chosen = listed(n for n in mine if n in decided)
    given = listed(n for n in mine if n not in decided)
    said = []
    if chosen:
        said.append(
            f"the {workers} workers decided differently ({chosen}): each decides by its own hardware, and one model "
            f"must train alike on all; give every worker the same explicit choice ({how})"
        )
    if given:
        said.append(
            f"the {workers} workers were given different settings ({given}): every worker must run the same "
            "program with the same arguments (python -m tfmp.launch starts them so)"
        )
    return "; and ".join(said) or None
