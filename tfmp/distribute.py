"""Pick a tf.distribute strategy, and split a global batch and learning rate across it."""

import dataclasses
import glob
import json
import math
import os

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from tfmp import keras_compat, tf_compat
from tfmp.choices import LR_SCALING, STRATEGIES  # noqa: F401 - re-exported: named where TensorFlow need not load.
from tfmp.errors import UsageError, first_line


def _tf_config_workers():
    """Number of workers (chief included) that TF_CONFIG names; 0 without TF_CONFIG."""
    raw = os.environ.get("TF_CONFIG")
    if not raw:
        return 0
    try:
        config = json.loads(raw)
        cluster, task = config.get("cluster", {}), config.get("task", {})
    except (json.JSONDecodeError, AttributeError) as e:
        raise UsageError(f"TF_CONFIG is not valid JSON ({e}); see BUILD.md for its form") from e
    if not isinstance(cluster, dict) or not all(isinstance(v, list) for v in cluster.values()):
        raise UsageError('TF_CONFIG "cluster" must map task types to lists of host:port; see BUILD.md')
    workers = len(cluster.get("worker", [])) + len(cluster.get("chief", []))
    if workers > 1 or task:
        kind, index = task.get("type"), task.get("index", 0)
        if kind not in cluster or not isinstance(index, int) or not 0 <= index < len(cluster[kind]):
            names = ", ".join(f"{k} 0..{len(v) - 1}" for k, v in cluster.items())
            raise UsageError(f"TF_CONFIG task {kind}:{index} is not in its cluster ({names}); see BUILD.md")
    return workers


def _tpu_present():
    """Whether this host has a TPU: visible TPU devices, a TPU VM's /dev/accel0 or vfio
    devices, or the variables Colab and Cloud TPU set. Starts nothing."""
    if os.environ.get("COLAB_TPU_ADDR") or os.environ.get("TPU_NAME"):
        return True
    if os.path.exists("/dev/accel0") or glob.glob("/dev/vfio/[0-9]*"):
        return True
    return bool(tf.config.list_logical_devices("TPU"))


@dataclasses.dataclass(frozen=True)
class _Naming:
    """How refusals name the user's choices: train.py's flags, or tfmp.get_strategy's arguments (no flag there)."""

    flags: bool = False

    def strategy(self, name, tpu=None):
        if self.flags:
            return f"--strategy={name}" + (f" with --tpu={tpu}" if tpu else "")
        return f"tfmp.get_strategy({name!r}{f', tpu={tpu!r}' if tpu else ''})"

    def tpu(self, value):
        return f"--tpu={value}" if self.flags else f"tpu={value!r}"


def _no_tpu(address, why, asked, tpu, naming):  # Named as asked: auto picks a TPU given or found.
    if asked == "tpu":
        said, other = naming.strategy("tpu"), f"or pick {naming.strategy('auto')}"
    elif tpu:
        said, other = f"{naming.strategy('auto', tpu)} picks tpu", f"or leave {naming.tpu(tpu)} out"
    else:
        said = f"{naming.strategy('auto')} picks tpu on a host that shows one"
        other = f"or pick {naming.strategy('default')}"
    return UsageError(
        f"{said}: no TPU found at tpu={address!r} ({why}); on a Colab or Cloud TPU VM use {naming.tpu('local')}, "
        f"else {naming.tpu('NAME_OR_GRPC_ADDRESS')}, {other}"
    )


def _tpu_strategy(tpu, asked, naming):
    address = tpu or "local"
    if address == "local" and not _tpu_present():
        # Said at once, without TensorFlow's TPU start: that clears the process's eager caches and collects its
        # garbage before it finds no TPU, a cost that grows with what the process holds (a notebook's, a test run's).
        shows = "this host shows no TPU device, /dev/accel0, /dev/vfio device, TPU_NAME or COLAB_TPU_ADDR"
        raise _no_tpu(address, shows, asked, tpu, naming)
    try:
        resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=address)
        if address != "local":
            tf.config.experimental_connect_to_cluster(resolver)
        tf.tpu.experimental.initialize_tpu_system(resolver)
    except Exception as e:  # noqa: BLE001 - a wrong name or address fails in many ways (URLError, ...).
        raise _no_tpu(address, first_line(e), asked, tpu, naming) from e
    return tf.distribute.TPUStrategy(resolver)


