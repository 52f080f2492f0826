"""What /proc/cpuinfo says about this CPU: its bfloat16 instructions (`bf16_flags`, which
`tfmp.precision` decides "auto" by) and the name that labels figures (`name`)."""

import functools
import os
import platform

BF16_FLAGS = ("amx_bf16", "avx512_bf16")


@functools.cache
def _fields(path):
    """The first processor's fields in `path` ({} where it cannot be read: not Linux)."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return {}
    fields = {}
    for line in text.split("\n\n")[0].splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


def bf16_flags(path="/proc/cpuinfo"):
    """The bfloat16 flags among `BF16_FLAGS` this CPU has (none known where not Linux)."""
    words = set(_fields(path).get("flags", "").split())
    return tuple(flag for flag in BF16_FLAGS if flag in words)


def name(path="/proc/cpuinfo"):
    """The CPU's model name, family and model numbers, bfloat16 flags and cores, e.g.
    "Intel(R) Xeon(R) Processor (family 6 model 167, amx_bf16 avx512_bf16, 2 cores)".

    A virtual machine's model name can be as bare as that one, the same for several
    generations; the family and model numbers tell them apart (an AMD EPYC Zen 3 is family
    25 model 1, a Zen 4 family 25 model 17, a Zen 5 family 26), and the flags say whether
    bfloat16 runs in hardware. Figures and autotune's cached choices are labelled with it.
    """
    fields = _fields(path)
    model = fields.get("model name") or platform.processor() or "CPU"
    details = [f"family {fields['cpu family']} model {fields.get('model', '?')}"] if "cpu family" in fields else []
    if "flags" in fields:
        details.append(" ".join(bf16_flags(path)) or "no bfloat16 instructions")
    return f"{model} ({', '.join([*details, f'{os.cpu_count()} cores'])})"
