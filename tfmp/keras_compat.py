"""Uses of Keras internals, in one place, each with a test in tests/test_keras_compat.py: a release that
changes one of them fails the test named after it.

Keras 3 has no public API for a layer's sublayers, for swapping a built layer's dtype policy without writing
into a shared `DTypePolicyMap`, for seeing what a layer's `call` received and returned (the doctor needs
these, on any model, without copying it), for building a model with its compiled loss and metrics from a data
spec, for the layers a `DTypePolicyMap` serves (tfmp.keep_float32 warns of names that matched none), for the
loss `model.fit` computes and the metric it reports it with, for the order `model.evaluate` lists its results
in, or for an optimizer's slot variables (tfmp's fused updates, tfmp.adafactor) and for running its update on
stand-ins (tfmp.bf16's float32 updates of bfloat16 weights); Keras 3.10's `Model.quantize` takes no
`filters`; the seed `keras.utils.set_random_seed` was given has no getter, nor the epoch a `BackupAndRestore`
callback restored, nor which of a `MultiOptimizer`'s optimizers updates a variable (and a copy of its
optimizers is what tfmp's applier needs), nor the base class of what a `.keras` file holds the state of
(`Saveable`: tfmp.bf16's Kahan buffers). The uses of TensorFlow's internals are in tfmp.tf_compat.

Besides these, tfmp overrides hooks Keras calls: `LossScaleOptimizer._tf_apply` (tfmp.loss_scale), a model's
`_aggregate_additional_loss` and its compiled losses' `call` while `compute_loss` runs (the losses layers add, in
float32; tfmp.scalar_losses), an optimizer's `_all_reduce_sum_gradients` and `update_step` on tfmp's own copy of it
(`reduced_applier`: the user's optimizer is never changed); tests/test_loss_scale.py and test_fused.py cover them.
"""

import contextlib
import inspect

import keras
from keras.src.saving.keras_saveable import KerasSaveable as Saveable  # noqa: F401 - see the docstring.
from keras.src.utils import rng_utils  # Keras' record of the global seed.

from tfmp import scalar_losses
from tfmp.errors import UsageError


def symbolic_build(model, element_spec):
    """Builds `model`, its compiled loss and metrics and its optimizer from a data spec, as `model.fit` does."""
    model._symbolic_build(data_batch=element_spec)  # noqa: SLF001


def compiled(model):
    """(its compiled loss, its compiled metrics), None for what was not: to tell when a model was compiled again."""
    return getattr(model, "_compile_loss", None), getattr(model, "_compile_metrics", None)


def compute_loss(model, x, y, y_pred, sample_weight, training, micro_batches=1, sums_times=None):
    """The loss `model.fit` minimizes: compiled losses with their weights and sample weights, each a mean over
    the global batch under a strategy (one returning a scalar too: tfmp.scalar_losses), plus regularization.

    Each loss a layer added (`add_loss`, an `activity_regularizer`) is summed in float32. Keras sums one computed
    in float16 or bfloat16 in that dtype, then fails adding it to the float32 compiled loss ("Cannot convert a
    list containing a tensor of dtype float16"), so under a mixed policy `model.fit` cannot train such a model.

    Raises:
        UsageError: the loss is not a scalar (a compiled loss with `reduction=None`).
    """
    aggregate = type(model)._aggregate_additional_loss.__get__(model)  # noqa: SLF001 - Keras' own, never a wrapper.

    def in_float32(loss):
        low = keras.backend.standardize_dtype(loss.dtype) in ("float16", "bfloat16")
        return aggregate(keras.ops.cast(loss, "float32") if low else loss)

    object.__setattr__(model, "_aggregate_additional_loss", in_float32)  # Past Keras' tracking; this call only.
    try:
        with scalar_losses.one_per_example(compiled(model)[0], y_pred, micro_batches, sums_times):  # As one device's.
            loss = model._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training)  # noqa: SLF001
    finally:
        model.__dict__.pop("_aggregate_additional_loss", None)  # (A MirroredStrategy's replicas run one at a time.)
    if loss is not None and loss.shape.rank:
        raise UsageError(
            f"the model's loss is not one number but shape {loss.shape} (a loss with reduction=None gives one per "
            "example): give it reduction='sum_over_batch_size' (the mean, Keras' default) or 'sum' (model.fit "
            "trains an unreduced loss as its sum, and reports its mean)"
        )
    return loss


def results_in_order(model, logs):
    """`logs` as `model.evaluate` returns them without `return_dict`: one number, or a list in its metrics' order."""
    return model._flatten_metrics_in_order(logs)  # noqa: SLF001


def compiled_jit_compile(model):
    """`compile(jit_compile=...)` where it is not "auto"'s answer here (the user's, as model.fit takes it), or None."""
    chosen = bool(model.jit_compile)
    return None if chosen == bool(model._resolve_auto_jit_compile()) else chosen  # noqa: SLF001


