"""Uses of Keras internals, in one place (an optimizer's: tfmp.keras_optimizers), each with a test in
tests/test_keras_compat.py: a release that changes one of them fails the test named after it.

Keras 3 has no public API for a layer's sublayers, for swapping a built layer's dtype policy without writing
into a shared `DTypePolicyMap`, for seeing what a layer's `call` received and returned (the doctor needs
these, on any model, without copying it), for building a model with its compiled loss and metrics from a data
spec, for the layers a `DTypePolicyMap` serves (tfmp.keep_float32 warns of names that matched none), for the
loss `model.fit` computes and the metric it reports it with, or for the order `model.evaluate` lists its
results in; Keras 3.10's `Model.quantize` takes no `filters`; the seed `keras.utils.set_random_seed` was given
has no getter, nor the epoch a `BackupAndRestore` callback restored, nor the base class of what a `.keras` file
holds the state of (`Saveable`: tfmp.bf16's Kahan buffers). The uses of TensorFlow's internals are in
tfmp.tf_compat.

Besides these, tfmp overrides hooks Keras calls: `LossScaleOptimizer._tf_apply` (tfmp.loss_scale), a model's
`_aggregate_additional_loss`, its compiled losses' `call`, its per-output loss trackers' `update_state` and, for a
`compute_loss` of the model's own on replicas, Keras' 1/replicas on each loss while `compute_loss` runs (the losses
layers add, in float32; tfmp.scalar_losses); tests/test_loss_scale.py and test_scalar_losses.py cover them.
"""

import contextlib
import inspect
import re

import keras
import tensorflow as tf
from keras.src.backend import compute_output_spec  # The symbolic call of Keras' build: `build_layers`.
from keras.src.losses import loss as loss_module  # Keras' 1/replicas on each loss: `compute_loss`.
from keras.src.saving.keras_saveable import KerasSaveable as Saveable  # noqa: F401 - see the docstring.
from keras.src.utils import rng_utils  # Keras' record of the global seed.

from tfmp import scalar_losses
from tfmp.errors import UsageError


def symbolic_build(model, element_spec):
    """Builds `model`, its compiled loss and metrics and its optimizer from a data spec, as `model.fit` does.
    A None in the elements (`map(lambda x, y: (x, y, None))`) is None here, as in the batch `model.fit` builds
    from: Keras' build reads a shape of each spec, and a NoneTensorSpec has none."""
    batch = tf.nest.map_structure(lambda spec: None if _holds_none(spec) else spec, element_spec)
    try:
        model._symbolic_build(data_batch=batch)  # noqa: SLF001
    except ValueError as e:
        metrics = model._compile_metrics  # noqa: SLF001
        # Keras' words for a shape of unknown rank: TensorFlow's up to Keras 3.15, its own after.
        if metrics is None or not metrics.built or not re.search("unknown TensorShape|unknown rank", str(e)):
            raise
        # Its metrics built, a result failed: one of no static shape (a host call's), which Keras' build reads and
        # model.fit on one device leaves to the first step. The rest built again, past the metrics.
        model._symbolic_build(data_batch=batch)  # noqa: SLF001


def build_layers(model, element_spec):
    """Builds `model`'s layers only, not its compiled loss and metrics nor its optimizer, by the symbolic call of
    `model`'s inputs in `element_spec` that `model.fit`'s build makes."""
    symbolic = keras.KerasTensor  # As Keras' build makes each: a spec's shape and dtype, a None's None.
    batch = tf.nest.map_structure(
        lambda spec: None if _holds_none(spec) else symbolic(spec.shape, keras.backend.standardize_dtype(spec.dtype)),
        element_spec,
    )
    x, _, _ = keras.utils.unpack_x_y_sample_weight(batch)
    compute_output_spec(model, x, training=False)


def _holds_none(spec):
    return type(spec).__name__ == "NoneTensorSpec"  # TensorFlow's spec of a None, not exported.


def compiled(model):
    """(its compiled loss, its compiled metrics), None for what was not: to tell when a model was compiled again."""
    return getattr(model, "_compile_loss", None), getattr(model, "_compile_metrics", None)


