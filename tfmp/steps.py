"""The compiled train and test steps behind `tfmp.fit`, for any compiled Keras model.

One update: each replica runs `grad_accum_steps` batches forward and backward with the model's own
`compute_loss` (its compiled losses, loss weights, sample weights and regularization, each a mean over the
GLOBAL batch), summing their gradients locally; the sum is all-reduced once, clipped by the global norm of the
reduced, unscaled gradients, and applied. Under loss scaling the update is skipped on every replica when any
reduced gradient is non-finite, without advancing `iterations` or the learning-rate schedule.
"""

import itertools

import keras
import tensorflow as tf
from absl import logging

from tfmp import (
    accumulate,
    bf16,
    calls,
    crossing,
    distribute,
    float8,
    fused,
    gradients,
    keras_compat,
    keras_optimizers,
    packed,
    tf_compat,
    xla,
    xla_kernels,
)

FELL_BACK = object()  # What a first call returns when XLA could not compile it.
STEP_STATE = ("step_loss", "grad_norm", "finite", "iterations", "learning_rate", "loss_scale")  # Besides metrics.
_COMPILED = ("gradients", "_forward", "_split", "_step", "_quiet_step", "_compute", "_apply", "_one", "_many")
_COMPILED += ("_concrete", "_test", "_lean", "_grouped")  # What `Steps.compile` makes, kept per choice of XLA.


def computes_norm(optimizer, clipnorm, grad_norm):
    """Whether a step computes the gradients' norm: where asked, or where a clip or a loss scale's check needs it."""
    return bool(grad_norm or clipnorm or isinstance(optimizer, keras.optimizers.LossScaleOptimizer))


