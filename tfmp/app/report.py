"""What a run shows and leaves behind: the summary screen, metrics.json, training.png."""

import csv
import hashlib

import keras
import numpy as np

from tfmp import bf16, distribute


def summary(config, decision, strategy, plan, source, model, steps, start_step, batches, xla=(False, "off")):
    """The one-screen summary printed before training: `steps` updates an epoch, `batches` over every epoch,
    resumed after `start_step` of them; `xla` is (XLA on?, why)."""
    lines = [
        "=" * 72,
        f"model       {config.model} ({model.count_params():,} parameters)",
        f"dataset     {source.name} ({source.kind}, {source.num_classes} classes, "
        f"{source.train_size or '?'} train examples, eval on {source.test_split})",
        f"precision   {decision.policy} ({decision.reason.splitlines()[0]})",
        *decision.reason.splitlines()[1:],  # The trial table of autotune, if any.
        f"strategy    {distribute.strategy_name(strategy)} ({_count(strategy.num_replicas_in_sync, 'replica')}), "
        f"{_count(config.epochs, 'epoch')} x {_count(steps, 'update')}",
        f"schedule    {_schedule(config, steps)}",
        f"XLA         {'on' if xla[0] else 'off'} ({xla[1]})",
        f"memory      {bf16.bytes_per_parameter(model, model.optimizer):.1f} bytes a parameter (weights and "
        "optimizer state)"
        + (f", bfloat16 updates rounded: {config.bf16_rounding}" if bf16.holds_bfloat16(model) else ""),
        "batch",
        plan.table(),
        "=" * 72,
    ]
    if start_step:
        done = ": nothing left to train (more --epochs train on)" if start_step >= batches else ""
        lines.insert(-1, f"resumed     from batch {start_step} of {batches}{done}")
    if decision.warning:
        lines.insert(-1, f"WARNING     {decision.warning}")
    return "\n".join(lines)


def _schedule(config, steps):
    if config.lr_schedule == "constant":
        return "constant learning rate"
    return f"cosine: the learning rate decays to 0 over {_count(config.epochs * steps, 'update')}"


def _count(n, noun):
    return f"{n} {noun}" + ("" if n == 1 else "s")


class Summary(keras.callbacks.Callback):
    """Prints `summary` as training begins, with the XLA choice `tfmp.fit` made (its params)."""

    def __init__(self, say, *args):
        super().__init__()
        self.say, self.args = say, args

    def on_train_begin(self, logs=None):
        self.say(summary(*self.args, xla=(self.params["jit_compile"], self.params["jit_compile_reason"])))


def weights_fingerprint(model):
    """SHA-256 of every weight's bytes: equal exactly when two runs end with the same weights."""
    digest = hashlib.sha256()
    for weight in model.weights:
        digest.update(np.ascontiguousarray(weight.numpy()).tobytes())
    return digest.hexdigest()


def plot_history(history_csv, png_path):
    """Loss, accuracy and loss scale per step, from history.csv, into a PNG. Returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(history_csv, newline="") as f:
        rows = list(csv.DictReader(f))

    def column(key):
        return np.array([float(r[key]) if r[key] not in ("", "None") else np.nan for r in rows])

    steps = column("step")
    panels = [("loss", "loss"), ("accuracy", "accuracy"), ("loss_scale", "loss scale")]
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 7), sharex=True)
    for ax, (key, label) in zip(axes, panels, strict=True):
        values = column(key)
        ax.plot(steps, values, lw=1)
        ax.set_ylabel(label)
        if key == "loss_scale":
            if np.isfinite(values).any():
                ax.set_yscale("log", base=2)
            else:
                ax.text(0.5, 0.5, "no loss scale (not mixed_float16)", ha="center", va="center", transform=ax.transAxes)
    skipped = column("skipped_steps")
    if len(skipped) and np.nanmax(skipped) > 0:
        axes[-1].set_title(f"{int(np.nanmax(skipped))} skipped steps", fontsize=9)
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(png_path, dpi=90)
    plt.close(fig)
    return png_path
