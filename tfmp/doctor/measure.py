"""What the doctor measures: `diagnose`, `localize_non_finite`, `parity` (see `tfmp.doctor`)."""

import math
import statistics

import keras
import numpy as np
import tensorflow as tf

from tfmp import bf16, data_check, fit_data, float8, gradients, keras_compat, keras_optimizers, precision
from tfmp.doctor.diagnosis import FLOAT16_MAX, Diagnosis
from tfmp.doctor.watch import (
    BINS,
    Session,
    abs_values,
    finite,
    fraction_below,
    log2_histogram,
    model_loss,
    owners,
    relative_error,
)
from tfmp.errors import UsageError

FLOAT16_SUBNORMAL = 2.0**-24  # The smallest positive float16: anything below flushes to zero.
FLOAT16_NORMAL = 2.0**-14  # Below this float16 is subnormal: fewer significant bits.
MAX_SCALE = 2.0**24
HEADROOM = 2.0**-3  # The recommended scale keeps the largest gradient 3 binades below 65504.
BFLOAT16_TOLERANCE = 0.05  # Relative output error that marks a layer as bfloat16-sensitive.


def diagnose(model, data, steps=8):
    """Runs `steps` float32 training steps of `model` and reports, per layer, what float16
    and bfloat16 would do to its outputs and gradients. The model is not copied, so any
    model `tfmp.fit` trains can be diagnosed (Sequential, functional with Lambda layers,
    subclassed); it is as it was afterwards (weights, optimizer, dtype policies).

    Args:
        model: a compiled Keras model, in any policy.
        data: a `tf.data.Dataset` of `(x, y)` or `(x, y, sample_weight)` batches, or what
            `tfmp.fit` takes besides: arrays as a tuple `(x, y)` or `(x, y, sample_weight)`
            (in batches of 32, in order), a `keras.utils.PyDataset` or a generator.
        steps: batches to train on and measure.

    Returns:
        A `Diagnosis`. Its `keep_float32` names each layer whose output exceeds float16's
        maximum, and each layer that would cast such a value back to float16 (its
        consumers): with all of them in float32 the model trains in mixed_float16.
    """
    if not isinstance(model, keras.Model):
        raise UsageError(f"diagnose takes a compiled Keras model, got {type(model).__name__}")
    if not getattr(model, "compiled", False):
        raise UsageError("diagnose needs a compiled model: call model.compile(optimizer, loss) first")
    if isinstance(steps, bool) or not isinstance(steps, int | np.integer) or steps < 1:
        raise UsageError(f"diagnose: steps must be an integer >= 1, got {steps!r}")
    targets = data_check.needs_targets(model)
    data, _ = fit_data.datasets(data, strategy=model.distribute_strategy, training=False, targets=targets)
    if not isinstance(data, tf.data.Dataset):
        kind = type(data).__name__
        raise UsageError(f"diagnose reads a dataset, arrays (x, y), a PyDataset or a generator, not a {kind}")
    data_check.check(model, data.element_spec)  # As tfmp.fit: an unbatched dataset said so, not Keras' shape error.
    if not model.built:  # Its layers built as model.fit builds them: a first call watched would record symbolic
        # tensors. Not its optimizer (the doctor updates with a copy): float8 could not quantize the model after.
        keras_compat.build_layers(model, data.element_spec)
    with Session(model) as session:
        layers, calls = session.layers, session.calls
        dtypes = [layer.compute_dtype for layer in layers]  # The model's own, before float32.
        with model.distribute_strategy.scope():
            optimizer = keras_optimizers.fresh_optimizer(model.optimizer)
        # Not float8's scales and amax histories (a quantized model's): its delayed scaling is measured apart, and
        # Keras' optimizer warned at every step that they had no gradient.
        variables = [v for v in model.trainable_variables if not float8.is_state(v)]
        compensated = bf16.holds_bfloat16(model)
        if compensated:  # As tfmp.fit updates them: Keras' own update rounds Adam's beta_2 to 1 and moves none.
            optimizer = _compensated(optimizer, variables, model.distribute_strategy)
        owner = owners(layers)
        hist = np.zeros((len(layers), len(BINS)), dtype=np.int64)
        zeros = np.zeros(len(layers), dtype=np.int64)
        grad_max = np.zeros(len(layers))
        bf16_error = np.zeros(len(layers))
        dropped = np.zeros((len(layers), 2), dtype=np.int64)  # Updates nearest would drop, updates made.
        order, done = None, 0
        matmuls = {id(layer) for layer in float8.matmul_layers(model)}
        calls.float8 = {i for i, layer in enumerate(layers) if id(layer) in matmuls}
        e4m3, e5m2 = (float8.E4M3_MAX, float8.E4M3_SMALLEST), (float8.E5M2_MAX, float8.E5M2_SMALLEST)
        delayed = {
            i: [float8.DelayedScaling(*e4m3), float8.DelayedScaling(*e4m3), float8.DelayedScaling(*e5m2)]
            for i in calls.float8
        }
        for batch in data.take(steps):
            x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(batch)
            if held := non_finite_data(batch):  # Every figure would be NaN, and no precision's doing.
                raise UsageError(f"diagnose: batch {done + 1} holds non-finite values ({held}): check the input data")
            if done == 0:  # bfloat16: the same batch forward, each layer's output against float32's.
                session.forward(x, "float32")
                ref, order = calls.outputs(), list(dict.fromkeys(calls.started))
                session.forward(x, "mixed_bfloat16")
                for i, (low, high) in enumerate(zip(calls.outputs(), ref, strict=True)):
                    bf16_error[i] = relative_error(low, high)
            calls.recording = True
            with keras_compat.policies([model, *layers], "float32"), tf.GradientTape() as tape:
                loss = model_loss(model, y, session.forward(x, training=True), sample_weight)
            calls.recording = False
            matmuls = sorted(calls.matmuls.items())
            grads, output_grads = tape.gradient(loss, (variables, [outputs for _, (_, outputs) in matmuls]))
            for (i, (inputs, _)), output_grad in zip(matmuls, output_grads, strict=True):
                delayed[i][0].add(inputs)
                delayed[i][1].add(layers[i].kernel)
                if output_grad is not None:
                    delayed[i][2].add(output_grad)
            for v, g in zip(variables, grads, strict=True):
                if g is None or id(v) not in owner:
                    continue
                values = abs_values(g)
                counts, z = log2_histogram(values)
                i = owner[id(v)]
                hist[i] += counts
                zeros[i] += z
                grad_max[i] = max(grad_max[i], float(values.max(initial=0.0)))
            before = [np.asarray(v, np.float32) for v in variables]
            _apply(model.distribute_strategy, optimizer, grads, variables, reduced=compensated)
            for v, old in zip(variables, before, strict=True):
                if id(v) in owner:
                    dropped[owner[id(v)]] += nearest_drops(old, np.asarray(v, np.float32))
            done += 1
    if not done:
        raise UsageError("diagnose got no batches from the data")
    order += [i for i in range(len(layers)) if i not in order]  # Layers the forward pass never called.
    diagnosis = _report(layers, order, dtypes, calls, grad_max, hist, zeros, bf16_error, done)
    stored = {owner[id(v)] for v in variables if bf16.is_bfloat16(v) and id(v) in owner}  # Compensated: None.
    for record, i in zip(diagnosis.layers, order, strict=True):
        lost = float(dropped[i, 0] / dropped[i, 1]) if dropped[i, 1] else 0.0
        record["bfloat16_nearest_dropped"] = None if i in stored else lost
    diagnosis.float8 = [
        float8.layer_report(layers[i].path or layers[i].name, *delayed[i]) for i in sorted(delayed, key=order.index)
    ]
    diagnosis.keep_bfloat16 = [r["name"] for r in diagnosis.float8 if r["keep_bfloat16"]]
    diagnosis.show_float8 = bool(float8.quantized_layers(model)) or precision.float8_enabled()
    return diagnosis


