"""Input data: shipped samples, TFDS datasets and synthetic data, as tf.data pipelines."""

from tfmp.data.pipeline import Data, Vectorizer, build, make_vectorizer
from tfmp.data.sources import SHIPPED, SYNTHETIC, Source, load_source, synthetic


def load(name, global_batch, data_dir=None, kind="image", download=True, **pipeline_kwargs):
    """Opens dataset `name` and builds its pipeline; see `sources.load_source` and `pipeline.build`."""
    source, train, test = load_source(name, data_dir, kind, download)
    return build(source, train, test, global_batch, **pipeline_kwargs)


__all__ = [
    "Data",
    "SHIPPED",
    "SYNTHETIC",
    "Source",
    "build",
    "load",
    "load_source",
    "Vectorizer",
    "make_vectorizer",
    "synthetic",
]
