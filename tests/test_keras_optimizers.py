"""The Keras optimizers' internals tfmp relies on (tfmp/keras_optimizers.py), a test per
behaviour: a Keras release that changes one of them fails here, by name."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmp import keras_optimizers


def test_slots_are_the_optimizers_own():
    variable = keras.Variable(np.ones(3, "float32"))
    adam = keras.optimizers.Adam(0.1)
    adam.apply([tf.constant([1.0, 2.0, 3.0])], [variable])
    m, v = keras_optimizers.slot(adam, "momentums", variable), keras_optimizers.slot(adam, "velocities", variable)
    np.testing.assert_allclose(np.asarray(m), [0.1, 0.2, 0.3], rtol=1e-6)  # (1 - beta_1) g.
    np.testing.assert_allclose(np.asarray(v), [0.001, 0.004, 0.009], rtol=1e-5)  # (1 - beta_2) g^2.
    sgd = keras.optimizers.SGD(0.1, momentum=0.9)
    sgd.apply([tf.constant([1.0, 1.0, 1.0])], [variable])
    np.testing.assert_allclose(np.asarray(keras_optimizers.slot(sgd, "momentums", variable)), [-0.1] * 3, rtol=1e-6)
    assert keras_optimizers.trained_variables(sgd) == [variable]


def test_reduced_applier_applies_to_the_shared_variables_without_all_reducing_or_changing_the_optimizer(mirrored):
    with mirrored.scope():
        variable = keras.Variable(np.ones(2, "float32"))
        sgd = keras.optimizers.SGD(0.5, momentum=0.9)
        sgd.build([variable])
    before = dict(vars(sgd))
    steps = []

    def update_step(gradient, var, learning_rate):
        steps.append(var.name)
        var.assign_sub(learning_rate * gradient)

    applier = keras_optimizers.reduced_applier(sgd, {id(sgd): (update_step, None)})

    def replica_apply():  # Each replica gives the already-summed gradient [2, 4].
        applier.apply([tf.constant([2.0, 4.0])], [variable])

    mirrored.run(tf.function(replica_apply))
    # Applied once per replica with the given gradient (Keras' own would sum to [4, 8]).
    for local in mirrored.experimental_local_results(variable.value):
        np.testing.assert_allclose(local.numpy(), [0.0, -1.0])
    assert steps and int(sgd.iterations.numpy()) == 1  # The shared iteration count moved on.
    assert dict(vars(sgd)) == before and "update_step" not in vars(sgd)  # The optimizer itself: untouched.
    wrapped = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    copied = keras_optimizers.reduced_applier(wrapped, None, "gradients_reduced")
    assert copied.inner_optimizer is not wrapped.inner_optimizer and copied.gradients_reduced is True
    assert (
        not hasattr(wrapped, "gradients_reduced")
        and copied.inner_optimizer.iterations is wrapped.inner_optimizer.iterations
    )


@pytest.mark.skipif(not hasattr(keras.optimizers, "MultiOptimizer"), reason="Keras before 3.15 has no MultiOptimizer")
def test_a_multi_optimizers_map_parts_copy_and_reduced_applier(mirrored):
    """optimizer_for and optimizer_groups follow its map, built or not; optimizer_parts are
    its optimizers; fresh_optimizer copies a map that is a function; the reduced applier
    copies each of its optimizers, none of them summing over replicas."""
    with mirrored.scope():
        kernel, bias = keras.Variable(np.ones(2, "float32"), name="kernel"), keras.Variable(np.ones(2, "float32"))
        sgd, adam = keras.optimizers.SGD(0.5), keras.optimizers.Adam()
        multi = keras.optimizers.MultiOptimizer(lambda v: sgd if "kernel" in v.path else adam)
        assert keras_optimizers.optimizer_for(multi, kernel) is sgd  # Unbuilt: its map.
        multi.build([kernel, bias])
    assert keras_optimizers.optimizer_groups(multi, [kernel, bias]) == [(sgd, [kernel]), (adam, [bias])]
    assert keras_optimizers.optimizer_groups(sgd, [kernel]) == [(sgd, [kernel])]
    wrapped = keras.optimizers.LossScaleOptimizer(multi)
    assert keras_optimizers.optimizer_parts(wrapped) == [sgd, adam] and keras_optimizers.optimizer_parts(sgd) == []
    assert keras_optimizers.learning_rate(wrapped) is None and keras_optimizers.learning_rate(sgd) is sgd.learning_rate
    fresh = keras_optimizers.fresh_optimizer(wrapped)
    fresh.build([kernel, bias])
    assert [type(o) for o in fresh.optimizers] == [keras.optimizers.SGD, keras.optimizers.Adam]
    assert not set(map(id, fresh.optimizers)) & {id(sgd), id(adam)}
    applier = keras_optimizers.reduced_applier(multi)
    assert applier.optimizers[0] is not sgd and applier.optimizers[0].iterations is sgd.iterations
    mirrored.run(tf.function(lambda: applier.apply([tf.constant([2.0, 4.0]), tf.constant([1.0, 1.0])], [kernel, bias])))
    for local in mirrored.experimental_local_results(kernel.value):
        np.testing.assert_allclose(local.numpy(), [0.0, -1.0])  # Keras' own would sum to [4, 8].
    assert multi.optimizers == [sgd, adam] and "_all_reduce_sum_gradients" not in vars(sgd)


def test_variable_index_decays_slots_of_and_with_slots():
    a, b = keras.Variable(np.ones(3, "float32"), name="a"), keras.Variable(np.ones(2, "float32"), name="b")
    adamw = keras.optimizers.AdamW(0.1, weight_decay=0.1)
    adamw.exclude_from_weight_decay(var_names=["b"])
    adamw.build([a, b])
    assert keras_optimizers.variable_index(adamw, b) == 1 and keras_optimizers.variable_index(adamw, b.value) == 1
    assert keras_optimizers.decays(adamw, a) and not keras_optimizers.decays(adamw, b)
    slots = keras_optimizers.slots_of(adamw, 1)
    assert set(slots) == {"_momentums", "_velocities"} and slots["_momentums"].shape == (2,)
    copy = keras_optimizers.with_slots(adamw, 1, {"_momentums": "stand-in"})
    assert copy._momentums[1] == "stand-in" and adamw._momentums[1] is slots["_momentums"]  # noqa: SLF001
    assert copy._get_variable_index(a) == 1  # noqa: SLF001
    assert set(keras_optimizers.slots_of(keras.optimizers.SGD(0.1), 0)) == set()  # No momentum: no slot.
