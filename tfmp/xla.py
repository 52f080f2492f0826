"""`jit_compile`: whether the per-replica math of tfmp's steps runs as one XLA computation.

"auto" (the default) is a rule, the same on every run: XLA on GPUs and TPUs, and on CPUs
only for float16 compute, or emulated bfloat16 (see `_rule`);
a model XLA cannot compile runs without it, after one warning line.

"autotune" (opt-in) also compiles the step with XLA and then times the forward and backward
passes with and without XLA, in alternating rounds on a batch of ones (a call of each in
turn), keeping XLA only when it is clearly faster (see `tfmp.timing`); its cost is said
before it runs, and `tfmp.fit` records the choice in the run's directory for a resumed
run or a rerun to take again. The timing changes nothing: the layers' non-trainable state
(batch-norm statistics, dropout seeds) is put back afterwards. On several workers, which
would time differently and must all run the same collectives, and under op determinism,
where reruns must match bit for bit, "autotune" follows the rule too.
"""

import re
import time
import warnings

import numpy as np
import tensorflow as tf
from absl import logging

from tfmp import (
    decisions,
    distribute,
    gradients,
    keras_compat,
    keras_optimizers,
    precision,
    tf_compat,
    timing,
    xla_kernels,
)
from tfmp.errors import UsageError, first_line

CHOICES = ("auto", "autotune", True, False)
AUTO_BUDGET_SECONDS = 15.0
TURN_SECONDS = 0.25  # Each variant's share of a round.
# Per model architecture, batch and setup, in this process: whether XLA compiles it (None or why not), "autotune"'s.
_PROBES, _VERDICTS = {}, {}
ON, OFF = "XLA", "no XLA"


def check(jit_compile):
    """Raises UsageError unless `jit_compile` is "auto", "autotune", True or False."""
    if jit_compile not in CHOICES or (jit_compile in (0, 1) and not isinstance(jit_compile, bool)):
        raise UsageError(f'jit_compile must be "auto", "autotune", True or False, got {jit_compile!r}')


