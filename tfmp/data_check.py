"""Whether data fits a model, checked before anything runs: its inputs' number, names, dtypes
and shapes, and targets where the model's compiled loss needs them. `tfmp.fit` checks its
validation data so too, which `model.fit` first reads after the first epoch's training."""

import keras
import tensorflow as tf
from absl import logging

from tfmp import keras_compat
from tfmp.errors import UsageError, first_line


def needs_targets(model):
    """Whether `model`'s data must hold targets: it was compiled with a loss (else its layers add theirs)."""
    return keras_compat.compiled(model)[0] is not None


def check(model, element_spec, name="the data"):
    """Refuses data (`element_spec`, its batches', `name` in words) that the model cannot take: inputs of
    another number, names, dtype or shape than the model's, or no targets for a compiled loss."""
    x, y, _ = keras.utils.unpack_x_y_sample_weight(element_spec)
    inputs = getattr(model, "inputs", None) or []
    if inputs:
        given = tf.nest.flatten(x)
        if isinstance(x, dict):
            names = sorted(i.name for i in inputs)
            if set(names) - set(x):
                raise UsageError(f"{name}'s inputs are {sorted(x)} but the model takes {names}")
            unread = sorted(set(x) - set(names))
            if unread:  # As model.fit reads them: not at all.
                logging.warning("%s's %s are none of the model's inputs %s: left unread", name, unread, names)
            given = [x[i.name] for i in inputs]
        elif len(given) != len(inputs):
            names = f" ({', '.join(i.name for i in inputs)})" if all(map(_named, inputs)) else ""
            raise UsageError(
                f"the model takes {len(inputs)} input(s){names} but {name}'s "
                f"elements hold {len(given)}: give (x, y) or (x, y, sample_weight) with x matching the inputs"
            )
        for spec, layer_input, called in zip(given, inputs, _called(inputs), strict=True):
            _check_input(spec, layer_input, called, name)
    if y is None and needs_targets(model):
        raise UsageError(f"{name} gives no targets, but the model was compiled with a loss: give (x, y) elements")


def build_for(model, strategy, element_spec, before_optimizer=None):
    """Checks the data's structure against the model (`check`) and builds the model, its
    compiled losses and metrics (their variables must exist before the step is traced).
    `before_optimizer(model)`, where given, runs once the layers are built and before the
    optimizer is (float8 adds variables that the optimizer must know)."""
    check(model, element_spec)
    with strategy.scope():
        if before_optimizer is not None:
            if not model.built:  # A subclassed model: its layers built by a symbolic call, as model.fit's build does.
                _build(keras_compat.build_layers, model, element_spec)
            before_optimizer(model)
        _build(keras_compat.symbolic_build, model, element_spec)  # What model.fit does first.


def _build(build, model, element_spec):
    try:
        build(model, element_spec)
    except (ValueError, TypeError) as e:
        raise UsageError(f"the data does not fit the model or its compiled loss: {first_line(e, 300)}") from e


def _named(layer_input):
    """Whether the user named the model's input: Keras names an unnamed `keras.Input` keras_tensor_N, a name the
    user never wrote and an error should not show."""
    return not layer_input.name.startswith("keras_tensor")


def _called(inputs):
    """The words for each of the model's `inputs`: its name where the user gave one, else its place."""
    if len(inputs) == 1 and not _named(inputs[0]):
        return ["the model's input"]
    return [f"input {i.name!r}" if _named(i) else f"input {n}" for n, i in enumerate(inputs)]


def _check_input(spec, layer_input, called, name):
    """Refuses data (`spec`, a batch's; `name` in words) of a dtype or shape that the model's input `layer_input`
    (`called` so in words) cannot take, as Keras' own call would, before anything is traced."""
    if not isinstance(spec, tf.TypeSpec) or not hasattr(spec, "shape"):
        return  # Nested further than the model's inputs: Keras' own build checks it.
    if (spec.dtype == tf.string) != (keras.backend.standardize_dtype(layer_input.dtype) == "string"):
        raise UsageError(f"{called} takes {layer_input.dtype} but {name} gives {spec.dtype.name}")
    example, shape = tf.TensorShape(layer_input.shape[1:]), spec.shape
    # As a Keras model's call adjusts it: a last axis of 1 added or dropped where that makes the input's rank.
    if shape.rank == example.rank + 2 and shape[-1] == 1:
        shape = shape[:-1]
    elif shape.rank == example.rank and example.rank and example[-1] == 1:
        shape = shape.concatenate([1])
    if not tf.TensorShape(shape[1:]).is_compatible_with(example):
        # A batch's first axis is unknown or the batch size; an unbatched dataset's, an example's.
        unbatched = spec.shape.rank and spec.shape[0] is not None and spec.shape.is_compatible_with(example)
        dataset = "the dataset" if name == "the data" else name
        raise UsageError(
            f"{called} takes shape {tuple(layer_input.shape)} but {name} gives {tuple(spec.shape)}"
            + (f"; its elements are single examples: batch {dataset} (`.batch(N)`)" if unbatched else "")
        )
