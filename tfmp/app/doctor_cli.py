"""`python -m tfmp.doctor` for the bundled models (see `tfmp.doctor` for the library).

python -m tfmp.doctor --model=transformer --policy=mixed_float16   # per-layer float16 report
python -m tfmp.doctor --parity --model=lstm --seeds=3               # float32 vs mixed accuracy
"""

import os
import tempfile

import keras
from absl import app, flags

from tfmp import bf16, cli, data, doctor, files, float8, precision
from tfmp.app import models, training

FLAGS = flags.FLAGS


def define_flags():
    flags.DEFINE_string("model", "cnn", "A bundled model: cnn, resnet, lstm, transformer.")
    flags.DEFINE_string("dataset", None, "Dataset (default: the shipped sample for the model's input kind).")
    flags.DEFINE_string("data_dir", None, "Where TFDS looks for prepared datasets.")
    flags.DEFINE_enum(
        "policy",
        "mixed_float16",
        ["mixed_float16", "mixed_bfloat16", "float8", "bfloat16"],
        "The policy the model is built under (float8: bfloat16 with float8 matmuls; bfloat16: weights and "
        "optimizer state in bfloat16, updates rounded by --bf16_rounding).",
    )
    flags.DEFINE_enum("bf16_rounding", "kahan", list(bf16.ROUNDINGS), "Under --policy=bfloat16: see train.py.")
    flags.DEFINE_string(
        "baseline", None, "The policy --parity compares --policy with (default: float32; mixed_bfloat16 for float8)."
    )
    flags.DEFINE_integer("steps", 8, "float32 training steps the diagnosis measures.")
    flags.DEFINE_integer("batch_size", 128, "Global batch size.")
    flags.DEFINE_string("output_dir", "doctor_out", "Where diagnosis.json, gradients.png (or parity.json) go.")
    flags.DEFINE_bool("parity", False, "Compare test accuracy of float32 and --policy over --seeds seeds instead.")
    flags.DEFINE_integer("seeds", 3, "Seeds per policy for --parity.")
    flags.DEFINE_integer("epochs", 2, "Epochs per --parity run.")
    flags.DEFINE_integer("steps_per_epoch", None, "Steps per epoch for --parity runs (default: one pass).")
    flags.DEFINE_float("learning_rate", 1e-3, "Learning rate for --parity runs.")


def run_parity():
    def run(policy, seed):
        with tempfile.TemporaryDirectory() as model_dir, open(os.devnull, "w") as quiet:
            config = training.Config(
                model=FLAGS.model,
                dataset=FLAGS.dataset,
                data_dir=FLAGS.data_dir,
                precision=policy,
                epochs=FLAGS.epochs,
                steps_per_epoch=FLAGS.steps_per_epoch,
                batch_size=FLAGS.batch_size,
                learning_rate=FLAGS.learning_rate,
                seed=seed,
                bf16_rounding=FLAGS.bf16_rounding if policy == "bfloat16" else training.Config.bf16_rounding,
                deterministic=True,
                checkpoint_every=0,
                model_dir=model_dir,
                verbose=0,
            )
            accuracy = training.train_and_evaluate(config, out=quiet)["test_accuracy"]
        print(f"  {policy:15s} seed {seed}: test accuracy {accuracy:.4f}", flush=True)
        return accuracy

    baseline = FLAGS.baseline or ("mixed_bfloat16" if FLAGS.policy == "float8" else "float32")
    result = doctor.parity(run, FLAGS.seeds, (baseline, FLAGS.policy))
    for policy in result["policies"]:
        r = result[policy]
        print(f"{policy:15s} mean {r['mean']:.4f}  std {r['std']:.4f}  over seeds 0..{FLAGS.seeds - 1}")
    verdict = "within" if result["within_noise"] else "BEYOND"
    print(
        f"difference {result['difference']:+.4f}, standard error {result['noise']:.4f}: {verdict} the seed-to-seed "
        "noise (2 standard errors)"
    )
    if FLAGS.policy in ("float8", "bfloat16"):  # Their targets: within half a point of the baseline.
        close = abs(result["difference"]) <= 0.005
        verdict = "within" if close else "BEYOND"
        name = f"bfloat16 ({FLAGS.bf16_rounding})" if FLAGS.policy == "bfloat16" else FLAGS.policy
        print(f"{name} against {baseline}: {100 * result['difference']:+.2f} points, {verdict} 0.5 point")
    return result


def run_diagnosis():
    entry = models.MODELS[FLAGS.model]
    ds = data.load(
        FLAGS.dataset or models.DEFAULT_DATASETS[entry.kind],
        FLAGS.batch_size,
        FLAGS.data_dir,
        kind=entry.kind,
        repeat=True,
        drop_remainder=True,
    )
    # A few steps, to read the numbers: how fast the policy runs here is beside the point (no slowness warning).
    precision.apply_policy(precision.resolve_policy(FLAGS.policy)._replace(warning=None))
    model = models.build(FLAGS.model, ds)
    if precision.float8_enabled():
        float8.quantize(model)
    models.compile(model, keras.optimizers.Adam(1e-3))
    diagnosis = doctor.diagnose(model, ds.train, FLAGS.steps)
    print(diagnosis.table())
    return diagnosis


def main(argv):
    del argv

    with cli.user_errors("tfmp.doctor"):
        if FLAGS.model not in models.MODELS:
            raise cli.UsageError(f"unknown --model={FLAGS.model!r}; choose one of {', '.join(models.MODELS)}")
        os.makedirs(FLAGS.output_dir, exist_ok=True)
        if FLAGS.parity:
            result = run_parity()
            path = os.path.join(FLAGS.output_dir, "parity.json")
            files.write_json(path, result)
        else:
            json_path, png_path = run_diagnosis().save(FLAGS.output_dir)
            path = f"{json_path} and {png_path}"
        print(f"wrote {path}")


def run():
    """The command (`tfmp/doctor/__main__.py` has started quietly and defined the flags)."""
    app.run(main, flags_parser=cli.flags_parser("tfmp.doctor"))
