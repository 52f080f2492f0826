"""What `tfmp.fit` reads: datasets, per-worker callables, arrays, PyDatasets and generators, as
distributed streams."""

import inspect

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from tfmp import distribute, pydata, tf_compat
from tfmp.errors import UsageError, is_count

# Where a training stream's batches are prefetched to, 2 ahead, on one device (`Input.stream`): None (host memory:
# TensorFlow copies each batch to a GPU when its step runs, after the steps queued before it), or a device such as
# "/gpu:0" (not a second CPU: XLA's step on a CPU waits on its copy forever, DECISIONS.md). Off until a GPU
# measures it (`python -m tfmp.bench.gpu_report --input_on_device=tfmp`, BENCHMARKS.md). A OneDeviceStrategy on a
# GPU has it even where this is None: its own device, as its distributed dataset gives Keras fit.
PREFETCH_TO = None


def batch_dim(element_spec):
    """The static batch size of the data's elements, or None."""
    first = tf.nest.flatten(element_spec)[0]
    return first.shape[0] if first.shape.rank else None


class Input:
    """Training or validation input: how long an epoch is, and its distributed iterators.

    A dataset of known length (or any input with `steps` given) is read as one stream
    repeated without end, epoch after epoch, so that `position` (batches drawn) says
    exactly where a resumed run continues. A dataset of unknown length is read afresh
    each epoch until it runs out.
    """

    def __init__(self, data, strategy, steps, grad_accum_steps, name, training=True, class_weight=None):
        self.strategy, self.steps, self.name = strategy, steps, name
        self._weigh = None  # `class_weights`' map, applied to every element (a callable's too).
        self.replicas = strategy.num_replicas_in_sync
        self.fn = None if isinstance(data, tf.data.Dataset) else data
        self.data = data if self.fn is None else None
        self._given = self.data  # As given (a PyDataset's, or arrays': `pydata.again`), before any map of ours.
        self._maps = []  # Those maps, in turn.
        self._reads = None  # Batches read since the iterator began (a variable), where a read may end an update.
        self._count = None  # The map that counts them, among `_maps`.
        self._grad_accum_steps = grad_accum_steps
        self.period = steps  # Batches an epoch takes from the stream.
        steps_arg = "steps_per_epoch" if name == "data" else "validation_steps"
        if self.fn is not None:
            self._take_callable(data, class_weight, steps_arg)
        else:
            self._take_dataset(data, class_weight, training, steps_arg)
        # Training epochs of unknown length would end at different steps on different
        # workers; one evaluation pass is fine (the distributed iterator agrees on its end).
        if training and self.period is None and distribute.num_workers(strategy) > 1:
            raise UsageError(f"{name} has unknown length; several workers need steps_per_epoch to stay in step")

    def _take_callable(self, data, class_weight, steps_arg):
        """A callable input_context -> dataset: checked, and called once for its element spec."""
        name, steps = self.name, self.steps
        if not callable(data):
            raise UsageError(
                f"{name} must be a tf.data.Dataset, a callable input_context -> dataset, a "
                f"keras.utils.PyDataset or a generator, got {type(data).__name__} (arrays go as "
                "tfmp.fit(model, x, y) or (x, y) as data)"
            )
        if not steps:
            raise UsageError(f"{name} as a callable needs {steps_arg}")
        probe = data(tf.distribute.InputContext(1, 0, 1))
        if not isinstance(probe, tf.data.Dataset):
            raise UsageError(f"{name}(input_context) must return a tf.data.Dataset, got {type(probe).__name__}")
        if class_weight is not None:
            self._weigh = class_weights(class_weight, probe.element_spec)
            probe = probe.map(self._weigh)
        self.element_spec = probe.element_spec

    def _take_dataset(self, data, class_weight, training, steps_arg):
        """A dataset: our maps of it (class weights, its reads counted), an epoch's length, its batch checked."""
        name, strategy, steps, grad_accum_steps = self.name, self.strategy, self.steps, self._grad_accum_steps
        if class_weight is not None:
            self._maps.append(class_weights(class_weight, data.element_spec))
            data = self.data = data.map(self._maps[-1])
        cardinality = int(data.cardinality())
        if training and grad_accum_steps > 1 and cardinality == tf.data.UNKNOWN_CARDINALITY:
            # Its end may come within an update; the batches read then make none. One worker only (several
            # may each read all and keep a share), and not on a TPU, whose input may run on another host.
            if distribute.num_workers(strategy) == 1 and distribute.strategy_name(strategy) != "tpu":
                self._reads = tf_compat.host_variable(tf.constant(0, tf.int64))
                self._count = _counted(self._reads, data.element_spec)
                self._maps.append(self._count)
                data = self.data = data.map(self._maps[-1])
        self.element_spec = data.element_spec
        if cardinality == 0:
            raise UsageError(f"{name} is empty")
        if cardinality == tf.data.INFINITE_CARDINALITY and not steps:
            raise UsageError(f"{name} repeats without end: give {steps_arg}")
        if cardinality > 0 and not steps:
            self._whole_epochs(cardinality, steps_arg)
        batch = batch_dim(self.element_spec)
        if batch is not None:
            distribute.check_divides(batch, self.replicas, f"{name}'s global batch size")
        if distribute.strategy_name(strategy) == "tpu" and batch is None:
            raise UsageError(f"TPUs need static shapes: batch {name} with drop_remainder=True")

    def _whole_epochs(self, cardinality, steps_arg):
        """An epoch of the dataset's `cardinality` batches: its updates, whole ones of grad_accum_steps each."""
        name, grad_accum_steps = self.name, self._grad_accum_steps
        self.period = cardinality
        self.steps = cardinality // grad_accum_steps * grad_accum_steps
        if self.steps == 0:
            raise UsageError(
                f"{name} holds {cardinality} batches, fewer than grad_accum_steps={grad_accum_steps}; "
                f"the largest grad_accum_steps it fills is {cardinality} (or repeat the data and give "
                f"{steps_arg})"
            )
        if cardinality % grad_accum_steps:
            logging.warning(
                "%s holds %d batches and grad_accum_steps=%d makes an update of every %d: each epoch makes "
                "%d updates and leaves out its last %d batch(es), drawn and not trained on (a dataset that "
                "does not shuffle never trains on them). Give %s a number of batches that %d divides (arrays: "
                "another batch_size), or repeat it and give %s",
                name,
                cardinality,
                grad_accum_steps,
                grad_accum_steps,
                self.steps // grad_accum_steps,
                cardinality % grad_accum_steps,
                name,
                grad_accum_steps,
                steps_arg,
            )

    @property
    def global_batch(self):
        """Examples a batch (a callable's batches are per replica), or None where the shapes do not say."""
        batch = batch_dim(self.element_spec)
        return batch * self.replicas if batch is not None and self.fn is not None else batch

    @property
    def streamed(self):
        return self.period is not None

    @property
    def may_end(self):
        """Whether a read may find the input's end: each epoch of unknown length ends so, and a generator's
        stream (it runs once) within an epoch. (A dataset of the user's that repeating does not make endless,
        one made from a generator object, is not told apart: its reads go ungated, as the waits cost.)"""
        return not self.streamed or self.generator

    @property
    def read_alike(self):
        """Whether a new iterator reads the same batches in the same order (not a callable's, and no shuffle
        drawing a new order for each: `tf_compat.reorders`; or one of the dataset made again: `pydata.again`, where
        tfmp shuffled, or a generator's before its first update ran, `settle`), as `Run._fell_back` needs
        (`reread`)."""
        again = pydata.made_again(self._given) is not None
        return self.fn is None and (again or not self.generator and not tf_compat.reorders(self.data))

    def reread(self, epoch, done):
        """An iterator from `done` batches into `epoch`, reading there what this run's first iterator read (where
        `read_alike`): for the update XLA refused at its first step. What tfmp shuffled is made again, and a
        generator's dataset, from the batches it kept."""
        make = pydata.made_again(self._given)
        if make is not None:
            self.data = self._given = make()
            for fn in self._maps:
                self.data = self.data.map(fn)
        return self.stream(self.position(epoch, done)) if self.streamed else self.epoch(done)

    def replayable(self):
        """(the input's batches as the run's first iterator read them, a dataset not distributed; or None, and why
        not), for the NaN guard's replay of a failing batch: a new iterator of a pipeline that reshuffles each
        pass would read other batches, and one of a generator the generator's next ones (training's)."""
        if self.generator:  # (Made again, before its first update ran, it would start training's again.)
            return None, "a generator's batches are read once (a dataset, a PyDataset or arrays are not)"
        make = pydata.made_again(self._given)
        if self.fn is not None:
            ds = self.fn(tf.distribute.InputContext())
            ds = ds if self._weigh is None else ds.map(self._weigh)
        else:
            ds = make() if make is not None else self._given  # Made again: its orders drawn from the first.
            for fn in self._maps:
                ds = ds if fn is self._count else ds.map(fn)  # Class weights; not the read count's.
        if make is None and tf_compat.reorders(ds):
            return None, "a new iterator of this input draws another order (a shuffle that reshuffles each pass)"
        return ds, None

    def settle(self):
        """An update has run: a generator's batches are no longer kept to be read again (`pydata.settle`)."""
        pydata.settle(self._given)

    @property
    def generator(self):
        """Whether the input is a Python generator's batches (which run once)."""
        return pydata.runs_once(self._given)

    def _distribute(self, skip, repeat):
        if self._reads is not None:  # A new iterator: its reads count from 0, the skipped ones included.
            self._reads.assign(0)
        if self.fn is not None:
            # A callable that takes `skip` (global batches) skips by itself, cheaply (before
            # decoding); it then returns the whole remaining stream. Others get Dataset.skip.
            takes_skip = "skip" in inspect.signature(self.fn).parameters

            def dataset_fn(context):
                if takes_skip:
                    ds = self.fn(context, skip=skip)
                else:
                    per_pipeline = context.num_replicas_in_sync // context.num_input_pipelines
                    ds = self.fn(context)
                    ds = (ds.repeat() if repeat else ds).skip(skip * per_pipeline)
                return ds if self._weigh is None else ds.map(self._weigh)

            return self.strategy.distribute_datasets_from_function(dataset_fn)
        ds = (self.data.repeat() if repeat else self.data).skip(skip)
        if self.replicas > 1 or distribute.num_workers(self.strategy) > 1:
            return self.strategy.experimental_distribute_dataset(ds)  # Prefetched to each replica's device.
        return self._on_device(ds) if repeat else ds

    def _on_device(self, ds):
        """`ds` prefetched 2 batches ahead to `PREFETCH_TO`, or to a OneDeviceStrategy's GPU
        (`distribute.input_device`), where the reads ahead change nothing: an endless stream of numbers (no
        strings, ragged or sparse tensors) whose reads are not counted (`_reads`) and that no generator's end or
        PyDataset's epoch hooks follow."""
        device = PREFETCH_TO or distribute.input_device(self.strategy)
        if device is None or self._reads is not None or self.generator or pydata.has_hooks(self._given):
            return ds
        specs = tf.nest.flatten(ds.element_spec)
        if not all(type(s) is tf.TensorSpec and (s.dtype.is_floating or s.dtype.is_integer) for s in specs):
            return ds
        return ds.apply(tf.data.experimental.prefetch_to_device(device, buffer_size=2))

    def end_hooks_ran(self, epochs, timeout=pydata.END_HOOK_SECONDS):
        """Whether a PyDataset's `on_epoch_end` has run for every pass that `epochs` epochs
        of the stream make whole, waiting up to `timeout` seconds (`tfmp.pydata`)."""
        return self.period is None or pydata.end_hooks_ran(self._given, epochs * self.period, timeout)

    def position(self, epoch, done):
        """Batches drawn from the input's iterator when `done` of `epoch`'s are: the stream's since it began (all
        the epochs before), or the epoch's own where each epoch reads the input afresh."""
        return epoch * self.period + done if self.streamed else done

    def stream(self, position):
        """An iterator over the repeated input, `position` batches in."""
        return iter(self._distribute(position, repeat=True))

    def epoch(self, offset):
        """An iterator over one pass of the input, `offset` batches in."""
        return iter(self._distribute(offset, repeat=False))

    def say_left_out(self, epoch, position):
        """After the input ran out `position` batches into its iterator (see `position`; an epoch of unknown length,
        or a generator's stream within an epoch): warns, once a run, of the batches read past the last whole
        update, which made none (`grad_accum_steps`); as `tfmp.fit` leaves out an epoch's batches past its last
        whole update where the length is known."""
        left = 0 if self._reads is None else int(self._reads.numpy()) - position
        if left > 0:
            self._reads = None  # Said once; the count goes on unread.
            n, generator = self._grad_accum_steps, self.generator
            logging.warning(
                "%s ran out at epoch %d with %d batch(es) past its last whole update (grad_accum_steps=%d makes an "
                "update of every %d): read and left out, not trained on%s. Give %s a number of batches that %d "
                "divides%s",
                self.name,
                epoch + 1,
                left,
                n,
                n,
                "" if generator or self.streamed else " (and so in every epoch of this length)",
                self.name,
                n,
                "" if generator else ", or repeat it and give steps_per_epoch",
            )

    def once(self):
        """The input for one evaluation."""
        return self._distribute(0, repeat=False) if self.fn is not None else self.data