def nearest_drops(old, new):
    """(elements whose float32 update bfloat16 weights would lose under round-to-nearest,
    elements updated): the update `new - old` applied to `old` rounded to bfloat16 rounds
    back to it (Keras' `bfloat16` policy; tfmp.bf16's `nearest`)."""
    low = tf.cast(tf.cast(old, tf.bfloat16), tf.float32)
    update = new - old
    moved = update != 0
    lost = tf.logical_and(moved, tf.equal(tf.cast(low + update, tf.bfloat16), tf.cast(low, tf.bfloat16)))
    return np.array([int(tf.reduce_sum(tf.cast(lost, tf.int64))), int(np.sum(moved))])


def _compensated(optimizer, variables, strategy):
    """`optimizer` (fresh) updating bfloat16 weights as tfmp.fit does (`tfmp.bf16`: each update in float32, written
    back with the rounding `configure_precision` set), its `apply` taking gradients already summed (`_apply`)."""
    with strategy.scope():
        optimizer.build(variables)
    rounding, seed = precision.bf16_rounding()
    groups = keras_optimizers.optimizer_groups(optimizer, variables)
    hooks = {id(sub): bf16.applier_hooks(sub, group, strategy, rounding, seed) for sub, group in groups}
    return keras_optimizers.reduced_applier(optimizer, hooks)


