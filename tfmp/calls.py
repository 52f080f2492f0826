"""A traced step called for one iterator without `tf.function`'s work per call, and, where
`Steps` chooses it, on TensorFlow's single-threaded executor (`single_threaded`).

Calling a concrete function binds its arguments to its signature, flattens them, and
flattens its captured inputs again (300 variable handles for a 300-variable model), every
call. For one iterator none of that changes: `Direct` does it once, then hands the same
flat inputs to the traced function each step (deferred captures, which a strategy's
variables may have, are still read at each call, as TensorFlow reads them). On a
300-variable model's step of 2.5-7 ms (an Intel Xeon with AMX, 2 cores) that saves
0.25-0.6 ms a call, with XLA and without (DECISIONS.md).

An evaluation's step takes a batch, not an iterator: `OfBatches` calls it the same way, the
batch's tensors flattened at each call, the captures once (on the same model, an AMD EPYC
Zen 4: 1.3-1.9x `model.evaluate`'s speed, where the ordinary call gave 0.7-1.1x;
`tfmp.bench.micro.evaluation_costs`, BENCHMARKS.md).

The flattening goes through TensorFlow's own functions (present from TensorFlow 2.18 on).
Where they are missing or a gradient tape could record the call, `Direct` calls the
concrete function as usual; the bits are the same either way.
"""

import threading
import weakref

import tensorflow as tf
from absl import logging

from tfmp import tf_compat
from tfmp.errors import first_line

try:  # Private: how a concrete function flattens its arguments; absent, the ordinary call.
    from tensorflow.python.eager import record
    from tensorflow.python.eager.polymorphic_function import function_type_utils
except ImportError:  # pragma: no cover - a TensorFlow that moved them.
    record = function_type_utils = None

LET_GO = "tfmp-let-go"  # The threads that delete iterators (`let_go`).
SINGLE_THREADED = "SINGLE_THREADED_EXECUTOR"  # TensorFlow's executor for small graphs, one op after another.


def _flatten(value):
    return tf.nest.flatten(value, expand_composites=True)


def _flat_inputs(concrete, iterator):
    """What `concrete(iterator)` passes to its traced function, as (that function, the
    iterator's tensors, the captures: each flattened, or a callable to read at each call),
    or None where TensorFlow's own functions for it are missing."""
    inference = getattr(concrete, "_inference_function", None)
    captures = getattr(concrete, "_captured_inputs", None)
    if function_type_utils is None or captures is None or not hasattr(inference, "call_preflattened"):
        return None
    try:
        bound = function_type_utils.canonicalize_function_inputs((iterator,), {}, concrete.function_type)
        arguments = list(concrete.function_type.unpack_inputs(bound))
    except (TypeError, ValueError, AttributeError) as e:
        logging.info("the step is called through tf.function (%s)", e)
        return None
    return inference, arguments, [capture if callable(capture) else _flatten(capture) for capture in captures]


def of_iterator(step, *args):
    """`step(iterator, *args)` as a `tf.function` of the iterator alone, as `Direct` calls it.
    Traced as written (no AutoGraph, as Keras' own steps): its control flow is TensorFlow's."""
    return tf_compat.function(lambda iterator: step(iterator, *args), autograph=False)


class Direct:
    """`concrete(iterator)`, its inputs flattened once (see the module's docstring).

    The iterator and its flattened tensors are held in a list that only the call and a finalizer of it hold: when
    the call goes, by `let_go` or collected in a reference cycle (a `Steps` is one), that list is emptied on a
    thread of its own (the module's `let_go`), which then alone deletes the iterator (it may wait up to a minute).
    `call.let_go()` does so at once; the call is not to be made after it.

    Args:
        concrete: a concrete function of one argument, the iterator.
        iterator: the iterator every call passes.
    """

    def __init__(self, concrete, iterator):
        self.concrete = concrete
        self._inference = arguments = inputs = None
        flat = _flat_inputs(concrete, iterator)
        if flat is not None:
            inference, arguments, self._captures = flat
            self._deferred = any(callable(part) for part in self._captures)
            inputs = self._gather(arguments)
            if len(inputs) == len(inference.cached_definition.signature.input_arg):
                self._inference = inference
        # The iterator is kept so that its tensors stay alive and its id names no other.
        self._held = [_Held(iterator, arguments, inputs)]
        self.let_go = weakref.finalize(self, let_go, self._held)
        self.let_go.atexit = False  # At exit the interpreter deletes what is left, as it would anyway.

    def _gather(self, arguments):
        inputs = list(arguments)
        for part in self._captures:
            inputs.extend(_flatten(part()) if callable(part) else part)
        return inputs

    @property
    def direct(self):
        """Whether calls skip `tf.function`'s argument handling."""
        return self._inference is not None

    def arguments_are(self, tensors):
        """Whether `tensors` are, in order, the arguments the traced function takes (besides its captures)."""
        arguments = self._held[0].arguments
        if len(tensors) != len(arguments):
            return False
        return all(a is b for a, b in zip(tensors, arguments, strict=True))

    def with_arguments(self, tensors):
        """The traced function called on `tensors` (in the order `arguments_are` checked) and the captures."""
        held = self._held[0]
        captures = self._gather([]) if self._deferred else held.inputs[len(held.arguments) :]
        return self._inference.call_preflattened([*tensors, *captures])

    def __call__(self):
        held = self._held[0]
        if self._inference is None or record.could_possibly_record() or not tf.executing_eagerly():
            return self.concrete(held.iterator)
        return self._inference.call_preflattened(self._gather(held.arguments) if self._deferred else held.inputs)


