"""How the doctor watches a model: each layer's calls seen as they happen (`Session`), and
the statistics it takes of the values (maximum magnitude, finiteness, log2 histograms)."""

import contextlib
import math

import numpy as np
import tensorflow as tf

from tfmp import keras_compat
from tfmp.errors import UsageError

BINS = np.arange(-100, 41)  # Integer log2 bins: a power-of-two scale shifts them exactly.


class Calls:
    """What the layers' calls saw during a forward pass, per layer (an index into `layers`):
    the largest |input| that the layer casts to its compute dtype and the largest |output|
    over every call while `recording`; and, per pass, the layers in the order their calls
    began and finished, with their outputs."""

    def __init__(self, layers):
        self.layers = layers
        self._index = {id(layer): i for i, layer in enumerate(layers)}
        self.input_max = np.zeros(len(layers))
        self.output_max = np.zeros(len(layers))
        self.output_floats = np.zeros(len(layers), bool)  # Whether a float came out (not only ids, tokens, masks).
        self.casts = [keras_compat.casts_inputs(layer) for layer in layers]  # In the model's own policies.
        self.float8 = set()  # Indices of the layers whose matmul inputs and outputs are kept (see `matmuls`).
        self.matmuls = {}  # Index -> (inputs, outputs) of its last call while recording.
        self.recording = False
        self.new_pass()

    def new_pass(self):
        self.started, self.finished = [], []

    def start(self, layer):
        self.started.append(self._index[id(layer)])

    def __call__(self, layer, args, kwargs, outputs):
        i = self._index[id(layer)]
        self.finished.append((i, outputs))
        if self.recording:
            if self.casts[i]:
                self.input_max[i] = max(self.input_max[i], max_abs((args, kwargs)))
            values = floats(outputs)  # Once, for both.
            self.output_max[i] = max(self.output_max[i], max_abs(values))
            self.output_floats[i] |= bool(values)
            if i in self.float8:
                self.matmuls[i] = (args[0], outputs)

    def outputs(self):
        """Each layer's outputs in this pass (a list per layer: one item per call)."""
        per_layer = [[] for _ in self.layers]
        for i, outputs in self.finished:
            per_layer[i].append(outputs)
        return per_layer


def floats(structure):
    """The floating-point tensors in a nest (not masks, flags or integer ids)."""
    tensors = []
    for t in tf.nest.flatten(structure, expand_composites=False):
        if isinstance(t, tf.IndexedSlices):
            t = t.values
        if isinstance(t, (tf.Tensor, tf.Variable, np.ndarray)) and t.dtype in FLOATING:
            tensors.append(t)
    return tensors


FLOATING = (tf.float16, tf.bfloat16, tf.float32, tf.float64, np.float16, np.float32, np.float64)


def max_abs(structure):
    values = [np.abs(np.asarray(t, np.float64)) for t in floats(structure)]
    return max((float(np.nanmax(v, initial=0.0)) for v in values), default=0.0)


def finite(structure):
    return all(bool(np.isfinite(np.asarray(t, np.float32)).all()) for t in floats(structure))


def owners(layers):
    """Per trainable variable (by id), the index of the innermost layer in `layers` holding it."""
    owner = {}
    for i, layer in enumerate(layers):  # Parents come before their children: the last one wins.
        for v in layer.trainable_weights:
            owner[id(v)] = i
    return owner


def abs_values(tensors):
    flat = [
        np.abs(np.asarray(t.values if isinstance(t, tf.IndexedSlices) else t, dtype=np.float64)).ravel()
        for t in tf.nest.flatten(tensors, expand_composites=False)
        if t is not None
    ]
    return np.concatenate(flat) if flat else np.zeros(0)


def log2_histogram(values):
    nonzero = values[values > 0]
    bins = np.clip(np.floor(np.log2(nonzero)), BINS[0], BINS[-1]).astype(int) - BINS[0]
    return np.bincount(bins, minlength=len(BINS)), int(values.size - nonzero.size)


def fraction_below(histogram, zeros, threshold, scale):
    """Fraction of non-zero values v with v * scale < threshold (powers of two: exact)."""
    total = histogram.sum()
    if not total:
        return 0.0
    edge = int(math.log2(threshold / scale)) - BINS[0]
    return float(histogram[: max(edge, 0)].sum() / total)


def model_loss(model, y, y_pred, sample_weight):
    compiled = keras_compat.compiled(model)[0]
    terms = [compiled(y, y_pred, sample_weight)] if compiled is not None else []
    terms += list(model.losses)
    if not terms:
        raise UsageError("diagnose needs a compiled loss (model.compile(loss=...)) or layer losses")
    return tf.add_n([tf.cast(t, tf.float32) for t in terms])


def relative_error(low, ref):
    a = np.concatenate([np.asarray(t, np.float64).ravel() for t in floats(low)] or [np.zeros(0)])
    b = np.concatenate([np.asarray(t, np.float64).ravel() for t in floats(ref)] or [np.zeros(0)])
    return float(np.linalg.norm(a - b) / (np.linalg.norm(b) + 1e-30)) if a.shape == b.shape else 0.0


class Session:
    """The user's model, its layers watched and its variables put back on exit: diagnose
    trains it in float32 for a few steps, and the model is as it was afterwards."""

    def __init__(self, model):
        self.model = model
        self.layers = keras_compat.sublayers(model)
        if not self.layers:
            raise UsageError(f"diagnose found no layers in {type(model).__name__}; build it by calling it first")
        self.calls = Calls(self.layers)
        self._stack = contextlib.ExitStack()

    def __enter__(self):
        saved = [(v, v.numpy()) for v in self.model.variables]
        self._stack.callback(lambda: [v.assign(value) for v, value in saved])
        self._stack.enter_context(keras_compat.watching_calls(self.layers, self.calls, self.calls.start))
        return self

    def __exit__(self, *exc):
        return self._stack.__exit__(*exc)

    def forward(self, x, policy=None, training=False):
        """The model's prediction, every layer computing in `policy` (default: its own)."""
        self.calls.new_pass()
        if policy is None:
            return self.model(x, training=training)
        with keras_compat.policies([self.model, *self.layers], policy):
            return self.model(x, training=training)