def _apply(strategy, optimizer, grads, variables, reduced=False):
    """Applies the gradients of the whole batch. Under a strategy (a model built in its
    scope) Keras' optimizer applies in a replica context and sums what each replica
    gives: each gives its share; an applier of `reduced` gradients is given them whole."""
    replicas = strategy.num_replicas_in_sync
    whole = reduced or replicas == 1
    share = [g if g is None or whole else gradients.scale(g, 1.0 / replicas) for g in grads]
    logger, level = tf.get_logger(), tf.get_logger().level
    logger.setLevel("ERROR")  # Not "Using MirroredStrategy eagerly has significant overhead": a few steps.
    try:
        with strategy.scope():
            strategy.run(optimizer.apply, args=(share, variables))
    finally:
        logger.setLevel(level)


def _report(layers, order, dtypes, calls, grad_max, hist, zeros, bf16_error, steps):
    any_low = any(d in ("float16", "bfloat16") for d in dtypes)
    # Only low-precision layers' gradients live in float16; float32 layers' never overflow it.
    low = [i for i, d in enumerate(dtypes) if d != "float32" or not any_low]
    largest = float(grad_max[low].max(initial=0.0)) if low else 0.0
    scale = 1.0
    if largest > 0:
        scale = 2.0 ** math.floor(math.log2(FLOAT16_MAX * HEADROOM / largest))
    scale = float(min(max(scale, 1.0), MAX_SCALE))
    index = {id(layer): i for i, layer in enumerate(layers)}
    overflows = calls.output_max > FLOAT16_MAX
    records, keep = [], []
    for i in order:
        layer = layers[i]
        name = layer.path or layer.name
        inside = [index[id(sub)] for sub in keras_compat.sublayers(layer) if id(sub) in index]
        # A layer that only passes on what an inner layer made too large is not the culprit.
        overflow = bool(overflows[i] and not overflows[inside].any())
        # It casts a value beyond float16 to 16 bits: inf (all layers would, in a float32 model).
        would_cast = dtypes[i] != "float32" or not any_low
        consumer = bool(calls.input_max[i] > FLOAT16_MAX and would_cast)
        grad_overflow = bool(grad_max[i] > FLOAT16_MAX)
        records.append(
            {
                "name": name,
                "class": type(layer).__name__,
                "compute_dtype": dtypes[i],
                "input_max_abs": calls.input_max[i],
                "input_overflow": consumer,
                "output_max_abs": calls.output_max[i],
                "output_floating": bool(calls.output_floats[i]),
                "forward_overflow": overflow,
                "gradient_max_abs": grad_max[i],
                "gradient_overflow_at_1": grad_overflow,
                "gradient_values": int(hist[i].sum() + zeros[i]),
                "underflow_at_1": fraction_below(hist[i], zeros[i], FLOAT16_SUBNORMAL, 1.0),
                "subnormal_at_1": fraction_below(hist[i], zeros[i], FLOAT16_NORMAL, 1.0),
                "underflow_at_recommended": fraction_below(hist[i], zeros[i], FLOAT16_SUBNORMAL, scale),
                "subnormal_at_recommended": fraction_below(hist[i], zeros[i], FLOAT16_NORMAL, scale),
                "bfloat16_relative_error": bf16_error[i],
            }
        )
        # Only layers that would compute in low precision need keeping (all, for a model
        # that is float32 throughout, diagnosed before choosing a mixed policy).
        if (overflow or consumer or grad_overflow) and (dtypes[i] != "float32" or not any_low):
            keep.append(name)
    return Diagnosis(
        layers=records,
        keep_float32=keep,
        recommended_loss_scale=scale,
        bfloat16_sensitive=[r["name"] for r in records if r["bfloat16_relative_error"] > BFLOAT16_TOLERANCE],
        steps=steps,
        histogram={"log2_bins": BINS.tolist(), "counts": hist.sum(0).tolist()},
    )


