"""Uses of TensorFlow internals, in one place, each with a test in tests/test_tf_compat.py:
a release that changes one of them fails the test named after it.

TensorFlow keeps private a strategy's worker count, whether op determinism is on,
MirroredStrategy's collective keys (tfmp gives each strategy its own), a variable's
aggregation and the no-merge-call switch (set aside while tfmp's loss-scale cond counts an
update where no merge call may run), the collective broadcast of a new variable's initial
value (which takes no bfloat16), the FLOP profiler the bench uses, how tf.function
counts a function's traces, a variable made past any strategy's scope, the kernels XLA
registered, the ops TensorFlow registered and the functions a traced graph calls. The
uses of Keras' internals are in tfmp.keras_compat.
"""

import contextlib
import functools
import weakref

import tensorflow as tf

_KEY_STRIDE = 100000  # Group keys one MirroredStrategy may take (one per device set it reduces over).
_keyed = weakref.WeakSet()  # The MirroredStrategies given keys of their own.


def own_collective_keys(strategy):
    """Gives a `MirroredStrategy` collective keys that no other strategy of this process
    has used, once; other strategies are left as they are.

    Every MirroredStrategy numbers its collective groups from its class's
    `_collective_key_base` (0 unless a test moves it) and its instances from 100, and
    TensorFlow's runtime keeps what it learnt of each (group, instance) pair, shapes
    included, for the life of the process. A second strategy (a notebook that trains two
    models) reuses the first one's keys and fails with "Shape mismatch in the collective
    instance 100" (tensorflow/tensorflow#62790). Its collective ops are remade from a fresh
    base here, before anything is traced with them, and the class's base is moved past it
    so that a strategy made later, even one tfmp never sees, starts elsewhere too.
    """
    if not isinstance(strategy, tf.distribute.MirroredStrategy) or strategy in _keyed:
        return
    extended = strategy.extended
    old = getattr(extended, "_collective_ops", None)
    if old is None or not hasattr(extended, "_make_collective_ops_with_fallbacks"):
        return
    mirrored = tf.distribute.MirroredStrategy
    base = max(mirrored._collective_key_base, extended._collective_key_base) + _KEY_STRIDE  # noqa: SLF001
    mirrored._collective_key_base = base + _KEY_STRIDE  # noqa: SLF001
    extended._collective_key_base = base  # noqa: SLF001
    extended._collective_ops = extended._make_collective_ops_with_fallbacks()  # noqa: SLF001
    if extended._cross_device_ops is old:  # noqa: SLF001
        extended._cross_device_ops = extended._collective_ops  # noqa: SLF001
    _keyed.add(strategy)


def collective_group_keys(strategy):
    """The group keys a MirroredStrategy's collective all-reduce uses (for tests)."""
    return sorted(strategy.extended._collective_keys._known_groups.values())  # noqa: SLF001


_MIRRORED = ("MirroredExtended", "CollectiveAllReduceExtended")  # MirroredStrategy's, MultiWorkerMirroredStrategy's.


@contextlib.contextmanager
def replica_local_updates(variables, strategy=None):
    """Inside the block, updates in replica context of those of `variables` that a strategy
    broadcasts from its first replica (an optimizer's iteration count) go to each replica's
    own copy instead. TensorFlow broadcasts them with a merge call even where the strategy
    makes none (XLA on GPUs), and refuses a merge call inside a `cond` branch; tfmp's
    loss-scale `cond` updates the count with every replica on the same branch and the copies
    equal, so each adding its own increment leaves them equal. Tracing only: the variables'
    aggregation is put back at the end of the block.

    With `strategy`, its replicas also make no merge call inside the block, as under XLA on
    GPUs (TensorFlow's own no-merge-call branch): each variable update goes to the replica's
    own copy (`MirroredExtended._replica_ctx_update`). tfmp applies every update under a
    (multi-worker) mirrored strategy so, with XLA or without: a merge call cannot run inside
    a function called per replica, nor in the cond of an optimizer's own gradient
    accumulation or moving-average overwrite. A strategy of another kind (one device, TPUs)
    is left as it is, its variables too.
    """
    if strategy is not None and type(strategy.extended).__name__ not in _MIRRORED:
        yield
        return
    only_first = tf.VariableAggregation.ONLY_FIRST_REPLICA
    changed = []
    for variable in variables:
        value = getattr(variable, "value", variable)  # A Keras variable's tf.Variable.
        if getattr(value, "_aggregation", None) == only_first:
            changed.append(value)
    extended = strategy.extended if strategy is not None else None
    own = extended is not None and "_use_merge_call" in vars(extended)
    previous = vars(extended).get("_use_merge_call") if extended is not None else None
    try:
        for value in changed:
            value._aggregation = tf.VariableAggregation.NONE  # noqa: SLF001
        if extended is not None:
            extended._use_merge_call = lambda: False  # noqa: SLF001
        yield
    finally:
        for value in changed:
            value._aggregation = only_first  # noqa: SLF001
        if extended is not None:
            if own:
                extended._use_merge_call = previous  # noqa: SLF001
            else:
                del extended._use_merge_call  # Back to the class's.


