"""What `tfmp.fit` and `tfmp.evaluate` refuse before anything runs: their arguments, one
clear error each, where Keras would fail later or in its own words."""

import math

import keras
import tensorflow as tf

from tfmp import distribute, run_directory, tf_compat, xla
from tfmp.errors import UsageError, is_count

VERBOSE = ("auto", 0, 1, 2)


def given_data(data, x, caller):
    """`data`, or `x` (`model.fit`'s name for it); UsageError for both or neither."""
    if data is not None and x is not None:
        raise UsageError(f"{caller} got data and x=: give the data once (x= is model.fit's name for it)")
    if data is None and x is None:
        raise UsageError(f"{caller} needs data: a dataset, a PyDataset, a generator or arrays (model.fit's x)")
    return x if data is None else data


def strategy_for(model, strategy, caller):
    """`strategy`, else the one `model` was built under; UsageError for a `model` that is no Keras model or a
    `strategy` that is no tf.distribute strategy (a name: tfmp.get_strategy makes one)."""
    if not isinstance(model, keras.Model):
        raise UsageError(f"{caller} takes a keras.Model, got {type(model).__name__}")
    if strategy is not None and not isinstance(strategy, tf.distribute.Strategy):
        made = f"tfmp.get_strategy({strategy!r})" if isinstance(strategy, str) else "tfmp.get_strategy(NAME)"
        raise UsageError(
            f"{caller}: strategy takes a tf.distribute.Strategy, got {type(strategy).__name__}: make one with "
            f"{made} and build the model in its scope"
        )
    return strategy or model.distribute_strategy


def callback_list(given):
    """`callbacks` as a list, as `model.fit` takes them (one callback, or nested lists); UsageError for anything
    in them that is not a `keras.callbacks.Callback` (Keras fails at it with "has no attribute 'set_model'")."""
    listed = keras.tree.flatten(given) if given else []
    for callback in listed:
        if not isinstance(callback, keras.callbacks.Callback):
            kind = f"{type(callback).__module__}.{type(callback).__name__}"
            raise UsageError(f"callbacks must be keras.callbacks.Callback objects, got {kind}")
    return listed


def refuse_own_step(model, step, replaced_by, instead):
    """UsageError where `model` overrides Keras' `step`, which `replaced_by` would silently skip."""
    if getattr(type(model), step) is not getattr(keras.Model, step):
        raise UsageError(
            f"{type(model).__name__} overrides {step}, which {replaced_by} replaces with its own; override "
            f"compute_loss / compute_metrics instead, or {instead}"
        )


def check_fit(model, strategy, epochs, initial_epoch, steps_per_epoch, grad_accum_steps, clipnorm, **kw):
    """Raises UsageError for anything wrong before touching the model; returns the strategy and the callbacks as a
    list (`callback_list`)."""
    strategy = strategy_for(model, strategy, "tfmp.fit")
    if not getattr(model, "compiled", False) or model.optimizer is None:
        raise UsageError("tfmp.fit needs a compiled model: call model.compile(optimizer, loss, metrics) first")
    refuse_own_step(model, "train_step", "tfmp.fit", "train it with model.fit")
    if kw["validation_data"] is not None or kw["validation_split"]:
        refuse_own_step(model, "test_step", "tfmp.fit's validation", "validate it with model.evaluate")
    for name, value, low in (
        ("epochs", epochs, 0),
        ("initial_epoch", initial_epoch, 0),
        ("grad_accum_steps", grad_accum_steps, 1),
        ("steps_per_execution", kw["steps_per_execution"], 1),
        ("checkpoint_every", kw["checkpoint_every"], 0),
        ("log_every", kw["log_every"], 1),
    ):
        if not is_count(value, low):
            compiled = name == "steps_per_execution" and value is getattr(model, name, None)
            whose = " (the model's compile gave it)" if compiled else ""
            raise UsageError(f"{name} must be an integer >= {low}, got {value!r}{whose}")
    freq = kw["validation_freq"]
    listed = list(freq) if isinstance(freq, list | tuple) else [freq]  # Keras' list: the epochs that validate.
    if not listed or not all(is_count(f, 1) for f in listed):
        raise UsageError(f"validation_freq must be an integer >= 1 or a list of epochs (from 1), got {freq!r}")
    for name, value in (("steps_per_epoch", steps_per_epoch), ("validation_steps", kw["validation_steps"])):
        if value is not None and not is_count(value, 1):
            raise UsageError(f"{name} must be None or an integer >= 1, got {value!r}")
    if steps_per_epoch and steps_per_epoch % grad_accum_steps:
        raise UsageError(
            f"steps_per_epoch={steps_per_epoch} counts batches and must be a multiple of "
            f"grad_accum_steps={grad_accum_steps} (every {grad_accum_steps} batches make one update)"
        )
    if clipnorm is not None and not (isinstance(clipnorm, int | float) and 0 < clipnorm < math.inf):
        raise UsageError(f"clipnorm must be a positive finite number, got {clipnorm!r}")
    for name in ("checkpoint_dir", "log_dir"):
        if kw[name]:
            run_directory.check_writable(kw[name], name)
    callbacks = callback_list(kw["callbacks"])
    if kw["checkpoint_dir"] and any(isinstance(c, keras.callbacks.BackupAndRestore) for c in callbacks):
        raise UsageError(
            "checkpoint_dir= and a keras.callbacks.BackupAndRestore would each restore the run: give one "
            "(checkpoint_dir resumes at the batch, with the input's position and the loss scale)"
        )
    xla.check(kw["jit_compile"])
    check_verbose(kw["verbose"])
    variables = model.weights
    if variables and not strategy.extended.variable_created_in_scope(variables[0].value):
        raise UsageError(
            f"the model was built outside the scope of the {distribute.strategy_name(strategy)} strategy it is "
            "trained under: build and compile it inside `with strategy.scope():`"
        )
    tf_compat.own_collective_keys(strategy)
    return strategy, callbacks


def check_verbose(verbose):
    if verbose not in VERBOSE:
        raise UsageError(f"verbose must be one of {', '.join(map(str, VERBOSE))}, got {verbose!r}")
