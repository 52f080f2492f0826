"""The compiled train and test steps behind `tfmp.fit`, for any compiled Keras model.

One update: each replica runs `grad_accum_steps` batches forward and backward with the
model's own `compute_loss` (its compiled losses, loss weights, sample weights and
regularization, each a mean over the GLOBAL batch), summing their gradients locally; the
sum is all-reduced once, clipped by the global norm of the reduced, unscaled gradients,
and applied. Under loss scaling the update is skipped on every replica when any reduced
gradient is non-finite, without advancing `iterations` or the learning-rate schedule.
"""

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from tfmp import distribute, float8, fused, gradients, keras_compat
from tfmp.errors import first_line

# What `Steps.train` returns besides the model's metric results.
_FAILED = object()  # What a first call returns when XLA could not compile it.
STEP_STATE = ("step_loss", "grad_norm", "finite", "iterations", "learning_rate", "loss_scale")


def _max_over_replicas(context, values):
    """Each of `values` (dense tensors), its element-wise maximum over the replicas: one
    all-gather of them all, flattened."""
    if not values:
        return []
    flat = tf.concat([tf.reshape(v, [-1]) for v in values], 0)
    largest = tf.reduce_max(context.all_gather(flat[tf.newaxis], axis=0), axis=0)
    sizes = [v.shape.num_elements() for v in values]
    return [tf.reshape(part, v.shape) for part, v in zip(tf.split(largest, sizes), values, strict=True)]


def _batch_size(x):
    return tf.shape(next(t for t in tf.nest.flatten(x) if t is not None))[0]


def is_xla_error(error):
    """Whether a TensorFlow error says XLA could not compile a function."""
    text = str(error)
    return "XLA" in text or "unsupported operations when trying to compile" in text