def replica_batch(element_spec, replicas, default_batch=8):
    """Ones shaped like one replica's batch of `element_spec` (a global batch's spec).

    Ones, not zeros: a token id of 0 is padding to a masking embedding (an LSTM would skip
    every step), and a sample weight of 0 weighs nothing.
    """

    def ones(spec):
        shape = list(spec.shape)
        if shape and shape[0] is not None:
            shape[0] = max(shape[0] // replicas, 1)
        shape = [default_batch if i == 0 and d is None else (d or 1) for i, d in enumerate(shape)]
        return tf.ones(shape, spec.dtype) if spec.dtype != tf.string else tf.fill(shape, "a")

    return tf.nest.map_structure(ones, element_spec)


_MERGE_CALL = "`merge_call` called while defining a new graph"
_NOT_ON_THESE = "which XLA does not compile on these devices"


def probe(steps, batches):
    """None if XLA compiles `steps`' gradient computation and learning rate for `batches`, else the reason."""
    # Forward and backward passes, the metrics' updates (a metric's host call too) and the learning rate (a host call
    # in its schedule), as Steps compiles them; not the optimizer's update, whose lowering costs seconds (DECISIONS.md).
    stage = lambda b: (steps.gradients_stage(b), keras_optimizers.learning_rate(steps.optimizer))  # noqa: E731
    fn = tf.function(stage, jit_compile=True, autograph=False)

    def lower(b):  # Traces and lowers to XLA's HLO; runs nothing.
        # The replica's device, named: without a name TensorFlow finds it by running a random op, which op
        # determinism refuses unless a global seed is set. (Named the only way that skips it, which warns.)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "device_name is being deprecated")
            fn.experimental_get_compiler_ir(b)(stage="hlo", device_name=tf.identity(0.0).device)
        return tf.constant(0)

    tf_logger, level = tf.get_logger(), tf.get_logger().level
    tf_logger.setLevel("ERROR")  # Not "Using MirroredStrategy eagerly has significant overhead".
    try:
        steps.strategy.run(lower, args=(batches,))  # In a replica context, like the real step.
    except (ValueError, TypeError, tf.errors.OpError, RuntimeError) as e:
        if isinstance(e, RuntimeError) and not is_compile_failure(e):  # A merge call (a layer syncing replicas) is.
            raise
        return reason(e)
    finally:
        tf_logger.setLevel(level)
    return None


# What a step under XLA raises where XLA cannot compile it (`is_compile_failure` tells which are that).
COMPILE_ERRORS = (tf.errors.InvalidArgumentError, tf.errors.UnimplementedError, tf.errors.NotFoundError, RuntimeError)


def is_compile_failure(error):
    """Whether a TensorFlow error raised by a step under XLA says XLA could not compile or
    run it there (the step then falls back to no XLA), not that the step itself is wrong."""
    text = str(error)
    if isinstance(error, RuntimeError):  # Only a merge call that the compiled step cannot hold.
        return _MERGE_CALL in text
    return (
        "XLA" in text
        or "unsupported operations when trying to compile" in text
        or xla_kernels.elsewhere(text) is not None
    )


def reason(error):
    """Why XLA could not compile a step, from the error it raised, up front (`probe`) or
    at the first step: the op it has no kernel for, or the variable on another device, in
    a user's words; else the error's first line."""
    text = str(error)
    unsupported = re.search(r"unsupported operations .* on XLA_\w+: (\w+)", text)
    taken = re.search(r"Requested Attributes: T=DT_(\w+)", text)
    if unsupported and unsupported.group(1) == "_Arg" and taken:  # The step's own input.
        kind = taken.group(1).lower()
        return f"its input holds {kind} tensors, which XLA does not take; make them numbers in the input pipeline"
    if unsupported:
        return f"no XLA kernel for {unsupported.group(1)}{xla_kernels.made_at(text)}"
    determinism = re.search(r"(?:GPU )?(\w[\w ]*?) do(?:es)? not yet have a deterministic XLA implementation", text)
    if determinism:  # TensorFlow's words say "GPU" on every device.
        return (
            f"{determinism.group(1)} have no deterministic XLA implementation, and op determinism is on "
            "(train.py's --deterministic, or tf.config.experimental.enable_op_determinism())"
        )
    if _MERGE_CALL in text:  # TensorFlow makes the call, then XLA could not compile it on CPUs either.
        layer = re.search(r"when calling (\w+)\.call\(\)", text)
        who = layer.group(1) if layer else "a layer"
        if who == "BatchNormalization":
            return f"{who} (synchronized=True) all-reduces across replicas in its forward pass, {_NOT_ON_THESE}"
        return (
            f"{who} syncs replicas in its forward pass (an all-reduce, or an update of a variable whose aggregation "
            f'is "mean" or "sum"), {_NOT_ON_THESE}'
        )
    return (
        xla_kernels.elsewhere(text)
        or first_line(error, limit=1000).removeprefix("Failed getting HLO text: ").strip("'")[:200]
    )


def _throughput(steps, jit, batches, repeats):
    fn = tf.function(steps.replica_gradients, jit_compile=True, autograph=False) if jit else steps.replica_gradients
    strategy = steps.strategy

    def replica(b):  # Not converted by AutoGraph: `run` is traced without it, and strategy.run then converts nothing.
        grads, losses, *_ = fn(b)
        # A checksum of every output, so that no part of the work can be pruned away.
        sums = [tf.reduce_sum(tf.cast(gradients.values(g), tf.float32)) for g in grads if g is not None]
        return tf.add_n(sums + [tf.cast(x, tf.float32) for x in losses])

    @tf.function(autograph=False)
    def run(b):
        return strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(replica, args=(b,)), axis=None)

    run(batches).numpy()  # Trace and compile.
    examples = len(batches) * int(tf.shape(tf.nest.flatten(batches[0])[0])[0])

    def timed():  # A turn of `repeats` calls, yielding after each (`timing.interleaved`).
        seconds = 0.0
        for _ in range(repeats):
            start = time.perf_counter()
            run(batches).numpy()
            seconds += time.perf_counter() - start
            yield
        return repeats * examples / seconds

    return timed


def measure(steps, batches, budget_seconds=None, clock=time.perf_counter):
    """Examples/second per replica of the gradient computation without and with XLA, in
    alternating rounds: {OFF: [...], ON: [...]}, within `budget_seconds` (default
    AUTO_BUDGET_SECONDS) after compiling. Leaves the model's state as it was."""
    budget_seconds = AUTO_BUDGET_SECONDS if budget_seconds is None else budget_seconds
    model = steps.model
    saved = [v.numpy() for v in model.non_trainable_variables]
    try:
        with steps.strategy.scope():
            once = _throughput(steps, False, batches, 1)()  # Traced; one call, to size the turns.
            start = clock()
            timing.interleaved([(OFF, once)])
            repeats = int(np.clip(TURN_SECONDS / max(clock() - start, 1e-6), 1, 50))
            runners = {OFF: _throughput(steps, False, batches, repeats), ON: _throughput(steps, True, batches, repeats)}
            return timing.alternate(runners, budget_seconds, clock, baseline=OFF, interleave=True)
    finally:
        with steps.strategy.scope():
            for v, value in zip(model.non_trainable_variables, saved, strict=True):
                v.assign(value)
        model.reset_metrics()


_AS_COMPILED = '{}: the model was compiled with jit_compile={}, which "auto" follows, as model.fit does'