def _mirrored_strategy(naming):
    gpus = tf.config.list_logical_devices("GPU")
    cpus = tf.config.list_logical_devices("CPU")
    strategy = None
    if gpus:
        strategy = tf.distribute.MirroredStrategy([d.name for d in gpus])
    elif len(cpus) > 1:
        # Logical CPU devices: how tests and laptops exercise a real multi-replica setup.
        strategy = tf.distribute.MirroredStrategy(
            [d.name for d in cpus], cross_device_ops=tf.distribute.ReductionToOneDevice()
        )
    if strategy:
        # A second MirroredStrategy in one process (a notebook that trains twice) would
        # reuse the first one's collective keys (tf_compat.own_collective_keys).
        tf_compat.own_collective_keys(strategy)
        return strategy
    raise UsageError(
        f"{naming.strategy('mirrored')} needs GPUs (or several logical CPU devices) and found "
        f"none; use {naming.strategy('default')} on one CPU"
    )


def get_strategy(name="auto", tpu=None, *, verbose=True, flags=False):
    """Returns a `tf.distribute.Strategy`; never None.

    Args:
        name: `auto` (TF_CONFIG with several workers -> multi_worker; else a TPU (or
            `tpu` given) -> tpu; else 2+ GPUs -> mirrored; else 1 GPU -> one_device; else default),
            `default`, `one_device`, `mirrored`, `multi_worker` (from TF_CONFIG), `tpu`.
        tpu: for `tpu` (and `auto`): "local" for a Colab or Cloud TPU VM, or a TPU
            name or grpc:// address.
        verbose: print `auto`'s choice and its reason on one line (absl's log, which has it
            too, is quiet by default outside an absl app; train.py prints it in its summary).
        flags: refusals name the choices as train.py's flags (`--strategy=mirrored`), not as arguments.

    Raises:
        UsageError: for an unknown name, or a strategy whose hardware is missing.
    """
    if name not in STRATEGIES:
        raise UsageError(f"unknown strategy {name!r}; choose one of {', '.join(STRATEGIES)}")
    asked, why = name, None
    if name == "auto":
        name, why = _auto_strategy(tpu)
        logging.info("Strategy auto -> %s (%s)", name, why)
    strategy = _make_strategy(name, tpu, asked, _Naming(flags))
    if verbose and why:  # Once made: a TPU that fails to start says so instead.
        print(f"tfmp: strategy {name} ({why})")
    return strategy


def _auto_strategy(tpu):
    """`auto`'s choice of strategy and why, in a few words. Devices are listed last: that starts TensorFlow's
    runtime, before which a multi-worker or TPU strategy must exist."""
    workers = _tf_config_workers()
    if workers > 1:
        return "multi_worker", f"TF_CONFIG names {workers} workers"
    if tpu:
        return "tpu", f"tpu={tpu!r} given"
    if _tpu_present():
        return "tpu", "a TPU found"
    gpus = tf.config.list_logical_devices("GPU")
    if len(gpus) > 1:
        return "mirrored", f"{len(gpus)} GPUs"
    if gpus:
        return "one_device", f"one GPU, {gpus[0].name}"
    return "default", "no GPU or TPU: one device, the CPU"


def _make_strategy(name, tpu, asked, naming):
    if name == "default":
        return tf.distribute.get_strategy()
    if name == "one_device":
        gpus = tf.config.list_logical_devices("GPU")
        return tf.distribute.OneDeviceStrategy(gpus[0].name if gpus else "/cpu:0")
    if name == "mirrored":
        return _mirrored_strategy(naming)
    if name == "multi_worker":
        if not _tf_config_workers():
            raise UsageError(
                f"{naming.strategy('multi_worker')} needs TF_CONFIG naming the cluster and this "
                "worker's task; see BUILD.md 'Several machines'"
            )
        tf_compat.broadcast_bfloat16_initial_values()  # bfloat16 weights, however the policy was set.
        return tf.distribute.MultiWorkerMirroredStrategy()
    return _tpu_strategy(tpu, asked, naming)


