"""What `tfmp.bench` shows of its rows: the console table, the Markdown for README and
BENCHMARKS.md, tfmp / Keras fit over the rows, and the plot."""

import math
import statistics

import numpy as np

from tfmp import precision

TRAINERS = ("tfmp", "keras")
CONV_MODELS = ("cnn", "resnet", "resnet50")  # Their possible gain is the conv peaks' ratio; others: matmul's.


def _versus_keras(row):
    """tfmp / Keras fit and the standard error of that median, e.g. "1.03 ±0.01"."""
    ratio, error = row["tfmp_vs_keras_fit"], row.get("tfmp_vs_keras_fit_error")
    if ratio is None:
        return "-"
    return f"{ratio:.2f}" if error is None else f"{ratio:.2f} ±{ratio * error:.2f}"


def versus_keras(rows):
    """tfmp / Keras fit over the rows where neither used XLA (the same kernels on both sides):
    the geometric mean of the rows' ratios, its standard error, and the rows below 1 by more
    than two of their own standard errors. None without such rows."""
    same = [r for r in rows if r["tfmp_vs_keras_fit"] and not any(r["jit_compile"].values())]
    if not same:
        return None
    logs = [math.log(r["tfmp_vs_keras_fit"]) for r in same]
    errors = [r.get("tfmp_vs_keras_fit_error") or 0.0 for r in same]
    return {
        "rows": len(same),
        "ratio": math.exp(statistics.fmean(logs)),
        "error": math.sqrt(sum(e * e for e in errors)) / len(same),
        "slower": [f"{r['model']} {r['policy']}" for r, x, e in zip(same, logs, errors, strict=True) if x + 2 * e < 0],
    }


def versus_keras_text(summary):
    slower = ", ".join(summary["slower"]) or "none"
    return (
        f"tfmp / Keras fit over the {summary['rows']} rows without XLA: {summary['ratio']:.3f} "
        f"±{summary['error']:.3f} (geometric mean); rows slower beyond two standard errors: {slower}"
    )


def table(rows):
    """The console (and README) table."""
    head = (
        "model", "policy", "ex/s", "vs fp32", "possible", "share", "Keras fit ex/s", "tfmp/Keras", "XLA tfmp/Keras",
        "MFU", "peak MB", "state MB",
    )  # fmt: skip
    torch = _has_pytorch(rows)
    head += ("PyTorch AMP ex/s",) if torch else ()
    lines = []
    for r in rows:
        kind = "conv" if r["model"] in CONV_MODELS else "matmul"
        possible = r["possible_speedup"][kind]

        def fmt(value, spec, suffix=""):
            return "-" if value is None else f"{value:{spec}}{suffix}"

        lines.append(
            (
                r["model"],
                r["policy"],
                _rate(r["examples_per_second"]),
                fmt(r["speedup_vs_float32"], ".2f", "x"),
                f"{possible:.2f}x {kind}" if possible else "-",
                fmt(r["share_of_possible_gain"] and 100 * r["share_of_possible_gain"], ".0f", "%"),
                _rate(r["keras_fit_examples_per_second"]),
                _versus_keras(r),
                "/".join("on" if r["jit_compile"][t] else "off" for t in TRAINERS),
                fmt(100 * r["mfu"], ".0f", "%"),
                f"{r['peak_memory_mb']:,.0f}",
                f"{r['state_mb']:,.1f}" if "state_mb" in r else "-",
            )
            + ((_pytorch_rate(r),) if torch else ())
        )
    widths = [max(len(str(x)) for x in col) for col in zip(head, *lines, strict=False)]
    fmt_line = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt_line.format(*head), *(fmt_line.format(*line) for line in lines)])


def pytorch_text(facts):
    """What the PyTorch column is, or why it was left out."""
    if "left_out" in facts:
        return f"PyTorch column left out: {facts['left_out']}"
    return (
        f"PyTorch AMP: torch {facts['torch']}, torchvision {facts['torchvision']} ResNet-50 (v1.5, channels_last, "
        f"Adam, GradScaler with float16), on {facts['device']}, in a subprocess of the same run"
    )


def _has_pytorch(rows):
    """Whether the tables get PyTorch's column: where any row has a PyTorch rate."""
    return any("pytorch_examples_per_second" in r for r in rows)


def _pytorch_rate(row):
    """PyTorch's examples/second for the row's model and policy, "-" where it has none."""
    value = row.get("pytorch_examples_per_second")
    return "-" if value is None else _rate(value)


def share_text(pick):
    """A pick's share of the fastest policy's speed, with the rounds' standard error of it."""
    error = pick.get("vs_fastest_error")
    return f"{100 * pick['vs_fastest']:.1f}%" + (f" ±{100 * error:.1f}" if error else "")


def _speedup(row):
    """A row's median speedup over float32, with its standard error (none for float32)."""
    error = row.get("speedup_vs_float32_error")
    if row.get("speedup_vs_float32") is None:  # float32 was not among the policies.
        return "-"
    return f"{row['speedup_vs_float32']:.2f}x" + (f" ±{error:.2f}" if error else "")


def _rate(value):
    return f"{value:,.1f}" if value < 100 else f"{value:,.0f}"


