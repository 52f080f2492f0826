"""What every worker of a job must share (`tfmp.agree`): each worker's settings as text, and the one error that
names what differs. Two real workers that differ: tests/test_fit_processes.py."""

import keras
import pytest
import tensorflow as tf

from tfmp import agree, steps


def _settings(units=4, learning_rate=1e-3, clipnorm=None, grad_accum_steps=1, epochs=3):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(units), keras.layers.Dense(1)])
    model.compile(keras.optimizers.Adam(learning_rate), "mse")
    compiled = steps.Steps(model, tf.distribute.get_strategy(), grad_accum_steps=grad_accum_steps, clipnorm=clipnorm)
    return agree.settings(compiled, epochs, None)


def test_settings_differ_where_and_only_where_the_arguments_do():
    base = _settings()
    assert _settings() == base  # A new model and optimizer (Keras numbers their names anew): the same text.
    for changed, what in [
        ({"units": 5}, "the model"),
        ({"learning_rate": 2e-3}, "the optimizer"),
        ({"clipnorm": 1.0}, "the update"),
        ({"grad_accum_steps": 2}, "the update"),
        ({"epochs": 4}, "the run"),
    ]:
        other = _settings(**changed)
        assert {name for name in base if other[name] != base[name]} == {what}, changed
    assert base["the update"] == "grad_accum_steps 1, clipnorm None, steps_per_execution 1"
    assert base["the optimizer"].startswith("Adam, learning rate 0.001, ")
    assert base["the model"].startswith("4 variables of 41 values ")
    assert all(len(text.encode()) <= agree._TEXT_BYTES for text in base.values())  # noqa: SLF001 - compared whole


def test_a_schedule_without_a_config_still_gives_settings():
    class Halving(keras.optimizers.schedules.LearningRateSchedule):
        def __call__(self, step):
            return 1e-3 * 0.5 ** tf.cast(step // 100, "float32")

    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(Halving()), "mse")
    text = agree.settings(steps.Steps(model, tf.distribute.get_strategy()), 1, 10)
    assert text["the optimizer"].startswith("SGD, learning rate unknown, ")
    assert text["the run"] == "epochs 1, steps_per_epoch 10"


@pytest.mark.parametrize("differ", ["decided", "given", "both", "neither"])
def test_the_error_names_what_differs_and_how_to_agree(differ):
    mine = {"XLA": b"on", "the update": b"clipnorm 1.0"}
    seen = {"XLA": {b"on", b"off"} if differ in ("decided", "both") else {b"on"}}
    seen["the update"] = {b"clipnorm 1.0", b"clipnorm 0.5"} if differ in ("given", "both") else {b"clipnorm 1.0"}
    message = agree.differences(2, mine, seen, {"XLA": "on"}, "--jit_compile")
    if differ == "neither":
        assert message is None
        return
    hardware = "the 2 workers decided differently (XLA: on here, off elsewhere): each decides by its own hardware"
    arguments = "the 2 workers were given different settings (the update: clipnorm 1.0 here, clipnorm 0.5 elsewhere)"
    assert (hardware in message, arguments in message) == (differ != "given", differ != "decided"), message
    assert ("--jit_compile" in message) == (differ != "given")
    assert ("tfmp.launch" in message) == (differ != "decided")


def test_texts_alike_in_their_first_bytes_still_differ():
    head = "grad_accum_steps 1, clipnorm 0.12345678901234567890, steps_per_execution 1"
    other = head.replace("steps_per_execution 1", "steps_per_execution 2")
    assert head[: agree._TEXT_BYTES] == other[: agree._TEXT_BYTES]  # noqa: SLF001 - what a cut alone would compare
    mine, theirs = agree._text(head), agree._text(other)  # noqa: SLF001 - the text each worker sends
    assert len(mine) == len(theirs) == agree._TEXT_BYTES and mine != theirs  # noqa: SLF001
    assert mine.startswith(head[:40].encode()) and agree._text("clipnorm 1.0") == b"clipnorm 1.0"  # noqa: SLF001
    message = agree.differences(2, {"the update": mine}, {"the update": {mine, theirs}}, {}, "")
    assert "the update: grad_accum_steps 1, clipnorm 0.1234" in message and "..#" in message
