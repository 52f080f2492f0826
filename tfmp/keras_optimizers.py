"""Uses of Keras optimizers' internals, in one place (tfmp.keras_compat has the rest of Keras'), each with a test in
tests/test_keras_optimizers.py: a release that changes one of them fails the test named after it.

Keras 3 has no public API for an optimizer's slot variables (tfmp's fused updates, tfmp.adafactor) and for running
its update on stand-ins (tfmp.bf16's float32 updates of bfloat16 weights), nor for which of a `MultiOptimizer`'s
optimizers updates a variable (and a copy of its optimizers is what tfmp's applier needs). tfmp overrides hooks
Keras calls on its own copy of an optimizer, `_all_reduce_sum_gradients` and `update_step` (`reduced_applier`: the
user's optimizer is never changed); tests/test_fused.py covers them.
"""

import keras


def slot(optimizer, name, variable):
    """The slot `name` ("momentums", "velocities") `optimizer` keeps for `variable` (Adam's moments, SGD's momentum)."""
    slots = getattr(optimizer, f"_{name}", None) or getattr(optimizer, name)  # SGD's `momentums` has no underscore.
    return slots[variable_index(optimizer, variable)]


def trained_variables(optimizer):
    """The variables a built Keras optimizer was built for."""
    return optimizer._trainable_variables  # noqa: SLF001


# The slot lists each Keras optimizer's `update_step` reads, by that method (AdamW is Adam's
# update after Keras' weight decay); tfmp.bf16 runs these updates on float32 stand-ins.
UPDATE_SLOTS = {
    keras.optimizers.SGD.update_step: ("momentums",),
    keras.optimizers.Adam.update_step: ("_momentums", "_velocities", "_velocity_hats"),
    keras.optimizers.Lion.update_step: ("_momentums",),
    keras.optimizers.Adafactor.update_step: ("_r", "_c", "_v"),
}


def variable_index(optimizer, variable):
    """The position of `variable` (Keras, TensorFlow or a replica's copy) in what `optimizer` was built for: the index
    of its slots."""
    return optimizer._get_variable_index(variable)  # noqa: SLF001


def decays(optimizer, variable):
    """Whether `optimizer` applies weight decay to `variable` (Keras' exclusions honoured)."""
    return optimizer.weight_decay is not None and optimizer._use_weight_decay(variable)  # noqa: SLF001


def slots_of(optimizer, index):
    """{slot list name: the slot of the variable at `index`} for the lists its class's `update_step` reads
    (`UPDATE_SLOTS`); an empty list (SGD without momentum, Adam without amsgrad) gives none."""
    names = UPDATE_SLOTS[type(optimizer).update_step]
    return {name: getattr(optimizer, name)[index] for name in names if getattr(optimizer, name, None)}


def with_slots(optimizer, index, replaced):
    """A shallow copy of `optimizer` whose slot lists hold `replaced[name]` at `index` and whose variable lookup answers
    `index` for anything: the class's `update_step` called on it with stand-ins for a variable reads and assigns the
    stand-ins."""
    copy = shallow_copy(optimizer)
    for name, value in replaced.items():
        held = getattr(optimizer, name)
        object.__setattr__(copy, name, [*held[:index], value, *held[index + 1 :]])
    object.__setattr__(copy, "_get_variable_index", lambda _: index)
    return copy


def shallow_copy(obj):
    """A new object of `obj`'s class sharing all its attributes (`copy.copy` would go through Keras' pickling, which
    saves and rebuilds the variables)."""
    twin = object.__new__(type(obj))
    object.__getattribute__(twin, "__dict__").update(vars(obj))
    return twin


def _as_given(grads_and_vars):
    return grads_and_vars


