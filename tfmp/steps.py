"""The compiled train and test steps behind `tfmp.fit`, for any compiled Keras model.

One update: each replica runs `grad_accum_steps` batches forward and backward with the
model's own `compute_loss` (its compiled losses, loss weights, sample weights and
regularization, each a mean over the GLOBAL batch), summing their gradients locally; the
sum is all-reduced once, clipped by the global norm of the reduced, unscaled gradients,
and applied. Under loss scaling the update is skipped on every replica when any reduced
gradient is non-finite, without advancing `iterations` or the learning-rate schedule.
"""

import contextlib

import keras
import tensorflow as tf

from tfmp import distribute
from tfmp.loss_scale import LossScaleOptimizer

# What `Steps.train` returns besides the model's metric results.
STEP_STATE = ("step_loss", "grad_norm", "finite", "iterations", "learning_rate", "loss_scale")


def _as_given(grads_and_vars):
    return grads_and_vars


@contextlib.contextmanager
def reduced_gradients(optimizer):
    """While active, `optimizer` applies gradients that the caller has already all-reduced.

    Keras optimizers all-reduce inside `apply` (and clip before that, per replica); these
    steps reduce and clip first. The override lives on the instance only while a step of
    ours traces or runs, and is removed afterwards, so the same optimizer used later with
    `model.fit` sums its gradients again.
    """
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    inner._all_reduce_sum_gradients = _as_given  # noqa: SLF001 - see docstring.
    scaled = isinstance(optimizer, LossScaleOptimizer)
    if scaled:
        optimizer.gradients_reduced = True
    try:
        yield
    finally:
        del inner._all_reduce_sum_gradients
        if scaled:
            optimizer.gradients_reduced = False


def _batch_size(x):
    return tf.shape(next(t for t in tf.nest.flatten(x) if t is not None))[0]


class Steps:
    """Compiled train and test steps for one compiled model under one strategy.

    Args:
        model: a compiled Keras model, built under `strategy`; `model.optimizer` updates it.
        strategy: the `tf.distribute.Strategy` the model was built under.
        grad_accum_steps: batches whose gradients are summed into one update.
        clipnorm: clip the global norm of the all-reduced, unscaled gradients to this.
        steps_per_execution: updates per call of `train` when the epoch has room for them.
    """

    def __init__(self, model, strategy, grad_accum_steps=1, clipnorm=None, steps_per_execution=1):
        self.model = model
        self.optimizer = model.optimizer
        self.strategy = strategy
        self.grad_accum_steps = grad_accum_steps
        self.clipnorm = clipnorm
        self.steps_per_execution = steps_per_execution
        self.scaled = isinstance(self.optimizer, keras.optimizers.LossScaleOptimizer)
        self.variables = list(model.trainable_variables)
        self.applied = []  # Indices of the variables that get gradients (set when tracing).
        if not self.optimizer.built:  # Its slots must exist before a step traces a cond around them.
            with strategy.scope():
                self.optimizer.build(self.variables)
        self._one = tf.function(self._single)
        self._many = tf.function(self._updates)
        self._test = tf.function(self._test_step, reduce_retracing=True)

    # ---- training ----

    def train(self, iterator, updates=1):
        """Runs `updates` updates (1 or `steps_per_execution`) from `iterator`.

        Returns:
            A dict of numpy values: `step_loss` (the last update's mean loss),
            `grad_norm`, `finite` (per variable), `iterations`, `learning_rate`,
            `loss_scale` (-1 without loss scaling), and the model's metric results
            (`loss`, ...: running means over the epoch).
        """
        with reduced_gradients(self.optimizer):
            out = (self._many if updates > 1 else self._one)(iterator)
        return {k: v.numpy() for k, v in out.items()}

    def _replica_update(self, batches):
        model, optimizer, n = self.model, self.optimizer, len(batches)
        grads, loss_sum = None, 0.0
        for batch in batches:  # Unrolled: n is small.
            x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(batch)
            with tf.GradientTape() as tape:
                y_pred = model(x, training=True) if model._call_has_training_arg else model(x)  # noqa: SLF001
                # A mean over the global batch (Keras divides each replica's mean by the
                # replica count), plus regularization counted once after the sum.
                loss = model._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True)  # noqa: SLF001
                scaled = optimizer.scale_loss(loss / n if n > 1 else loss)
            new = tape.gradient(scaled, self.variables)
            grads = new if grads is None else [a if a is None else a + b for a, b in zip(grads, new, strict=True)]
            self._track_loss(loss, x, skip_non_finite=True)
            model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
            loss_sum += loss
        self.applied = [i for i, g in enumerate(grads) if g is not None]
        # Dense before the all-reduce: an embedding's IndexedSlices become a dense tensor.
        reduced = [tf.convert_to_tensor(grads[i]) for i in self.applied]
        if self.strategy.num_replicas_in_sync > 1:
            reduced = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, reduced)
        scale = tf.cast(optimizer.dynamic_scale, tf.float32) if self.scaled else 1.0
        grad_norm = tf.linalg.global_norm([tf.cast(g, tf.float32) for g in reduced]) / scale
        if self.clipnorm:
            reduced, _ = tf.clip_by_global_norm(reduced, self.clipnorm * scale, use_norm=grad_norm * scale)
        finite = tf.stack([tf.reduce_all(tf.math.is_finite(g)) for g in reduced])
        optimizer.apply(reduced, [self.variables[i] for i in self.applied])
        return loss_sum / n, grad_norm, finite

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
        return out

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
        tracker = getattr(self.model, "_loss_tracker", None)
        if tracker is None:
            return
        value = loss * self.strategy.num_replicas_in_sync  # This replica's own mean.
        count = tf.cast(_batch_size(x), value.dtype)
        if skip_non_finite:  # A step skipped for overflow must not turn the epoch's mean into inf.
            ok = tf.math.is_finite(value)
            value, count = tf.where(ok, value, 0.0), tf.where(ok, count, 0.0)
        tracker.update_state(value, sample_weight=count)

    def _replica_test(self, batch):
        model = self.model
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(batch)
        y_pred = model(x, training=False) if model._call_has_training_arg else model(x)  # noqa: SLF001
        loss = model._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=False)  # noqa: SLF001
        self._track_loss(loss, x)
        model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

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
            self._test(batch)
            if callbacks is not None:
                callbacks.on_test_batch_end(i, None)
        return self.results()