def broadcast_bfloat16_initial_values():
    """Lets MultiWorkerMirroredStrategy make bfloat16 variables (weights, slots, Kahan
    buffers: `tfmp.bf16`); once per process, every strategy of that class at once.

    The strategy sends each new variable's initial value from the chief to the other
    workers by a collective broadcast, and TensorFlow's `CollectiveBcastSend` takes no
    bfloat16 (bool, float, half, double, int32, int64 only): building a bfloat16 model under
    it fails. A bfloat16 value crosses as float32 here (exact both ways) and is cast back;
    every other variable is made as before."""
    from tensorflow.python.distribute import collective_all_reduce_strategy as car  # noqa: PLC0415 - private, here only.

    extended = car.CollectiveAllReduceExtended
    original = getattr(extended, "_get_variable_creator_initial_value", None)
    if original is None or getattr(original, "tfmp_bfloat16", False):
        return

    def initial_value(self, replica_id, device, primary_var, **kwargs):
        dtype = kwargs.get("dtype")
        if replica_id != 0 or dtype is None or tf.as_dtype(dtype) != tf.bfloat16:
            return original(self, replica_id=replica_id, device=device, primary_var=primary_var, **kwargs)
        value = kwargs["initial_value"]

        def as_float32():
            given = value() if callable(value) else value
            return tf.cast(getattr(given, "wrapped_value", given), tf.float32)  # A checkpoint's initial value too.

        kwargs.update(initial_value=as_float32, dtype=tf.float32)
        sent = original(self, replica_id=0, device=device, primary_var=None, **kwargs)
        return lambda: tf.cast(sent() if callable(sent) else sent, tf.bfloat16)

    initial_value.tfmp_bfloat16 = True
    extended._get_variable_creator_initial_value = initial_value  # noqa: SLF001


def host_variable(value):
    """A plain variable of `value` in this host's memory, even inside a strategy's scope, where `tf.Variable` makes
    a distributed one with a copy on each of its devices (GPUs), which a `tf.data` function on the host would
    update across devices: TensorFlow's variable class, called directly, skips the scope's variable creators."""
    from tensorflow.python.ops import resource_variable_ops  # noqa: PLC0415 - private, here only.

    with tf.device("/cpu:0"):
        return resource_variable_ops.ResourceVariable(value, trainable=False)


def reorders(dataset):
    """Whether `dataset` may read in another order from each new iterator: a shuffle that draws a new order each
    iteration (tf.data's default, `model.fit`'s arrays), or a random source drawing anew, anywhere in the pipeline
    it was made from (through its private `_inputs`; where that cannot be read, it may)."""
    stack = [dataset]
    try:
        while stack:
            found = stack.pop()
            if any(getattr(found, name, False) for name in ("_reshuffle_each_iteration", "_rerandomize")):
                return True
            stack.extend(found._inputs())  # noqa: SLF001
    except Exception:  # noqa: BLE001 - a dataset of a kind that does not say: it may.
        return True
    return False


def op_determinism():
    """Whether `tf.config.experimental.enable_op_determinism()` is on (TensorFlow has no
    public getter)."""
    from tensorflow.python.framework import config as tf_config  # noqa: PLC0415 - private, here only.

    return tf_config.is_op_determinism_enabled()


def num_workers(strategy):
    """Worker processes (hosts) `strategy` spans: 1 for single-process strategies (TensorFlow
    keeps the count in a private attribute of the strategy's extended object)."""
    return getattr(strategy.extended, "_num_workers", 1)


def float_ops(graph):
    """The floating-point operations TensorFlow's (v1, non-public) profiler counts in `graph`."""
    from tensorflow.python.profiler import model_analyzer, option_builder  # noqa: PLC0415 - private, here only.

    options = option_builder.ProfileOptionBuilder.float_operation()
    options["output"] = "none"
    return model_analyzer.profile(graph, options=options).total_float_ops


def function(fn=None, **options):
    """`tf.function(fn, **options)`, its traces counted apart from any other function's (without
    `fn`, a decorator that makes one).

    TensorFlow warns that a function "triggered tf.function retracing" when 5 of its last 10
    calls traced, and counts the calls of every function made from the same Python code as
    one's (its call-stats key is the code object). tfmp makes its steps and checks one set a
    model, each traced once, so a sweep of short fits (a notebook, a hyperparameter search)
    would read as one function retraced again and again. A `functools.partial` has no code
    object: TensorFlow then keys the count by the function itself.
    """
    if fn is None:
        return functools.partial(function, **options)
    own = functools.partial(fn)
    own.__name__ = own.__qualname__ = getattr(fn, "__name__", "function")
    return tf.function(own, **options)


def xla_kernels(device_type):
    """{op type: one list per kernel XLA registered for `device_type` ("XLA_CPU_JIT", "XLA_GPU_JIT") of its dtype
    constraints, (attribute, the DataType numbers it allows)}; empty where XLA has registered none (TensorFlow's
    registry is private)."""
    from tensorflow.python.framework import kernels  # noqa: PLC0415 - private, here only.

    found = {}
    for kernel in kernels.get_all_registered_kernels().kernel:
        if kernel.device_type == device_type:
            allowed = [(c.name, frozenset(c.allowed_values.list.type)) for c in kernel.constraint]
            found.setdefault(kernel.op, []).append([(name, types) for name, types in allowed if types])
    return found


def called_graph(graph, name):
    """(Whether `graph` calls a function `name`, its graph: Python ops with their tracebacks, or None where
    TensorFlow keeps none, a function loaded rather than traced here); a traced graph's library is private."""
    function = graph._get_function(name)  # noqa: SLF001
    return function is not None, getattr(function, "graph", None)


def registered_op(name):
    """Whether `name` is an op TensorFlow registered (its own, or a loaded library's), not a function's name: a
    call of a function is a node whose op is the function's name (the op registry is private)."""
    from tensorflow.python.framework import op_def_registry  # noqa: PLC0415 - private, here only.

    return op_def_registry.get(name) is not None