def reduced_applier(optimizer, hooks=None, reduced_flag=None):
    """tfmp's own applier for `optimizer`: a shallow copy, sharing every variable (slots, iterations, learning rate,
    loss scale), whose `apply` takes gradients the caller has already all-reduced (Keras' own all-reduces inside
    `apply`, after clipping per replica). `hooks` maps `id(o)` of each optimizer `o` of `optimizer_groups` to its
    `(update_step, weight_decay_filter)`: each gradient is applied with that `update_step` (tfmp.fused, tfmp.bf16) where
    one is given, and Keras' weight decay (applied before the updates) touches only the variables the filter accepts
    (`update_step` decays the others). A loss-scale wrapper is copied with its inner optimizer, and `reduced_flag` (the
    name of its attribute saying the gradients are reduced) set on the copy; a MultiOptimizer with each of its
    optimizers. `optimizer` itself is not changed."""
    hooks = hooks or {}
    applier = shallow_copy(optimizer)
    inner = applier
    if hasattr(optimizer, "inner_optimizer"):
        inner = shallow_copy(optimizer.inner_optimizer)
        object.__setattr__(applier, "inner_optimizer", inner)
        if reduced_flag:
            object.__setattr__(applier, reduced_flag, True)
    if is_multi(inner):  # Its own apply hands each its gradients: the copies get them.
        copies = [_reduced(shallow_copy(sub), *hooks.get(id(sub), (None, None))) for sub in inner.optimizers]
        object.__setattr__(inner, "_inner_optimizers", copies)
    else:
        _reduced(inner, *hooks.get(id(getattr(optimizer, "inner_optimizer", optimizer)), (None, None)))
    return applier


def _reduced(optimizer, update_step, weight_decay_filter):
    # Plain attributes, set past Keras' tracking __setattr__: they steer tracing only.
    object.__setattr__(optimizer, "_all_reduce_sum_gradients", _as_given)
    if update_step is not None:
        object.__setattr__(optimizer, "update_step", update_step)
    if weight_decay_filter is not None:
        decay = optimizer._apply_weight_decay  # noqa: SLF001

        def filtered_weight_decay(variables):
            return decay([v for v in variables if weight_decay_filter(v)])

        object.__setattr__(optimizer, "_apply_weight_decay", filtered_weight_decay)
    return optimizer


# Keras 3.15 and later: an optimizer that hands each variable to one of several.
_MULTI = getattr(keras.optimizers, "MultiOptimizer", None)


def is_multi(optimizer):
    """Whether `optimizer` is a Keras MultiOptimizer."""
    return _MULTI is not None and isinstance(optimizer, _MULTI)


def optimizer_for(optimizer, variable):
    """The optimizer that updates `variable`: a MultiOptimizer's for it, else `optimizer`."""
    if not is_multi(optimizer):
        return optimizer
    if not optimizer.built:
        return optimizer._optimizer_map(variable)  # noqa: SLF001
    return optimizer.optimizers[optimizer._var_to_optimizer_idx[optimizer._var_key(variable)]]  # noqa: SLF001


def optimizer_groups(optimizer, variables):
    """[(an optimizer, the variables of `variables` it updates)]: `optimizer`, or a MultiOptimizer's each."""
    groups = {}
    for variable in variables:
        sub = optimizer_for(optimizer, variable)
        groups.setdefault(id(sub), (sub, []))[1].append(variable)
    return list(groups.values()) or [(optimizer, [])]


def fresh_optimizer(optimizer):
    """A new optimizer, unbuilt, configured as `optimizer` (a loss-scale wrapper's inner one): a MultiOptimizer gets
    fresh copies of its optimizers, each variable going to the copy of its own (its map may be a function, which no
    config holds)."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    if not is_multi(inner):
        return inner.__class__.from_config(inner.get_config())
    copies = {}

    def copy_for(variable):
        sub = optimizer_for(inner, variable)
        return copies.setdefault(id(sub), fresh_optimizer(sub))

    return _MULTI(copy_for, loss_scale_factor=inner.loss_scale_factor)


def optimizer_parts(optimizer):
    """A MultiOptimizer's optimizers (a wrapper's inner one's), else []: tf.train's tracking does not reach them."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    return list(inner.optimizers) if is_multi(inner) else []


def learning_rate(optimizer):
    """`optimizer`'s learning rate (a wrapper's, its inner one's); None for a MultiOptimizer (one each)."""
    return None if is_multi(getattr(optimizer, "inner_optimizer", optimizer)) else optimizer.learning_rate
