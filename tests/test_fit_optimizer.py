"""tfmp.fit and the user's optimizer: tfmp's LossScaleOptimizer wherever float16 computes,
Keras' own replaced keeping its state, no lasting change to the optimizer, several
strategies in one process, and strategies without merge calls."""

import keras
import numpy as np
import pytest
import tensorflow as tf
import tiny
from conftest import assert_same, regression, regression_data, seeded, weights

import tfmp


def test_float16_layers_under_float32_policy_get_tfmp_loss_scaling():
    @seeded
    def half_model():
        inputs = keras.Input((8,))
        hidden = keras.layers.Dense(16, dtype="mixed_float16")(inputs)
        model = keras.Model(inputs, keras.layers.Dense(1, dtype="float32")(hidden))
        model.compile(keras.optimizers.Adam(1e-3), "mse")
        return model

    model = half_model()
    assert isinstance(tfmp.wrap_optimizer(keras.optimizers.Adam(), model=model), tfmp.LossScaleOptimizer)
    assert not isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)  # Keras' compile saw float32.
    tfmp.fit(model, regression_data(), verbose=0)
    assert isinstance(model.optimizer, tfmp.LossScaleOptimizer)


def test_keras_loss_scale_optimizer_in_compile_is_replaced_keeping_its_state():
    keras.config.set_dtype_policy("mixed_float16")
    model = regression()  # Keras' compile wrapped Adam in its own LossScaleOptimizer.
    assert type(model.optimizer) is keras.optimizers.LossScaleOptimizer
    inner = model.optimizer.inner_optimizer
    tfmp.fit(model, regression_data(), verbose=0)
    assert isinstance(model.optimizer, tfmp.LossScaleOptimizer) and model.optimizer.inner_optimizer is inner


def test_no_lasting_change_to_the_users_optimizer(mirrored):
    """After tfmp.fit the same optimizer still sums gradients over replicas in model.fit."""
    one, two = regression(), regression(mirrored)
    for model in (one, two):
        tfmp.fit(model, regression_data(), verbose=0)
        inner = getattr(model.optimizer, "inner_optimizer", model.optimizer)
        assert "_all_reduce_sum_gradients" not in vars(inner)
        model.fit(regression_data(), verbose=0)
    assert_same(weights(two), weights(one))


def test_several_strategies_one_after_another():
    """A notebook that trains twice: each tfmp.get_strategy("mirrored") gets its own
    collective keys, so loss-scaled training runs on both."""
    keras.config.set_dtype_policy("mixed_float16")
    results = []
    for _ in range(2):
        strategy = tfmp.get_strategy("mirrored")
        model = regression(strategy)
        results.append(tfmp.fit(model, regression_data(), verbose=0).history["loss"][0])
    assert np.isfinite(results).all()


def test_no_merge_call_branch_trains_like_one_replica(no_merge_call):
    """The branch XLA on GPUs and TPUs takes: the loss-scale cond updates the optimizer's
    iteration count, which TensorFlow would broadcast with a merge call that it refuses
    there; and Keras' LossScaleOptimizer from compile is replaced inside the strategy's scope
    (one made outside it hung the first step)."""
    keras.config.set_dtype_policy("mixed_float16")
    keras.utils.set_random_seed(0)  # A start of its own, not the generator earlier tests left.
    init = [w.numpy() for w in tiny.build(tf.distribute.get_strategy())[0].weights]
    one, _ = tiny.train(tf.distribute.get_strategy(), init, 4, 16)
    two, model = tiny.train(no_merge_call, init, 4, 16)
    assert_same(two, one, atol=1e-3)  # float16 compute.
    assert int(model.optimizer.iterations.numpy()) == 4
    # Keras' own wrapper from compile, replaced: 2**15 overflows float16 here at first, and
    # every skipped step halved the scale on both replicas.
    model = regression(no_merge_call)
    assert type(model.optimizer) is keras.optimizers.LossScaleOptimizer
    tfmp.fit(model, regression_data(), verbose=0, strategy=no_merge_call)
    applied = int(model.optimizer.iterations.numpy())
    assert 0 < applied < 8 and float(model.optimizer.dynamic_scale.numpy()) == 2.0 ** (15 - (8 - applied))
    assert all(np.isfinite(w).all() for w in weights(model))


