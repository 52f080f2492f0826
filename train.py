"""Train a bundled model under a mixed-precision policy and a tf.distribute strategy.

python train.py                                   # cnn on the shipped digits
python train.py --model=lstm                      # lstm on the shipped sentences
python train.py --model=resnet --dataset=cifar10 --precision=mixed_float16
python train.py --model=cnn --strategy=tpu --tpu=local
"""

import dataclasses
import sys

from absl import app, flags

from tfmp import choices, cli
from tfmp.app import config as settings  # Neither loads TensorFlow: a wrong flag or --help is answered at once.
from tfmp.app import models

FLAGS = flags.FLAGS
DEFAULT = settings.Config()  # Every flag's default is the Config field's: stated once, there.
flags.DEFINE_enum("model", DEFAULT.model, list(models.MODELS), "Model to train.")
flags.DEFINE_string(
    "dataset",
    DEFAULT.dataset,
    "digits | sentiment (shipped samples) | synthetic | a TFDS "
    "name (mnist, cifar10, imdb_reviews, glue/sst2, ...) | a prepared TFDS "
    "directory. Default: digits for image models, sentiment for text models.",
)
flags.DEFINE_string("data_dir", DEFAULT.data_dir, "Where TFDS looks for prepared datasets.")
flags.DEFINE_bool("download", DEFAULT.download, "Let TFDS download a registered dataset missing from --data_dir.")
flags.DEFINE_enum(
    "precision",
    DEFAULT.precision,
    [*choices.POLICIES, choices.AUTOTUNE],
    "Dtype policy. auto: from the hardware, with the reason; autotune: a short timed trial of each "
    "policy on this model, batch and strategy, cached in MODEL_DIR/autotune.json.",
)
flags.DEFINE_enum(
    "bf16_rounding",
    DEFAULT.bf16_rounding,
    list(choices.ROUNDINGS),
    "Under --precision=bfloat16 (weights and optimizer state in bfloat16, half the memory): how each float32 "
    "update is written back. kahan: a compensation buffer per weight (8 bytes a parameter with Adam); "
    "stochastic: seeded by --seed, the step and the variable (6 bytes); nearest: Keras' behaviour, small "
    "updates vanish.",
)
flags.DEFINE_enum("strategy", DEFAULT.strategy, list(choices.STRATEGIES), "tf.distribute strategy.")
flags.DEFINE_string("tpu", DEFAULT.tpu, "With --strategy=tpu: 'local' (Colab/TPU VM) or a TPU name/address.")
flags.DEFINE_integer("batch_size", DEFAULT.batch_size, "GLOBAL batch size (summed over replicas).")
flags.DEFINE_integer("epochs", DEFAULT.epochs, "Training epochs.")
flags.DEFINE_integer(
    "steps_per_epoch",
    DEFAULT.steps_per_epoch,
    "Updates per epoch, each of --grad_accum_steps global batches (repeats the data); default one pass.",
)
flags.DEFINE_float("learning_rate", DEFAULT.learning_rate, "Base learning rate (for --base_batch_size).")
flags.DEFINE_enum("lr_scaling", DEFAULT.lr_scaling, list(choices.LR_SCALING), "Scale the LR with the batch size.")
flags.DEFINE_enum(
    "lr_schedule",
    DEFAULT.lr_schedule,
    list(choices.LR_SCHEDULES),
    "cosine: the learning rate decays to 0 over the run's updates (--epochs x the updates of an epoch), so that "
    "the weights settle and BatchNormalization's moving statistics, which the test set is scored with, catch up "
    "with them; more --epochs on a finished run go on along the longer schedule. constant: no decay.",
)
flags.DEFINE_integer(
    "base_batch_size", DEFAULT.base_batch_size, "Batch size the base LR is tuned for (default: the batch size)."
)
flags.DEFINE_integer("seed", DEFAULT.seed, "Seed for python, numpy, TensorFlow and Keras.")
flags.DEFINE_bool("deterministic", DEFAULT.deterministic, "Turn on TensorFlow op determinism.")
flags.DEFINE_string("model_dir", DEFAULT.model_dir, "Where metrics.json (and later checkpoints) go.")
flags.DEFINE_float("loss_scale_initial", DEFAULT.loss_scale_initial, "Initial loss scale (mixed_float16 only).")
flags.DEFINE_integer(
    "loss_scale_growth_steps", DEFAULT.loss_scale_growth_steps, "Finite steps before the loss scale doubles."
)
flags.DEFINE_integer("vocab_size", DEFAULT.vocab_size, "Text models: vocabulary size.")
flags.DEFINE_integer("sequence_length", DEFAULT.sequence_length, "Text models: tokens per example.")
flags.DEFINE_bool("augment", DEFAULT.augment, "Random crop and flip (32x32 colour images).")
flags.DEFINE_integer(
    "grad_accum_steps", DEFAULT.grad_accum_steps, "Micro-batches accumulated per update (effective batch = batch x N)."
)
flags.DEFINE_float("clipnorm", DEFAULT.clipnorm, "Clip the global norm of the all-reduced, unscaled gradients.")
flags.DEFINE_integer("steps_per_execution", DEFAULT.steps_per_execution, "Updates per compiled call; raise it on TPUs.")
flags.DEFINE_integer(
    "checkpoint_every",
    DEFAULT.checkpoint_every,
    "Global batches between checkpoints in MODEL_DIR/checkpoints (0: off). Rerunning the same command resumes "
    "from the latest.",
)
flags.DEFINE_integer(
    "log_every", DEFAULT.log_every, "Global batches between TensorBoard scalars in MODEL_DIR/tensorboard."
)
flags.DEFINE_string("export_dir", DEFAULT.export_dir, "Write model.keras and saved_model/ here after training.")
flags.DEFINE_list(
    "keep_float32",
    list(DEFAULT.keep_float32),
    "Layer names or regular expressions (full match), comma-separated, built in float32 under a mixed "
    "policy; e.g. what --diagnose recommends.",
)
flags.DEFINE_list(
    "float8_exclude",
    list(DEFAULT.float8_exclude),
    "Under --precision=float8: Dense / EinsumDense layers (names or full-match regular expressions) whose "
    "matmuls stay in bfloat16; e.g. what --diagnose recommends.",
)
flags.DEFINE_bool(
    "diagnose",
    DEFAULT.diagnose,
    "Instead of training: run the numerics doctor (8 float32 steps) and write its report, JSON and gradient "
    "histogram to MODEL_DIR/doctor.",
)
flags.DEFINE_enum(
    "jit_compile",
    DEFAULT.jit_compile,
    list(settings.JIT_COMPILE),
    "XLA for the whole update (one computation on one device), under any strategy. auto: on GPUs and TPUs; on "
    "CPUs only where layers compute in float16, or in bfloat16 on a CPU without bfloat16 instructions (a rule); "
    "autotune: measure both ways before training and keep XLA only where it is clearly faster (recorded in "
    "--model_dir); a model XLA cannot compile trains without it; several workers must all decide alike.",
)
flags.DEFINE_float(
    "trial_seconds",
    DEFAULT.trial_seconds,
    "Seconds of alternating rounds in the precision trial of --precision=auto (on a bfloat16 CPU) or autotune "
    "(at most; default 45: a clear gap ends the rounds early).",
)
flags.DEFINE_enum(
    "resume",
    DEFAULT.resume,
    list(settings.RESUME),
    "auto: resume MODEL_DIR's checkpoint only with the settings it was saved with (batch size, precision, seed, "
    "model, dataset, grad accumulation, replicas, steps per epoch); force: resume it anyway, giving up an exact "
    "resume (the input position is counted in this run's batches).",
)


def main(argv):
    del argv  # Stray arguments were refused by the flags parser.
    from tfmp.app import training  # noqa: PLC0415 - TensorFlow loads here, once the flags are read.

    config = settings.Config(
        **{f.name: FLAGS[f.name].value for f in dataclasses.fields(settings.Config) if f.name in FLAGS}
    )
    with cli.user_errors("train.py"), cli.sigterm_exits_75(config.model_dir):
        training.train_and_evaluate(config)


def _quiet_main(argv):
    cli.quiet_start(sys.argv, "train.py")  # Before TensorFlow loads: no C++ start-up lines unless -v is given.
    main(argv)


if __name__ == "__main__":
    app.run(_quiet_main, flags_parser=cli.flags_parser("train.py"))
