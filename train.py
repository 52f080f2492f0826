"""Train a bundled model under a mixed-precision policy and a tf.distribute strategy.

python train.py                                   # cnn on the shipped digits
python train.py --model=lstm                      # lstm on the shipped sentences
python train.py --model=resnet --dataset=cifar10 --precision=mixed_float16
python train.py --model=cnn --strategy=tpu --tpu=local
"""

import dataclasses
import sys

from absl import app, flags

from tfmp import cli

if __name__ == "__main__":
    cli.quiet_start(sys.argv, "train.py")  # Before TensorFlow loads: no C++ start-up lines unless -v is given.

from tfmp import distribute, precision  # noqa: E402
from tfmp.app import models, training  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_enum("model", "cnn", list(models.MODELS), "Model to train.")
flags.DEFINE_string(
    "dataset",
    None,
    "digits | sentiment (shipped samples) | synthetic | a TFDS "
    "name (mnist, cifar10, imdb_reviews, glue/sst2, ...) | a prepared TFDS "
    "directory. Default: digits for image models, sentiment for text models.",
)
flags.DEFINE_string("data_dir", None, "Where TFDS looks for prepared datasets.")
flags.DEFINE_bool("download", True, "Let TFDS download a registered dataset missing from --data_dir.")
flags.DEFINE_enum(
    "precision",
    "auto",
    [*precision.POLICIES, precision.AUTOTUNE],
    "Dtype policy. auto: from the hardware, with the reason; autotune: a short timed trial of each "
    "policy on this model, batch and strategy, cached in MODEL_DIR/autotune.json.",
)
flags.DEFINE_enum("strategy", "auto", list(distribute.STRATEGIES), "tf.distribute strategy.")
flags.DEFINE_string("tpu", None, "With --strategy=tpu: 'local' (Colab/TPU VM) or a TPU name/address.")
flags.DEFINE_integer("batch_size", 128, "GLOBAL batch size (summed over replicas).")
flags.DEFINE_integer("epochs", 3, "Training epochs.")
flags.DEFINE_integer("steps_per_epoch", None, "Steps per epoch (repeats the data); default one pass.")
flags.DEFINE_float("learning_rate", 1e-3, "Base learning rate (for --base_batch_size).")
flags.DEFINE_enum("lr_scaling", "none", list(distribute.LR_SCALING), "Scale the LR with the batch size.")
flags.DEFINE_integer("base_batch_size", None, "Batch size the base LR is tuned for (default: the batch size).")
flags.DEFINE_integer("seed", 0, "Seed for python, numpy, TensorFlow and Keras.")
flags.DEFINE_bool("deterministic", False, "Turn on TensorFlow op determinism.")
flags.DEFINE_string("model_dir", "runs/default", "Where metrics.json (and later checkpoints) go.")
flags.DEFINE_float("loss_scale_initial", 2.0**15, "Initial loss scale (mixed_float16 only).")
flags.DEFINE_integer("loss_scale_growth_steps", 2000, "Finite steps before the loss scale doubles.")
flags.DEFINE_integer("vocab_size", 20000, "Text models: vocabulary size.")
flags.DEFINE_integer("sequence_length", 64, "Text models: tokens per example.")
flags.DEFINE_bool("augment", False, "Random crop and flip (32x32 colour images).")
flags.DEFINE_integer("grad_accum_steps", 1, "Micro-batches accumulated per update (effective batch = batch x N).")
flags.DEFINE_float("clipnorm", None, "Clip the global norm of the all-reduced, unscaled gradients.")
flags.DEFINE_integer("steps_per_execution", 1, "Steps per compiled call; raise it on TPUs.")
flags.DEFINE_integer(
    "checkpoint_every",
    200,
    "Steps between checkpoints in MODEL_DIR/checkpoints (0: off). Rerunning the same command resumes from the latest.",
)
flags.DEFINE_integer("log_every", 10, "Steps between TensorBoard scalars in MODEL_DIR/tensorboard.")
flags.DEFINE_string("export_dir", None, "Write model.keras and saved_model/ here after training.")
flags.DEFINE_list(
    "keep_float32",
    [],
    "Layer names or regular expressions (full match), comma-separated, built in float32 under a mixed "
    "policy; e.g. what --diagnose recommends.",
)
flags.DEFINE_list(
    "float8_exclude",
    [],
    "Under --precision=float8: Dense / EinsumDense layers (names or full-match regular expressions) whose "
    "matmuls stay in bfloat16; e.g. what --diagnose recommends.",
)
flags.DEFINE_bool(
    "diagnose",
    False,
    "Instead of training: run the numerics doctor (8 float32 steps) and write its report, JSON and gradient "
    "histogram to MODEL_DIR/doctor.",
)
flags.DEFINE_enum(
    "jit_compile",
    "auto",
    ["auto", "autotune", "true", "false"],
    "XLA for each replica's forward and backward passes, under any strategy. auto: on GPUs and TPUs, off on "
    "CPUs (a rule); autotune: measure both ways before training and keep XLA only where it is clearly faster "
    "(recorded in --model_dir); a model XLA cannot compile trains without it.",
)
flags.DEFINE_float(
    "trial_seconds",
    None,
    "Seconds of alternating rounds in the precision trial of --precision=auto (on a bfloat16 CPU) or autotune "
    "(at most; default 45: a clear gap ends the rounds early).",
)
flags.DEFINE_enum(
    "resume",
    "auto",
    ["auto", "force"],
    "auto: resume MODEL_DIR's checkpoint only with the settings it was saved with (batch size, precision, seed, "
    "model, dataset, grad accumulation, replicas, steps per epoch); force: resume it anyway, giving up an exact "
    "resume (the input position is counted in this run's batches).",
)


def main(argv):
    del argv  # Stray arguments were refused by the flags parser.
    config = training.Config(
        **{f.name: FLAGS[f.name].value for f in dataclasses.fields(training.Config) if f.name in FLAGS}
    )
    with cli.user_errors("train.py"), cli.sigterm_exits_75(config.model_dir):
        training.train_and_evaluate(config)


if __name__ == "__main__":
    app.run(main, flags_parser=cli.flags_parser("train.py"))