@pytest.mark.parametrize("bad_replica", [0, 1])
def test_no_merge_call_overflow_on_one_replica_skips_everywhere(no_merge_call, bad_replica):
    keras.config.set_dtype_policy("mixed_float16")
    model, optimizer = tiny.build(no_merge_call)
    data = tiny.dataset(16).train
    tfmp.fit(model, data, steps_per_epoch=1, verbose=0)
    before = weights(model)
    model.get_layer("inject").bad_replica.assign(bad_replica)
    tfmp.fit(model, data, steps_per_epoch=1, verbose=0)
    assert_same(weights(model), before, atol=0)
    assert int(optimizer.iterations.numpy()) == 1 and float(optimizer.dynamic_scale.numpy()) == 2.0**7


def _by_kind(variable):
    """Adam for kernels, SGD with momentum for biases: a MultiOptimizer's map."""
    if "kernel" in variable.path:
        return keras.optimizers.Adam(1e-2)
    return keras.optimizers.SGD(0.05, momentum=0.5)


@seeded
def _two_optimizers():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
    model.compile(keras.optimizers.MultiOptimizer(_by_kind), "mse", jit_compile=False)
    return model


@pytest.mark.skipif(not hasattr(keras.optimizers, "MultiOptimizer"), reason="Keras before 3.15 has no MultiOptimizer")
@pytest.mark.parametrize("policy", ["float32", "mixed_float16"])
def test_a_multi_optimizer_trains_as_model_fit_does_resumes_and_is_diagnosed(mirrored, policy, tmp_path):
    """Each optimizer updates its own variables as under model.fit (to the bit on one
    device in float32); its state, which tf.train does not reach from the MultiOptimizer,
    resumes: the same weights as without the break."""
    keras.config.set_dtype_policy(policy)
    expected = _two_optimizers()
    expected.fit(regression_data(), epochs=2, verbose=0)
    ours = _two_optimizers()
    tfmp.fit(ours, regression_data(), epochs=2, verbose=0, log_dir=str(tmp_path / "logs"))
    assert_same(weights(ours), weights(expected), atol=0 if policy == "float32" else 5e-3)  # float16's rounding.
    two = _two_optimizers(mirrored)
    tfmp.fit(two, regression_data(), epochs=2, verbose=0)
    if policy == "float32":  # (In float16 two replicas, with half the batch each, overflow at other steps.)
        assert_same(weights(two), weights(expected))
    assert all(np.isfinite(w).all() for w in weights(two))
    resumed = _two_optimizers()
    tfmp.fit(resumed, regression_data(), epochs=1, verbose=0, checkpoint_dir=str(tmp_path / "run"))
    resumed = _two_optimizers()
    tfmp.fit(resumed, regression_data(), epochs=2, verbose=0, checkpoint_dir=str(tmp_path / "run"))
    assert_same(weights(resumed), weights(ours), atol=0)
    assert tfmp.diagnose(_two_optimizers(), regression_data()).layers  # Its map is a function: no config holds it.


@pytest.mark.skipif(not hasattr(keras.optimizers, "ScheduleFreeAdamW"), reason="Keras before 3.14")
def test_an_optimizer_that_starts_from_the_weights_starts_there():
    """ScheduleFreeAdamW's build copies the weights into its `momentum`: tfmp builds it
    before tracing, so the copy happens (in model.fit's trace it is lost, and the first
    step moves every weight to about -lr); against model.fit of an optimizer built first."""

    @seeded
    def schedule_free():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4), keras.layers.Dense(1)])
        model.compile(keras.optimizers.ScheduleFreeAdamW(1e-2), "mse", jit_compile=False)
        return model

    expected = schedule_free()
    expected.optimizer.build(expected.trainable_variables)
    expected.fit(regression_data(), verbose=0)
    ours = schedule_free()
    tfmp.fit(ours, regression_data(), verbose=0)
    assert_same(weights(ours), weights(expected), atol=0)


