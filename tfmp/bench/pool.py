"""Pools several `python -m tfmp.bench` runs: tfmp / Keras fit per row over all their rounds.

One run's 7 rounds on a shared 2-core machine put a row's tfmp / Keras at 1.00 with a
standard error of 1-10%: whether a row reads 0.99 or 1.01 is chance. The rounds of several
runs, pooled, narrow it.

    python3 -m tfmp.bench --rounds=7 --output_dir=bench_out/a   # (and b, c: same machine)
    python3 -m tfmp.bench.pool bench_out/a/bench.json bench_out/b/bench.json bench_out/c/bench.json
"""

import json
import sys

from tfmp import timing


def pool(results):
    """Per (model, policy) in the runs' order: each run's tfmp / Keras, and the median of
    the per-round ratios over every run's rounds with its standard error (a fraction)."""
    rows = {}
    for result in results:
        for r in result["rows"]:
            rows.setdefault((r["model"], r["policy"]), []).append(r)
    pooled = []
    for (model, policy), runs in rows.items():
        ours = [x for r in runs for x in r["rounds"]]
        theirs = [x for r in runs for x in r["keras_fit_rounds"]]
        ratio, error = timing.median_ratio(ours, theirs)
        pooled.append(
            {
                "model": model,
                "policy": policy,
                "runs": [r["tfmp_vs_keras_fit"] for r in runs],
                "rounds": len(ours),
                "tfmp_vs_keras_fit": ratio,
                "tfmp_vs_keras_fit_error": error,
                "xla": [r["jit_compile"]["tfmp"] for r in runs],
            }
        )
    return pooled


def markdown(pooled, device):
    runs = max(len(p["runs"]) for p in pooled)
    out = [
        f"tfmp / Keras fit, {device}: each run's median of per-round ratios, then all their rounds pooled",
        "",
        "| model | policy | " + " | ".join(f"run {i + 1}" for i in range(runs)) + " | pooled (rounds) | tfmp XLA |",
        "|---|---|" + "---|" * runs + "---|---|",
    ]
    for p in pooled:
        each = " | ".join(f"{r:.2f}" for r in p["runs"])
        ratio, error = p["tfmp_vs_keras_fit"], p["tfmp_vs_keras_fit_error"]
        xla = "/".join("on" if x else "off" for x in p["xla"])
        both = f"{ratio:.3f} ±{ratio * error:.3f} ({p['rounds']})"
        out.append(f"| {p['model']} | {p['policy']} | {each} | {both} | {xla} |")
    return "\n".join(out)


def main(paths):
    if not paths:
        print("usage: python3 -m tfmp.bench.pool BENCH_JSON [BENCH_JSON ...]", file=sys.stderr)
        return 2
    results = []
    for path in paths:
        with open(path) as f:
            results.append(json.load(f))
    devices = sorted({r["device"] for r in results})
    if len(devices) > 1:
        print(f"benchpool: error: runs from different devices ({', '.join(devices)}) do not pool", file=sys.stderr)
        return 2
    print(markdown(pool(results), devices[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