class Steps:
    """Compiled train and test steps for one compiled model under one strategy.

    Args:
        model: a compiled Keras model, built under `strategy`; `model.optimizer` updates it.
        strategy: the `tf.distribute.Strategy` the model was built under.
        grad_accum_steps: batches whose gradients are summed into one update.
        clipnorm: clip the global norm of the all-reduced, unscaled gradients to this.
        steps_per_execution: updates per call of `train` when the epoch has room for them.
        jit_compile: run each replica's forward and backward passes (and evaluation's
            forward pass) as one XLA computation. The all-reduce, clipping and the
            optimizer's update stay outside it, where every strategy supports them.
        sparse: keep embedding gradients (`tf.IndexedSlices`) sparse through
            accumulation, all-reduce, the overflow check and clipping (not on TPUs,
            whose all-reduce takes dense tensors; on one replica, only where the update
            keeps them sparse too); False densifies them first.
        fused_updates: update with one kernel per variable where `tfmp.fused` can (Adam,
            AdamW, SGD; not on TPUs); False keeps Keras' element-wise update.
    """

    def __init__(
        self,
        model,
        strategy,
        grad_accum_steps=1,
        clipnorm=None,
        steps_per_execution=1,
        jit_compile=False,
        sparse=True,
        fused_updates=True,
    ):
        self.model = model
        self.optimizer = model.optimizer
        self.strategy = strategy
        self.grad_accum_steps = grad_accum_steps
        self.clipnorm = clipnorm
        self.steps_per_execution = steps_per_execution
        self.scaled = isinstance(self.optimizer, keras.optimizers.LossScaleOptimizer)
        self.variables = list(model.trainable_variables)
        self._state = [float8.is_state(v) for v in self.variables]  # Set, not learnt: see tfmp.float8.
        self.applied = []  # Indices of the variables that get gradients (set when tracing).
        if not self.optimizer.built:  # Its slots must exist before a step traces a cond around them.
            with strategy.scope():
                self.optimizer.build(self.variables)
        self.sparse = sparse and distribute.strategy_name(strategy) != "tpu"
        # TPU variables update through their own replicated assign ops: Keras' update there.
        inner = getattr(self.optimizer, "inner_optimizer", self.optimizer)
        fused_updates = fused_updates and distribute.strategy_name(strategy) != "tpu"
        self._update_step = fused.update_step(inner) if fused_updates else None  # Made once, not per call.
        # What applies the all-reduced gradients: tfmp's own copy of the optimizer, sharing
        # its variables; the user's optimizer object is never changed (keras_compat).
        self._applier = keras_compat.reduced_applier(self.optimizer, self._update_step, "gradients_reduced")
        # Which gradients to make dense before the all-reduce: all of them with sparse=False;
        # on one replica (nothing to all-reduce), those the update makes dense anyway (Adam's
        # moments decay on every row): once dense, they need no deduplication for the norm.
        alone = strategy.num_replicas_in_sync == 1
        densifies = self._update_step.densifies if self._update_step is not None and alone else None
        self._dense = [not self.sparse or (densifies is not None and densifies(v)) for v in self.variables]
        self._ran = False
        self.compile(jit_compile)

    def compile(self, jit_compile):
        """(Re)creates the compiled steps, with each replica's math under XLA or not."""
        if getattr(self, "_one", None) is not None and self.jit_compile == bool(jit_compile):
            return  # Already so: keep what was traced.
        self.jit_compile = bool(jit_compile)
        jit = tf.function(jit_compile=True) if self.jit_compile else (lambda fn: fn)
        self.gradients = jit(self.replica_gradients)
        self._forward = jit(self._replica_forward)
        self._one = tf.function(self._single)
        self._many = tf.function(self._updates)
        self._test = tf.function(self._test_step, reduce_retracing=True)

    def _fall_back(self, error):
        logging.warning("XLA cannot compile this model (%s); training without XLA", first_line(error)[:300])
        self.compile(False)

    def _first_call(self, fn, *args):
        """Calls a compiled step; the first call under XLA falls back to no XLA if it fails to compile."""
        if self._ran or not self.jit_compile:
            return fn(*args)
        try:
            out = fn(*args)
        except (tf.errors.InvalidArgumentError, tf.errors.UnimplementedError, tf.errors.NotFoundError) as e:
            if not is_xla_error(e):
                raise
            self._fall_back(e)
            return _FAILED
        self._ran = True
        return out

    # ---- training ----

    def train(self, iterator, updates=1):
        """Runs `updates` updates (1 or `steps_per_execution`) from `iterator`, and waits
        for them: `read(dispatch(iterator, updates))`.

        Returns:
            A dict of numpy values: `step_loss` (the last update's mean loss),
            `grad_norm`, `finite` (per variable), `iterations`, `learning_rate`,
            `loss_scale` (-1 without loss scaling), and the model's metric results
            (`loss`, ...: running means over the epoch).
        """
        return self.read(self.dispatch(iterator, updates))

    def dispatch(self, iterator, updates=1):
        """Queues `updates` updates from `iterator` on the device and returns at once, with
        what they will return packed into one tensor (see `read`): nothing here waits for
        the device."""
        fn = self._many if updates > 1 else self._one
        out = self._first_call(fn, iterator)
        if out is _FAILED:  # XLA failed to compile: the same update without it.
            out = (self._many if updates > 1 else self._one)(iterator)
        return out

    def read(self, packed):
        """The dict `train` returns, from what `dispatch` returned: one device-to-host copy."""
        words = packed.numpy()
        out, at = {}, 0
        for key, kind, shape, size in self._layout:
            part = words[at : at + size]
            at += size
            value = part.view(np.float32) if kind == "f" else part.view(np.int64) if kind == "i" else part.astype(bool)
            out[key] = value.reshape(shape) if shape else value.reshape(())[()]
        return out

    def _pack(self, out):
        """The step's outputs as one int32 vector (floats and int64s bit for bit), so that
        the host reads them with one copy; `read` unpacks them by `_layout`, set here."""
        layout, words = [], []
        for key in sorted(out):
            value = tf.convert_to_tensor(out[key])
            shape = tuple(value.shape)
            if value.dtype == tf.bool:
                kind, word = "b", tf.cast(value, tf.int32)
            elif value.dtype.is_integer:
                kind, word = "i", tf.bitcast(tf.cast(value, tf.int64), tf.int32)
            else:
                kind, word = "f", tf.bitcast(tf.cast(value, tf.float32), tf.int32)
            word = tf.reshape(word, [-1])
            layout.append((key, kind, shape, int(word.shape[0])))
            words.append(word)
        self._layout = layout
        return tf.concat(words, 0)

    def replica_gradients(self, batches):
        """Forward and backward passes over this replica's `batches`, gradients summed.

        Returns:
            (gradients per trainable variable (None where it gets none; embeddings'
            IndexedSlices stay sparse), each batch's loss, each batch's predictions).
        """
        model, n = self.model, len(batches)
        grads, losses, preds = None, [], []
        for batch in batches:  # Unrolled: n is small.
            x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(batch)
            with tf.GradientTape() as tape:
                y_pred = keras_compat.call(model, x, training=True)
                # A mean over the global batch (Keras divides each replica's mean by the
                # replica count), plus regularization counted once after the sum.
                loss = keras_compat.compute_loss(model, x, y, y_pred, sample_weight, training=True)
                scaled = self.optimizer.scale_loss(loss / n if n > 1 else loss)
            new = tape.gradient(scaled, self.variables)
            if grads is None:
                grads = new
            else:  # float8 state: the largest amax of the micro-batches, not their sum.
                grads = [
                    (tf.maximum(a, b) if state and a is not None else gradients.add(a, b))
                    for a, b, state in zip(grads, new, self._state, strict=True)
                ]
            losses.append(loss)
            preds.append(y_pred)
        return grads, losses, preds

    def _replica_update(self, batches):
        optimizer = self.optimizer
        grads, losses, preds = self.gradients(batches)
        for batch, loss, y_pred in zip(batches, losses, preds, strict=True):
            x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(batch)
            self._track_loss(loss, x, skip_non_finite=True)
            self.model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        self.applied = [i for i, g in enumerate(grads) if g is not None]
        weights = [k for k, i in enumerate(self.applied) if not self._state[i]]
        state = [k for k, i in enumerate(self.applied) if self._state[i]]
        reduced = [tf.convert_to_tensor(grads[i]) if self._dense[i] else grads[i] for i in self.applied]
        if self.strategy.num_replicas_in_sync > 1:  # IndexedSlices are all-gathered, not densified.
            context = tf.distribute.get_replica_context()
            summed = context.all_reduce(tf.distribute.ReduceOp.SUM, [reduced[k] for k in weights]) if weights else []
            for k, g in zip(weights, summed, strict=True):
                reduced[k] = g
            for k, g in zip(state, _max_over_replicas(context, [reduced[k] for k in state]), strict=True):
                reduced[k] = g
        # One row per index, so that the norm is that of the dense gradient.
        reduced = [gradients.deduplicate(g) for g in reduced]
        scale = tf.cast(optimizer.dynamic_scale, tf.float32) if self.scaled else 1.0
        grad_norm = gradients.global_norm([reduced[k] for k in weights]) / scale  # float8 state is no gradient.
        # A finite norm means every gradient is finite: the per-variable check (to name the
        # culprit) runs only when it is not, sparing a pass over all gradients every step.
        finite = tf.cond(
            tf.math.is_finite(grad_norm),
            lambda: tf.ones([len(reduced)], tf.bool),
            lambda: tf.stack([gradients.all_finite(g) for g in reduced]),
        )
        if self.clipnorm:
            factor = self.clipnorm / tf.maximum(grad_norm, self.clipnorm)
            for k in weights:
                reduced[k] = gradients.scale(reduced[k], factor)
        self._applier.apply(reduced, [self.variables[i] for i in self.applied])
        return tf.add_n(losses) / len(losses), grad_norm, finite

    def _update(self, iterator):
        batches = tuple(next(iterator) for _ in range(self.grad_accum_steps))
        loss, grad_norm, finite = self.strategy.run(self._replica_update, args=(batches,))
        first = self.strategy.experimental_local_results
        return {
            "step_loss": self.strategy.reduce(tf.distribute.ReduceOp.SUM, loss, axis=None),
            # Every replica computed these from the same all-reduced gradients.
            "grad_norm": first(grad_norm)[0],
            "finite": first(finite)[0],
        }

    def _updates(self, iterator):
        out = self._update(iterator)
        for _ in tf.range(self.steps_per_execution - 1):
            out = self._update(iterator)
        return self._with_state(out)

    def _single(self, iterator):
        return self._with_state(self._update(iterator))

    def _with_state(self, out):
        # Read inside the compiled call, so the host needs no extra variable reads per step.
        with self.strategy.scope():  # Cross-replica reads of the on-read metric variables.
            out.update(self.model.get_metrics_result())
        out["iterations"] = tf.convert_to_tensor(self.optimizer.iterations)
        out["learning_rate"] = tf.convert_to_tensor(self.optimizer.learning_rate)
        out["loss_scale"] = tf.convert_to_tensor(self.optimizer.dynamic_scale) if self.scaled else tf.constant(-1.0)
        return self._pack(out)

    def results(self):
        """The model's metric results, summed over replicas and workers."""
        with self.strategy.scope():
            return {k: float(v) for k, v in self.model.get_metrics_result().items()}

    def first_non_finite_gradient(self, finite):
        """The path of the first variable whose reduced gradient was non-finite, or None."""
        for index, ok in zip(self.applied, finite, strict=True):
            if not ok:
                return self.variables[index].path
        return None

    # ---- evaluation ----

    def _track_loss(self, loss, x, skip_non_finite=False):
        tracker = keras_compat.loss_tracker(self.model)
        if tracker is None:
            return
        value = loss * self.strategy.num_replicas_in_sync  # This replica's own mean.
        count = tf.cast(_batch_size(x), value.dtype)
        if skip_non_finite:  # A step skipped for overflow must not turn the epoch's mean into inf.
            ok = tf.math.is_finite(value)
            value, count = tf.where(ok, value, 0.0), tf.where(ok, count, 0.0)
        tracker.update_state(value, sample_weight=count)

    def _replica_forward(self, x, y, sample_weight):
        y_pred = keras_compat.call(self.model, x, training=False)
        loss = keras_compat.compute_loss(self.model, x, y, y_pred, sample_weight, training=False)
        return y_pred, loss

    def _replica_test(self, batch):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(batch)
        y_pred, loss = self._forward(x, y, sample_weight)
        self._track_loss(loss, x)
        self.model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def _test_step(self, batch):
        self.strategy.run(self._replica_test, args=(batch,))

    def evaluate(self, dataset, steps=None, callbacks=None):
        """The model's loss and metrics over `dataset` (global batches, or a distributed
        dataset), every example or `steps` batches. Resets the metrics first."""
        self.model.reset_metrics()
        if isinstance(dataset, tf.data.Dataset):
            if steps:
                dataset = dataset.take(steps)
            if self.strategy.num_replicas_in_sync > 1 or distribute.num_workers(self.strategy) > 1:
                dataset = self.strategy.experimental_distribute_dataset(dataset)
        for i, batch in enumerate(dataset):
            if steps and i >= steps:
                break
            if callbacks is not None:
                callbacks.on_test_batch_begin(i)
            if self._first_call(self._test, batch) is _FAILED:
                self._test(batch)  # XLA failed to compile: the same batch without it.
            if callbacks is not None:
                callbacks.on_test_batch_end(i, None)
        return self.results()
