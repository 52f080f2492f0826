"""tfmp.data_check: data that does not fit the model is refused before anything runs, in words naming the input
and the argument (the data, validation_data), and what Keras' own model takes is taken."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import autoencoder, regression_arrays

import tfmp
from tfmp import data_check
from tfmp.errors import UsageError

ONE = tf.distribute.get_strategy


def test_build_for_checks_the_structure_against_the_model():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    wrong = tf.data.Dataset.from_tensor_slices((np.ones((4, 5), "float32"), np.ones((4, 1), "float32"))).batch(2)
    # The input by its place, not by the name Keras made up for it (keras_tensor_N).
    with pytest.raises(UsageError, match=r"^the model's input takes shape \(None, 3\) but the data gives \(None, 5\)$"):
        data_check.build_for(model, ONE(), wrong.element_spec)
    pair = [keras.Input((3,)), keras.Input((2,))]
    two = keras.Model(pair, keras.layers.Dense(1)(keras.layers.Concatenate()(pair)))
    two.compile("sgd", "mse")
    with pytest.raises(UsageError, match=r"^input 1 takes shape \(None, 2\) but the data gives \(None, 5\)$"):
        data_check.build_for(
            two,
            ONE(),
            tf.data.Dataset.from_tensor_slices(((np.ones((4, 3)), np.ones((4, 5))), np.ones(4))).batch(2).element_spec,
        )
    with pytest.raises(UsageError, match=r"^the model takes 2 input\(s\) but the data's elements hold 1"):
        data_check.build_for(two, ONE(), wrong.element_spec)
    unbatched = tf.data.Dataset.from_tensor_slices((np.ones((4, 3), "float32"), np.ones((4, 1), "float32")))
    with pytest.raises(UsageError, match=r"gives \(3,\); its elements are single examples: batch the dataset"):
        data_check.build_for(model, ONE(), unbatched.element_spec)
    no_targets = tf.data.Dataset.from_tensor_slices(np.ones((4, 3), "float32")).batch(2)
    with pytest.raises(UsageError, match="the data gives no targets"):
        data_check.build_for(model, ONE(), no_targets.element_spec)
    # Batched data of one axis too few (arrays of shape (4,)): no hint to batch what is batched already.
    flat = tf.data.Dataset.from_tensor_slices((np.ones(4, "float32"), np.ones((4, 1), "float32"))).batch(2)
    with pytest.raises(UsageError, match=r"gives \(None,\)$"):
        data_check.build_for(model, ONE(), flat.element_spec)
    words = tf.data.Dataset.from_tensor_slices((np.array(["a b"] * 4), np.ones((4, 1), "float32"))).batch(2)
    with pytest.raises(UsageError, match="takes float32 but the data gives string"):  # Keras: "Invalid dtype: str32".
        data_check.build_for(model, ONE(), words.element_spec)


def test_build_for_takes_what_a_keras_model_takes_and_checks_dict_inputs_too():
    """A Keras model adds or drops a last axis of 1 to make its input's rank (1-D values for `Input((1,))`, a
    pandas column say): model.fit trains on them, and tfmp refused them. Dict inputs get the same checks as a
    tuple's, where a string reached the step as "Cast string to float is not supported"."""

    def model(shape):
        inputs = keras.Input(shape, name="a")
        built = keras.Model({"a": inputs}, keras.layers.Dense(1)(keras.layers.Flatten()(inputs)))
        built.compile("sgd", "mse")
        return built

    def spec(x, named=False):
        x = {"a": x} if named else x
        return tf.data.Dataset.from_tensor_slices((x, np.ones((4, 1), "float32"))).batch(2).element_spec

    for shape, x in (((1,), np.ones(4, "float32")), ((3,), np.ones((4, 3, 1), "float32"))):
        for named in (False, True):
            data_check.build_for(model(shape), ONE(), spec(x, named))
    history = tfmp.fit(model((1,)), np.arange(8, dtype="float32"), np.ones((8, 1), "float32"), batch_size=4, verbose=0)
    assert np.isfinite(history.history["loss"][0])  # Trains, as under model.fit.
    with pytest.raises(UsageError, match=r"input 'a' takes shape \(None, 3\) but the data gives \(None,\)$"):
        data_check.build_for(model((3,)), ONE(), spec(np.ones(4, "float32"), named=True))
    with pytest.raises(UsageError, match="input 'a' takes float32 but the data gives string"):
        data_check.build_for(model((3,)), ONE(), spec(np.array([["x"] * 3] * 4), named=True))