def _keras_options(options):
    @seeded
    def build():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
        model.compile(keras.optimizers.Adam(1e-2, **options), "mse", jit_compile=False)
        return model

    return build


@pytest.mark.parametrize("jit_compile", [False, True])
@pytest.mark.parametrize(
    "options", [{"gradient_accumulation_steps": 2}, {"use_ema": True, "ema_overwrite_frequency": 3}], ids=str
)
def test_an_optimizers_own_accumulation_and_average_overwrite_train_under_a_strategy(mirrored, options, jit_compile):
    """Keras runs these in a cond around the update, which under a strategy cannot hold the merge call that
    Keras' update makes (keras#20582): tfmp.fit's replicas update their own copies, so both train under a
    2-replica MirroredStrategy, with XLA or without, as on one device."""
    build = _keras_options(options)
    expected = build()
    expected.fit(regression_data(), epochs=2, verbose=0)
    two = build(mirrored)
    tfmp.fit(two, regression_data(), epochs=2, jit_compile=jit_compile, verbose=0)
    assert int(two.optimizer.iterations.numpy()) == int(expected.optimizer.iterations.numpy())
    assert_same(weights(two), weights(expected), atol=1e-6)


def test_an_optimizers_own_clipping_sees_the_all_reduced_gradients(mirrored):
    """Keras' optimizer clips (global_clipnorm, clipnorm, clipvalue) inside its `apply`; under model.fit each
    replica clips its own gradients before the sum. tfmp.fit hands `apply` the all-reduced ones: 2 replicas clip
    as 1 does, where model.fit's 2 replicas end far from its 1."""
    for options in ({"global_clipnorm": 1.0}, {"clipnorm": 0.5}, {"clipvalue": 0.1}):
        build = _keras_options(options)
        one = build()
        one.fit(regression_data(), epochs=2, verbose=0)
        ours = build(mirrored)
        tfmp.fit(ours, regression_data(), epochs=2, verbose=0)
        assert_same(weights(ours), weights(one), atol=1e-6)
        keras_two = build(mirrored)
        keras_two.fit(regression_data(), epochs=2, verbose=0)
        gap = max(float(np.abs(a - b).max()) for a, b in zip(weights(keras_two), weights(one), strict=True))
        assert gap > 1e-3, (options, gap)  # The clip acts: per replica it clips other gradients.


@pytest.mark.parametrize("jit_compile", [False, True])
def test_a_second_fit_trains_with_what_changed_since_the_first(jit_compile, deterministic_gpu):
    """tfmp.fit keeps its traced step from one fit of a model to the next; a learning rate set between them, and
    a layer frozen with the model compiled again for another optimizer, are what the next fit trains with, as in
    model.fit."""

    def fits(fit):
        model, seen = regression(), []
        fit(model)
        model.optimizer.learning_rate = 0.0
        seen.append(weights(model))
        fit(model)
        seen.append(weights(model))
        model.layers[0].trainable = False
        model.compile(keras.optimizers.SGD(0.05, momentum=0.9), "mse", jit_compile=jit_compile)
        fit(model)
        seen.append(weights(model))
        return seen

    def keras_fit(model):
        model.jit_compile = jit_compile
        model.fit(regression_data(), verbose=0)

    ours = fits(lambda model: tfmp.fit(model, regression_data(), verbose=0, jit_compile=jit_compile))
    theirs = fits(keras_fit)
    assert_same(ours[1], ours[0], atol=0)  # A learning rate of 0 moves nothing.
    assert_same(ours[2][:2], ours[1][:2], atol=0)  # The frozen layer stays; the head trains.
    assert not np.array_equal(ours[2][2], ours[1][2])
    for a, b in zip(ours, theirs, strict=True):
        assert_same(a, b, atol=1e-6 if jit_compile else 0)
