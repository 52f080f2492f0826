"""tfmp: mixed-precision training for Keras 3 / TensorFlow that is correct under tf.distribute."""

from tfmp.distribute import BatchPlan, get_strategy, plan_batch
from tfmp.errors import Preempted, TrainingError, UsageError
from tfmp.heads import ClassificationHead, audit, classification_head
from tfmp.loop import evaluate, fit
from tfmp.loss_scale import LossScaleOptimizer, wrap_optimizer
from tfmp.precision import configure_precision
from tfmp.seed import set_seed

__version__ = "0.2.0"

__all__ = [
    "BatchPlan",
    "ClassificationHead",
    "LossScaleOptimizer",
    "Preempted",
    "TrainingError",
    "UsageError",
    "__version__",
    "audit",
    "classification_head",
    "configure_precision",
    "evaluate",
    "fit",
    "get_strategy",
    "plan_batch",
    "set_seed",
    "wrap_optimizer",
]
