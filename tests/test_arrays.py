"""tfmp.fit and tfmp.evaluate on arrays, as model.fit takes them: x and y (and sample
weights), batch_size, shuffle, validation_split; the same weights as model.fit where the
order is the same, a shuffle that a resumed run repeats, and clear errors."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import assert_same, autoencoder, regression, regression_arrays, regression_data, weights

import tfmp
from tfmp import fit_data
from tfmp.errors import UsageError

arrays = regression_arrays  # The examples of conftest's regression_data, unbatched.


def test_arrays_train_as_model_fit_does_with_a_validation_split():
    """Unshuffled, the batches are model.fit's: the same weights, and the same held-out last
    quarter for validation (its loss the same each epoch)."""
    x, y = arrays()
    theirs = regression()
    keras_history = theirs.fit(x, y, batch_size=16, epochs=2, shuffle=False, validation_split=0.25, verbose=0)
    ours = regression()
    history = tfmp.fit(ours, x, y, batch_size=16, epochs=2, shuffle=False, validation_split=0.25, verbose=0)
    assert_same(weights(ours), weights(theirs))
    assert set(history.history) == set(keras_history.history) == {"loss", "mae", "val_loss", "val_mae"}
    for key, values in keras_history.history.items():
        np.testing.assert_allclose(history.history[key], values, rtol=1e-5)
    assert int(ours.optimizer.iterations.numpy()) == 2 * 12  # 192 training examples in batches of 16.


def test_x_by_keras_name_is_the_data():
    """`tfmp.fit(model, x=x, y=y)` and `tfmp.evaluate(model, x=x, y=y)`, as model.fit and
    model.evaluate are called: the same as the data given first."""
    x, y = arrays()
    theirs, ours = regression(), regression()
    theirs.fit(x=x, y=y, batch_size=16, shuffle=False, verbose=0)
    tfmp.fit(ours, x=x, y=y, batch_size=16, shuffle=False, verbose=0)
    assert_same(weights(ours), weights(theirs))
    expected = theirs.evaluate(x=x, y=y, verbose=0, return_dict=True)
    assert tfmp.evaluate(theirs, x=x, y=y, return_dict=True) == pytest.approx(expected, rel=1e-5)
    with pytest.raises(UsageError, match="tfmp.evaluate got data and x="):
        tfmp.evaluate(theirs, x, x=x)
    with pytest.raises(UsageError, match="tfmp.fit needs data"):
        tfmp.fit(theirs, y=y)


def test_the_shuffle_is_set_by_the_seed_and_a_resumed_run_repeats_it(tmp_path):
    x, y = arrays()
    run = {"batch_size": 32, "epochs": 3, "verbose": 0}
    straight = regression()  # (Seeds 0 as it builds.)
    tfmp.fit(straight, x, y, **run)
    again = regression()
    tfmp.fit(again, x, y, **run)
    assert_same(weights(again), weights(straight), atol=0)
    unshuffled = regression()
    tfmp.fit(unshuffled, x, y, shuffle=False, **run)
    assert max(np.abs(a - b).max() for a, b in zip(weights(unshuffled), weights(straight), strict=True)) > 1e-4
    other_seed = regression()
    tfmp.set_seed(1)
    tfmp.fit(other_seed, x, y, **run)
    assert max(np.abs(a - b).max() for a, b in zip(weights(other_seed), weights(straight), strict=True)) > 1e-4
    halves = regression()  # Stopped after the first epoch, then resumed: the orders go on.
    tfmp.fit(halves, x, y, **{**run, "epochs": 1}, checkpoint_dir=str(tmp_path))
    tfmp.fit(halves, x, y, **run, checkpoint_dir=str(tmp_path))
    assert_same(weights(halves), weights(straight), atol=0)


@pytest.mark.parametrize("drop_remainder", [False, True])
def test_shuffle_batch_keeps_each_batchs_examples_and_shuffles_within_it(drop_remainder):
    """shuffle="batch", as model.fit takes it: batch k holds examples k*B .. k*B+B-1 every pass, in a new
    order each pass, the orders set by the seed."""
    x = np.arange(10, dtype="float32")[:, None]

    def passes(seed, count=4):
        data = fit_data.from_arrays((x, x), 4, "batch", seed=seed, drop_remainder=drop_remainder)
        return [[b[0][:, 0].numpy().astype(int).tolist() for b in data] for _ in range(count)]

    orders = passes(0)
    whole = [[0, 1, 2, 3], [4, 5, 6, 7]] + ([] if drop_remainder else [[8, 9]])
    assert all([sorted(batch) for batch in order] == whole for order in orders), orders
    assert len({str(order) for order in orders}) > 1 and any(order != whole for order in orders), orders
    assert passes(0) == orders and passes(1) != orders


def test_tuples_dicts_sample_weights_and_two_replicas(mirrored):
    """(x, y, w) as data equals x, y with sample_weight=w (and model.fit's weights); a dict x
    names the inputs; two replicas train as one."""
    x, y = arrays()
    w = np.linspace(0.5, 1.5, len(x), dtype=np.float32)
    theirs = regression()
    theirs.fit(x, y, sample_weight=w, batch_size=32, shuffle=False, verbose=0)
    as_tuple, as_keywords = regression(), regression()
    tfmp.fit(as_tuple, (x, y, w), shuffle=False, verbose=0)  # batch_size: 32, as model.fit's.
    tfmp.fit(as_keywords, x, y, sample_weight=w, shuffle=False, verbose=0)
    assert_same(weights(as_tuple), weights(theirs))
    assert_same(weights(as_keywords), weights(theirs))
    two = regression(mirrored)
    tfmp.fit(two, x, y, sample_weight=w, shuffle=False, verbose=0)
    assert_same(weights(two), weights(theirs))
    inputs = keras.Input((8,), name="features")
    named = keras.Model({"features": inputs}, keras.layers.Dense(1)(inputs))
    named.compile("sgd", "mse")
    history = tfmp.fit(named, {"features": x}, y, verbose=0)
    assert np.isfinite(history.history["loss"][0])


def test_evaluate_and_validation_arrays_beside_a_dataset():
    x, y = arrays()
    model = regression()
    expected = model.evaluate(x, y, batch_size=64, verbose=0, return_dict=True)
    result = tfmp.evaluate(model, x, y, batch_size=64, return_dict=True)
    assert result.keys() == expected.keys()
    np.testing.assert_allclose([result[k] for k in expected], list(expected.values()), rtol=1e-5)
    weight = np.linspace(0.0, 2.0, len(x), dtype=np.float32)
    expected = model.evaluate(x, y, sample_weight=weight, verbose=0, return_dict=True)
    assert tfmp.evaluate(model, x, y, sample_weight=weight, return_dict=True) == pytest.approx(expected, rel=1e-5)
    history = tfmp.fit(model, regression_data(), validation_data=(x, y), verbose=0)
    np.testing.assert_allclose(history.history["val_loss"], [tfmp.evaluate(model, (x, y))[0]], rtol=1e-5)


def test_evaluate_returns_what_model_evaluate_returns():
    """Without return_dict, as model.evaluate: a list, the loss first and the metrics in
    the model's order (`loss, mae = ...` unpacks the same); the loss alone without metrics."""
    x, y = arrays()
    model = regression()
    expected = model.evaluate(x, y, verbose=0)
    result = tfmp.evaluate(model, x, y, verbose=0)
    assert isinstance(result, list) and len(result) == 2
    np.testing.assert_allclose(result, expected, rtol=1e-5)
    loss, mae = result
    assert loss == result[0] and mae == tfmp.evaluate(model, x, y, verbose=0, return_dict=True)["mae"]
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    expected = model.evaluate(x, y, verbose=0)
    assert isinstance(expected, float) and isinstance(tfmp.evaluate(model, x, y, verbose=0), float)
    assert tfmp.evaluate(model, x, y, verbose=0) == pytest.approx(expected, rel=1e-5)


def test_arrays_without_a_batch_size_are_batched_as_keras_batches_them():
    """As Keras: in steps_per_epoch batches where it is given (all the arrays an epoch),
    validation arrays at validation_batch_size, else in validation_steps batches, and
    tfmp.evaluate in `steps` batches: the same weights, validation losses and results."""
    x, y = arrays()
    kwargs = {"epochs": 2, "shuffle": False, "verbose": 0}
    for validation in ({"validation_steps": 1}, {"validation_batch_size": 48, "validation_steps": 1}):
        theirs = regression()
        expected = theirs.fit(
            x[:192], y[:192], steps_per_epoch=3, validation_data=(x[192:], y[192:]), **validation, **kwargs
        )
        ours = regression()
        history = tfmp.fit(
            ours, x[:192], y[:192], steps_per_epoch=3, validation_data=(x[192:], y[192:]), **validation, **kwargs
        )
        assert_same(weights(ours), weights(theirs), atol=0)  # Batches of 64: at 32, 0.01 apart.
        np.testing.assert_allclose(history.history["val_loss"], expected.history["val_loss"], rtol=1e-6)
        assert int(ours.optimizer.iterations.numpy()) == 6
    assert tfmp.evaluate(ours, x, y, steps=3, return_dict=True) == pytest.approx(
        theirs.evaluate(x, y, steps=3, verbose=0, return_dict=True), rel=1e-6
    )


class _Frame:
    """What tfmp reads of a pandas DataFrame or Series (pandas is not installed here): `__array__`, a shape."""

    def __init__(self, values):
        self.values, self.shape = values, values.shape

    def __array__(self, dtype=None, copy=None):
        return np.asarray(self.values, dtype=dtype)


def test_array_likes_train_as_their_numpy_arrays():
    x, y = arrays()
    theirs = regression()
    expected = theirs.fit(x, y, shuffle=False, validation_data=(x[:64], y[:64]), verbose=0)
    ours = regression()
    validation = (_Frame(x[:64]), _Frame(y[:64]))
    history = tfmp.fit(ours, _Frame(x), _Frame(y), shuffle=False, validation_data=validation, verbose=0)
    assert_same(weights(ours), weights(theirs), atol=0)
    assert history.history["val_loss"] == pytest.approx(expected.history["val_loss"], rel=1e-6)


def test_inputs_alone_train_a_model_whose_layers_add_its_loss():
    """model.fit(x) of a model with no compiled loss: the same weights and validation losses."""
    x, _ = arrays()
    theirs = autoencoder()
    expected = theirs.fit(x, epochs=2, shuffle=False, validation_split=0.25, verbose=0)
    ours = autoencoder()
    history = tfmp.fit(ours, x, epochs=2, shuffle=False, validation_split=0.25, verbose=0)
    assert_same(weights(ours), weights(theirs), atol=0)
    np.testing.assert_allclose(history.history["val_loss"], expected.history["val_loss"], rtol=1e-6)
    assert tfmp.evaluate(ours, x, return_dict=True) == pytest.approx(
        theirs.evaluate(x, verbose=0, return_dict=True), rel=1e-6
    )
    with pytest.raises(UsageError, match="sample_weight weighs the compiled loss"):
        tfmp.fit(ours, x, sample_weight=np.ones(len(x)), verbose=0)


@pytest.mark.parametrize(
    "args, kwargs, words",
    [
        ((arrays()[0],), {}, "data holds inputs only"),
        ((arrays() * 2,), {}, r"^data is a tuple of 4 arrays: give \(x, y\) or \(x, y, sample_weight\), x a tuple"),
        (arrays(), {"validation_split": 1.5}, r"validation_split must be in \[0, 1\)"),
        (arrays(), {"validation_split": 0.999}, "leaves no training or validation data"),
        (arrays(), {"validation_split": 0.2, "validation_data": arrays()}, "not both"),
        ((arrays()[0], arrays()[1][:10]), {}, r"same number \(> 0\) of examples; their lengths are \[10, 256\]"),
        (arrays(), {"batch_size": 0}, "batch_size must be an integer >= 1"),
        (arrays(), {"shuffle": "batches"}, 'shuffle must be True, False or "batch" \\(as in model.fit\\), got'),
        (
            arrays(),
            {"validation_split": 0.25, "validation_batch_size": 1.5},
            "validation_batch_size must be an integer",
        ),
        ((regression_data(),), {"validation_data": regression_data(), "validation_batch_size": 8}, "batch it yourself"),
        ((arrays() + (np.ones(256),),), {"sample_weight": np.ones(256)}, "sample_weight is given twice"),
        ((regression_data(),), {"batch_size": 32}, "batch_size= is for arrays, and data is a dataset: batch the"),
        ((regression_data(),), {"shuffle": True}, r"data.shuffle\(buffer"),
        ((regression_data(),), {"validation_split": 0.1}, "split the dataset"),
        ((regression_data(),), {"sample_weight": np.ones(256)}, r"\(x, y, sample_weight\) elements"),
        ((regression_data(), arrays()[1]), {}, "a dataset holds its targets"),
        (arrays(), {"x": 1}, "tfmp.fit got data and x=: give the data once"),
        ((arrays()[0], arrays()[1].tolist()), {}, "y holds Python numbers where arrays go"),
        ((arrays()[0].tolist(), arrays()[1]), {}, "data holds Python numbers where arrays go"),
        (arrays(), {"sample_weight": [1.0] * 256}, "sample_weight holds Python numbers"),
        (arrays(), {"strategy": "mirrored"}, r"^tfmp.fit: strategy takes a tf.distribute.Strategy, got str: make one"),
        (arrays(), {"checkpoint_dir": 3}, "^checkpoint_dir must be a directory's path, got int$"),
        (arrays(), {"steps_per_epoch": True}, "^steps_per_epoch must be None or an integer >= 1, got True$"),
    ],
)
def test_bad_arrays_and_array_arguments_beside_a_dataset(args, kwargs, words):
    with pytest.raises(UsageError, match=words):
        tfmp.fit(regression(), *args, verbose=0, **kwargs)


def test_a_bad_steps_per_execution_from_compile_is_named_as_compiles():
    model = regression()
    model.compile("sgd", "mse", steps_per_execution="auto")  # Keras 2's; Keras 3's fit fails on it in range().
    with pytest.raises(UsageError, match=r"^steps_per_execution .*, got 'auto' \(the model's compile gave it\)$"):
        tfmp.fit(model, *arrays(), verbose=0)


def test_evaluate_refuses_what_is_no_model_no_strategy_or_no_count_of_steps():
    for model, strategy, words in (("model", None, "takes a keras.Model, got str"), (regression(), 2, "got int")):
        with pytest.raises(UsageError, match=words):  # Not an AttributeError.
            tfmp.evaluate(model, *arrays(), strategy=strategy)
    with pytest.raises(UsageError, match=r"^steps must be None or an integer >= 0, got 2.5$"):  # Not TensorFlow's.
        tfmp.evaluate(regression(), *arrays(), steps=2.5)


def test_an_unknown_keyword_is_a_type_error_as_python_says():
    with pytest.raises(TypeError, match="unexpected keyword argument 'epoch'"):
        tfmp.fit(regression(), regression_data(), epoch=2)


class _Sum(keras.layers.Layer):
    def call(self, a, b=None):
        return a if b is None else a + b


def test_none_for_an_optional_input_trains_as_model_fit_takes_it():
    """`keras.Input(optional=True)` given None among the arrays: Keras 3.15's model.fit trains on it (3.10's fails
    at the None, so its fit here reads the same batches from a dataset), and tfmp.fit refused the dict ("y= is for
    arrays, and data is a dict")."""

    def model():
        keras.utils.set_random_seed(0)
        a, b = keras.Input((3,), name="a"), keras.Input((3,), name="b", optional=True)
        built = keras.Model({"a": a, "b": b}, keras.layers.Dense(1)(_Sum()(a, b)))
        built.compile(keras.optimizers.Adam(1e-2), "mse")
        return built

    rng = np.random.default_rng(0)
    x, y = {"a": rng.normal(size=(40, 3)).astype("float32"), "b": None}, rng.normal(size=(40, 1)).astype("float32")
    theirs, ours = model(), model()
    batches = [
        tf.data.Dataset.from_tensor_slices(({"a": x["a"][part], "b": None}, y[part])).batch(8)
        for part in (slice(None, 30), slice(30, None))
    ]
    expected = theirs.fit(batches[0], validation_data=batches[1], epochs=2, verbose=0)
    history = tfmp.fit(ours, x, y, batch_size=8, epochs=2, shuffle=False, validation_split=0.25, verbose=0)
    assert_same(weights(ours), weights(theirs), atol=0)
    np.testing.assert_allclose(history.history["val_loss"], expected.history["val_loss"], rtol=1e-6)
