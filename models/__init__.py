"""The bundled models: a plain dict from name to (input kind, builder)."""

import typing

from models import cnn, lstm, resnet, transformer


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
