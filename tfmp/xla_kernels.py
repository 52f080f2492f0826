"""An op XLA has no kernel for, found in a traced step before its first call runs.

XLA refuses such a step when it compiles it, at its first call, after the call has read its
batches: a generator's are then gone (its next batches train in their place, where Keras fit
trains on every one), and on several replicas the refusal can come on one while the others
wait in a collective. `xla.probe` finds it up front in the forward and backward passes and the
learning rate, not in the optimizer's update, whose lowering costs seconds (DECISIONS.md); a
custom optimizer's host call (`tf.numpy_function`, `tf.print`) is found here instead. The
traced step's XLA functions are read op by op against the kernels XLA registered for the
device, with their dtype constraints (0.05-0.19 s for 300 variables, an Intel Xeon, 2 cores),
and such an op raises the error XLA would raise, before anything runs: `Steps` then falls back
to no XLA as at a failed first call, with no batch read. What only a compile finds (an input
XLA needs constant, a kernel op determinism lacks, a variable on another device) still comes
at the first call.
"""

import tensorflow as tf

from tfmp import distribute, tf_compat

# Ops that call functions (their bodies are read), and a function's inputs (XLA's `_Arg`, of the dtypes it takes).
CALLS = frozenset({"PartitionedCall", "StatefulPartitionedCall", "While", "StatelessWhile", "If", "StatelessIf"})
CALLS |= {"Case", "StatelessCase"}
_INPUTS = frozenset({"Placeholder"})
_KERNELS = {}  # Device type -> `tf_compat.xla_kernels`' table.


class Unsupported(tf.errors.UnimplementedError):
    """XLA's own words for an op it has no kernel for (`xla.reason` reads them), raised before the step runs. An
    input of the function (a placeholder in its graph) is XLA's `_Arg`, with its dtype."""

    def __init__(self, op, function, device_type):
        frames = "".join(f'File "{f.filename}", line {f.lineno}, in {f.name}\n' for f in op.traceback)
        name, dtype = ("_Arg", op.get_attr("dtype")) if op.type in _INPUTS else (op.type, None)
        taken = f" Requested Attributes: T=DT_{dtype.name.upper()}" if dtype is not None else ""
        message = (
            f"Detected unsupported operations when trying to compile graph {function} on {device_type}: {name} "
            f"(no {device_type} kernel for its types{taken}) {{{{node {op.name}}}}}\nThe op is created at: \n{frames}"
        )
        super().__init__(None, None, message)


def device_type(strategy):
    """XLA's device type for `strategy`'s devices: "XLA_CPU_JIT", "XLA_GPU_JIT", or None (a TPU, read no further).
    The default strategy's is the default device's: a GPU where there is one."""
    if distribute.strategy_name(strategy) == "default":
        kind = "GPU" if tf.config.list_logical_devices("GPU") else "CPU"
    else:
        kind = tf.DeviceSpec.from_string(strategy.extended.worker_devices[0]).device_type
    return {"CPU": "XLA_CPU_JIT", "GPU": "XLA_GPU_JIT"}.get(kind)


def check(concrete, device_type):
    """Raises `Unsupported` for the first op in `concrete`'s XLA functions that XLA has no kernel of
    `device_type` for (the node's dtypes allowed); returns where every op has one, or nothing is to be read
    (`device_type` None: no XLA, or a TPU's)."""
    kernels = _KERNELS.get(device_type) or (tf_compat.xla_kernels(device_type) if device_type else {})
    if not kernels:  # XLA's kernels not registered yet, or a device not read: the first call finds out.
        return
    _KERNELS[device_type] = kernels
    inputs = _argument_types(kernels)  # (None known: inputs left to the first call.)
    stack, seen = [(concrete.graph, concrete.name, False)], set()
    while stack:
        graph, function, under_xla = stack.pop()
        for op in sorted(graph.get_operations(), key=lambda op: op.type not in _INPUTS):  # Inputs first, as XLA.
            called = _called(op, graph, kernels)
            if called is not None:  # Its functions read in turn (under XLA from a call XLA must compile).
                inner = under_xla or _must_compile(op)
                for name, body in called:
                    if body is not None and (name, inner) not in seen:
                        seen.add((name, inner))
                        stack.append((body, name, inner))
            elif under_xla and op.type in _INPUTS:
                if inputs and not _allows(op, "dtype", inputs):
                    raise Unsupported(op, function, device_type)
            elif under_xla and not _has_kernel(op, kernels.get(op.type, ())):
                if tf_compat.registered_op(op.type):  # (Not a call of a function this graph does not hold.)
                    raise Unsupported(op, function, device_type)


def _called(op, graph, kernels):
    """[(name, graph)] of the functions `op` calls (a call's, a loop's, a branch's, or the op itself a function;
    a graph None where TensorFlow keeps none), or None for an op that calls none."""
    if op.type in CALLS:
        attrs = op.node_def.attr.values()
        names = [a.func.name for a in attrs if a.HasField("func")] + [f.name for a in attrs for f in a.list.func]
        return [(name, tf_compat.called_graph(graph, name)[1]) for name in names]
    if op.type in kernels:
        return None
    is_function, body = tf_compat.called_graph(graph, op.type)
    return [(op.type, body)] if is_function else None


def _argument_types(kernels):
    """The dtypes XLA takes as a function's input (its `_Arg` kernel's)."""
    return frozenset().union(*(types for kernel in kernels.get("_Arg", ()) for name, types in kernel if name == "T"))


def _must_compile(op):
    try:
        return bool(op.get_attr("_XlaMustCompile"))
    except ValueError:
        return False


def _has_kernel(op, kernels):
    """Whether one of `kernels` (each its dtype constraints) takes `op`'s dtypes (an attribute it does not set:
    the kernel says)."""
    return any(all(_allows(op, name, allowed) for name, allowed in kernel) for kernel in kernels)


def _allows(op, name, allowed):
    try:
        value = op.get_attr(name)
    except ValueError:
        return True
    dtypes = value if isinstance(value, list) else [value]
    return all(tf.as_dtype(dtype).as_datatype_enum in allowed for dtype in dtypes)
