"""A compiled step's metrics and outputs: the loss tracker and the metrics updated, their results as Keras fit
logs them, packed into one int32 vector so that the host reads them with one copy."""

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from tfmp import keras_compat


def flat(results):
    """A model's metric results with a dict result's entries in its place (a metric whose `result()` is a dict), as
    Keras fit's logs hold them."""
    out = {}
    for key, value in results.items():
        out.update(flat(value) if isinstance(value, dict) else {key: value})
    return out


def update_metrics(model, x, y, y_pred, sample_weight):
    """`model.compute_metrics(...)`, which updates its metrics. A `compute_metrics` of the model's own may return more
    than their results: model.fit logs the extra entries (the last step's values), tfmp.fit its metrics' results
    only, and says so once."""
    returned = model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
    if type(model).compute_metrics is keras.Model.compute_metrics or not isinstance(returned, dict):
        return
    extra = sorted(set(flat(returned)) - set(flat(model.get_metrics_result())))
    if extra:
        logging.log_first_n(
            logging.WARNING,
            "%s.compute_metrics returns %s beside its metrics' results: model.fit logs them, tfmp.fit logs only the "
            "results of the model's metrics (make each a keras.metrics.Metric, e.g. a keras.metrics.Mean)",
            1,
            type(model).__name__,
            ", ".join(extra),
        )


def track_loss(model, loss, examples, replicas, skip_non_finite=False):
    """The model's loss tracker's running mean gets a replica's `loss` (its share of the global's) x `replicas`."""
    tracker = keras_compat.loss_tracker(model)
    if tracker is None:
        return
    value, count = loss * replicas, tf.cast(examples, loss.dtype)  # Its own mean.
    if skip_non_finite:  # A step skipped for overflow must not turn the epoch's mean into inf.
        ok = tf.math.is_finite(value)
        value, count = tf.where(ok, value, 0.0), tf.where(ok, count, 0.0)
    tracker.update_state(value, sample_weight=count)


def as_log(value):
    """A metric's result as Keras fit logs it: a Python float, or a numpy array where it has a shape (F1Score's,
    one per class)."""
    if not isinstance(value, (np.ndarray, np.generic, float, int)):  # A tensor, or a variable a result() returned.
        value = tf.convert_to_tensor(value).numpy()
    return float(value) if np.ndim(value) == 0 else np.asarray(value)


class Packed:
    """Packs a dict of tensors into one int32 vector inside a compiled function (floats and
    int64s bit for bit, booleans as 0 or 1) and unpacks that vector's value on the host, by
    the layout recorded when the function traced. A tensor whose shape the trace does not
    know (a metric's result from the host, `tf.numpy_function`) carries its shape in the
    vector: its rank, then its dimensions, then its values."""

    def __init__(self):
        self.layout = []  # (key, kind, shape, words) per entry, in key order; shape and words None where not known.

    def pack(self, out):
        """The int32 vector of `out`'s tensors (called while tracing)."""
        layout, words = [], []
        for key in sorted(out):
            value = tf.convert_to_tensor(out[key])
            if value.dtype == tf.bool:
                kind, word = "b", tf.cast(value, tf.int32)
            elif value.dtype.is_integer:
                kind, word = "i", tf.bitcast(tf.cast(value, tf.int64), tf.int32)
            else:
                kind, word = "f", tf.bitcast(tf.cast(value, tf.float32), tf.int32)
            word = tf.reshape(word, [-1])
            if value.shape.is_fully_defined():
                layout.append((key, kind, tuple(value.shape), int(word.shape[0])))
            else:  # Its shape read on the host, ahead of its words.
                layout.append((key, kind, None, None))
                word = tf.concat([[tf.rank(value)], tf.shape(value, out_type=tf.int32), word], 0)
            words.append(word)
        self.layout = layout
        return tf.concat(words, 0)

    def unpack(self, words):
        """The dict of numpy values (float32, int64, bool) that `words`, a packed vector's
        numpy value, holds."""
        out, at = {}, 0
        for key, kind, shape, size in self.layout:
            if shape is None:  # Rank, dimensions, values.
                rank = int(words[at])
                shape = tuple(int(d) for d in words[at + 1 : at + 1 + rank])
                at += 1 + rank
                size = int(np.prod(shape, dtype=np.int64)) * (2 if kind == "i" else 1)
            part = words[at : at + size]
            at += size
            value = part.view(np.float32) if kind == "f" else part.view(np.int64) if kind == "i" else part.astype(bool)
            out[key] = value.reshape(shape) if shape else value.reshape(())[()]
        return out
