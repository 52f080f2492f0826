"""Dynamic loss scaling for mixed_float16 that skips a step on every replica or on none."""

import keras
import tensorflow as tf
from absl import logging
from keras import ops

from tfmp import keras_optimizers, precision, tf_compat
from tfmp.errors import UsageError


@keras.saving.register_keras_serializable(package="tfmp")
class LossScaleOptimizer(keras.optimizers.LossScaleOptimizer):
    """A Keras `LossScaleOptimizer` whose overflow check is global across replicas.

    Keras 3's own wrapper, under a `tf.distribute` strategy that uses merge calls, reads
    the "all gradients finite" flag from replica 0 only; under one that does not (XLA on
    GPUs), each replica decides alone. Either way an overflow on another replica reaches
    the weights as NaN. Here every replica counts its non-finite gradients, the counts are
    summed across replicas, and the step is applied (or skipped, halving the scale) on
    all replicas from that one sum.

    Args:
        inner_optimizer: the Keras optimizer that applies the unscaled gradients.
        initial_scale: the starting loss scale.
        dynamic_growth_steps: finite steps in a row after which the scale doubles.

    Example:
        >>> opt = LossScaleOptimizer(keras.optimizers.Adam(1e-3), initial_scale=2**15)
    """

    # Set by `tfmp.fit`'s steps while they run: the gradients are already all-reduced (the
    # same on every replica), so the overflow flag needs no all-reduce of its own.
    gradients_reduced = False
    # Set by `tfmp.fit`'s steps while they apply: whether every gradient is finite, which
    # they computed already (from each gradient's sum of squares); None: check here.
    all_finite = None

    def _tf_apply(self, grads, trainable_variables=None):
        replica_ctx = tf.distribute.get_replica_context()
        if replica_ctx is None:
            raise ValueError("apply() must be called in a replica context.")
        finite = self._finite_on_every_replica(replica_ctx, grads)
        if tf.__internal__.distribute.strategy_supports_no_merge_call():
            # Every replica holds the same `finite`, so all take the same branch and
            # the collective all-reduce inside the inner optimizer stays matched; the
            # iteration count, which TensorFlow would broadcast from replica 0 with a
            # merge call (refused inside a cond), is counted on each replica's own copy.
            with tf_compat.replica_local_updates(self.variables):  # The inner optimizer's too.
                ops.cond(
                    finite,
                    lambda: self._stateful_handle_finite_grads(grads, trainable_variables),
                    self._stateful_handle_non_finite_grads,
                )
            return

        def cross_replica(distribution, finite, grads, trainable_variables):
            # The value is identical on every replica; any one of them will do.
            finite = distribution.experimental_local_results(finite)[0]

            def apply_fn():
                distribution.extended.call_for_each_replica(
                    self._stateful_handle_finite_grads, args=(grads, trainable_variables)
                )

            # The cond must run in cross-replica context: the inner optimizer's apply
            # makes a merge call, which a replica-context cond branch cannot hold.
            ops.cond(finite, apply_fn, self._stateful_handle_non_finite_grads)

        replica_ctx.merge_call(cross_replica, args=(finite, grads, trainable_variables))

    def _finite_on_every_replica(self, replica_ctx, grads):
        finite = self.check_finite(grads) if self.all_finite is None else self.all_finite
        local_bad = ops.cast(ops.logical_not(finite), "float32")
        if replica_ctx.num_replicas_in_sync > 1 and not self.gradients_reduced:
            local_bad = replica_ctx.all_reduce(tf.distribute.ReduceOp.SUM, local_bad)
        return ops.equal(local_bad, 0.0)


def needs_loss_scaling(model=None):
    """Whether any layer of `model` computes in float16 (without a model: the global policy)."""
    if model is None:
        return precision.compute_dtype() == "float16"  # float16 is the one that needs a loss scale.
    return precision.computes_in(model, "float16")


