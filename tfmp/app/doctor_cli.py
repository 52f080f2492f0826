"""`python -m tfmp.doctor` for the bundled models (see `tfmp.doctor` for the library).

python -m tfmp.doctor --model=transformer --policy=mixed_float16   # per-layer float16 report
python -m tfmp.doctor --parity --model=lstm --seeds=3               # float32 vs mixed accuracy
"""

import os
import tempfile

import keras
from absl import flags

from tfmp import cli, data, doctor, files, float8, precision
from tfmp.app import models, training

FLAGS = flags.FLAGS


def run_parity():
    schedules = set()  # The learning-rate schedule the runs trained with, as their metrics say.

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
                lr_schedule=FLAGS.lr_schedule,
                seed=seed,
                bf16_rounding=FLAGS.bf16_rounding if policy == "bfloat16" else training.Config.bf16_rounding,
                deterministic=True,
                checkpoint_every=0,
                model_dir=model_dir,
                verbose=0,
            )
            metrics = training.train_and_evaluate(config, out=quiet)
        schedules.add(metrics["lr_schedule"])
        accuracy = metrics["test_accuracy"]
        print(f"  {policy:15s} seed {seed}: test accuracy {accuracy:.4f}", flush=True)
        return accuracy

    baseline = FLAGS.baseline or ("mixed_bfloat16" if FLAGS.policy == "float8" else "float32")
    result = doctor.parity(run, FLAGS.seeds, (baseline, FLAGS.policy))
    result["lr_schedule"] = ", ".join(sorted(schedules))
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
        os.makedirs(FLAGS.output_dir, exist_ok=True)
        if FLAGS.parity:
            result = run_parity()
            path = os.path.join(FLAGS.output_dir, "parity.json")
            files.write_json(path, result)
        else:
            json_path, png_path = run_diagnosis().save(FLAGS.output_dir)
            path = f"{json_path} and {png_path}"
        print(f"wrote {path}")
