"""What `tfmp.diagnose` found, and how it shows it: the console table, diagnosis.json and
the gradient histogram (gradients.png)."""

import dataclasses
import math
import os

import numpy as np

from tfmp import files
from tfmp.errors import column_width

FLOAT16_MAX = 65504.0


@dataclasses.dataclass(repr=False)
class Diagnosis:
    """What `diagnose` found.

    Attributes:
        layers: one record per layer (name, class, compute dtype in the model, output and
            gradient ranges, float16 overflow and underflow, bfloat16 output error, and
            `bfloat16_nearest_dropped`: the fraction of its weights' updates that weights
            stored in bfloat16 would lose to round-to-nearest, Keras' `bfloat16` policy,
            which `--precision=bfloat16`'s compensated rounding keeps; None where the
            weights are bfloat16 already, updated so, as tfmp.fit would).
        keep_float32: layers to keep in float32: their outputs exceed float16's maximum,
            or they would cast such an input to 16 bits (the consumers), or their
            gradients exceed it even at loss scale 1. Pass it to `tfmp.keep_float32`.
        recommended_loss_scale: a power of two that lifts the gradients out of float16's
            underflow while keeping the largest 3 binades below its maximum.
        bfloat16_sensitive: layers whose output moves more than 5% in bfloat16.
        steps: float32 training steps measured.
        histogram: counts of floor(log2 |gradient|) over all layers, per integer bin.
        float8: per Dense / EinsumDense layer that runs (or would run) in float8: the
            amax of its inputs and kernel (E4M3, max 448) and of its output gradients
            (E5M2, max 57344), and the fractions Keras' delayed scaling flushes to zero or
            saturates (`tfmp.float8.DelayedScaling`).
        keep_bfloat16: those float8 layers to leave in bfloat16 (`tfmp.float8.quantize`'s
            `exclude`).
        show_float8: whether `table()` shows the float8 part (the model or the policy
            is float8).
    """

    layers: list
    keep_float32: list
    recommended_loss_scale: float
    bfloat16_sensitive: list
    steps: int
    histogram: dict
    float8: list = dataclasses.field(default_factory=list)
    keep_bfloat16: list = dataclasses.field(default_factory=list)
    show_float8: bool = False

    def to_dict(self):
        return dataclasses.asdict(self)

    def __repr__(self):
        """One line, what a notebook or REPL shows of `tfmp.diagnose(...)`: `table()` has each layer, `to_dict()`
        every figure (a dataclass's own repr printed every layer's record, 90 KB for a MobileNetV2)."""
        float8 = f", keep_bfloat16={_names(self.keep_bfloat16)}" if self.show_float8 else ""
        return (
            f"Diagnosis({len(self.layers)} layers over {self.steps} float32 steps, "
            f"keep_float32={_names(self.keep_float32)}, recommended_loss_scale={self.recommended_loss_scale:g}, "
            f"bfloat16_sensitive={_names(self.bfloat16_sensitive)}{float8}; print(it) or .table() for each layer)"
        )

    def __str__(self):
        return self.table()

    def table(self):
        """The console table."""
        scale = self.recommended_loss_scale
        width = column_width([r["name"] for r in self.layers], 24)
        head = (
            f"{'layer':{width}s} {'dtype':8s} {'max |out|':>10s} {'max |grad|':>10s} "
            f"{'<2^-24 @1':>9s} {'<2^-14 @1':>9s} {f'<2^-24 @2^{int(math.log2(scale))}':>11s} {'bf16 err':>8s} "
            f"{'bf16 lost':>9s}"
        )
        lines = [head]
        for r in self.layers:
            mark = "  <- exceeds float16" if r["forward_overflow"] else ""
            if r["input_overflow"]:
                mark += "  <- casts a value beyond float16"
            if r["gradient_values"]:
                grads = (
                    f"{r['gradient_max_abs']:10.3g} {r['underflow_at_1']:9.1%} {r['subnormal_at_1']:9.1%} "
                    f"{r['underflow_at_recommended']:11.1%}"
                )
                dropped = r.get("bfloat16_nearest_dropped", 0.0)  # None: its weights are bfloat16, compensated.
                lost = f"{'-':>9s}" if dropped is None else f"{dropped:9.1%}"
            else:  # No trainable weight of its own (an RNN's are its cell's, a row of their own).
                grads, lost = f"{'-':>10s} {'-':>9s} {'-':>9s} {'-':>11s}", f"{'-':>9s}"
            out, error = f"{r['output_max_abs']:10.3g}", f"{r['bfloat16_relative_error']:8.1%}"
            if not r.get("output_floating", True):  # Token ids, a lookup's strings: no float to measure.
                out, error = f"{'-':>10s}", f"{'-':>8s}"
            lines.append(f"{r['name']:{width}s} {r['compute_dtype']:8s} {out} {grads} {error} {lost}{mark}")
        lines.append(f"keep in float32: {', '.join(self.keep_float32) or 'none'}")
        lines.append(f"recommended initial loss scale: 2^{int(math.log2(scale))} = {scale:g}")
        if self.bfloat16_sensitive:
            lines.append(f"bfloat16-sensitive (>5% output error): {', '.join(self.bfloat16_sensitive)}")
        lost = [r for r in self.layers if (r.get("bfloat16_nearest_dropped") or 0.0) > 0.01]
        if lost:
            worst = max(lost, key=lambda r: r["bfloat16_nearest_dropped"])
            lines.append(
                f"bf16 lost: weights stored in bfloat16 would lose up to {worst['bfloat16_nearest_dropped']:.0%} of "
                f"their updates to rounding ({worst['name']}); --precision=bfloat16 compensates (--bf16_rounding)"
            )
        if self.show_float8 and self.float8:
            lines += self._float8_lines()
        return "\n".join(lines)

    def _float8_lines(self):
        width = column_width([r["name"] for r in self.float8], 24)
        lines = [
            "float8 matmuls, delayed scaling (flushed: non-zero values lost to zero; saturated: clipped at the "
            "format's maximum; after the first step):",
            f"  {'layer':{width}s} {'inputs E4M3 amax':>16s} {'flushed':>8s} {'satur.':>7s} {'kernel amax':>11s} "
            f"{'flushed':>8s} {'grads E5M2 amax':>15s} {'flushed':>8s} {'satur.':>7s}",
        ]
        for r in self.float8:
            lines.append(
                f"  {r['name']:{width}s} {r['inputs_amax']:16.3g} {r['inputs_flushed']:8.2%} "
                f"{r['inputs_saturated']:7.2%} "
                f"{r['kernel_amax']:11.3g} {r['kernel_flushed']:8.2%} {r['output_gradients_amax']:15.3g} "
                f"{r['output_gradients_flushed']:8.2%} {r['output_gradients_saturated']:7.2%}"
                + ("  <- leave in bfloat16" if r["keep_bfloat16"] else "")
            )
        lines.append(f"leave in bfloat16 (float8 exclude): {', '.join(self.keep_bfloat16) or 'none'}")
        return lines

    def save(self, directory):
        """Writes diagnosis.json and gradients.png into `directory`; returns their paths."""
        os.makedirs(directory, exist_ok=True)
        json_path = os.path.join(directory, "diagnosis.json")
        files.write_json(json_path, self.to_dict())
        return json_path, self.plot(os.path.join(directory, "gradients.png"))

    def plot(self, path):
        """Histogram of log2 |gradient| over all layers, float16's range shaded (after
        Micikevicius et al. 2017, "Mixed Precision Training", Fig. 3)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        bins, counts = np.array(self.histogram["log2_bins"]), np.array(self.histogram["counts"])
        fig, ax = plt.subplots(figsize=(8, 4))
        ax.axvspan(-24, -14, color="tab:orange", alpha=0.15, label="float16 subnormal")
        ax.axvspan(-14, math.log2(FLOAT16_MAX), color="tab:green", alpha=0.15, label="float16 normal")
        ax.bar(bins + 0.5, np.maximum(counts, 0), width=1.0, color="tab:blue", label="gradients (loss scale 1)")
        shift = math.log2(self.recommended_loss_scale)
        ax.step(bins + shift, counts, where="post", color="tab:red", label=f"x 2^{int(shift)} (recommended)")
        used = np.nonzero(counts)[0]
        if used.size:
            ax.set_xlim(bins[used[0]] - 4, max(bins[used[-1]] + shift, math.log2(FLOAT16_MAX)) + 4)
        ax.set_yscale("symlog")
        ax.set_xlabel("log2 |gradient|")
        ax.set_ylabel("values")
        ax.set_title(f"weight gradients of {len(self.layers)} layers over {self.steps} float32 steps")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path


def _names(names, most=6):
    """A list of layer names as Python writes it, its first `most` where longer, with how many it holds."""
    if len(names) <= most:
        return repr(list(names))
    return f"[{', '.join(map(repr, names[:most]))}, ... {len(names)} in all]"