def call(model, x, training):
    """`model(x, training=training)`, or `model(x)` where its `call` takes no `training`."""
    return model(x, training=training) if model._call_has_training_arg else model(x)  # noqa: SLF001


def slot(optimizer, name, variable):
    """The slot `name` ("momentums", "velocities") `optimizer` keeps for `variable` (Adam's moments, SGD's momentum)."""
    slots = getattr(optimizer, f"_{name}", None) or getattr(optimizer, name)  # SGD's `momentums` has no underscore.
    return slots[variable_index(optimizer, variable)]


def trained_variables(optimizer):
    """The variables a built Keras optimizer was built for."""
    return optimizer._trainable_variables  # noqa: SLF001


@contextlib.contextmanager
def paths_looked_up():
    """Inside the block, collects (into the set it yields) the layer paths that layers look
    their dtype up by in a `DTypePolicyMap`: a layer holding a map reads its path in it
    each time it asks its dtype, from its build on (Keras lists no map's layers)."""
    looked_up = set()
    cls = keras.dtype_policies.DTypePolicyMap
    original = cls.__getitem__

    def getitem(self, key):
        if key not in self.keys():  # Not the map reading its own entries.
            looked_up.add(key)
        return original(self, key)

    cls.__getitem__ = getitem
    try:
        yield looked_up
    finally:
        cls.__getitem__ = original


def quantize(model, layers, mode):
    """`model.quantize(mode)` for `layers` only. Keras 3.10 has no `filters=` argument: there each layer is
    quantized by itself and the model's compiled functions are dropped, as `Model.quantize` does after it."""
    if "filters" in inspect.signature(model.quantize).parameters:
        ids = {id(layer) for layer in layers}
        model.quantize(mode, filters=lambda layer: id(layer) in ids)
        return
    for layer in layers:
        layer.quantize(mode)
    model.train_function = model.test_function = model.predict_function = None


def sublayers(model):
    """Every layer inside `model` (nested models' and custom layers' too), parents first; no InputLayer."""
    layers = model._flatten_layers(include_self=False, recursive=True)  # noqa: SLF001
    return [layer for layer in layers if not isinstance(layer, keras.layers.InputLayer)]


def producer(tensor):
    """The layer that made a symbolic tensor of a functional model (e.g. an output)."""
    return tensor._keras_history.operation  # noqa: SLF001


def output_layers(model):
    """The layers that make a functional model's outputs, each found by walking back from the output through
    weightless layers of one input (an Activation, a Softmax, a Dropout); none for a subclassed model."""
    found = []
    for output in getattr(model, "outputs", None) or []:
        layer = producer(output)
        while layer is not None and not layer.weights and len(layer._inbound_nodes) == 1:  # noqa: SLF001
            parents = layer._inbound_nodes[0].parent_nodes  # noqa: SLF001
            layer = parents[0].operation if len(parents) == 1 else None
        if layer is not None:
            found.append(layer)
    return found


def casts_inputs(layer):
    """Whether `layer` casts its floating inputs to its compute dtype when called. A nested functional model
    leaves that to its own layers; a Sequential model casts to its InputLayer's dtype."""
    converts = layer.autocast and getattr(layer, "_convert_input_args", True)
    return bool(converts and layer.input_dtype == layer.compute_dtype)


def set_policy(layer, policy):
    """The built `layer` computes under `policy`, its shared `DTypePolicyMap` untouched (the public setter writes)."""
    layer._dtype_policy = keras.dtype_policies.get(policy)  # noqa: SLF001


def forget_compiled_functions(model):
    """Drops the functions `model.fit` traced, so that the next call traces them again (a new dtype policy)."""
    model.train_function = model.test_function = model.predict_function = None


@contextlib.contextmanager
def policies(layers, policy):
    """Inside the block every layer in `layers` computes under `policy` (a name or a `DTypePolicy`); afterwards
    each has its own policy object back. The public setter would write into a `DTypePolicyMap` that other layers
    share (the one `tfmp.keep_float32` makes); the policy attribute itself is swapped instead."""
    policy = keras.dtype_policies.get(policy)
    saved = [layer._dtype_policy for layer in layers]  # noqa: SLF001
    try:
        for layer in layers:
            set_policy(layer, policy)
        yield
    finally:
        for layer, kept in zip(layers, saved, strict=True):
            set_policy(layer, kept)  # The same object back (`get` returns a policy object as it is).