def resolve(steps, element_spec, jit_compile, per_replica=False, say=None, refuses_late=False):
    """Compiles `steps` with XLA or not, as `jit_compile` says; returns (bool, why).

    `element_spec` is a global batch's, or one replica's when `per_replica`. `say` (e.g. `print`) hears, before
    "autotune" times XLA, what that will cost. XLA is tried (a compile, seconds) only where it would be used.
    "auto" follows a choice the model's compile made (`keras_compat.compiled_jit_compile`).
    `refuses_late`: whether a first step XLA cannot compile may find it out itself and run the batches it
    read again without XLA (an input read again alike): then, on one replica, no `probe` traces the step up
    front (seconds, for a large model) unless "autotune" times it. A refusal is kept for models alike."""
    check(jit_compile)
    on, off = "on", "off"
    compiled_with = keras_compat.compiled_jit_compile(steps.model) if jit_compile == "auto" else None
    if compiled_with is not None:  # The model's compile chose: as jit_compile=True or False from here.
        jit_compile = compiled_with
        on, off = _AS_COMPILED.format("on", "True"), _AS_COMPILED.format("off", "False (or run_eagerly=True)")
    if jit_compile is False:
        steps.compile(False)
        return False, off
    if distribute.strategy_name(steps.strategy) == "tpu":
        steps.compile(True)
        return True, "TPUs always compile with XLA"
    replicas = 1 if per_replica else steps.strategy.num_replicas_in_sync
    if not all(isinstance(s, tf.TensorSpec) for s in tf.nest.flatten(element_spec)):
        steps.compile(False)
        return False, "the inputs are not all dense tensors (ragged or sparse)"
    varying = [tuple(s.shape) for s in tf.nest.flatten(element_spec) if None in tuple(s.shape)[1:]]
    if jit_compile is not True and varying:  # "auto" or "autotune" (a timing of one shape would not see it).
        steps.compile(False)
        return False, (
            f"{jit_compile}: off: the data's shapes vary beyond the batch ({varying[0]}), and XLA would compile the "
            "step anew for each (pad to fixed lengths, or jit_compile=True)"
        )
    several = distribute.num_workers(steps.strategy) > 1  # Workers decide alike: by the rule, up front.
    ruled = jit_compile == "auto" or several or tf_compat.op_determinism()
    if jit_compile is not True and ruled:  # The rule's answer stands unless XLA cannot compile the model.
        use, why = _rule(steps, jit_compile)
        if not use:
            steps.compile(False)
            return use, why
    batches = (replica_batch(element_spec, replicas),) * steps.grad_accum_steps
    key = _fingerprint(steps, batches)
    alone = steps.strategy.num_replicas_in_sync == 1  # Several (workers too): a refused step can cancel collectives.
    if key not in _PROBES and not (refuses_late and alone and (jit_compile is True or ruled)):
        _PROBES[key] = probe(steps, batches)
        if _PROBES[key]:
            logging.warning("XLA cannot compile this model (%s); training without XLA", _PROBES[key])
    steps.refused = lambda why: _PROBES.setdefault(key, why)  # What a first step found, for models alike.
    refused = _PROBES.get(key) or steps.fallback  # (Or a first step of these steps, where no probe found it.)
    if refused:
        use, why = False, f"XLA cannot compile this model: {refused}"
    elif jit_compile is True:
        use, why = True, on
    elif not ruled:
        if key not in _VERDICTS:
            if say is not None:
                say(
                    f"XLA: timing the step with and without XLA for up to {AUTO_BUDGET_SECONDS:g} s "
                    '(jit_compile="autotune"; "auto", True or False skips it)'
                )
            _VERDICTS[key] = timing.decide(measure(steps, batches), baseline=OFF)
        verdict = _VERDICTS[key]
        use, why = verdict.choice == ON, f"autotune: {verdict.reason}"
    steps.compile(use)
    return use, why


def _rule(steps, jit_compile):
    """(XLA on?, why) by the hardware and the compute dtype: on GPUs; on CPUs only where
    layers compute in float16, or in bfloat16 without the CPU's bfloat16 instructions (TPUs
    compile with XLA before this).

    On CPUs, measured with the whole update in one XLA computation (BENCHMARKS.md, the
    loop-cost tables): under mixed_float16 XLA made tfmp's step 2.3-5.8x faster on an
    Intel Xeon with AMX (TensorFlow's own float16 CPU kernels are slow there; the bundled
    models' autotune picked XLA too), 0.85-1.07x on an AMD EPYC Zen 4, whose float16
    matmuls are fast; 1.2x under mixed_bfloat16 but not on the bundled models; and 5-37%
    slower in float32. On an AMD EPYC Zen 3 (bfloat16 emulated), the bundled models' steps
    2.8-8.4x under mixed_bfloat16 (the lstm's 0.87x). "autotune" times it on the machine."""
    if tf.config.list_physical_devices("GPU"):
        use, hardware = True, "GPUs: on"
    elif steps.scaled:  # Loss scaling is on exactly where layers compute in float16.
        use, hardware = True, "CPUs: on for float16 compute (2.3-5.8x faster than without XLA on an Intel Xeon)"
    elif precision.computes_in(steps.model, "bfloat16") and precision.bfloat16_is_emulated():
        use, hardware = True, "CPUs: on for emulated bfloat16 compute (2.8-8.4x faster on an AMD EPYC Zen 3)"
    else:
        use, hardware = False, "CPUs: off"
    if jit_compile == "auto":
        return use, f'auto: {hardware} (a rule, the same every run; jit_compile="autotune" times it)'
    who = "on several workers" if distribute.num_workers(steps.strategy) > 1 else "with deterministic ops"
    return use, f"autotune {who}: {hardware} (a rule, not a timing, so that all runs agree)"


