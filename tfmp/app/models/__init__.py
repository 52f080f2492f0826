"""The bundled models: a plain dict from name to (input kind, builder), the shipped
dataset each input kind trains on by default, and `build` for a model on its data.

Each model's module (and Keras) loads on its first build or first use as an attribute
(`models.resnet`, `tfmp.lazy`), so that `train.py` can define its flags from `MODELS` before
TensorFlow starts."""

import importlib
import typing

from tfmp import lazy

__all__ = ["DEFAULT_DATASETS", "MODELS", "Entry", "build", "cnn", "compile", "lstm", "resnet", "transformer"]
__getattr__, __dir__ = lazy.names(globals(), {}, modules=("cnn", "lstm", "resnet", "transformer"))


class Entry(typing.NamedTuple):
    """A registered model: the input kind it takes and its `build` function."""

    kind: str  # "image" or "text"
    build: typing.Callable


def _build_of(module):
    """`tfmp.app.models.<module>.build`, imported on its first call."""

    def build(*args, **kwargs):
        return importlib.import_module(f"{__name__}.{module}").build(*args, **kwargs)

    build.__qualname__ = f"{module}.build"
    build.__doc__ = f"`{__name__}.{module}.build`, imported on its first call: its docstring has the arguments."
    return build


MODELS = {
    "cnn": Entry("image", _build_of("cnn")),
    "resnet": Entry("image", _build_of("resnet")),
    "lstm": Entry("text", _build_of("lstm")),
    "transformer": Entry("text", _build_of("transformer")),
}


DEFAULT_DATASETS = {"image": "digits", "text": "sentiment"}  # The shipped samples (tfmp/data/samples).


def build(name, ds, sequence_length=None):
    """Builds bundled model `name` for the `Data` it trains on, under the global policy.

    Args:
        name: a key of `MODELS`.
        ds: a `tfmp.data.Data`: its source's classes and image shape, or its vocabulary.
        sequence_length: text models: tokens per example (default: the data's).
    """
    entry, source = MODELS[name], ds.source
    if entry.kind == "image":
        return entry.build(source.num_classes, input_shape=source.image_shape)
    length = sequence_length or ds.train.element_spec[0].shape[-1]
    return entry.build(source.num_classes, vocab_size=ds.vectorizer.vocabulary_size(), sequence_length=length)


def compile(model, optimizer, steps_per_execution=1, jit_compile="auto"):  # noqa: A001 - Keras' word for it.
    """Compiles a bundled classifier (float32 probabilities out) with its loss and metric
    (`jit_compile`: Keras' own, for `model.fit`; tfmp.fit takes its own)."""
    import keras  # noqa: PLC0415 - loads TensorFlow: not for `MODELS` alone.

    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(),
        metrics=["accuracy"],
        steps_per_execution=steps_per_execution,
        jit_compile=jit_compile,
    )
    return model