def _counted(reads, spec):
    """The `Dataset.map` function that adds one to `reads` (a variable) for each element read and passes it on."""

    def count(*element):
        with tf.control_dependencies([reads.assign_add(1)]):
            element = tf.nest.map_structure(tf.identity, element)
        return element if type(spec) is tuple else element[0]  # (Dataset.map unpacks plain tuples only.)

    return count


def class_weights(class_weight, element_spec):
    """The `Dataset.map` function that gives each `(x, y)` element the sample weights
    `class_weight[label]`, as `model.fit(class_weight=...)` does: labels are y's integers,
    or its argmax where y is one-hot (a last axis over 1); a class not in `class_weight`
    weighs 1. Raises UsageError for a mapping that is not {class index >= 0: weight >= 0},
    for elements that already hold sample weights, and for several outputs."""
    if not isinstance(class_weight, dict) or not class_weight:
        raise UsageError(f"class_weight must be a non-empty dict {{class index: weight}}, got {class_weight!r}")
    for key, weight in class_weight.items():
        if not is_count(key) or not isinstance(weight, int | float | np.number) or not 0 <= weight < np.inf:
            raise UsageError(f"class_weight maps class indices (>= 0) to finite weights >= 0; got {key!r}: {weight!r}")
    _, y, sample_weight = keras.utils.unpack_x_y_sample_weight(element_spec)
    if sample_weight is not None:
        raise UsageError("class_weight and sample weights in the data cannot both weigh the examples: give one")
    if y is None or tf.nest.is_nested(y):
        raise UsageError(
            "class_weight needs a single target y per element (one output); for several, put each output's "
            "sample weights in the data: (x, y, sample_weight) elements"
        )
    # One entry past the largest class: the weight (1) of any label above it.
    table = tf.constant([float(class_weight.get(c, 1.0)) for c in range(max(class_weight) + 2)], tf.float32)
    if y.shape.rank is None:
        raise UsageError("class_weight needs targets of known rank")
    rank, last = y.shape.rank, y.shape[-1] if y.shape.rank else None

    def weigh(*element):
        x, labels, _ = keras.utils.unpack_x_y_sample_weight(element)
        if rank >= 2 and last != 1:  # One-hot (or probabilities) over the last axis.
            classes = tf.argmax(labels, axis=-1, output_type=tf.int32)
        else:  # Class indices, with or without a last axis of 1.
            classes = tf.cast(tf.round(tf.squeeze(labels, -1) if rank >= 2 else labels), tf.int32)
        return x, labels, tf.gather(table, tf.clip_by_value(classes, 0, table.shape[0] - 1))

    return weigh