class Steps:
    """Compiled train and test steps for one compiled model under one strategy.

    Args:
        model: a compiled Keras model, built under `strategy`; `model.optimizer` updates it.
        strategy: the `tf.distribute.Strategy` the model was built under.
        grad_accum_steps: batches whose gradients are summed into one update.
        clipnorm: clip the global norm of the all-reduced, unscaled gradients to this.
        steps_per_execution: updates per call of `train` when the epoch has room for them.
        jit_compile: run the update under XLA (see `compile`), and evaluation's forward pass.
        sparse: keep embedding gradients (`tf.IndexedSlices`) sparse through accumulation, all-reduce, the
            overflow check and clipping (not on TPUs, whose all-reduce takes dense tensors; on one replica, only
            where the update keeps them sparse too); False densifies them first.
        fused_updates: update with one kernel per variable where `tfmp.fused` can (Adam, AdamW, SGD; not on
            TPUs); False keeps Keras' element-wise update (Adafactor's repaired either way: `tfmp.adafactor`).
        bf16_rounding: how bfloat16 weights take each float32 update (`tfmp.bf16`): kahan, stochastic or nearest.
        seed: seeds stochastic rounding, with the step and the variable.
        grad_norm: give each update's gradient norm and per-variable finiteness (`train`'s `grad_norm`, `finite`).
            False: made only where a clip or loss scale needs them (`computes_norm`), else grad_norm NaN, finite True.
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
        bf16_rounding="kahan",
        seed=0,
        grad_norm=True,
    ):
        self.model, self.optimizer, self.strategy = model, model.optimizer, strategy
        self.grad_accum_steps, self.clipnorm, self.steps_per_execution = grad_accum_steps, clipnorm, steps_per_execution
        self.scaled = isinstance(self.optimizer, keras.optimizers.LossScaleOptimizer)
        self.grad_norm = computes_norm(self.optimizer, clipnorm, grad_norm)
        self.variables = list(model.trainable_variables)
        self._state = [float8.is_state(v) for v in self.variables]  # Set, not learnt: see tfmp.float8.
        self._crossing = crossing.Crossing(self._state)  # What crosses replicas, and back.
        self.applied = []  # Indices of the variables that get gradients (set when tracing).
        if not self.optimizer.built:  # Its slots must exist before a step traces a cond around them.
            with strategy.scope():
                self.optimizer.build(self.variables)
        self.sparse = sparse and distribute.strategy_name(strategy) != "tpu"
        inner = getattr(self.optimizer, "inner_optimizer", self.optimizer)
        # TPU variables update through their own replicated assign ops: Keras' update there.
        fused_updates = fused_updates and distribute.strategy_name(strategy) != "tpu"
        self._bf16 = [bf16.is_bfloat16(v) for v in self.variables]  # Updated in float32, compensated.
        hooks = {}  # Per optimizer (a MultiOptimizer's each): (its update_step, its weight decay filter).
        for sub, variables in keras_optimizers.optimizer_groups(inner, self.variables):
            update_step = fused.update_step(sub, fuse=fused_updates, graph_optimized=lambda: not self.jit_compile)
            hooks[id(sub)] = bf16.applier_hooks(sub, variables, strategy, bf16_rounding, seed, update_step)
        self._applier = keras_optimizers.reduced_applier(self.optimizer, hooks, "gradients_reduced")  # Shares its state
        owners = [keras_optimizers.optimizer_for(inner, v) for v in self.variables]  # Each one's optimizer.
        alone = strategy.num_replicas_in_sync == 1
        self._dense, self._sums_rows = fused.sparse_plan(owners, self._bf16, alone, self.sparse, self.grad_norm)
        self._outputs = packed.Packed()  # What a step returns, read with one copy.
        self._ran, self.fallback = set(), None  # Kinds of step run under XLA; why XLA failed an update (`_first_call`).
        self.refused = lambda why: None  # Told that why (`xla.resolve` keeps it for models alike).
        self._made = {}  # XLA on? -> what `compile` made for it, as it was when left.
        self.compile(jit_compile)

    def compile(self, jit_compile):
        """Makes the compiled steps, with the update under XLA or not; a choice made before gets its steps
        again, traced and compiled as they were (as Keras keeps `train_function` while `evaluate` makes its
        own: a fit under XLA, an evaluate without it, then a fit again compiles the update once).

        Under XLA, one replica runs its whole update as ONE XLA computation: forward, backward, loss scaling,
        unscale, finite check and skip, clip, the optimizer's update, metrics and the packed outputs. Several
        replicas run two per replica, around the one thing XLA cannot hold there, the cross-replica sum: forward
        and backward, packing every dense gradient into one vector; then, after the all-reduce of that vector
        (and one all-gather of the float8 state), the rest of the update. Either way the ops run outside XLA
        per step do not grow with the model's variables."""
        jit_compile = bool(jit_compile)
        if getattr(self, "_one", None) is not None:
            if self.jit_compile == jit_compile:
                return  # Already so.
            self._made[self.jit_compile] = {name: getattr(self, name) for name in _COMPILED}
        self.jit_compile = jit_compile
        if jit_compile in self._made:
            self.__dict__.update(self._made.pop(jit_compile))
            return
        # Without AutoGraph, as Keras' steps: converting tfmp's functions took 3.5 s of a process's first step.
        jit = tf_compat.function(jit_compile=True, autograph=False) if self.jit_compile else (lambda fn: fn)
        self.gradients = jit(self.replica_gradients)  # The forward and backward passes alone.
        self._forward = jit(self._replica_forward)
        one, tpu = self.strategy.num_replicas_in_sync == 1, distribute.strategy_name(self.strategy) == "tpu"
        self._split = not one and not tpu  # TPUs compile the whole replica function anyway: plain stages.
        self._step = jit(self._packed_update) if one else self._packed_update
        self._quiet_step = jit(self._update) if one else self._update  # No outputs: not the call's last.
        self._compute = jit(self._compute_stage) if self._split else self._compute_stage
        self._apply = jit(self._apply_stage) if self._split else self._apply_stage
        self._one = {gated: calls.of_iterator(self._single, gated) for gated in (False, True)}  # `_replica_update`.
        self._many = {gated: calls.of_iterator(self._updates, gated) for gated in (False, True)}
        self._concrete = {}  # (updates > 1, gated, iterator id) -> its traced step (`calls.Direct`).
        self._test = self._test_function()  # Its forward pass under XLA or not, as `_forward` is.
        # Lean: under XLA on one CPU the call runs on one thread (the executor's hand-offs cost 4-7% of a small
        # step). Grouped: the norm's reductions one a shape where each would be an op of its own (DECISIONS.md).
        gpu = bool(tf.config.list_logical_devices("GPU"))
        self._lean = self.jit_compile and one and not tpu and not gpu
        self._grouped = gradients.GROUPED if gradients.GROUPED is not None else gpu == self.jit_compile and not tpu

    def _first_call(self, kind, fn, *args):
        """Calls a compiled step; the first of its kind under XLA falls back to no XLA if it fails to compile."""
        if kind in self._ran or not self.jit_compile:
            return fn(*args)
        try:
            out = fn(*args)
        except xla.COMPILE_ERRORS as e:
            if not xla.is_compile_failure(e):
                raise
            self.model.reset_metrics()  # What the failed call's ops outside XLA counted (an evaluation's examples).
            if kind == "test":  # Evaluation alone: its forward pass may take other branches than training's.
                logging.warning("XLA cannot compile the evaluation step (%s); evaluating without XLA", xla.reason(e))
                self._forward, self._test = self._replica_forward, self._test_function()
                return FELL_BACK
            self.fallback = xla.reason(e)
            self.refused(self.fallback)
            logging.warning("XLA cannot compile this model (%s); training without XLA", self.fallback)
            self.compile(False)
            return FELL_BACK
        self._ran.add(kind)
        return out

    # ---- training ----

    def train(self, iterator, updates=1):
        """Runs `updates` updates (1 or `steps_per_execution`) from `iterator`, waits for them, and returns a dict
        of numpy values: `step_loss` (the last update's mean loss), `grad_norm`, `finite` (per variable; see
        `grad_norm` above), `iterations`, `learning_rate`, `loss_scale` (-1 without loss scaling), and the
        model's metric results (`loss`, ...: running means over the epoch)."""
        return self.read(self.dispatch(iterator, updates))

    def dispatch(self, iterator, updates=1, gated=False, retry=True):
        """Queues `updates` updates from `iterator` and returns at once, with what they will return packed into
        one tensor (see `read`). `gated`: an input of unknown length, whose epochs end with a failed read (see
        `_replica_update`). The traced step is kept per iterator and called directly (`tfmp.calls`), its first
        call on the executor the later ones take (each executor instantiates the step anew: 40-550 ms)."""
        gate = gated and not self.jit_compile  # XLA's one computation waits for its inputs anyway.
        key = (updates > 1, gate, id(iterator))
        kept = self._concrete.get(key)
        if kept is not None:
            return self._call(kept, updates)
        fn = (self._many if updates > 1 else self._one)[gate]
        traced = self._first_call("train", self._trace_and_call, fn, iterator, updates)
        if traced is FELL_BACK:  # XLA failed to compile (or to trace: a merge call), its batches read unless found
            return self.dispatch(iterator, updates, gated) if retry else FELL_BACK  # before: on (`retry`) or again.
        kept, out = traced
        if len(self._concrete) > 8:  # Iterators of epochs gone.
            calls.let_go_of(self._concrete)
        self._concrete[key] = kept
        return out

    def _trace_and_call(self, fn, iterator, updates):
        traced = fn.get_concrete_function(iterator)  # Not yet run: an op XLA has no kernel for raises before it reads.
        if self.jit_compile and "train" not in self._ran:  # Its first call under XLA (`_first_call`).
            xla_kernels.check(traced, xla_kernels.device_type(self.strategy))
        kept = calls.Direct(traced, iterator)
        return kept, self._call(kept, updates)

    def _call(self, kept, updates):
        if self._lean and updates == 1:  # (Several updates loop outside XLA.)
            out, self._lean = calls.single_threaded(kept)  # Refused once (before it runs), not tried again.
            return out
        return kept()

    def read(self, vector):
        """The dict `train` returns, from the vector `dispatch` returned: one device-to-host copy."""
        return self._outputs.unpack(vector.numpy())

    def release(self):
        """Drops the kept calls, their iterators (prefetched batches, tf.data's tuning thread) on a thread."""
        for kept in (self._concrete, *(made["_concrete"] for made in self._made.values())):
            calls.let_go_of(kept)

    def replica_gradients(self, batches):
        """This replica's batches forward and backward, gradients summed: `tfmp.accumulate.replica_gradients`."""
        return accumulate.replica_gradients(self, batches)

    # One update, as a pipeline: gradients -> all-reduce -> unscale and check -> clip -> apply.

    def gradients_stage(self, batches, replica_share=None):
        """Each replica: gradients summed over its batches (see `replica_gradients`), the loss tracker and
        metrics updated; returns (gradients of the trained variables, dense where `_dense` says, the mean loss)."""
        grads, losses, preds, divisor = accumulate.replica_gradients(self, batches, replica_share)
        examples = crossing.examples_in(batches)
        each = examples[0] if len(batches) == 1 else tf.add_n(examples) / len(batches)  # The losses: as their mean's.
        for batch, loss, y_pred in zip(batches, losses, preds, strict=True):
            x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(batch)
            if not accumulate.logged_once(self.model, divisor, self.strategy.num_replicas_in_sync):
                packed.track_loss(self.model, loss, each, self.strategy.num_replicas_in_sync, skip_non_finite=True)
            packed.update_metrics(self.model, x, y, y_pred, sample_weight)
        self.applied = [i for i, g in enumerate(grads) if g is not None]
        grads = [tf.convert_to_tensor(grads[i]) if self._dense[i] else grads[i] for i in self.applied]
        return grads, tf.add_n(losses) / len(losses), divisor

    def _unscale_and_check(self, grads):
        """(gradients, one row an id where summed, their global norm unscaled, per-variable finiteness). One pass
        over each gradient gives both: its sum of squares, finite where the gradient is (or, past 1e19, where it
        overflows float32: then the norm is not finite either). No cond: one per gradient would add its ops."""
        summed = [self._sums_rows[i] for i in self.applied]  # For the norm and the update (`fused.sparse_plan`).
        grads = [gradients.deduplicate(g) if sums else g for g, sums in zip(grads, summed, strict=True)]
        if not self.grad_norm:  # Nothing reads them: no pass over the gradients (Keras fit makes none either).
            return grads, tf.constant(float("nan")), tf.ones([len(grads)], tf.bool)
        squares = gradients.half_squares_all(grads, self._grouped)
        scale = tf.cast(self.optimizer.dynamic_scale, tf.float32) if self.scaled else 1.0
        weights = tf.constant(self._crossing.weights(self.applied), tf.int32)
        grad_norm = tf.sqrt(2.0 * tf.reduce_sum(tf.gather(squares, weights))) / scale
        return grads, grad_norm, tf.math.is_finite(squares)

    def _clip(self, grads, grad_norm):
        """The weights' gradients scaled so that their global norm is at most `clipnorm`."""
        if not self.clipnorm:
            return grads
        factor = self.clipnorm / tf.maximum(grad_norm, self.clipnorm)
        return [g if self._state[i] else gradients.scale(g, factor) for g, i in zip(grads, self.applied, strict=True)]

    def _apply_reduced(self, grads):
        """Unscale and check, clip, apply (skipped on every replica if any gradient is not finite, under loss
        scaling): the same on every replica, from the same gradients."""
        grads, grad_norm, finite = self._unscale_and_check(grads)
        if self.scaled:  # The loss-scale wrapper skips the step on this, not on a check of its own.
            object.__setattr__(self._applier, "all_finite", tf.reduce_all(finite))
        try:
            # Mirrored replicas update their own copies: no merge call, which XLA and Keras' accumulation cond refuse.
            with tf_compat.replica_local_updates(self._applier.variables, self.strategy):
                self._applier.apply(self._clip(grads, grad_norm), [self.variables[i] for i in self.applied])
        finally:
            if self.scaled:
                object.__setattr__(self._applier, "all_finite", None)
        return grad_norm, finite

    def _compute_stage(self, batches, replica_share=None):
        grads, loss, divisor = self.gradients_stage(batches, replica_share)
        return (*self._crossing.pack(grads, self.applied), loss, divisor)

    def _apply_stage(self, dense_flat, state_flat, sparse):
        return self._apply_reduced(self._crossing.unpack(dense_flat, state_flat, sparse, self.applied))

    def _replica_update(self, batches, gated):
        # Gated, every op waits for the batches: else, without XLA, the failed read ending an epoch of unknown
        # length runs those that take no input from it (iteration count, dropout's seed), as Keras fit does.
        with tf.control_dependencies(tf.nest.flatten(batches, expand_composites=True) if gated else []):
            if self.strategy.num_replicas_in_sync == 1:  # Nothing crosses replicas.
                grads, loss, _ = self.gradients_stage(batches)
                return (loss, *self._apply_reduced(grads))
            share = accumulate.replica_share(self.model, batches, self.strategy.num_replicas_in_sync)
            replicas, computed = self.strategy.num_replicas_in_sync, self._compute(batches, share)
            if accumulate.logged_once(self.model, computed[-1], replicas):  # As the global batch's.
                examples = tf.add_n(crossing.examples_in(batches))
                tracked = accumulate.as_global(computed[-2], examples, computed[-1], replicas)
                packed.track_loss(self.model, *tracked, replicas, skip_non_finite=True)
            *sent, loss = crossing.weigh_by_share(batches, *computed, replicas, accumulate.summed(self.model), share)
            return (loss, *self._apply(*self._crossing.all_reduce(*sent)))

    def _update(self, batches, gated=False):
        """One update from `batches`; returns its (loss, grad_norm, finite) per replica."""
        return self.strategy.run(self._replica_update, args=(batches, gated))

    def _packed_update(self, batches):
        """One update from `batches`, and the step's outputs packed (`tfmp.packed`)."""
        return self._packed(*self._update(batches))

    def _packed(self, loss, grad_norm, finite):
        first = self.strategy.experimental_local_results  # grad_norm, finite: the same on every replica.
        loss = self.strategy.reduce(tf.distribute.ReduceOp.SUM, loss, axis=None)
        return self._with_state({"step_loss": loss, "grad_norm": first(grad_norm)[0], "finite": first(finite)[0]})

    def _batches(self, iterator):
        return tuple(next(iterator) for _ in range(self.grad_accum_steps))

    def _single(self, iterator, gated):
        batches = self._batches(iterator)  # Gated only without XLA (`dispatch`): the plain update, traced inline.
        return self._packed(*self._update(batches, gated=True)) if gated else self._step(batches)

    def _updates(self, iterator, gated):
        # The same updates in the same order; only the last one's outputs are read and packed.
        step = (lambda batches: self._update(batches, gated=True)) if gated else self._quiet_step

        def update(i):
            step(self._batches(iterator))
            return (i + 1,)

        tf.while_loop(lambda i: i < self.steps_per_execution - 1, update, (tf.constant(0),))
        return self._single(iterator, gated)

    def _with_state(self, out):
        # Read inside the compiled call, so the host needs no extra variable reads per step.
        with self.strategy.scope():  # Cross-replica reads of the on-read metric variables.
            out.update(packed.flat(self.model.get_metrics_result()))
        out["iterations"] = tf.convert_to_tensor(self.optimizer.iterations)
        learning_rate = keras_optimizers.learning_rate(self.optimizer)
        if learning_rate is not None:  # A MultiOptimizer has none of its own.
            out["learning_rate"] = tf.reshape(learning_rate, [])  # A schedule's numpy_function has no shape.
        out["loss_scale"] = tf.convert_to_tensor(self.optimizer.dynamic_scale) if self.scaled else tf.constant(-1.0)
        return self._outputs.pack(out)

    def update_graph(self, iterator):
        """The graph of one update from `iterator` (traced, not run; see `xla.ops_outside_xla`)."""
        return self._one[False].get_concrete_function(iterator).graph

    def results(self):
        """The model's metric results, summed over replicas and workers."""
        with self.strategy.scope():
            return {k: packed.as_log(v) for k, v in packed.flat(self.model.get_metrics_result()).items()}

    # ---- evaluation ----

    def _replica_forward(self, x, y, sample_weight, share=None):
        y_pred = keras_compat.call(self.model, x, training=False)
        sums_times = None if share is None else tf.math.divide_no_nan(1.0, share)  # Each sum whole once weighed.
        loss = keras_compat.compute_loss(self.model, x, y, y_pred, sample_weight, False, 1, sums_times, share)
        return y_pred, loss, accumulate.divisor_on_replicas(self.model, y_pred, sample_weight, self.strategy)

    def _replica_test(self, batch):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(batch)
        share = accumulate.replica_share(self.model, [batch], self.strategy.num_replicas_in_sync, by_shapes=False)
        y_pred, loss, divisor = self._forward(x, y, sample_weight, share)
        examples = crossing.examples(x)
        if accumulate.logged_once(self.model, divisor, self.strategy.num_replicas_in_sync):
            loss, examples = accumulate.as_global(loss, examples, divisor, self.strategy.num_replicas_in_sync)
        packed.track_loss(self.model, loss, examples, self.strategy.num_replicas_in_sync)
        packed.update_metrics(self.model, x, y, y_pred, sample_weight)

    def _test_step(self, batch):
        self.strategy.run(self._replica_test, args=(batch,))

    def _test_function(self):  # (A new function where `_forward` changed: one traced before would keep the old.)
        return tf_compat.function(self._test_step, reduce_retracing=True, autograph=False)

    def evaluate(self, dataset, steps, callbacks, batch_logs=False):
        """The model's loss and metrics over `dataset` (global batches, or a distributed dataset), every example
        or `steps` batches; metrics reset first. `callbacks` (a CallbackList) see each batch begin and end, with
        the running logs where `batch_logs`; one that sets `model.stop_evaluating` ends it there, as in Keras."""
        self.model.reset_metrics()
        self.model.stop_evaluating = False
        if isinstance(dataset, tf.data.Dataset):
            dataset = dataset.take(steps) if steps else dataset
            if self.strategy.num_replicas_in_sync > 1 or distribute.num_workers(self.strategy) > 1:
                dataset = self.strategy.experimental_distribute_dataset(dataset)
        test = calls.OfBatches(self._test, getattr(dataset, "element_spec", None))  # (Called directly.)
        with calls.LetGo(iter(dataset)) as held:  # Deleted on a thread of its own at the end, an error's or not.
            for i, batch in enumerate(itertools.islice(held[0], steps or None)):  # Not a batch past `steps` read.
                callbacks.on_test_batch_begin(i)
                # XLA failed to compile (its first batch here): the same batch without it.
                if self._first_call("test", test, batch) is FELL_BACK:
                    test = calls.OfBatches(self._test, test.spec)
                    test(batch)
                callbacks.on_test_batch_end(i, self.results() if batch_logs else None)
                if self.model.stop_evaluating:
                    break
        return self.results()
