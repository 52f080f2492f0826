"""tfmp.cpuinfo: the bfloat16 flags and the name that labels figures, from cpuinfo files of
the CPU kinds this project runs on (not this machine's, which may be any of them)."""

import os
import platform

import pytest

from tfmp import cpuinfo

ZEN3 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 1
model name\t: AMD EPYC 7R13 Processor
flags\t\t: fpu sse2 avx avx2 fma

processor\t: 1
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 1
model name\t: AMD EPYC 7R13 Processor
flags\t\t: fpu sse2 avx avx2 fma
"""


@pytest.mark.parametrize(
    "text, expected",
    [
        (ZEN3, "AMD EPYC 7R13 Processor (family 25 model 1, no bfloat16 instructions, {n} cores)"),
        (
            ZEN3.replace("model\t\t: 1\n", "model\t\t: 17\n").replace("avx2 fma", "avx2 avx512f avx512_bf16 fma"),
            "AMD EPYC 7R13 Processor (family 25 model 17, avx512_bf16, {n} cores)",
        ),
        (
            "cpu family\t: 6\nmodel\t\t: 167\nmodel name\t: Intel(R) Xeon(R) Processor\n"
            "flags\t: avx512_bf16 amx_bf16\n",
            "Intel(R) Xeon(R) Processor (family 6 model 167, amx_bf16 avx512_bf16, {n} cores)",
        ),
    ],
)
def test_cpu_name_tells_cpu_kinds_apart(tmp_path, text, expected):
    """Figures and autotune's cache are labelled with it: a Zen 3 and a Zen 4 that share a
    model name differ in their model number and bfloat16 flags."""
    path = tmp_path / "cpuinfo"
    path.write_text(text)
    assert cpuinfo.name(str(path)) == expected.format(n=os.cpu_count())
    assert cpuinfo.bf16_flags(str(path)) == tuple(f for f in ("amx_bf16", "avx512_bf16") if f in text)


def test_cpu_name_without_cpuinfo_says_what_it_knows(tmp_path):
    name = cpuinfo.name(str(tmp_path / "missing"))
    assert name == f"{platform.processor() or 'CPU'} ({os.cpu_count()} cores)"
    assert cpuinfo.bf16_flags(str(tmp_path / "missing")) == ()
