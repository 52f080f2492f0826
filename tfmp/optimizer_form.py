"""What an optimizer keeps, recorded in tfmp's checkpoints, so that a run resumed with another optimizer (or
other trainable layers) is refused in words: TensorFlow's checkpoints hold a Keras optimizer's state by position,
and its restore failed on a shape or an unmatched slot (said to be a checkpoint of another model) or dropped the
state this run's optimizer does not keep (Adam's moments under SGD), unsaid."""

import json

import tensorflow as tf
from absl import logging

from tfmp import keras_optimizers
from tfmp.errors import UsageError


class OptimizerForm(tf.train.experimental.PythonState):
    """`form_of` a model and its optimizer, as JSON in a checkpoint: as they stand at each save (an optimizer
    may build after the checkpoint is set up); `form` holds what a restore read."""

    def __init__(self, model=None, optimizer=None):
        self._model, self._optimizer = model, optimizer
        self.form = {}

    def serialize(self):
        return json.dumps(form_of(self._model, self._optimizer))

    def deserialize(self, string_value):
        self.form = json.loads(bytes(string_value))


def form_of(model, optimizer):
    """{"weights": the shapes of `model`'s weights, "trains": of its trainable ones, "optimizers": [[type name,
    [each state variable's shape], [the names of the types it is built on]]] for `optimizer`'s optimizers (a
    loss-scale wrapper's inner one, a MultiOptimizer's each; None where one is not built yet, its state still to
    come)}: their state is their slots, moving averages and accumulators, not their step count or learning rate
    (which a schedule replaces)."""
    parts = keras_optimizers.optimizer_parts(optimizer) or [getattr(optimizer, "inner_optimizer", optimizer)]
    optimizers = []
    for part in parts:
        fixed = {id(part.iterations), id(keras_optimizers.learning_rate(part))}
        state = [list(v.shape) for v in part.variables if id(v) not in fixed]
        optimizers.append([type(part).__name__, state, [kind.__name__ for kind in type(part).__mro__]])
    return {
        "weights": [list(w.shape) for w in model.weights],
        "trains": [list(w.shape) for w in model.trainable_weights],
        "optimizers": optimizers if all(part.built for part in parts) else None,
    }


def _says(optimizers):
    """Optimizers' forms in words: `Adam (4 state variables)`."""
    return " and ".join(
        f"{name} ({len(state)} state variable{'' if len(state) == 1 else 's'})" for name, state, _ in optimizers
    )


def _afresh(flag, path, when=""):
    """How to train on afresh: a new directory, for tfmp.fit's `checkpoint_dir` from the checkpoint's weights."""
    weights = f" (its weights first{when}: tf.train.Checkpoint(model=model).restore({path!r}).expect_partial())"
    return f"use a new {flag}" + (weights if flag == "checkpoint_dir" else "")


def check(path, model, optimizer, flag):
    """Raises a UsageError where the checkpoint `path` was saved with the same model training other variables, or
    with an optimizer keeping other state, than `model` and `optimizer` (`form_of`); warns where only an
    optimizer's type differs (Adam's state going on under AdamW). `flag` names the checkpoint directory in the
    message. Passes a checkpoint of another model (the restore says it does not load), one without the record (an
    older tfmp's), one that cannot be read (the restore says what fails) and an optimizer not built."""
    saved = OptimizerForm()
    try:
        tf.train.Checkpoint(optimizer_form=saved).restore(path).expect_partial()
    except Exception:  # noqa: BLE001 - a broken checkpoint fails in many ways, which the restore then names.
        return
    saved, now = saved.form, form_of(model, optimizer)
    if not saved or saved == now or saved["weights"] != now["weights"]:
        return
    if saved["trains"] != now["trains"]:
        raise UsageError(
            f"checkpoint {path} was saved training {len(saved['trains'])} of the model's weights, and this run trains "
            f"{len(now['trains'])} (a layer's `trainable` changed): the optimizer's state is kept per trained weight; "
            f"resume with the layers trainable as they were, or {_afresh(flag, path, ', restored while they are')}"
        )
    if None in (saved["optimizers"], now["optimizers"]):  # One not built: its state is not there to load.
        return
    alike = len(saved["optimizers"]) == len(now["optimizers"]) and all(
        was[1] == new[1] and (was[0] in new[2] or new[0] in was[2])  # A type built on the other: Adam, AdamW.
        for was, new in zip(saved["optimizers"], now["optimizers"], strict=False)
    )
    if alike:  # The same state, meaning the same.
        logging.warning(
            "checkpoint %s was saved with %s; its state goes on in this run's %s",
            path,
            _says(saved["optimizers"]),
            _says(now["optimizers"]),
        )
        return
    raise UsageError(
        f"checkpoint {path} was saved with {_says(saved['optimizers'])}, and this run trains with "
        f"{_says(now['optimizers'])}: an optimizer's state carries over only to the same optimizer (or one built "
        f"on it: Adam's to AdamW) with the same settings; resume with the optimizer it was saved with, or "
        f"{_afresh(flag, path)}"
    )
