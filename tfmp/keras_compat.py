"""Uses of Keras internals, in one place, each with a test in tests/test_keras_compat.py.

Keras 3 has no public API for a layer's sublayers, for swapping a built layer's dtype
policy without writing into a shared `DTypePolicyMap`, or for seeing what a layer's `call`
received and returned. The doctor needs all three, on any model (Sequential, functional,
subclassed), without copying it. A Keras upgrade that changes one of these fails the test
named after it.
"""

import contextlib

import keras


def sublayers(model):
    """Every layer inside `model` (nested models' and custom layers' too), parents before
    their children, without InputLayers and without `model` itself."""
    layers = model._flatten_layers(include_self=False, recursive=True)  # noqa: SLF001
    return [layer for layer in layers if not isinstance(layer, keras.layers.InputLayer)]


def output_layers(model):
    """The layers that make a functional model's outputs, each found by walking back from
    the output through weightless layers of one input (an Activation, a Softmax, a
    Dropout); none for a subclassed model."""
    found = []
    for output in getattr(model, "outputs", None) or []:
        layer = output._keras_history.operation  # noqa: SLF001
        while layer is not None and not layer.weights and len(layer._inbound_nodes) == 1:  # noqa: SLF001
            parents = layer._inbound_nodes[0].parent_nodes  # noqa: SLF001
            layer = parents[0].operation if len(parents) == 1 else None
        if layer is not None:
            found.append(layer)
    return found


def casts_inputs(layer):
    """Whether `layer` casts its floating inputs to its compute dtype when called. A nested
    functional model leaves that to its own layers; a Sequential model casts to its
    InputLayer's dtype."""
    converts = layer.autocast and getattr(layer, "_convert_input_args", True)
    return bool(converts and layer.input_dtype == layer.compute_dtype)


def set_policy(layer, policy):
    """Makes the built `layer` compute under `policy` from now on, without writing into a
    `DTypePolicyMap` that other layers share (as the public setter would)."""
    layer._dtype_policy = keras.dtype_policies.get(policy)  # noqa: SLF001


def forget_compiled_functions(model):
    """Drops the train/test/predict functions `model.fit` traced, so that the next call
    traces them again (after a layer's dtype policy changed)."""
    model.train_function = model.test_function = model.predict_function = None


@contextlib.contextmanager
def policies(layers, policy):
    """Inside the block every layer in `layers` computes under `policy` (a name or a
    `DTypePolicy`); afterwards each has its own policy object back.

    The public setter would write into a `DTypePolicyMap` that other layers share (the one
    `tfmp.keep_float32` makes); the policy attribute itself is swapped instead.
    """
    policy = keras.dtype_policies.get(policy)
    saved = [layer._dtype_policy for layer in layers]  # noqa: SLF001
    try:
        for layer in layers:
            layer._dtype_policy = policy  # noqa: SLF001
        yield
    finally:
        for layer, kept in zip(layers, saved, strict=True):
            layer._dtype_policy = kept  # noqa: SLF001


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