def _fingerprint(steps, batches):
    """What a verdict depends on: the model's layers, by class (a BatchNormalization's `synchronized` too: it
    all-reduces), and weights (their aggregation too: updating a "mean" or "sum" one syncs replicas), the batch,
    the setup (op determinism included: XLA has no deterministic kernel for some gradients)."""
    model = steps.model
    layers = [model, *keras_compat.sublayers(model)]
    return (
        tuple((_class(layer), layer.compute_dtype, getattr(layer, "synchronized", None)) for layer in layers),
        tuple((tuple(v.shape), v.dtype, getattr(v, "aggregation", None)) for v in model.weights),
        tuple((tuple(t.shape), t.dtype.name) for t in tf.nest.flatten(batches)),
        distribute.strategy_name(steps.strategy),
        steps.strategy.num_replicas_in_sync,
        type(steps.optimizer).__name__,
        tf_compat.op_determinism(),
    )


def _class(layer):
    """A layer's class by module and name: two layers of one name (a user's Block, say) may compile differently."""
    kind = type(layer)
    return f"{kind.__module__}.{kind.__qualname__}"


def _show(use):
    return ON if use else OFF


def resolve_run(steps, element_spec, jit_compile, directory, per_replica=False, reuse=True, say=None, **late):
    """`resolve` for a run kept in `directory`: where "autotune" decided before for this
    directory (a resumed run, or a rerun of the same command), that decision is taken
    again, so that the run trains as the recorded one did; a decision that differs from
    the recorded one is said in one line.

    Args:
        reuse: False where the recorded decision must not be taken (several workers,
            which must all decide alike, and may not all see `directory`).
        say: hears what a timing will cost before it runs (see `resolve`).
        late: `refuses_late`, as `resolve` takes it.

    Returns:
        (XLA on?, why, whether it is a choice "autotune" made now: `decisions.record` it as
        "jit_compile" once the run owns `directory`).
    """
    entry = decisions.recorded(directory, "jit_compile")
    if jit_compile == "autotune" and entry is not None and reuse:
        use, why = resolve(steps, element_spec, bool(entry["value"]), per_replica, say, **late)
        if use == entry["value"]:
            why = decisions.reused_reason(directory, entry)
        chosen_now = False
    else:
        use, why = resolve(steps, element_spec, jit_compile, per_replica, say, **late)
        chosen_now = jit_compile == "autotune" and directory is not None and entry is None
    decisions.say_if_different(directory, "XLA", entry, use, _show)
    return use, why, chosen_now


_CALLS = ("f", "then_branch", "else_branch", "cond", "body")  # Attributes naming a called function.
_NOT_RUN = ("Placeholder", "_Arg", "_Retval", "NoOp", "Const")  # Arguments and constants, not work.


def ops_outside_xla(graph):
    """The TensorFlow ops a traced step runs one by one, outside XLA, per call.

    Counts the ops of `graph` (a concrete function's), into the functions and control-flow
    branches it calls that are not XLA-compiled; a call of an XLA-compiled function is one
    op. Arguments and constants are not counted. A static count of the step as traced:
    what the host dispatches each step, before Grappler's rewrites.
    """
    definition = graph.as_graph_def()
    library = {f.signature.name: f for f in definition.library.function}

    def count(nodes):
        total = 0
        for node in nodes:
            if node.op in _NOT_RUN:
                continue
            total += 1
            if "_XlaMustCompile" in node.attr and node.attr["_XlaMustCompile"].b:
                continue  # One XLA computation.
            called = [
                node.attr[k].func.name for k in ("f", "then_branch", "else_branch", "cond", "body") if k in node.attr
            ]
            if "branches" in node.attr:
                called += [f.name for f in node.attr["branches"].list.func]
            total += sum(count(library[name].node_def) for name in called if name in library)
        return total

    return count(definition.node)