def compute_loss(model, x, y, y_pred, sample_weight, training, micro_batches=1, sums_times=None, share=None):
    """The loss `model.fit` minimizes: compiled losses with their weights and sample weights, each a mean over
    the global batch under a strategy (one returning a scalar too: tfmp.scalar_losses), plus regularization.

    Each loss a layer added (`add_loss`, an `activity_regularizer`) is summed in float32. Keras sums one computed
    in float16 or bfloat16 in that dtype, then fails adding it to the float32 compiled loss ("Cannot convert a
    list containing a tensor of dtype float16"), so under a mixed policy `model.fit` cannot train such a model.

    A `compute_loss` of the model's own runs on replicas with Keras' 1/replicas on each loss turned off (and the
    sums times the replicas): what it returns, its own terms too, is its replica's loss as one device's, and a
    1/replicas of it is its share. Keras scales its parts only, so that a mean of its own counted once a replica:
    under `model.fit` on 2 replicas it trained with twice one device's gradient and logged twice its loss.

    Raises:
        UsageError: the loss is not a scalar (a compiled loss with `reduction=None`).
    """
    aggregate = type(model)._aggregate_additional_loss.__get__(model)  # noqa: SLF001 - Keras' own, never a wrapper.

    def in_float32(loss):
        low = keras.backend.standardize_dtype(loss.dtype) in ("float16", "bfloat16")
        return aggregate(keras.ops.cast(loss, "float32") if low else loss)

    replicas = tf.distribute.get_strategy().num_replicas_in_sync
    own = replicas > 1 and type(model).compute_loss is not keras.Model.compute_loss
    if own:
        sums_times = (micro_batches if sums_times is None else sums_times) * replicas
    object.__setattr__(model, "_aggregate_additional_loss", in_float32)  # Past Keras' tracking; this call only.
    try:
        with (
            _unscaled(own),
            _batches_alike(compiled(model)[0], share),
            scalar_losses.one_per_example(compiled(model)[0], y_pred, micro_batches, sums_times, sample_weight),
        ):
            loss = model._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training)  # noqa: SLF001
    finally:
        model.__dict__.pop("_aggregate_additional_loss", None)  # (A MirroredStrategy's replicas run one at a time.)
    if loss is not None and loss.shape.rank:
        raise UsageError(
            f"the model's loss is not one number but shape {loss.shape} (a loss with reduction=None gives one per "
            "example): give it reduction='sum_over_batch_size' (the mean, Keras' default) or 'sum' (model.fit "
            "trains an unreduced loss as its sum, and reports its mean)"
        )
    return loss / replicas if own and loss is not None else loss


def _same(value):
    return value


@contextlib.contextmanager
def _unscaled(active):
    """Where `active`, while it runs: Keras' 1/replicas on a loss, and its undoing for a loss's log, do nothing."""
    if not active:
        yield
        return
    saved = loss_module.scale_loss_for_distribution, loss_module.unscale_loss_for_distribution
    loss_module.scale_loss_for_distribution = loss_module.unscale_loss_for_distribution = _same
    try:
        yield
    finally:
        loss_module.scale_loss_for_distribution, loss_module.unscale_loss_for_distribution = saved


def logs_per_output(model):
    """Whether Keras logs each compiled loss apart (`a_loss`, `b_loss`: there are several)."""
    return len(_loss_trackers(compiled(model)[0])) > 1


def _loss_trackers(compiled_loss):
    """Keras' per-output loss trackers (its `Mean`s, where there are several compiled losses), or []."""
    return list(getattr(compiled_loss, "metrics", None) or [])


@contextlib.contextmanager
def _batches_alike(compiled_loss, share=None):
    """While it runs, Keras' per-output loss trackers (`a_loss`, where there are several compiled losses) weigh each
    batch's value as one, as `model.fit` does where the batch size is not static (a dataset's), or, on a replica,
    by its `share` of the global batch (`tfmp.accumulate.replica_share`), so that the replicas' parts weigh one.
    Keras weighs it by that static size, which tfmp's evaluation step knows for every batch but an epoch's last:
    35 examples in batches of 8 weighed 8, 8, 8, 8 and 1, and val_a_loss was 0.676 where model.evaluate's is
    0.626."""
    trackers = _loss_trackers(compiled_loss)
    for tracker in trackers:  # Past Keras' tracking; this call only.
        object.__setattr__(tracker, "update_state", _as_one_batch(tracker.update_state, share))
    try:
        yield
    finally:
        for tracker in trackers:
            tracker.__dict__.pop("update_state", None)


def _as_one_batch(update_state, share):
    return lambda values, sample_weight=None: update_state(values, sample_weight=share)


def results_in_order(model, logs):
    """`logs` as `model.evaluate` returns them without `return_dict`: one number, or a list in its metrics' order."""
    return model._flatten_metrics_in_order(logs)  # noqa: SLF001


def compiled_jit_compile(model):
    """`compile(jit_compile=...)` where it is not "auto"'s answer here (the user's, as model.fit takes it), or None."""
    chosen = bool(model.jit_compile)
    return None if chosen == bool(model._resolve_auto_jit_compile()) else chosen  # noqa: SLF001