def strategy_name(strategy):
    """A short name for a strategy object, for summaries and metrics."""
    return {
        "_DefaultDistributionStrategy": "default",
        "OneDeviceStrategy": "one_device",
        "MirroredStrategy": "mirrored",
        "MultiWorkerMirroredStrategy": "multi_worker",
        "CollectiveAllReduceStrategy": "multi_worker",
        "TPUStrategy": "tpu",
    }.get(type(strategy).__name__, type(strategy).__name__)


def input_device(strategy):
    """The GPU of a OneDeviceStrategy on one, where its input goes ahead of the steps (its
    `experimental_distribute_dataset` prefetches there for Keras fit); else None (a CPU's is host memory)."""
    if not isinstance(strategy, tf.distribute.OneDeviceStrategy):
        return None
    device = tf.DeviceSpec.from_string(strategy.extended.worker_devices[0])
    return device.to_string() if device.device_type == "GPU" else None


def num_workers(strategy):
    """Worker processes (hosts) the strategy spans; 1 for single-process strategies."""
    return tf_compat.num_workers(strategy)


def worker_vote(strategy):
    """A function of a bool: whether it holds on any worker. Under several workers each call
    is a collective, which every worker must reach at the same point."""
    if num_workers(strategy) == 1:
        return bool

    @tf_compat.function(autograph=False)
    def votes(flag):
        return strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(lambda: tf.identity(flag)), axis=None)

    return lambda flag: float(votes(tf.constant(1.0 if flag else 0.0))) > 0


def is_chief(strategy):
    """Whether this process should write checkpoints, logs and metrics."""
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None or not resolver.cluster_spec().as_dict():
        return True
    task_type, task_id = resolver.task_type, resolver.task_id
    has_chief = "chief" in resolver.cluster_spec().as_dict()
    return task_type == "chief" or (not has_chief and task_type == "worker" and task_id == 0)


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """How one optimizer step's examples and learning rate split across replicas.

    Attributes:
        global_batch: examples per replica step, summed over all replicas.
        replicas: number of replicas in sync.
        per_replica: global_batch // replicas.
        workers: number of worker processes (hosts).
        per_worker: examples each worker's input pipeline yields per step.
        grad_accum_steps: micro-steps accumulated before each optimizer update.
        effective_batch: examples per optimizer update (global_batch * grad_accum_steps).
        base_learning_rate: the learning rate given for `base_batch`.
        base_batch: the batch size the base learning rate was tuned for.
        lr_scaling: `none`, `linear` or `sqrt`.
        learning_rate: the scaled learning rate used.
    """

    global_batch: int
    replicas: int
    per_replica: int
    workers: int
    per_worker: int
    grad_accum_steps: int
    effective_batch: int
    base_learning_rate: float
    base_batch: int
    lr_scaling: str
    learning_rate: float

    def table(self):
        """A small aligned text table, for logs."""
        rows = [
            ("replicas", self.replicas),
            ("workers (hosts)", self.workers),
            ("per-replica batch", self.per_replica),
            ("per-worker batch", self.per_worker),
            ("global batch", self.global_batch),
            ("grad accumulation steps", self.grad_accum_steps),
            ("effective batch per update", self.effective_batch),
            ("learning rate", f"{self.learning_rate:.6g} ({self._learning_rate_origin()})"),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)

    def _learning_rate_origin(self):
        if self.lr_scaling == "none":
            return "as given, not scaled with the batch"
        return f"{self.lr_scaling} scaling of {self.base_learning_rate:g} at batch {self.base_batch}"


