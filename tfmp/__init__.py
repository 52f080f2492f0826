"""tfmp: mixed-precision training for Keras 3 / TensorFlow that is correct under tf.distribute."""

from tfmp.distribute import BatchPlan, get_strategy, plan_batch
from tfmp.errors import UsageError
from tfmp.heads import ClassificationHead, audit, classification_head
from tfmp.loss_scale import LossScaleOptimizer, wrap_optimizer
from tfmp.precision import configure_precision
from tfmp.seed import set_seed

__all__ = [
    "BatchPlan",
    "ClassificationHead",
    "LossScaleOptimizer",
    "UsageError",
    "audit",
    "classification_head",
    "configure_precision",
    "get_strategy",
    "plan_batch",
    "set_seed",
    "wrap_optimizer",
]