def wrap_optimizer(optimizer, initial_scale=None, growth_steps=None, *, model=None):
    """Wraps `optimizer` for loss scaling when float16 compute needs it.

    Safe to call twice, and safe with `model.compile` (Keras only wraps an optimizer that
    is not already a `LossScaleOptimizer`). A Keras `LossScaleOptimizer` given here is
    re-wrapped, so that the distribution-safe overflow check is the one used; its initial
    scale and growth steps are kept unless given, and, if it was built, its current scale
    and step count too.

    Args:
        optimizer: a Keras optimizer, or its name as `model.compile` takes it ("adam").
        initial_scale: the starting loss scale (default 2**15, or the re-wrapped one's).
        growth_steps: finite steps in a row after which the scale doubles (default 2000,
            or the re-wrapped one's).
        model: decide from this model's layers (any layer computing in float16 needs loss
            scaling, whatever the global policy); without it, from the global policy.

    Returns:
        A `tfmp.LossScaleOptimizer` where float16 compute needs one (or a Keras one was
        given), else `optimizer` itself.

    Raises:
        UsageError: if `optimizer` is neither, `initial_scale` is not a positive finite number
            or `growth_steps` is not an integer >= 1.
    """
    if isinstance(optimizer, str):
        try:
            optimizer = keras.optimizers.get(optimizer)
        except ValueError as e:
            raise UsageError(f"wrap_optimizer: {optimizer!r} names no Keras optimizer") from e
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise UsageError(f"wrap_optimizer takes a Keras optimizer or its name, got {type(optimizer).__name__}")
    if initial_scale is not None and not (0 < initial_scale < float("inf")):
        raise UsageError(f"wrap_optimizer: initial_scale must be a positive finite number, got {initial_scale}")
    if growth_steps is not None and (int(growth_steps) != growth_steps or growth_steps < 1):
        raise UsageError(f"wrap_optimizer: growth_steps must be an integer >= 1, got {growth_steps}")
    # Called in a strategy's scope before compile: the keys are the strategy's own before
    # model.fit (or tfmp.fit) traces its first collective.
    tf_compat.own_collective_keys(tf.distribute.get_strategy())
    if isinstance(optimizer, LossScaleOptimizer):
        return optimizer
    keras_wrapper = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    if not keras_wrapper and not needs_loss_scaling(model):
        return optimizer
    if not keras_wrapper:
        return LossScaleOptimizer(
            optimizer,
            initial_scale=float(initial_scale or 2.0**15),
            dynamic_growth_steps=int(growth_steps or 2000),
        )
    logging.info("Replacing Keras' LossScaleOptimizer with tfmp's distribution-safe one.")
    wrapped = LossScaleOptimizer(
        optimizer.inner_optimizer,
        initial_scale=float(initial_scale or optimizer.initial_scale),
        dynamic_growth_steps=int(growth_steps or optimizer.dynamic_growth_steps),
    )
    if optimizer.built:  # Carry on where it was: same scale, same count towards the next growth.
        wrapped.build(keras_optimizers.trained_variables(optimizer.inner_optimizer))  # Its inner build is a no-op.
        wrapped.dynamic_scale.assign(optimizer.dynamic_scale)
        wrapped.step_counter.assign(optimizer.step_counter)
    return wrapped


def for_model(model, strategy):
    """Makes `model.optimizer` tfmp's `LossScaleOptimizer` wherever loss scaling is in play.

    A model whose layers compute in float16 gets one even under a float32 global policy,
    and a Keras `LossScaleOptimizer` (which `compile` adds under mixed_float16) is
    replaced, keeping its state. A model compiled with `auto_scale_loss=False` (Keras left
    its mixed_float16 optimizer bare) trains without loss scaling, as `model.fit` trains it.
    Returns the optimizer the model now has.
    """
    optimizer = model.optimizer
    if scaling_declined(model):
        logging.info("No loss scaling: the mixed_float16 model was compiled with auto_scale_loss=False.")
        return optimizer
    with strategy.scope():  # The wrapper's own variables are the strategy's, like the model's.
        wrapped = wrap_optimizer(optimizer, model=model)
        if wrapped is not optimizer and not wrapped.built and optimizer.built:
            wrapped.build(model.trainable_variables)
    if wrapped is not optimizer:
        model.optimizer = wrapped
    return model.optimizer


def scaling_declined(model):
    """Whether `model` was compiled with `auto_scale_loss=False`: Keras' compile wraps the
    optimizer of a mixed_float16 model in every other case (it keeps no record of the flag)."""
    optimizer = model.optimizer
    return model.dtype_policy.name == "mixed_float16" and not isinstance(optimizer, keras.optimizers.LossScaleOptimizer)


def loss_scale_of(optimizer):
    """The current loss scale as a float, or None for an optimizer without one."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return float(optimizer.dynamic_scale.numpy()) if optimizer.built else float(optimizer.initial_scale)
    return None
