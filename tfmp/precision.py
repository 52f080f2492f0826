"""Decide the global Keras dtype policy once, from the user's choice or the hardware."""

import contextlib
import dataclasses
import functools
import re
import typing

import keras
import tensorflow as tf
from absl import logging

from tfmp import bf16, cpuinfo, keras_compat, tf_compat
from tfmp.choices import AUTOTUNE, POLICIES  # noqa: F401 - re-exported: named where TensorFlow need not load.
from tfmp.errors import UsageError

FLOAT8_BASE = "mixed_bfloat16"  # float8 computes in bfloat16 around its float8 matmuls (tfmp.float8).


@dataclasses.dataclass(frozen=True)
class Hardware:
    """What the policy choice depends on.

    Attributes:
        tpu: whether TPU devices are visible.
        gpu_capability: lowest (major, minor) compute capability among the visible
            GPUs, or None without GPUs.
        gpu_name: name of the first GPU, for messages.
        cpu_flags: the bfloat16-related CPU flags found (subset of amx_bf16, avx512_bf16).
    """

    tpu: bool = False
    gpu_capability: tuple | None = None
    gpu_name: str = ""
    cpu_flags: tuple = ()


def detect_hardware():
    """Reads the visible accelerators and CPU features. Does not create any device."""
    tpu = bool(tf.config.list_logical_devices("TPU"))
    capability, name = None, ""
    for gpu in tf.config.list_physical_devices("GPU"):
        details = tf.config.experimental.get_device_details(gpu)
        cc = details.get("compute_capability")
        if cc is not None and (capability is None or tuple(cc) < capability):
            capability = tuple(cc)
        name = name or details.get("device_name", gpu.name)
    return Hardware(tpu=tpu, gpu_capability=capability, gpu_name=name, cpu_flags=cpuinfo.bf16_flags())


def choose_policy(hardware):
    """Returns (policy, reason) for `auto` on the given hardware."""
    if hardware.tpu:
        return "mixed_bfloat16", "TPU found: bfloat16 is native on TPU matrix units"
    if hardware.gpu_capability is not None:
        cc = "{}.{}".format(*hardware.gpu_capability)
        if hardware.gpu_capability >= (8, 0):
            return "mixed_bfloat16", (
                f"GPU {hardware.gpu_name} has compute capability {cc} >= 8.0: bfloat16 Tensor Cores run at the "
                "float16 rate and need no loss scaling"
            )
        if hardware.gpu_capability >= (7, 0):
            return "mixed_float16", f"GPU {hardware.gpu_name} has compute capability {cc} >= 7.0 (float16 Tensor Cores)"
        return "float32", f"GPU {hardware.gpu_name} has compute capability {cc} < 7.0: float16 would not be faster"
    if hardware.cpu_flags:
        return "mixed_bfloat16", f"CPU only, with {'/'.join(hardware.cpu_flags)}: bfloat16 matmuls run in hardware"
    return "float32", "CPU only, without AMX or AVX512-BF16: mixed precision would be slower"


def auto_trial_candidates(hardware=None):
    """The policies `train.py --precision=auto` times on the model itself, or None.

    On a CPU with AMX or AVX512-BF16, bfloat16 pays off for convolution- and matmul-heavy
    models (2.8-3x here) but not for small recurrent or attention models, so there the
    training binary measures float32 against mixed_bfloat16 on the user's model (cached).
    On TPUs and GPUs the hardware rule of `choose_policy` holds for every bundled model.
    """
    hardware = hardware or detect_hardware()
    if hardware.tpu or hardware.gpu_capability is not None or not hardware.cpu_flags:
        return None
    return ("float32", "mixed_bfloat16")


_AUTO = 'auto (configure_precision("auto"), train.py --precision=auto)'  # What the warnings below advise.


def _slow_float16_warning(hardware):
    if hardware.tpu:
        return "mixed_float16 on TPU: TPUs compute in bfloat16; use mixed_bfloat16."
    if hardware.gpu_capability is None:
        return (
            "mixed_float16 on a CPU can be many times slower than float32 (float16 matmuls "
            f"are emulated); use {_AUTO} or mixed_bfloat16 unless you are testing."
        )
    if hardware.gpu_capability < (7, 0):
        cc = "{}.{}".format(*hardware.gpu_capability)
        return f"mixed_float16 on a GPU of compute capability {cc} (< 7.0, no Tensor Cores) can be slower than float32."
    return None