def non_finite_data(batch):
    """How many NaN and inf values a batch's inputs, targets and sample weights hold, in words ("1 in its
    inputs"); "" for none. Nests, ragged and sparse tensors too."""

    def count(part):
        tensors = [tf.convert_to_tensor(t) for t in tf.nest.flatten(part, expand_composites=True) if t is not None]
        floating = [np.asarray(t) for t in tensors if t.dtype.is_floating]
        return sum(v.size - np.count_nonzero(np.isfinite(v)) for v in floating)

    parts = zip(("inputs", "targets", "sample weights"), keras.utils.unpack_x_y_sample_weight(batch), strict=True)
    return ", ".join(f"{n} in its {name}" for name, part in parts if (n := count(part)))


def localize_non_finite(model, batch, loss_scale=None):
    """Replays `batch` through `model` in its own precision and says where the first
    non-finite value appeared, and what would help.

    Returns:
        One sentence: the batch's own non-finite values where it holds any; else the first
        layer (in the order the layers' calls finished) whose output is not finite, or, with
        finite outputs, the layer nearest the loss whose weight gradient is not.
    """
    if held := non_finite_data(batch):  # The data's, not the model's: in any precision, from any weights.
        return f"the batch itself holds non-finite values ({held}): check the input data"
    broken = next((w.path for w in model.weights if not np.isfinite(np.asarray(w, np.float32)).all()), None)
    if broken:
        return (
            f"the weights are non-finite already (first: {broken}), so the replay cannot tell where it began; "
            "diagnose the model from finite weights (a checkpoint before it) with tfmp.diagnose"
        )
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(batch)
    with Session(model) as session:
        layers = session.layers
        variables = list(model.trainable_variables)
        with tf.GradientTape() as tape:
            loss = model_loss(model, y, session.forward(x), sample_weight) * (loss_scale or 1.0)
        finished = list(session.calls.finished)
        grads = tape.gradient(loss, variables)
    for i, outputs in finished:
        layer = layers[i]
        if not finite(outputs):
            name = layer.path or layer.name
            fix = (
                f"keeping it in float32 would help (tfmp.keep_float32([{name!r}]) or --keep_float32={name})"
                if layer.compute_dtype in ("float16", "bfloat16")
                else "it computes in float32 already: check the input data and the learning rate"
            )
            where = f"layer {name!r} ({type(layer).__name__}, {layer.compute_dtype})"
            return f"first non-finite output: {where}; {fix}"
    owner = owners(layers)
    bad = {owner.get(id(v)) for v, g in zip(variables, grads, strict=True) if g is not None and not finite(g)}
    for i in reversed(list(dict.fromkeys(i for i, _ in finished))):
        if i in bad:
            layer = layers[i]
            fix = (
                f"a lower loss scale would help (it was {loss_scale:g})"
                if loss_scale and loss_scale > 1
                else "lower the learning rate or keep the layer in float32"
            )
            name = layer.path or layer.name
            return f"outputs finite; first non-finite gradient: layer {name!r} ({type(layer).__name__}); {fix}"
    return "the replayed batch gives finite outputs and gradients: the weights were already non-finite"


def parity(run, seeds=3, policies=("float32", "mixed_bfloat16")):
    """Test accuracy of each policy over `seeds` seeds, and whether they differ beyond the
    seed-to-seed noise.

    Args:
        run: `run(policy, seed) -> test accuracy` (trains a fresh model).
        seeds: how many seeds (0, 1, ...) per policy.
        policies: the two policies to compare, float32 first.

    Returns:
        A dict: per policy the accuracies, mean and standard deviation; `difference`
        (mixed minus float32), `noise` (standard error of that difference) and
        `within_noise` (the difference is within two standard errors).
    """
    if seeds < 2:
        raise UsageError(f"parity needs at least 2 seeds to measure the noise, got {seeds}")
    if len(policies) != 2 or policies[0] == policies[1]:
        raise UsageError(f"parity compares two different policies, got {tuple(policies)}")
    result = {}
    for policy in policies:
        accuracies = [float(run(policy, seed)) for seed in range(seeds)]
        result[policy] = {
            "accuracies": accuracies,
            "mean": statistics.mean(accuracies),
            "std": statistics.stdev(accuracies),
        }
    base, mixed = (result[p] for p in policies)
    noise = math.sqrt(base["std"] ** 2 / seeds + mixed["std"] ** 2 / seeds)
    difference = mixed["mean"] - base["mean"]
    result.update(
        {
            "policies": list(policies),
            "seeds": seeds,
            "difference": difference,
            "noise": noise,
            "within_noise": abs(difference) <= 2 * noise,
        }
    )
    return result
