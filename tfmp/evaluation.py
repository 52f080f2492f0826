"""tfmp.evaluate: a compiled model's loss and metrics, as `model.evaluate` gives them, under its strategy."""

import keras
import tensorflow as tf

from tfmp import arguments, data_check, fit_data, inputs, keras_compat, loop, tf_compat, xla
from tfmp import callbacks as tfmp_callbacks
from tfmp.errors import UsageError, is_count, usage_error_inside
from tfmp.run import evaluated_nothing, runs_once


def evaluate(
    model,
    data=None,
    y=None,
    *,
    x=None,
    batch_size=None,
    sample_weight=None,
    steps=None,
    callbacks=None,
    verbose="auto",
    return_dict=False,
    strategy=None,
    jit_compile=False,
):
    """The model's compiled loss and metrics over `data`, under its strategy.

    Args:
        model: a compiled Keras model.
        data: a `tf.data.Dataset` of global batches, or a callable `input_context ->
            dataset` (then `steps` is required); or arrays as `tfmp.fit` takes them:
            `x` here and `y` next, or a tuple `(x, y)` or `(x, y, sample_weight)`.
        y: the targets, where `data` is the arrays `x`.
        x: `data` by `model.evaluate`'s name; give one of the two.
        batch_size: the GLOBAL batch of arrays; default, as in `model.evaluate`: the arrays
            in `steps` batches where it is given, else 32.
        sample_weight: with arrays, each example's weight (as in `model.evaluate`).
        steps: batches to evaluate; default: all.
        callbacks: Keras callbacks, called as `model.evaluate` calls them (test begin, each
            batch with the running logs, end); one may end the pass early by setting
            `model.stop_evaluating`.
        verbose: "auto" or 1 (a progress bar, as in `model.evaluate`), 0 (silent) or 2.
        return_dict: return the results by name; default, as in `model.evaluate`, a list.
        strategy: default: the strategy the model was built under.
        jit_compile: run each replica's forward pass with XLA (True, False or "auto").

    Returns:
        As `model.evaluate`: the loss alone where the model has no metric, else a list of floats, the loss
        first and each metric in the model's order; with `return_dict=True`, a dict of them by name.
    """
    data = arguments.given_data(data, x, "tfmp.evaluate")
    strategy = arguments.strategy_for(model, strategy, "tfmp.evaluate")
    tf_compat.own_collective_keys(strategy)
    if not getattr(model, "compiled", False):
        raise UsageError("tfmp.evaluate needs a compiled model: call model.compile(optimizer, loss, metrics) first")
    arguments.refuse_own_step(model, "test_step", "tfmp.evaluate", "evaluate it with model.evaluate")
    xla.check(jit_compile)
    arguments.check_verbose(verbose)
    if steps is not None and not is_count(steps, 0):  # 0, as None: every batch (model.evaluate's).
        raise UsageError(f"steps must be None or an integer >= 0, got {steps!r}")
    data, _ = fit_data.datasets(
        data,
        y,
        strategy=strategy,
        sample_weight=sample_weight,
        batch_size=batch_size,
        training=False,
        steps=steps,
        targets=data_check.needs_targets(model),
    )
    source = inputs.Input(data, strategy, steps, 1, "data", training=False)
    compiled = loop.prepare(model, strategy, source.element_spec, evaluating=True)
    # A refusal at the first batch evaluates that batch again without XLA.
    xla.resolve(compiled, source.element_spec, jit_compile, per_replica=source.fn is not None, refuses_late=True)
    callbacks = keras.callbacks.CallbackList(
        arguments.callback_list(callbacks),
        add_progbar=verbose != 0,
        verbose=verbose,
        epochs=1,
        steps=source.steps,
        model=model,
    )
    callbacks.on_test_begin()
    batch_logs = tfmp_callbacks.overrides(callbacks.callbacks, "on_test_batch_end", keras.callbacks.History)
    try:
        logs = compiled.evaluate(source.once(), steps, callbacks, batch_logs)
    except tf.errors.InvalidArgumentError as e:  # (As is a UsageError raised in the input pipeline.)
        raise usage_error_inside(e) or e  # noqa: B904 - e itself, or the UsageError it carries (caused by e).
    if evaluated_nothing(model):
        raise UsageError(f"data gave no batch to evaluate ({runs_once('steps')})")
    callbacks.on_test_end(logs)
    return logs if return_dict else keras_compat.results_in_order(model, logs)