class _Held:
    """What a `Direct` call holds of its iterator: the iterator, its tensors flattened, and with the captures."""

    __slots__ = ("iterator", "arguments", "inputs")

    def __init__(self, iterator, arguments, inputs):
        self.iterator, self.arguments, self.inputs = iterator, arguments, inputs


class OfBatches:
    """`function(batch)` for the batches of one `spec` (a dataset's element_spec), each call handing the batch's
    tensors and the captures flattened once to the function traced for the spec, as `Direct` does: the per-batch
    call of an evaluation skips tf.function's cache lookup, which hashes every captured variable. Where the spec
    is None, the first batch's flattening is not the traced function's own, or a tape could record the call, it
    calls `function(batch)`; the bits are the same either way."""

    def __init__(self, function, spec):
        self.function, self.spec, self._call = function, spec, None

    @property
    def direct(self):
        """Whether calls skip `tf.function`'s argument handling (known after the first call)."""
        return isinstance(self._call, Direct) and self._call.direct

    def __call__(self, batch):
        if self._call is None:
            self._call = self.function
            if self.spec is not None:
                direct = Direct(self.function.get_concrete_function(self.spec), batch)
                self._call = direct if direct.direct and direct.arguments_are(_flatten(batch)) else self.function
        if self._call is self.function or record.could_possibly_record() or not tf.executing_eagerly():
            return self.function(batch)
        return self._call.with_arguments(_flatten(batch))


def single_threaded(call):
    """(`call()` on TensorFlow's single-threaded executor, True); where that executor
    refuses the graph (before running anything), (`call()` on the default one, False)."""
    try:
        with tf.experimental.function_executor_type(SINGLE_THREADED):
            return call(), True
    except (tf.errors.FailedPreconditionError, tf.errors.UnimplementedError) as e:
        if "single-threaded executor" not in str(e).lower():
            raise
        logging.info("the single-threaded executor cannot run this step (%s)", first_line(e)[:200])
        return call(), False


def let_go(held):
    """Empties the list `held` (iterators, or what holds them) on a thread of its own, and returns at once.

    Deleting the iterator of a dataset that tf.data tunes (AUTOTUNE) joins its tuning thread, and that thread
    may first sleep out the rest of its optimization period, which doubles as the input is read, up to a
    minute: TensorFlow wakes it to end before it marks the iterator cancelled, and it sleeps again. On an AMD
    EPYC Zen 3 an iterator read for 3 s took 0-2.1 s to delete, one read for 25 s 16 s; Keras fit waits so at
    its end. Not a daemon thread: at exit Python waits for it, as it would for the iterators left then."""
    try:
        threading.Thread(target=held.clear, name=LET_GO).start()
    except RuntimeError:  # The interpreter is shutting down: no new thread.
        held.clear()


class LetGo:
    """`with LetGo(iterator) as held:` the list `[iterator]` for the block, then `let_go` of it, however the block
    ends: an error's traceback keeps the block's frame, whose `held` is then empty, not the iterator."""

    def __init__(self, iterator):
        self.held = [iterator]

    def __enter__(self):
        return self.held

    def __exit__(self, *error):
        let_go(self.held)


def let_go_of(kept):
    """Empties `kept`, a dict of `Direct` calls: each call's iterator on a thread of its own (`Direct.let_go`), the
    calls at once (so that their model can go)."""
    for call in kept.values():
        call.let_go()
    kept.clear()
