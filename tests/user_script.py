"""A user's own training script: its own two-output model and data, trained by tfmp.fit.

    python tests/user_script.py OUT.npz [CHECKPOINT_DIR|-] [SECONDS_PER_BATCH] [DROPOUT] [BATCH]

USER_SCRIPT_PRECISION=float8 in the environment trains it under that policy and also saves
the float8 state (scales, amax histories) to OUT.float8.npz; =bfloat16 stores its weights and
optimizer state in bfloat16 (Kahan-compensated), saved as float32 (exactly).
USER_SCRIPT_STOP=train_batch:N (or epoch:N) has worker 0 alone set `model.stop_training` at the end of its
batch (or epoch) N, as a callback with a time limit might.
USER_SCRIPT_CALLBACKS=DIR adds Keras' file-writing callbacks, all writing under DIR: ModelCheckpoint
(DIR/w.weights.h5, every 2 batches), CSVLogger (DIR/log.csv), TensorBoard (DIR/tb), BackupAndRestore
(DIR/backup, every 2 batches, kept).
USER_SCRIPT_VALIDATION_SECONDS=S sleeps S seconds after each batch of the first validation pass.
USER_SCRIPT_JIT_COMPILE=1 (or 0) sets tfmp.fit's jit_compile (default "auto"); USER_SCRIPT_CLIPNORM its
clipnorm (default 1.0).
Each of these settings may hold one value per worker, split by "|" (`float32|mixed_bfloat16`: worker 0's, then
worker 1's), as workers that decide by their own hardware, or run with other flags, might.
USER_SCRIPT_DATA=arrays trains on the same examples as numpy arrays (`tfmp.fit(model, x, y,
batch_size=..., validation_split=0.25)`, shuffled by tfmp) instead of a dataset; =pydataset
on them as a keras.utils.PyDataset of batches (its batch order shuffled by tfmp); =uneven as a generator of
batches that runs out in the second epoch, on worker 0 three batches before the others.

The History of the epochs it trained goes to OUT.history.json. OUT may hold `{worker}`: the
worker's index (0 without TF_CONFIG), for jobs whose workers all get the same arguments
(python -m tfmp.launch).

Under TF_CONFIG it is one worker of a cluster (`tfmp.get_strategy("auto")` picks
multi_worker). The optional sleep per batch gives a test time to kill it mid-run.
"""

import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfmp  # noqa: E402


def build(dropout=0.2):
    features = keras.Input((8,), name="features")
    hidden = keras.layers.Dense(16, activation="relu")(features)
    # Its random state must resume too; 0 for comparisons across replicas, whose masks differ.
    hidden = keras.layers.Dropout(dropout)(hidden)
    value = keras.layers.Dense(1, name="value")(hidden)
    label = keras.layers.Dense(3, activation="softmax", name="label")(hidden)
    model = keras.Model(features, {"value": value, "label": label})
    model.compile(
        tfmp.wrap_optimizer(keras.optimizers.AdamW(1e-2)),
        loss={"value": "mse", "label": "sparse_categorical_crossentropy"},
        loss_weights={"value": 0.3, "label": 1.0},
        metrics={"label": ["accuracy"]},
    )
    return model


def arrays():
    rng = np.random.default_rng(3)
    x = rng.random((256, 8), dtype=np.float32)
    return x, {"value": x.sum(1, keepdims=True), "label": (x[:, 0] * 3).astype(np.int64)}


def data(batch=32):
    # Reshuffled every epoch from one seed: a resumed run must see the same batches.
    return tf.data.Dataset.from_tensor_slices(arrays()).shuffle(256, seed=7).batch(batch, drop_remainder=True)


class Batches(keras.utils.PyDataset):
    def __init__(self, batch, n=256):
        super().__init__()
        self.batch, self.n = batch, n

    def __len__(self):
        return self.n // self.batch

    def __getitem__(self, index):
        x, y = arrays()
        at = slice(index * self.batch, (index + 1) * self.batch)
        return x[at], {key: value[at] for key, value in y.items()}


class Slow(keras.callbacks.Callback):
    def __init__(self, seconds):
        super().__init__()
        self.seconds = seconds

    def on_train_batch_end(self, batch, logs=None):
        time.sleep(self.seconds)


class SlowValidation(keras.callbacks.Callback):
    """Sleeps `seconds` after each batch of the first validation pass."""

    def __init__(self, seconds):
        super().__init__()
        self.seconds = seconds

    def on_test_batch_end(self, batch, logs=None):
        time.sleep(self.seconds)

    def on_test_end(self, logs=None):
        self.seconds = 0.0


