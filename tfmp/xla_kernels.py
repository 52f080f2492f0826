"""An op XLA has no kernel for, or a variable on another device, found in a traced step before its first call runs.

XLA refuses such a step when it compiles it, at its first call, after the call has read its
batches: a generator's are then gone (its next batches train in their place, where Keras fit
trains on every one), and on several replicas the refusal can come on one while the others
wait in a collective. `xla.probe` finds it up front in the forward and backward passes and the
learning rate, not in the optimizer's update, whose lowering costs seconds (DECISIONS.md); a
custom optimizer's host call (`tf.numpy_function`, `tf.print`) is found here instead. The
traced step's XLA functions are read op by op against the kernels XLA registered for the
device, with their dtype constraints (0.05-0.19 s for 300 variables, an Intel Xeon, 2 cores),
and such an op raises the error XLA would raise, before anything runs: `Steps` then falls back
to no XLA as at a failed first call, with no batch read. So does a variable an XLA computation
takes from another device than its own (`Elsewhere`): on several replicas XLA refused it on
one replica's device only, after the others had run theirs, and their copies of the weights
parted for good. What only a compile finds (an input XLA needs constant, a kernel op
determinism lacks) still comes at the first call, alike on every replica.
"""

import os
import re

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
        name, dtype = ("_Arg", op.get_attr("dtype")) if op.type in _INPUTS else (op.type, None)
        taken = f" Requested Attributes: T=DT_{dtype.name.upper()}" if dtype is not None else ""
        message = (
            f"Detected unsupported operations when trying to compile graph {function} on {device_type}: {name} "
            f"(no {device_type} kernel for its types{taken}) {{{{node {op.name}}}}}\n{_created_at(op)}"
        )
        super().__init__(None, None, message)


def _created_at(op):
    """Where `op` was made, in the words of XLA's errors (`own_frame` reads them)."""
    return "The op is created at: \n" + "".join(
        f'File "{f.filename}", line {f.lineno}, in {f.name}\n' for f in op.traceback
    )


# Frames of TensorFlow's and Keras' machinery, not of a layer's own code.
MACHINERY = re.compile(
    r"/(tensorflow|tf_keras)/|/keras/src/(backend|ops|utils|models|trainers)/|/keras/src/layers/layer\.py"
    r"|/tfmp/(?!app/)"  # tfmp's own steps, not its bundled models.
)


def own_frame(text):
    """ "FILE:LINE": the last frame, of those XLA's error says made the op, that is a layer's own
    code (a Keras layer's file, or the user's), not the machinery; else ""."""
    frames = re.findall(r'File "([^"]+)", line (\d+)', text.partition("The op is created at")[2])
    own = [(path, line) for path, line in frames if not MACHINERY.search(path) and not path.startswith("<")]
    return f"{os.path.basename(own[-1][0])}:{own[-1][1]}" if own else ""


def made_at(text):
    """ " (made at FILE:LINE)" of `own_frame`, else ""."""
    frame = own_frame(text)
    return f" (made at {frame})" if frame else ""


def elsewhere(text):
    """The reason, in a user's words, when the step reads a variable on another device (TensorFlow's error says
    where it was made, `Elsewhere` where the step reads it); on a GPU TensorFlow keeps int32 variables in host
    memory, where XLA's GPU computation cannot read them. None for any other text."""
    device = r"\S*device:(\w+:\d+)"
    found = re.search(
        rf"resource (\S+) \((defined @|read in) ([^)]+)\) located in device {device} from device {device}", text
    )
    if not found:
        return None
    name, how, where, held, step = found.groups()
    fix = "make it with no tf.device of its own"
    if held.startswith("CPU") and step.startswith("GPU"):
        fix += ", and int64 or float32 if it is int32 (TensorFlow keeps int32 variables on the host)"
    read = own_frame(text)
    at = f"made at {where}" if how == "defined @" else (f"read at {read}" if read else f"read in {where}")
    return f"variable {name} ({at}) is on {held}, the step on {step}, and XLA reads only the step's: {fix}"


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
    stack, seen = [(concrete.graph, concrete.name, False, _captured_variables(concrete), "")], set()
    while stack:
        graph, function, under_xla, held, device = stack.pop()
        for op in sorted(graph.get_operations(), key=lambda op: op.type not in _INPUTS):  # Inputs first, as XLA.
            called = _called(op, graph, kernels)
            if called is not None:  # Its functions read in turn (under XLA from a call XLA must compile).
                inner = under_xla or _must_compile(op)
                for name, body in called:
                    passed = _passed(op, body, held) if body is not None else {}
                    if inner and not under_xla:  # XLA's computation starts here, on the call's device (each call's).
                        _check_devices(op.device or device, passed, body, name)
                    if body is not None and (name, inner) not in seen:
                        seen.add((name, inner))
                        stack.append((body, name, inner, passed, op.device or device))
            elif under_xla and op.type in _INPUTS:
                if inputs and not _allows(op, "dtype", inputs):
                    raise Unsupported(op, function, device_type)
            elif under_xla and not _has_kernel(op, kernels.get(op.type, ())):
                if tf_compat.registered_op(op.type):  # (Not a call of a function this graph does not hold.)
                    raise Unsupported(op, function, device_type)


class Elsewhere(tf.errors.InvalidArgumentError):
    """XLA's own words for a variable its computation reads on another device than its own (`xla.reason` reads
    them; on several replicas the others' updates would run, and their copies of the weights part), raised before
    the step runs."""

    def __init__(self, variable, held, device, reader, function):
        message = (
            f"Trying to access resource {variable} (read in XLA function {function}) located in device {held} from "
            f"device {device}\n{_created_at(reader)}"
        )
        super().__init__(None, None, message)


def _captured_variables(concrete):
    """{placeholder's name: (variable's name, its device)} for the variables `concrete` captures."""
    names = {id(v.handle): v.name.removesuffix(":0") for v in concrete.graph.variables}
    captured = concrete.graph.captures
    return {i.name: (names[id(e)], e.device) for e, i in captured if id(e) in names and e.device}


def _passed(op, body, held):
    """`held` (variables by tensor name) as `body`, called by `op`, receives them: its inputs in order (a branch's
    after the branch's index or condition)."""
    given = op.inputs[1:] if op.type in ("If", "StatelessIf", "Case", "StatelessCase") else op.inputs
    inputs = getattr(body, "inputs", ())
    if len(given) != len(inputs):  # (Not a call this reads: left to the first call.)
        return {}
    return {inner.name: held[outer.name] for outer, inner in zip(given, inputs, strict=True) if outer.name in held}


_DEVICE_FIELDS = ("job", "replica", "task", "device_type", "device_index")


def _check_devices(device, passed, body, function):
    """Raises `Elsewhere` for a variable `body` takes from another device than `device`, its call's (XLA compiles
    it for that one device; an unknown device is left to the first call)."""
    if not device:
        return
    step = tf.DeviceSpec.from_string(device)
    for inner in getattr(body, "inputs", ()):
        if inner.name not in passed:
            continue
        variable, held = passed[inner.name]
        spec = tf.DeviceSpec.from_string(held)
        if any(
            getattr(spec, k) is not None and getattr(step, k) is not None and getattr(spec, k) != getattr(step, k)
            for k in _DEVICE_FIELDS
        ):
            readers = inner.consumers() or [inner.op]
            raise Elsewhere(variable, held, device, readers[0], function)


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