def plan_batch(
    global_batch,
    replicas,
    learning_rate,
    lr_scaling="none",
    base_batch=None,
    grad_accum_steps=1,
    workers=1,
    batch_name="global batch size",
):
    """Checks the global batch against the replica count and scales the learning rate.

    Args:
        global_batch: examples per step over all replicas.
        replicas: `strategy.num_replicas_in_sync`.
        learning_rate: the base learning rate, tuned for `base_batch`.
        lr_scaling: `none`; `linear` (lr * effective/base); `sqrt` (lr * sqrt(effective/base)).
        base_batch: the batch size `learning_rate` was tuned for; defaults to the
            effective batch, i.e. no change.
        grad_accum_steps: micro-batches accumulated per update.
        workers: worker processes in the cluster.
        batch_name: what the user calls `global_batch` (a flag, say), for the refusals.

    Returns:
        A `BatchPlan`.

    Raises:
        UsageError: for a non-positive batch, a batch that does not divide by the
            replica count, or an unknown scaling rule.
    """
    if lr_scaling not in LR_SCALING:
        raise UsageError(f"unknown lr scaling {lr_scaling!r}; choose one of {', '.join(LR_SCALING)}")
    if global_batch < 1:
        raise UsageError(f"{batch_name} must be >= 1, got {global_batch}")
    if grad_accum_steps < 1:
        raise UsageError(f"grad_accum_steps must be >= 1, got {grad_accum_steps}")
    check_divides(global_batch, replicas, batch_name)
    effective = global_batch * grad_accum_steps
    base = base_batch or effective
    ratio = {"none": 1.0, "linear": effective / base, "sqrt": math.sqrt(effective / base)}[lr_scaling]
    return BatchPlan(
        global_batch=global_batch,
        replicas=replicas,
        per_replica=global_batch // replicas,
        workers=workers,
        per_worker=global_batch // workers,
        grad_accum_steps=grad_accum_steps,
        effective_batch=effective,
        base_learning_rate=learning_rate,
        base_batch=base,
        lr_scaling=lr_scaling,
        learning_rate=learning_rate * ratio,
    )


def check_divides(global_batch, replicas, what="global batch size"):
    """Raises a UsageError, with the nearest sizes that work, where `global_batch` does not
    divide by the `replicas`."""
    if global_batch % replicas:
        lower, upper = global_batch // replicas * replicas, (global_batch // replicas + 1) * replicas
        raise UsageError(
            f"{what}{'=' if what.startswith('--') else ' '}{global_batch} does not divide by the {replicas} replicas; "
            f"use a multiple of {replicas} such as {lower or upper} or {upper}"
        )


def batch_statistics(model):
    """The first layer of `model` that computes statistics over each replica's batch as it trains (a trainable
    BatchNormalization, not synchronized across replicas), or None. Over a batch of no example they are NaN."""
    return next(iter(_batch_statistics(model)), None)


def _batch_statistics(model):
    return [
        layer
        for layer in keras_compat.sublayers(model)
        if isinstance(layer, keras.layers.BatchNormalization) and layer.trainable and not layer.synchronized
    ]


def leaves_a_replica_none(examples, batch, strategy, statistics):
    """Whether the last batch of `examples` arrays, fewer than the replicas, would leave a replica none, where the layer
    `statistics` would make NaN of them (on that replica's copy of its moving statistics, the others' unaware).
    Keras fit trains to NaN so; tfmp leaves that batch out, saying so."""
    short, replicas = examples % batch, strategy.num_replicas_in_sync
    if statistics is None or not 0 < short < replicas:
        return False
    logging.warning(
        "the last batch of each epoch would hold %d of the %d examples for %d replicas: a replica would get none, "
        "and %s's statistics over no example are NaN; that batch is left out (other examples each epoch where "
        "shuffled; a batch_size that leaves no such remainder keeps them all)",
        short,
        examples,
        replicas,
        statistics.name,
    )
    return True


def starved_statistics(model, strategy):
    """Where a batch of fewer examples than replicas (a dataset's last, batched without drop_remainder) left a
    replica none: the first `batch_statistics` layer whose moving statistics are non-finite in a replica's copy
    (only that copy: each replica updates its own), as a cause to tell the user; None where none is, or on one
    replica."""
    if strategy.num_replicas_in_sync == 1:
        return None
    for layer in _batch_statistics(model):
        for variable in layer.non_trainable_weights:
            copies = strategy.experimental_local_results(variable.value)
            broken = [k for k, copy in enumerate(copies) if not np.isfinite(copy.numpy()).all()]
            if broken:
                return (
                    f"{layer.name}'s moving statistics are non-finite on replica {broken[0]}: if a batch held fewer "
                    f"examples than the {len(copies)} replicas (a dataset's last, batched without drop_remainder), "
                    "that replica got none, and its statistics over no example are NaN (batch with "
                    "drop_remainder=True, or so that no last batch is that small)"
                )
    return None