def bfloat16_is_emulated(hardware=None):
    """Whether bfloat16 matmuls would run emulated: a CPU-only machine without AMX-BF16 or
    AVX512-BF16 (an AMD EPYC Zen 3, say, with AVX2 only)."""
    hardware = hardware or detect_hardware()
    return not (hardware.tpu or hardware.gpu_capability is not None or hardware.cpu_flags)


def computes_in(model, dtype):
    """Whether `model` or any layer inside it computes in `dtype`."""
    return any(layer.compute_dtype == dtype for layer in [model, *keras_compat.sublayers(model)])


def _emulated_bfloat16_warning(hardware, policy="mixed_bfloat16"):
    """The warning for bfloat16 compute asked for on a CPU that has no bfloat16 instructions."""
    if not bfloat16_is_emulated(hardware):
        return None
    return (
        f"{policy} on a CPU without AMX-BF16 or AVX512-BF16 (no amx_bf16 or avx512_bf16 in /proc/cpuinfo) "
        "runs emulated: expect each step to take longer than in float32 (the bundled cnn's 2.1-2.4x with XLA, "
        f"jit_compile=auto's choice here, 11x without, on an AMD EPYC Zen 3); use {_AUTO} or float32 unless testing."
    )


def _float8_warning(hardware):
    """float8 runs at float8 speed only on GPUs with float8 units (compute capability 8.9+)."""
    if hardware.gpu_capability is not None and hardware.gpu_capability >= (8, 9):
        return None
    where = (
        "a GPU of compute capability {}.{} (float8 units need 8.9 or more)".format(*hardware.gpu_capability)
        if hardware.gpu_capability is not None
        else ("a TPU" if hardware.tpu else "a CPU")
    )
    return (
        f"float8 on {where} is emulated (each float8 matmul is quantized and dequantized around a bfloat16 one): "
        "right for tests and accuracy parity, slower than mixed_bfloat16."
    )


_SLOW_POLICY_WARNINGS = {
    "mixed_float16": _slow_float16_warning,
    "mixed_bfloat16": _emulated_bfloat16_warning,
    "float8": _float8_warning,
    "bfloat16": functools.partial(_emulated_bfloat16_warning, policy="bfloat16"),
}
_float8 = [None]  # The Keras policy object float8 set (its base), while float8 is the policy.
_bf16 = {"rounding": "kahan", "seed": 0}  # How tfmp.fit writes bfloat16 weights back (tfmp.bf16).


class Decision(typing.NamedTuple):
    """A resolved policy and the sentence that explains it."""

    policy: str
    reason: str
    warning: str | None = None


def resolve_policy(policy="auto", hardware=None):
    """Turns a policy choice into a concrete policy, with the reason.

    Args:
        policy: one of `auto`, `mixed_float16`, `mixed_bfloat16`, `float32`.
        hardware: a `Hardware` to decide from; detected when None (tests pass one).

    Returns:
        A `Decision`. Nothing global changes.

    Raises:
        UsageError: for an unknown policy name.
    """
    if policy not in POLICIES:
        raise UsageError(f"unknown precision {policy!r}; choose one of {', '.join(POLICIES)}")
    hardware = hardware or detect_hardware()
    if policy == "auto":
        chosen, reason = choose_policy(hardware)
        return Decision(chosen, "auto: " + reason)
    slow = _SLOW_POLICY_WARNINGS.get(policy)
    return Decision(policy, "asked for", slow(hardware) if slow else None)


def configure_precision(policy="auto", hardware=None, *, rounding="kahan", seed=0, verbose=True):
    """Applies a global Keras dtype policy, logs why, and returns its name; `auto`'s choice and
    its reason are printed too.

    Asking for mixed_float16 where it is slow (CPU, TPU, GPU below compute capability
    7.0), or for mixed_bfloat16 on a CPU without bfloat16 instructions, works but logs a
    warning.

    Args:
        policy: one of `auto`, `mixed_float16`, `mixed_bfloat16`, `float32`, `float8`
            (bfloat16 compute with float8 matmuls in Dense and EinsumDense layers,
            applied by `tfmp.fit`), `bfloat16` (weights and optimizer state stored in
            bfloat16: half the memory; `tfmp.fit` computes each update in float32 and
            writes it back with `rounding`); or a `keras.DTypePolicy` of one of these names.
            `auto` picks neither float8 nor bfloat16.
        hardware: a `Hardware` to decide from; detected when None.
        rounding: for bfloat16 weights (`tfmp.bf16`): `kahan` (a compensation buffer per
            weight), `stochastic` (seeded by `seed`, the step and the variable), or
            `nearest` (Keras' behaviour: small updates vanish; it warns).
        seed: an integer seeding stochastic rounding.
        verbose: print `auto`'s choice and its reason on one line, where absl's log, which
            shows it, is quiet by default outside an absl app (train.py prints it in its summary).

    Returns:
        The name of the policy now global, e.g. "mixed_bfloat16".

    Raises:
        UsageError: for an unknown policy name or rounding.
    """
    set_bf16_rounding(rounding, seed)
    policy = policy.name if isinstance(policy, keras.DTypePolicy) else policy  # As keras.config.set_dtype_policy.
    decision = resolve_policy(policy, hardware)
    if verbose and policy == "auto":
        print(f"tfmp: precision {decision.policy} ({decision.reason})")
    return apply_policy(decision)