def stop_on_worker_0(index, when):
    """A callback that stops training on worker `index` 0 only, at the end of batch or epoch N (`when`)."""
    hook, at = when.split(":")

    def stop(number, logs=None):
        if index == 0 and number == int(at):
            callback.model.stop_training = True

    callback = keras.callbacks.LambdaCallback(**{f"on_{hook}_end": stop})
    return callback


def file_writers(directory):
    return [
        keras.callbacks.ModelCheckpoint(os.path.join(directory, "w.weights.h5"), save_weights_only=True, save_freq=2),
        keras.callbacks.CSVLogger(os.path.join(directory, "log.csv")),
        keras.callbacks.TensorBoard(os.path.join(directory, "tb")),
        keras.callbacks.BackupAndRestore(os.path.join(directory, "backup"), save_freq=2, delete_checkpoint=False),
    ]


def setting(name, index):
    """The environment's `name`, worker `index`'s where it holds one value per worker ("a|b")."""
    values = os.environ.get(name, "").split("|")
    return values[min(index, len(values) - 1)]


if __name__ == "__main__":
    index = json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {}).get("index", 0)
    out = sys.argv[1].format(worker=index)
    checkpoint_dir = sys.argv[2] if len(sys.argv) > 2 and sys.argv[2] != "-" else None
    seconds = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
    dropout = float(sys.argv[4]) if len(sys.argv) > 4 else 0.2
    batch = int(sys.argv[5]) if len(sys.argv) > 5 else 32
    tfmp.set_seed(0, deterministic=True)
    strategy = tfmp.get_strategy("auto")
    policy = setting("USER_SCRIPT_PRECISION", index)  # float8: its float8 state is saved too.
    if policy:
        tfmp.configure_precision(policy)
    with strategy.scope():
        model = build(dropout)
    if os.environ.get("USER_SCRIPT_DATA") == "arrays":
        given = {"data": arrays()[0], "y": arrays()[1], "batch_size": batch, "validation_split": 0.25}
    elif os.environ.get("USER_SCRIPT_DATA") == "pydataset":
        given = {"data": Batches(batch), "validation_data": Batches(batch, n=2 * batch)}
    elif os.environ.get("USER_SCRIPT_DATA") == "uneven":
        batches = Batches(batch)
        passes = (batches[i % len(batches)] for i in range(len(batches) + (3 if index == 0 else len(batches))))
        given = {"data": passes, "steps_per_epoch": len(batches)}
    else:  # Validation of unknown length (filter): fine on several workers too.
        given = {"data": data(batch), "validation_data": data(batch).take(2).filter(lambda x, y: True)}
    callbacks = [Slow(seconds)]
    if "USER_SCRIPT_VALIDATION_SECONDS" in os.environ:
        callbacks.append(SlowValidation(float(os.environ["USER_SCRIPT_VALIDATION_SECONDS"])))
    if "USER_SCRIPT_STOP" in os.environ:
        callbacks = [stop_on_worker_0(index, os.environ["USER_SCRIPT_STOP"])]
    elif "USER_SCRIPT_CALLBACKS" in os.environ:
        callbacks += file_writers(os.environ["USER_SCRIPT_CALLBACKS"])
    try:
        history = tfmp.fit(
            model,
            **given,
            epochs=3,
            grad_accum_steps=2,
            clipnorm=float(setting("USER_SCRIPT_CLIPNORM", index) or 1.0),
            jit_compile={"1": True, "0": False}.get(setting("USER_SCRIPT_JIT_COMPILE", index), "auto"),
            checkpoint_dir=checkpoint_dir,
            checkpoint_every=4,
            callbacks=callbacks,
            verbose=0,
        )
    except tfmp.Preempted as e:  # SIGTERM: a checkpoint was saved; exit "temporary failure".
        print(f"preempted: {e}", file=sys.stderr)
        sys.exit(75)
    except tfmp.PeerLost as e:  # Another worker died: rerun the job to resume.
        print(f"lost a peer: {e}", file=sys.stderr)
        sys.exit(76)
    np.savez(out, *[np.asarray(w.numpy(), np.float32) if w.dtype == "bfloat16" else w.numpy() for w in model.weights])
    with open(out + ".history.json", "w") as f:  # The epochs this process trained.
        json.dump(history.history, f)
    if policy == "float8":
        np.savez(out + ".float8.npz", *[np.asarray(v.value) for v in model.weights if tfmp.float8.is_state(v)])
