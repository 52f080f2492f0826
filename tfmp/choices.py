"""The names tfmp's choices take, in a module that loads nothing: `train.py` defines its flags from them, so that
a wrong value, or `--help`, is answered before TensorFlow starts (5 s sooner on 2 CPU cores)."""

POLICIES = ("auto", "mixed_float16", "mixed_bfloat16", "float32", "float8", "bfloat16")  # tfmp.precision's.
AUTOTUNE = "autotune"  # Handled by tfmp.app.autotune: it needs the model and data.
ROUNDINGS = ("kahan", "stochastic", "nearest")  # How bfloat16 weights take a float32 update (tfmp.bf16).
STRATEGIES = ("auto", "default", "one_device", "mirrored", "multi_worker", "tpu")  # tfmp.distribute's.
LR_SCALING = ("none", "linear", "sqrt")  # How the learning rate follows the batch size.
LR_SCHEDULES = ("cosine", "constant")  # How the learning rate follows the step (tfmp.app.training).