def set_bf16_rounding(rounding="kahan", seed=0):
    """How `tfmp.fit` writes bfloat16 weights back (see `configure_precision`)."""
    if rounding not in bf16.ROUNDINGS:
        raise UsageError(f"unknown rounding {rounding!r}; choose one of {', '.join(bf16.ROUNDINGS)}")
    _bf16.update(rounding=rounding, seed=int(seed))


def bf16_rounding():
    """(rounding, seed) for bfloat16 weights, as `configure_precision` last set them."""
    return _bf16["rounding"], _bf16["seed"]


def apply_policy(decision):
    """Makes a resolved `Decision` the global Keras dtype policy; logs it; returns its name.

    float8 sets its bfloat16 base as the Keras policy; `tfmp.fit` then runs the model's
    Dense and EinsumDense matmuls in float8 (`tfmp.float8`)."""
    logging.info("Precision: %s (%s)", decision.policy, decision.reason)
    if decision.warning:
        logging.warning(decision.warning)
    if decision.policy == "bfloat16":
        bf16.warn_if_nearest(_bf16["rounding"])
        tf_compat.broadcast_bfloat16_initial_values()  # Several workers can make its variables.
    policy = keras.DTypePolicy(FLOAT8_BASE) if decision.policy == "float8" else decision.policy
    keras.config.set_dtype_policy(policy)
    _float8[0] = policy if decision.policy == "float8" else None
    return decision.policy


def float8_enabled():
    """Whether the policy is float8: the global Keras policy is still the very object that
    float8 set (a policy set since, even mixed_bfloat16 again, ends it)."""
    return _float8[0] is not None and keras.config.dtype_policy() is _float8[0]


def compute_dtype(policy=None):
    """The compute dtype of policy name `policy` (float8: its bfloat16 base), or of the
    global policy without one, e.g. "bfloat16"."""
    if policy is None:
        return keras.config.dtype_policy().compute_dtype
    if policy not in POLICIES or policy == "auto":
        raise UsageError(f"unknown policy {policy!r}; choose from {', '.join(POLICIES[1:])}")
    return keras.DTypePolicy(FLOAT8_BASE if policy == "float8" else policy).compute_dtype


def keep_float32(model_or_names, names_or_regexes=None):
    """Layers that compute in float32 under a mixed global policy: in a model being built
    (a `with` block) or in a built one (loaded, subclassed, or any other).

    `tfmp.keep_float32(names)` is a `with` block: layers created in it whose path or name
    matches one of `names` compute in float32; every other layer follows the global policy.
    At the block's end, a name that matched none of the layers built in it is warned about
    once, with the real ones. `tfmp.keep_float32(model, names)` changes the built `model`
    in place: each of its layers (nested ones too) whose path or name matches computes in
    float32 from then on. Both take exactly the names `tfmp.diagnose(...).keep_float32`
    returns; the names are full-match regular expressions. Variables stay float32 either
    way.

    Args:
        model_or_names: a built Keras model, or the names (then `names_or_regexes` is
            left out).
        names_or_regexes: with a model: a layer name, a regular expression, or a list of them.

    Returns:
        With a model: the paths of the layers now computing in float32. Without: a
        context manager.

    Raises:
        UsageError: a pattern that is not a regular expression, or, with a model, one that
            matches none of its layers.

    Example:
        >>> with tfmp.keep_float32(["layer_norm.*", "logits"]):
        ...     model = build_model()
        >>> tfmp.keep_float32(loaded_model, tfmp.diagnose(loaded_model, data).keep_float32)
    """
    if isinstance(model_or_names, keras.layers.Layer):
        return _keep_float32_in(model_or_names, _patterns(names_or_regexes))
    if names_or_regexes is not None:
        raise UsageError("keep_float32 takes (names) as a with block, or (model, names) for a built model")
    return _keep_float32_block(_patterns(model_or_names))