@contextlib.contextmanager
def watching_calls(layers, on_call, on_start=None):
    """Inside the block, every call of a layer in `layers` (eager or traced) also runs
    `on_call(layer, args, kwargs, outputs)` after the layer's own `call`, on the arguments
    the layer's `call` received (already cast to its compute dtype), and `on_start(layer)`
    before it. Afterwards the layers are as they were.

    Keras' `Layer.__call__` runs `self.call`, so an attribute on the instance shadows the
    class's method; it is set with `object.__setattr__`, past Keras' attribute tracking.
    """
    shadowed = [layer.__dict__.get("call") for layer in layers]

    def watch(layer, call):
        def watched(*args, **kwargs):
            if on_start is not None:
                on_start(layer)
            outputs = call(*args, **kwargs)
            on_call(layer, args, kwargs, outputs)
            return outputs

        return watched

    watched = []
    try:
        for layer in layers:
            object.__setattr__(layer, "call", watch(layer, layer.call))
            watched.append(layer)
        yield
    finally:
        for layer, own in zip(watched, shadowed, strict=False):
            if own is None:
                object.__delattr__(layer, "call")
            else:
                object.__setattr__(layer, "call", own)


# The slot lists each Keras optimizer's `update_step` reads, by that method (AdamW is Adam's
# update after Keras' weight decay); tfmp.bf16 runs these updates on float32 stand-ins.
UPDATE_SLOTS = {
    keras.optimizers.SGD.update_step: ("momentums",),
    keras.optimizers.Adam.update_step: ("_momentums", "_velocities", "_velocity_hats"),
    keras.optimizers.Lion.update_step: ("_momentums",),
    keras.optimizers.Adafactor.update_step: ("_r", "_c", "_v"),
}


def variable_index(optimizer, variable):
    """The position of `variable` (Keras, TensorFlow or a replica's copy) in what
    `optimizer` was built for: the index of its slots."""
    return optimizer._get_variable_index(variable)  # noqa: SLF001


def decays(optimizer, variable):
    """Whether `optimizer` applies weight decay to `variable` (Keras' exclusions honoured)."""
    return optimizer.weight_decay is not None and optimizer._use_weight_decay(variable)  # noqa: SLF001


def slots_of(optimizer, index):
    """{slot list name: the slot of the variable at `index`} for the lists its class's
    `update_step` reads (`UPDATE_SLOTS`); an empty list (SGD without momentum, Adam
    without amsgrad) gives none."""
    names = UPDATE_SLOTS[type(optimizer).update_step]
    return {name: getattr(optimizer, name)[index] for name in names if getattr(optimizer, name, None)}


def with_slots(optimizer, index, replaced):
    """A shallow copy of `optimizer` whose slot lists hold `replaced[name]` at `index` and
    whose variable lookup answers `index` for anything: the class's `update_step` called on
    it with stand-ins for a variable reads and assigns the stand-ins."""
    copy = shallow_copy(optimizer)
    for name, value in replaced.items():
        held = getattr(optimizer, name)
        object.__setattr__(copy, name, [*held[:index], value, *held[index + 1 :]])
    object.__setattr__(copy, "_get_variable_index", lambda _: index)
    return copy


def shallow_copy(obj):
    """A new object of `obj`'s class sharing all its attributes (`copy.copy` would go through
    Keras' pickling, which saves and rebuilds the variables)."""
    twin = object.__new__(type(obj))
    object.__getattribute__(twin, "__dict__").update(vars(obj))
    return twin


def _as_given(grads_and_vars):
    return grads_and_vars


def reduced_applier(optimizer, hooks=None, reduced_flag=None):
    """tfmp's own applier for `optimizer`: a shallow copy, sharing every variable (slots,
    iterations, learning rate, loss scale), whose `apply` takes gradients the caller has
    already all-reduced (Keras' own all-reduces inside `apply`, after clipping per
    replica). `hooks` maps `id(o)` of each optimizer `o` of `optimizer_groups` to its
    `(update_step, weight_decay_filter)`: each gradient is applied with that `update_step`
    (tfmp.fused, tfmp.bf16) where one is given, and Keras' weight decay (applied before the
    updates) touches only the variables the filter accepts (`update_step` decays the
    others). A loss-scale wrapper is copied with its inner optimizer, and `reduced_flag`
    (the name of its attribute saying the gradients are reduced) set on the copy; a
    MultiOptimizer with each of its optimizers. `optimizer` itself is not changed.
    """
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
    """A new optimizer, unbuilt, configured as `optimizer` (a loss-scale wrapper's inner
    one): a MultiOptimizer gets fresh copies of its optimizers, each variable going to the
    copy of its own (its map may be a function, which no config holds)."""
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


def global_seed():
    """The seed of `keras.utils.set_random_seed` (and `tfmp.set_seed`), or None."""
    return rng_utils.get_random_seed()


def backup_epoch(model):
    """The epoch a `keras.callbacks.BackupAndRestore` restored in its `on_train_begin` (Keras
    fit starts there), or None; taken, so that no later fit starts there too."""
    epoch = getattr(model, "_initial_epoch", None)
    model._initial_epoch = None  # noqa: SLF001
    return epoch


def loss_tracker(model):
    """The metric behind the `loss` that `model.fit` reports (a running mean), or None."""
    return getattr(model, "_loss_tracker", None)
