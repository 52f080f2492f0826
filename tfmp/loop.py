"""A training loop that runs under every tf.distribute strategy through `strategy.run`.

Per update, each replica computes gradients of its examples (summed per-example losses
divided by the global batch, so the all-reduce SUM gives the global mean), accumulating
`grad_accum_steps` micro-batches locally; the gradients are then all-reduced once, and
only then clipped (by the global norm of the all-reduced, unscaled gradients, so 2
replicas clip exactly like 1) and applied. Under mixed_float16 the loss-scale optimizer
skips the update on every replica when any gradient anywhere is non-finite; a skipped
update does not advance `optimizer.iterations` nor the learning-rate schedule.
"""

import keras
import numpy as np
import tensorflow as tf

from tfmp import distribute


def _no_reduce(grads_and_vars):
    return grads_and_vars


def prepare_optimizer(optimizer, clipnorm=None):
    """Lets `optimizer` apply gradients that this loop has already all-reduced.

    Keras optimizers all-reduce inside `apply` and clip before that (per replica). The
    loop reduces first, so the optimizer that updates the weights (the inner one of a
    loss-scale wrapper) must not reduce again, and clips the reduced gradients instead.
    """
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    inner._all_reduce_sum_gradients = _no_reduce  # noqa: SLF001 - see docstring.
    if clipnorm:
        inner.clipnorm = inner.clipvalue = None
        inner.global_clipnorm = float(clipnorm)
    return optimizer