def _patterns(names_or_regexes):
    given = names_or_regexes
    patterns = [] if given is None else [given] if isinstance(given, str) else given
    if not isinstance(patterns, (list, tuple, set)) or not all(isinstance(p, str) for p in patterns):
        raise UsageError(f"keep_float32 takes layer names or regular expressions (a str or a list), got {given!r}")
    for pattern in patterns:
        try:
            re.compile(pattern)
        except re.error as e:
            raise UsageError(f"keep_float32: {pattern!r} is not a regular expression ({e})") from e
    return list(patterns)


def _in_block(pattern):
    """What a keep_float32 pattern matches in a block: a layer whose path, or any part of
    it, it matches (a Sequential's layers have paths "sequential/NAME"), and the layers
    inside it (an LSTM's weights are its cell's, at "lstm/lstm_cell")."""
    return f"(?:.*/)?(?:{pattern})(?:/.*)?"


def _matches(pattern, path, name=None):
    """Whether a keep_float32 pattern names a layer: its whole path, or its name."""
    return any(re.fullmatch(pattern, n or "") for n in (path, name or (path or "").rsplit("/", 1)[-1]))


def require_matches(model, patterns, what):
    """Raises UsageError for the first of `patterns` (full-match regular expressions of layer paths or names) that
    names none of `model`'s layers, a typo's, said as `what`'s (the argument or flag), with some of the layers."""
    layers = keras_compat.sublayers(model)
    for pattern in patterns:
        if not any(_matches(pattern, layer.path, layer.name) for layer in layers):
            names = ", ".join(layer.path or layer.name for layer in layers[:12]) + (", ..." if len(layers) > 12 else "")
            raise UsageError(f"{what}: {pattern!r} matches no layer of {model.name} (its layers: {names})")


def _keep_float32_in(model, patterns):
    require_matches(model, patterns, "keep_float32")
    layers = keras_compat.sublayers(model)
    chosen = {}
    for pattern in patterns:
        hits = [layer for layer in layers if _matches(pattern, layer.path, layer.name)]
        chosen.update({id(layer): layer for layer in hits})
    for layer in chosen.values():
        keras_compat.set_policy(layer, "float32")
    keras_compat.forget_compiled_functions(model)
    return [layer.path or layer.name for layer in chosen.values()]


@contextlib.contextmanager
def _keep_float32_block(patterns):
    """Inside the block the global policy is a Keras `DTypePolicyMap` from layer paths
    (names for top-level layers) to float32, whose default is the policy before it (an
    enclosing block's names stay float32 too)."""
    previous = keras.config.dtype_policy()
    if not patterns:
        yield
        return
    default, outer = previous, []
    if isinstance(previous, keras.dtype_policies.DTypePolicyMap):  # A block inside a block.
        if any(policy.name != "float32" for policy in previous.values()):
            raise UsageError("keep_float32: the global policy is a DTypePolicyMap of other dtypes; set a policy first")
        default, outer = previous.default_policy, list(previous.keys())
    # One key: DTypePolicyMap refuses a path that matches two of its keys.
    combined = "|".join([*outer, *(_in_block(p) for p in patterns)])
    policy_map = keras.dtype_policies.DTypePolicyMap(default, {combined: keras.DTypePolicy("float32")})
    keras.config.set_dtype_policy(policy_map)
    try:
        with keras_compat.paths_looked_up() as paths:
            yield
    finally:
        keras.config.set_dtype_policy(previous)
    _warn_unmatched(patterns, paths, default)


def _warn_unmatched(patterns, paths, policy):
    """One warning naming the patterns that matched none of the layers built in a
    `keep_float32` block (a typo, or another naming), with some of the real paths. Where no
    layer was built in the block its layers' paths are not known yet: nothing to say."""
    unmatched = [p for p in patterns if not any(re.fullmatch(_in_block(p), path) for path in paths)]
    if not paths or not unmatched:
        return
    real = sorted(paths)
    shown = ", ".join(real[:8]) + (f", ... ({len(real)} in all)" if len(real) > 8 else "")
    logging.warning(
        "keep_float32: %s matched no layer built in the block (its layers: %s); those layers follow %s. "
        "The names are full-match regular expressions of layer paths or names: tfmp.audit(model) lists the paths.",
        ", ".join(repr(p) for p in unmatched),
        shown,
        policy.name,
    )


def device_name():
    """The accelerator's name, or the CPU's (`tfmp.cpuinfo.name`)."""
    hardware = detect_hardware()
    if hardware.gpu_name:
        return hardware.gpu_name
    if hardware.tpu:
        return "TPU"
    return cpuinfo.name()