def takes_training(model):
    """Whether `model`'s `call` takes a `training` argument. Keras' train step gives one only then, and layers
    inside read it (a Dropout's, a float8 layer's amax) from the call of an outer one: without, none has it."""
    return model._call_has_training_arg  # noqa: SLF001


def call(model, x, training):
    """`model(x, training=training)`, or `model(x)` where its `call` takes no `training`, as Keras' train step calls."""
    return model(x, training=training) if takes_training(model) else model(x)


@contextlib.contextmanager
def paths_looked_up():
    """Inside the block, collects (into the set it yields) the layer paths that layers look their dtype up by in a
    `DTypePolicyMap`: a layer holding a map reads its path in it each time it asks its dtype, from its build on (Keras
    lists no map's layers)."""
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
    """`model.quantize(mode)` for `layers` only. Keras 3.10 has no `filters=` argument: there each layer is quantized by
    itself and the model's compiled functions are dropped, as `Model.quantize` does after it."""
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
    """The layers that make a functional model's outputs, each found by walking back from the output through weightless
    layers of one input (an Activation, a Softmax, a Dropout); none for a subclassed model."""
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
    """Whether `layer` casts its floating inputs to its compute dtype when called. A nested functional model leaves that
    to its own layers; a Sequential model casts to its InputLayer's dtype."""
    converts = layer.autocast and getattr(layer, "_convert_input_args", True)
    return bool(converts and layer.input_dtype == layer.compute_dtype)


def set_policy(layer, policy):
    """The built `layer` computes under `policy`, its shared `DTypePolicyMap` untouched (the public setter writes)."""
    layer._dtype_policy = keras.dtype_policies.get(policy)  # noqa: SLF001


def own_policy(layer):
    """The dtype policy `layer` computes under: its own, or its entry in the `DTypePolicyMap` it holds (a layer
    without a path, a model, computes under the map's default, which the map stands for, as in Keras)."""
    policy = layer.dtype_policy
    return policy[layer.path] if isinstance(policy, keras.dtype_policies.DTypePolicyMap) and layer.path else policy


def forget_compiled_functions(model):
    """Drops the functions `model.fit` traced, so that the next call traces them again (a new dtype policy)."""
    model.train_function = model.test_function = model.predict_function = None


@contextlib.contextmanager
def policies(layers, policy):
    """Inside the block every layer in `layers` computes under `policy` (a name or a `DTypePolicy`); afterwards each has
    its own policy object back. The public setter would write into a `DTypePolicyMap` that other layers share (the one
    `tfmp.keep_float32` makes); the policy attribute itself is swapped instead."""
    policy = keras.dtype_policies.get(policy)
    saved = [layer._dtype_policy for layer in layers]  # noqa: SLF001
    try:
        for layer in layers:
            set_policy(layer, _over_own_variables(policy, layer))
        yield
    finally:
        for layer, kept in zip(layers, saved, strict=True):
            set_policy(layer, kept)  # The same object back (`get` returns a policy object as it is).


def _over_own_variables(policy, layer):
    """`policy`'s computation over `layer`'s own variable dtype where that differs (bfloat16 weights): Keras casts a
    layer's variables to its compute dtype only where its policy's two dtypes differ, and under "float32" a float32 op
    was handed a bfloat16 weight (tfmp.diagnose of a model of bfloat16 weights failed)."""
    own = own_policy(layer).variable_dtype
    if own == policy.variable_dtype or policy.quantization_mode:
        return policy
    kept = keras.DTypePolicy(policy.name)
    kept._variable_dtype = own  # noqa: SLF001
    return kept


@contextlib.contextmanager
def watching_calls(layers, on_call, on_start=None):
    """Inside the block, every call of a layer in `layers` (eager or traced) also runs `on_call(layer, args, kwargs,
    outputs)` after the layer's own `call`, on the arguments the layer's `call` received (already cast to its compute
    dtype), and `on_start(layer)` before it. Afterwards the layers are as they were.

    Keras' `Layer.__call__` runs `self.call`, so an attribute on the instance shadows the class's method; it is set with
    `object.__setattr__`, past Keras' attribute tracking."""
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


def global_seed():
    """The seed of `keras.utils.set_random_seed` (and `tfmp.set_seed`), or None."""
    return rng_utils.get_random_seed()


def backup_epoch(model):
    """The epoch a `keras.callbacks.BackupAndRestore` restored in its `on_train_begin` (Keras fit starts there), or
    None; taken, so that no later fit starts there too."""
    epoch = getattr(model, "_initial_epoch", None)
    model._initial_epoch = None  # noqa: SLF001
    return epoch


def loss_tracker(model):
    """The metric behind the `loss` that `model.fit` reports (a running mean), or None."""
    return getattr(model, "_loss_tracker", None)