class Loop:
    """Compiled train and eval steps for one model, optimizer and strategy.

    Args:
        model: a Keras classifier whose outputs are float32 probabilities.
        optimizer: a Keras optimizer, wrapped by `tfmp.wrap_optimizer` when needed.
        strategy: the `tf.distribute.Strategy` the model was built under.
        global_batch: examples per micro-step over all replicas.
        grad_accum_steps: micro-steps per update; each replica's batch holds
            `grad_accum_steps` micro-batches, which it splits.
        clipnorm: clip the global norm of the all-reduced, unscaled gradients to this.
        steps_per_execution: updates per compiled call of `train_steps` (TPUs: fewer
            host round trips).

    Example:
        >>> loop = Loop(model, optimizer, strategy, global_batch=128)
        >>> logs = loop.train_step(iterator)   # {"loss", "accuracy", "grad_norm", "finite", ...}
    """

    def __init__(
        self, model, optimizer, strategy, global_batch, grad_accum_steps=1, clipnorm=None, steps_per_execution=1
    ):
        self.model = model
        self.optimizer = prepare_optimizer(optimizer, clipnorm)
        self.strategy = strategy
        self.global_batch = global_batch
        self.grad_accum_steps = grad_accum_steps
        self.loss_fn = keras.losses.SparseCategoricalCrossentropy(reduction=None)
        self._scaled = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
        if not optimizer.built:  # Its slots must exist before the step traces a cond around them.
            with strategy.scope():
                optimizer.build(model.trainable_variables)
        self.steps_per_execution = steps_per_execution
        self.train_step = tf.function(self._train_step)
        self.train_steps = tf.function(self._train_steps)
        self.eval_step = tf.function(self._eval_step)

    def _micro_grads(self, x, y, weights):
        with tf.GradientTape() as tape:
            probs = self.model(x, training=True)
            per_example = self.loss_fn(y, probs)
            denominator = float(self.global_batch * self.grad_accum_steps)
            loss = tf.reduce_sum(per_example) / denominator
            if self.model.losses:  # Counted once per update after the SUM over replicas.
                replicas = self.strategy.num_replicas_in_sync * self.grad_accum_steps
                loss += tf.add_n(self.model.losses) / replicas
            scaled = self.optimizer.scale_loss(loss) if self._scaled else loss
        # Dense gradients (embeddings give IndexedSlices): they are summed, reduced and checked.
        grads = [tf.convert_to_tensor(g) for g in tape.gradient(scaled, weights)]
        correct = tf.reduce_sum(tf.cast(tf.equal(tf.argmax(probs, -1), tf.cast(y, tf.int64)), tf.float32))
        return grads, tf.reduce_sum(per_example), correct

    def _replica_train(self, x, y):
        weights = self.model.trainable_variables
        n = self.grad_accum_steps
        if n == 1:
            grads, loss_sum, correct = self._micro_grads(x, y, weights)
        else:
            xs, ys = tf.split(x, n), tf.split(y, n)
            grads, loss_sum, correct = self._micro_grads(xs[0], ys[0], weights)
            for i in range(1, n):  # Unrolled: n is small, and the shapes stay static.
                g, loss_i, correct_i = self._micro_grads(xs[i], ys[i], weights)
                grads = [a + b for a, b in zip(grads, g, strict=True)]
                loss_sum, correct = loss_sum + loss_i, correct + correct_i
        ctx = tf.distribute.get_replica_context()
        if self.strategy.num_replicas_in_sync > 1:
            grads = ctx.all_reduce(tf.distribute.ReduceOp.SUM, grads)
        scale = self.optimizer.dynamic_scale if self._scaled else 1.0
        grad_norm = tf.linalg.global_norm([tf.cast(g, tf.float32) / scale for g in grads])
        finite = tf.stack([tf.reduce_all(tf.math.is_finite(g)) for g in grads])
        self.optimizer.apply(grads, weights)
        return {
            "loss_sum": loss_sum,
            "correct": correct,
            "count": tf.cast(tf.shape(y)[0], tf.float32),
            "grad_norm": grad_norm,
            "finite": finite,
        }

    def _train_step(self, iterator):
        x, y = next(iterator)
        out = self.strategy.run(self._replica_train, args=(x, y))
        sums = {
            k: self.strategy.reduce(tf.distribute.ReduceOp.SUM, out[k], axis=None)
            for k in ("loss_sum", "correct", "count")
        }
        # Every replica computed the same values from the same all-reduced gradients.
        local = {k: self.strategy.experimental_local_results(out[k])[0] for k in ("grad_norm", "finite")}
        return {
            "loss": sums["loss_sum"] / sums["count"],
            "accuracy": sums["correct"] / sums["count"],
            "count": sums["count"],
            # Read here, inside the compiled step, so the host needs no extra variable reads.
            "iterations": tf.convert_to_tensor(self.optimizer.iterations),
            "learning_rate": tf.convert_to_tensor(self.optimizer.learning_rate),
            "loss_scale": tf.convert_to_tensor(self.optimizer.dynamic_scale) if self._scaled else tf.constant(-1.0),
            **local,
        }

    def _train_steps(self, iterator):
        """`steps_per_execution` updates in one call; returns the last one's logs."""
        logs = self._train_step(iterator)
        for _ in tf.range(self.steps_per_execution - 1):
            logs = self._train_step(iterator)
        return logs

    def _replica_eval(self, x, y):
        probs = self.model(x, training=False)
        per_example = self.loss_fn(y, probs)
        correct = tf.reduce_sum(tf.cast(tf.equal(tf.argmax(probs, -1), tf.cast(y, tf.int64)), tf.float32))
        return tf.reduce_sum(per_example), correct, tf.cast(tf.shape(y)[0], tf.float32)

    def _eval_step(self, batch):
        out = self.strategy.run(self._replica_eval, args=batch)
        return [self.strategy.reduce(tf.distribute.ReduceOp.SUM, v, axis=None) for v in out]

    def first_non_finite_gradient(self, logs):
        """The path of the first variable whose gradient was non-finite in `logs`, or None."""
        finite = np.asarray(logs["finite"])
        if finite.all():
            return None
        return self.model.trainable_variables[int(np.argmin(finite))].path

    def evaluate(self, dataset):
        """Loss and accuracy over every example of `dataset` (global batches)."""
        if self.strategy.num_replicas_in_sync > 1 or distribute.num_workers(self.strategy) > 1:
            dataset = self.strategy.experimental_distribute_dataset(dataset)
        loss_sum = correct = count = 0.0
        for batch in dataset:
            batch_loss, batch_correct, n = self.eval_step(batch)
            loss_sum, correct, count = loss_sum + float(batch_loss), correct + float(batch_correct), count + float(n)
        return loss_sum / count, correct / count