def test_features_the_model_does_not_take_are_left_unread_as_model_fit_leaves_them(caplog):
    """A dataset with a feature no input takes (an id, a column for another model) trains as under model.fit,
    with a warning naming it; a feature missing is refused. Before, the extra one was refused too."""
    rng = np.random.default_rng(0)
    features = {"a": rng.normal(size=(32, 3)), "b": rng.normal(size=(32, 2)), "id": np.arange(32)}
    data = tf.data.Dataset.from_tensor_slices((features, rng.normal(size=(32, 1)))).batch(8)

    def model():
        keras.utils.set_random_seed(0)
        a, b = keras.Input((3,), name="a"), keras.Input((2,), name="b")
        built = keras.Model({"a": a, "b": b}, keras.layers.Dense(1)(keras.layers.Concatenate()([a, b])))
        built.compile(keras.optimizers.SGD(0.1), "mse")
        return built

    theirs, ours = model(), model()
    theirs.fit(data, epochs=2, verbose=0)
    with caplog.at_level("WARNING"):
        tfmp.fit(ours, data, epochs=2, verbose=0, jit_compile=False)
    assert "the data's ['id'] are none of the model's inputs ['a', 'b']: left unread" in caplog.text
    for mine, keras_own in zip(ours.weights, theirs.weights, strict=True):
        np.testing.assert_array_equal(mine.numpy(), keras_own.numpy())
    with pytest.raises(UsageError, match=r"the data's inputs are \['a', 'id'\] but the model takes \['a', 'b'\]"):
        tfmp.fit(model(), data.map(lambda x, y: ({"a": x["a"], "id": x["id"]}, y)), verbose=0)


def _ones(*shape):
    return np.ones(shape, "float32")


@pytest.mark.parametrize(
    "validation, words",
    [
        (
            (_ones(8, 5), _ones(8, 1)),
            r"^the model's input takes shape \(None, 3\) but validation_data gives \(None, 5\)",
        ),
        (_ones(8, 3), r"^validation_data holds inputs only: give the targets too, \(x_val, y_val\)$"),
        ([_ones(8, 3), _ones(8, 1), _ones(8), _ones(8)], r"^validation_data is a list of 4 arrays: give \(x, y\) or"),
        ([_ones(8, 3)], "^validation_data gives no targets, but the model was compiled with a loss"),
        (tf.data.Dataset.from_tensor_slices(_ones(8, 3)).batch(4), "^validation_data gives no targets"),
        (
            tf.data.Dataset.from_tensor_slices(((_ones(8, 3), _ones(8, 3)), _ones(8, 1))).batch(4),
            r"^the model takes 1 input\(s\) but validation_data's elements hold 2",
        ),
        (
            tf.data.Dataset.from_tensor_slices((_ones(8, 3), _ones(8, 1))),
            r"gives \(3,\); its elements are single examples: batch validation_data \(`.batch\(N\)`\)$",
        ),
    ],
)
def test_validation_data_the_model_cannot_take_is_refused_before_a_step(validation, words):
    """model.fit reads validation data first at the first epoch's end, after that epoch's training, and fails there
    in Keras' words ("None values not supported" for missing targets); tfmp.fit refused nothing of it up front."""
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    batches = []
    counted = keras.callbacks.LambdaCallback(on_train_batch_begin=lambda batch, logs: batches.append(batch))
    with pytest.raises(UsageError, match=words):
        tfmp.fit(model, _ones(16, 3), _ones(16, 1), validation_data=validation, callbacks=[counted], verbose=0)
    assert batches == []


def test_validation_inputs_alone_validate_a_model_whose_layers_add_its_loss():
    """`validation_data=x`, as model.fit takes it for a model with no compiled loss: the same validation losses
    (tfmp.fit refused the array as no dataset)."""
    x, _ = regression_arrays()
    theirs, ours = autoencoder(), autoencoder()
    expected = theirs.fit(x, validation_data=x[:64], epochs=2, shuffle=False, verbose=0)
    history = tfmp.fit(ours, x, validation_data=x[:64], epochs=2, shuffle=False, verbose=0, jit_compile=False)
    np.testing.assert_allclose(history.history["val_loss"], expected.history["val_loss"], rtol=1e-6)


def test_the_doctor_checks_its_data_as_tfmp_fit_does():
    """An unbatched dataset gave Keras' shape error from inside the model's call; a string for the model, "needs
    a compiled model"."""
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    unbatched = tf.data.Dataset.from_tensor_slices((np.ones((4, 3), "float32"), np.ones((4, 1), "float32")))
    for run in (tfmp.fit, tfmp.diagnose):
        with pytest.raises(UsageError, match=r"gives \(3,\); its elements are single examples: batch the dataset"):
            run(model, unbatched)
    with pytest.raises(UsageError, match="^diagnose takes a compiled Keras model, got str$"):
        tfmp.diagnose("model", unbatched)