def plot(rows, path):
    """Bars per model: each policy's examples/second under tfmp and Keras fit, relative to
    tfmp's float32 (models differ in speed by orders of magnitude)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["model"] for r in rows))
    bars = [(r["policy"], t) for r in rows if r["model"] == names[0] for t in TRAINERS]
    width = 0.8 / len(bars)
    fig, ax = plt.subplots(figsize=(9, 4))
    for i, (policy, trainer) in enumerate(bars):
        values = []
        for name in names:
            row = next((r for r in rows if r["model"] == name and r["policy"] == policy), None)
            base = next((r["examples_per_second"] for r in rows if r["model"] == name and r["policy"] == "float32"), 0)
            key = "examples_per_second" if trainer == "tfmp" else "keras_fit_examples_per_second"
            values.append(row[key] / base if row and base else 0)
        ax.bar(np.arange(len(names)) + i * width, values, width, label=f"{policy} ({trainer})")
    ax.set_xticks(np.arange(len(names)) + width * (len(bars) - 1) / 2, names)
    ax.set_ylabel("examples/s relative to tfmp float32")
    ax.set_title(f"tfmp bench: {precision.device_name()}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def markdown(result):
    """bench.json's figures as README tables: the rows, then autotune's picks and the sparse check."""
    rows = result["rows"]
    torch = _has_pytorch(rows)
    out = (
        []
        if not rows
        else [
            "| model | policy | tfmp ex/s | vs float32 | possible (peaks) | share of it | Keras fit ex/s "
            "| tfmp / Keras | XLA tfmp / Keras | MFU | peak MB | state MB |" + (" PyTorch AMP ex/s |" if torch else ""),
            "|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if torch else ""),
        ]
    )
    for r in rows:
        kind = "conv" if r["model"] in CONV_MODELS else "matmul"
        possible, share = r["possible_speedup"][kind], r["share_of_possible_gain"]
        out.append(
            f"| {r['model']} | {r['policy']} | {_rate(r['examples_per_second'])} | "
            f"{_speedup(r)} | {f'{possible:.2f}x {kind}' if possible else '-'} | "
            f"{f'{100 * share:.0f}%' if share is not None else '-'} | {_rate(r['keras_fit_examples_per_second'])} | "
            f"{_versus_keras(r)} | "
            f"{' / '.join('on' if r['jit_compile'][t] else 'off' for t in TRAINERS)} | {100 * r['mfu']:.0f}% | "
            f"{r['peak_memory_mb']:,.0f} | {r.get('state_mb', math.nan):,.1f} |"
            + (f" {_pytorch_rate(r)} |" if torch else "")
        )
    if result.get("versus_keras"):
        out += ["", versus_keras_text(result["versus_keras"])]
    if result.get("pytorch"):
        out += ["", pytorch_text(result["pytorch"])]
    if result.get("choices"):
        out += [
            "",
            "| model | fastest in the rounds (vs float32) | autotune's picks (share of the fastest, trial seconds) |",
            "|---|---|---|",
        ]
        speedups = {(r["model"], r["policy"]): r["speedup_vs_float32"] for r in rows}
        for c in result["choices"]:
            picks = ", ".join(f"{p['policy']} ({share_text(p)}, {p['seconds']:.0f} s)" for p in c["picks"])
            gain = speedups.get((c["model"], c["fastest"]))
            error = c.get("fastest_error") or 0.0  # 0 when float32 itself is the fastest.
            fastest = f"{c['fastest']} ({gain:.2f}x" + (f" ±{error:.2f})" if error else ")") if gain else c["fastest"]
            out.append(f"| {c['model']} | {fastest} | {picks} |")
    if result.get("overhead"):
        out += ["", *loop_cost_table(result["overhead"])]
    if result.get("updates"):
        out += ["", "| Adam update, float32 | parameters | Keras | tfmp (fused) | speedup |", "|---|---|---|---|---|"]
        for u in result["updates"]:
            speedup = u["keras_ms"] / u["fused_ms"]
            out.append(
                f"| {u['model']} | {u['parameters'] / 1e6:.1f}M | {u['keras_ms']:.1f} ms | {u['fused_ms']:.1f} ms | "
                f"{speedup:.2f}x |"
            )
    if result.get("sparse"):
        out += [
            "",
            "| transformer vocabulary | replicas | step, gradient densified | step, gradient sparse | speedup |",
            "|---|---|---|---|---|",
        ]
        for s in result["sparse"]:
            dense, sparse = f"{s['dense_ms']:.1f} ms", f"{s['sparse_ms']:.1f} ms"
            out.append(f"| {s['vocab_size']:,} | {s.get('replicas', 1)} | {dense} | {sparse} | {s['speedup']:.2f}x |")
    return "\n".join(out)


def loop_cost_table(costs):
    """The loop-cost cells as Markdown: ms per step in each loop and tfmp's speed over Keras',
    after a line naming the machine and versions they were measured on."""
    out = [f"{costs['device']}, {costs['versions']}:", ""] if "device" in costs else []
    out += [
        f"| loop cost per step ({costs['layers']}-layer MLP, {costs['variables']} variables, batch 32, "
        f"{costs['rounds']} lockstep rounds; speed: the median per-round ratio) | XLA | optimizer | Keras fit "
        "| tfmp.fit | tfmp / Keras (speed) |",
        "|---|---|---|---|---|---|",
    ]
    for c in costs["cells"]:
        xla = "on" if c["xla"] else "off"
        out.append(
            f"| {c['policy']} | {xla} | {c['optimizer']} | {c['keras_ms']:.2f} ms | {c['tfmp_ms']:.2f} ms "
            f"| {c['speedup']:.2f}x |"
        )
    out.append(f"| geometric mean | | | | | {costs['geomean']:.2f}x |")
    return out
