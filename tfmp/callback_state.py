"""What Keras' stateful callbacks know, kept in tfmp's checkpoints: a resumed run decides as
the unbroken one would. EarlyStopping's patience count, best value, best epoch and best
weights; ReduceLROnPlateau's patience and cooldown counts and best value; ModelCheckpoint's
best value; and the epoch at which a callback ended the run, if one did (a rerun then trains
no further). Other callbacks start afresh on a resumed run, as under `model.fit`'s
BackupAndRestore (a CSVLogger appending to its file: `tfmp.run`)."""

import json

import keras
import numpy as np
import tensorflow as tf
from absl import logging

_FIELDS = (
    (keras.callbacks.EarlyStopping, ("wait", "stopped_epoch", "best", "best_epoch", "best_weights")),
    (keras.callbacks.ReduceLROnPlateau, ("wait", "cooldown_counter", "best")),
    (keras.callbacks.ModelCheckpoint, ("best",)),
)


def _stateful(callbacks):
    """{key: (callback, its fields)} for the callbacks with state: the key is the type's name, what it monitors
    and the count of such callbacks before it (`EarlyStopping(val_loss):0`), so that a rerun's callbacks find
    their own state, reordered or added to, and one monitoring another value does not take it."""
    found = {}
    for callback in callbacks:
        fields = next((f for kind, f in _FIELDS if isinstance(callback, kind)), None)
        if fields is not None:
            name = f"{type(callback).__name__}({getattr(callback, 'monitor', '')}):"
            found[f"{name}{sum(key.startswith(name) for key in found)}"] = callback, fields
    return found


def _plain(value):
    return value.item() if isinstance(value, np.generic) else value


class CallbackState(tf.train.experimental.PythonState):
    """The state of a run's callbacks, as one string in its checkpoints: JSON, a NUL, then the raw bytes of
    any weights the JSON describes (an EarlyStopping's best weights, of any dtype, bfloat16 too)."""

    def __init__(self):
        self.callbacks = []  # The run's callbacks, read at each save.
        self.stopped = None  # The epoch (from 0) at whose end a callback ended the run.
        self.restored = None  # What the checkpoint held: {"stopped": ..., "callbacks": {key: {field: value}}}.

    def serialize(self):
        state, buffers = {}, []
        for key, (callback, fields) in _stateful(self.callbacks).items():
            values = {field: _plain(getattr(callback, field, None)) for field in fields}
            weights = values.pop("best_weights", None)
            try:
                json.dumps(values)
            except (TypeError, ValueError) as e:  # A subclass keeping other values there: it starts afresh.
                logging.warning("callback %s's state is not checkpointed (%s): a resumed run starts it afresh", key, e)
                continue
            if weights is not None:
                arrays = [np.ascontiguousarray(w) for w in weights]
                values["best_weights"] = [[a.dtype.name, list(a.shape)] for a in arrays]
                buffers += [a.tobytes() for a in arrays]
            state[key] = values
        header = json.dumps({"stopped": self.stopped, "callbacks": state}).encode()
        return b"\0".join([header, b"".join(buffers)])

    def deserialize(self, string_value):
        header, data = bytes(string_value).split(b"\0", 1)
        self.restored = json.loads(header)
        offset = 0
        for values in self.restored["callbacks"].values():
            if values.get("best_weights") is not None:
                arrays = []
                for dtype, shape in values["best_weights"]:
                    dtype, count = tf.as_dtype(dtype).as_numpy_dtype, int(np.prod(shape))  # bfloat16 (ml_dtypes) too.
                    arrays.append(np.frombuffer(data, dtype, offset=offset, count=count).reshape(shape))
                    offset += count * np.dtype(dtype).itemsize
                values["best_weights"] = arrays

    def apply(self, callbacks):
        """Gives `callbacks` (after their `on_train_begin`, which resets them) the state restored, where the
        checkpoint holds one for them. Returns the epoch at whose end a callback ended the run, or None."""
        self.callbacks = callbacks
        if self.restored is None:
            return None
        held = self.restored["callbacks"]
        for key, (callback, _) in _stateful(callbacks).items():
            if key not in held:
                logging.info("the checkpoint holds no state for callback %s: it starts afresh", key)
                continue
            for field, value in held[key].items():
                setattr(callback, field, value)
        return self.restored["stopped"]
