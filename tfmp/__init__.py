"""tfmp: mixed-precision training for Keras 3 / TensorFlow that is correct under tf.distribute.

The public names load on first use, so that `import tfmp` is cheap and the command-line
entry points can silence TensorFlow's start-up before TensorFlow loads.
"""

from tfmp import lazy as _lazy
from tfmp import versions as _versions

__version__ = "0.2.0"

_versions.warn_outside_tested()  # Once: a module is imported once.

_EXPORTS = {
    "BatchPlan": "tfmp.distribute",
    "get_strategy": "tfmp.distribute",
    "plan_batch": "tfmp.distribute",
    "Interrupted": "tfmp.errors",
    "PeerLost": "tfmp.errors",
    "Preempted": "tfmp.errors",
    "TrainingError": "tfmp.errors",
    "UsageError": "tfmp.errors",
    "ClassificationHead": "tfmp.heads",
    "audit": "tfmp.heads",
    "classification_head": "tfmp.heads",
    "evaluate": "tfmp.evaluation",
    "fit": "tfmp.loop",
    "LossScaleOptimizer": "tfmp.loss_scale",
    "wrap_optimizer": "tfmp.loss_scale",
    "configure_precision": "tfmp.precision",
    "keep_float32": "tfmp.precision",
    "Diagnosis": "tfmp.doctor",
    "diagnose": "tfmp.doctor",
    "parity": "tfmp.doctor",
    "set_seed": "tfmp.seed",
}

_MODULES = ("float8",)  # tfmp.float8.quantize(model, exclude=...), tfmp.float8.is_state(variable).

__all__ = ["__version__", *sorted(_EXPORTS), *_MODULES]


# Where a `.keras` file's "tfmp>..." classes are defined: a model with tfmp's head, its loss-scale
# optimizer or pure bfloat16's initializer, or the bundled text models' vectorizer, reloads after `import tfmp`.
_SERIALIZABLE = ("tfmp.heads", "tfmp.loss_scale", "tfmp.bf16", "tfmp.data.pipeline")

__getattr__, __dir__ = _lazy.names(globals(), _EXPORTS, _MODULES, _SERIALIZABLE)
