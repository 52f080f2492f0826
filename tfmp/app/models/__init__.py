"""The bundled models: a plain dict from name to (input kind, builder)."""

import typing

import keras

from tfmp.app.models import cnn, lstm, resnet, transformer


class Entry(typing.NamedTuple):
    """A registered model: the input kind it takes and its `build` function."""

    kind: str  # "image" or "text"
    build: typing.Callable


MODELS = {
    "cnn": Entry("image", cnn.build),
    "resnet": Entry("image", resnet.build),
    "lstm": Entry("text", lstm.build),
    "transformer": Entry("text", transformer.build),
}


def compile(model, optimizer, steps_per_execution=1):  # noqa: A001 - Keras' word for it.
    """Compiles a bundled classifier (float32 probabilities out) with its loss and metric."""
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(),
        metrics=["accuracy"],
        steps_per_execution=steps_per_execution,
    )
    return model
