"""Where examples come from: the samples shipped in the repo, TFDS, or random data.

Every source gives unbatched `tf.data.Dataset`s of `{feature: value, "label": int}`
dicts, plus a `Source` describing them, so one pipeline serves all of them.
"""

import contextlib
import dataclasses
import glob
import gzip
import os
import pathlib
import socket

import numpy as np
import tensorflow as tf

from tfmp.errors import UsageError, first_line

SAMPLES_DIR = pathlib.Path(__file__).parent / "samples"
SHIPPED = {
    "digits": "real MNIST digits shipped in the repo (8000 train / 1000 test, 28x28x1)",
    "sentiment": "real SST-2 sentences shipped in the repo (67349 train / 872 validation)",
}
SYNTHETIC = "synthetic"
_IMAGE_KEYS = ("image",)
_TEXT_KEYS = ("text", "sentence", "description", "review", "content", "title", "document")
_LABEL_KEYS = ("label", "labels", "sentiment")


@dataclasses.dataclass(frozen=True)
class Source:
    """What a dataset holds.

    Attributes:
        name: the dataset name as the user gave it.
        kind: "image" or "text".
        feature: the key of the input feature in each example.
        num_classes: number of label classes.
        image_shape: (height, width, channels) for images, else None.
        train_size: number of training examples, when known.
        test_split: the name of the split used for evaluation.
        in_memory: the whole dataset is in memory (shipped or synthetic), so every
            worker can read all of it; TFDS datasets are sharded before reading.
    """

    name: str
    kind: str
    feature: str
    num_classes: int
    image_shape: tuple | None = None
    train_size: int | None = None
    test_split: str = "test"
    in_memory: bool = False


def _digits():
    arrays = np.load(SAMPLES_DIR / "digits.npz")

    def split(name):
        return tf.data.Dataset.from_tensor_slices(
            {"image": arrays[f"{name}_image"], "label": arrays[f"{name}_label"].astype(np.int64)}
        )

    source = Source("digits", "image", "image", 10, (28, 28, 1), len(arrays["train_label"]), in_memory=True)
    return source, split("train"), split("test")


def _sentiment():
    def split(name):
        with gzip.open(SAMPLES_DIR / f"sentiment_{name}.tsv.gz", "rt", encoding="utf-8") as f:
            next(f)  # Header.
            labels, sentences = zip(*(line.rstrip("\n").split("\t", 1) for line in f), strict=False)
        labels = np.array(labels, dtype=np.int64)
        return tf.data.Dataset.from_tensor_slices({"sentence": list(sentences), "label": labels}), len(labels)

    (train, n), (test, _) = split("train"), split("validation")
    return Source("sentiment", "text", "sentence", 2, None, n, "validation", in_memory=True), train, test


def synthetic(kind, num_examples=512, image_shape=(28, 28, 1), num_classes=10, seed=0):
    """Random data of the right shape and type, for smoke runs and benchmarks.

    Labels are a fixed function of the input, so a model can fit them.
    """
    rng = np.random.default_rng(seed)
    if kind == "image":
        images = rng.integers(0, 256, size=(num_examples, *image_shape), dtype=np.uint8)
        labels = images.reshape(num_examples, -1)[:, :16].sum(axis=1) % num_classes
        source = Source(SYNTHETIC, "image", "image", num_classes, tuple(image_shape), num_examples, in_memory=True)
        feature = {"image": images}
    else:
        words = np.array([f"w{i}" for i in range(200)])
        tokens = rng.integers(0, len(words), size=(num_examples, 12))
        labels = tokens[:, 0] % num_classes
        feature = {"text": [" ".join(words[t]) for t in tokens]}
        source = Source(SYNTHETIC, "text", "text", num_classes, None, num_examples, in_memory=True)
    ds = tf.data.Dataset.from_tensor_slices({**feature, "label": labels.astype(np.int64)})
    cut = num_examples * 7 // 8
    return source, ds.take(cut), ds.skip(cut)


def _find_key(features, wanted, name, what):
    for key in wanted:
        if key in features:
            return key
    raise UsageError(
        f"dataset {name!r} has no {what} feature (looked for {', '.join(wanted)}; it has "
        f"{', '.join(features) or 'none'}); tfmp trains image or text classifiers"
    )


def _tfds_builder(name, data_dir, download):
    import tensorflow_datasets as tfds  # Imported here: costly, and only TFDS runs need it.

    if os.path.isdir(name):
        try:
            return tfds.builder_from_directory(name)
        except Exception as e:  # noqa: BLE001 - TFDS raises many types; all mean "not a dataset".
            raise UsageError(f"{name!r} is not a prepared TFDS dataset directory ({e})") from e
    try:
        builder = tfds.builder(name, data_dir=data_dir)
    except Exception as e:  # noqa: BLE001
        raise UsageError(
            f"unknown dataset {name!r} (not shipped, not a TFDS name, not prepared in "
            f"--data_dir={data_dir or '~/tensorflow_datasets'}); shipped: "
            f"{', '.join([*SHIPPED, SYNTHETIC])}"
        ) from e
    if not builder.is_prepared():
        if not download:
            raise UsageError(
                f"dataset {name!r} is not prepared in {builder.data_dir}; pass --download to "
                "fetch it, or prepare it on a machine with internet and pass that directory "
                "as --data_dir"
            )
        with _tried_once_offline() as offline:
            try:
                builder.download_and_prepare()
            except Exception as e:  # noqa: BLE001 - offline machines fail in many ways.
                why = type(e).__name__ + (f"; {offline}" if offline else "")
                raise UsageError(
                    f"dataset {name!r} is not prepared in {builder.data_dir} and could not be "
                    f"downloaded ({why}); prepare it on a machine with internet "
                    "(python -c \"import tensorflow_datasets as tfds; tfds.load('"
                    f"{name}')\") and pass that directory as --data_dir"
                ) from e
    return builder


# Where TFDS downloads prepared datasets from first.
DOWNLOAD_HOST = "storage.googleapis.com"


def _offline():
    """Why this machine cannot download (its resolver knows no `DOWNLOAD_HOST`), or None. A proxy named in the
    environment may resolve names the machine cannot: then None."""
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None
    try:
        socket.getaddrinfo(DOWNLOAD_HOST, 443)
    except OSError:
        return f"no network: {DOWNLOAD_HOST} does not resolve"
    return None


@contextlib.contextmanager
def _tried_once_offline():
    """Yields `_offline()`; where it is not None, TFDS's downloads are tried once. TFDS retries each 10 times with
    backoff, 3 min 24 s before the download of a dataset fails offline (0.3 s tried once); a builder that needs no
    network (files in its manual_dir, mock data) prepares as before."""
    from tensorflow_datasets.core.download import downloader  # noqa: PLC0415 - TFDS is imported only where used.

    offline = _offline()
    if offline is None or not isinstance(getattr(downloader, "MAX_RETRIES", None), int):
        yield offline
        return
    saved, downloader.MAX_RETRIES = downloader.MAX_RETRIES, 0
    try:
        yield offline
    finally:
        downloader.MAX_RETRIES = saved


# Record files up to this size are read through once before training: a truncated or
# corrupted file then ends the run before anything is written, not halfway through it.
VERIFY_BYTES = 512 * 2**20


def _verify_records(builder, name):
    """Reads every record of a prepared dataset once (CRC-checked), if it is small enough,
    and compares the count with the one its metadata promises.

    Raises:
        UsageError: a file is truncated or corrupted, or records are missing.
    """
    files = sorted(glob.glob(os.path.join(str(builder.data_dir), "*.tfrecord*")))
    if not files or sum(os.path.getsize(f) for f in files) > VERIFY_BYTES:
        return
    try:
        count = sum(int(n) for n in tf.data.TFRecordDataset(files).batch(4096).map(lambda b: tf.shape(b)[0]))
    except (tf.errors.DataLossError, tf.errors.OpError) as e:
        first = first_line(e, 160)
        raise UsageError(
            f"dataset {name!r} has a corrupt record file in {builder.data_dir} ({first}); prepare it again"
        ) from e
    expected = sum(split.num_examples for split in builder.info.splits.values()) if builder.info.splits else None
    if expected and count != expected:
        raise UsageError(
            f"dataset {name!r} in {builder.data_dir} holds {count} records where its metadata says {expected}; "
            "prepare it again"
        )


def _tfds(name, data_dir, download):
    import tensorflow_datasets as tfds

    builder = _tfds_builder(name, data_dir, download)
    _verify_records(builder, name)
    features = builder.info.features
    label = _find_key(features, _LABEL_KEYS, name, "label")
    num_classes = features[label].num_classes
    if any(k in features for k in _IMAGE_KEYS):
        feature = _find_key(features, _IMAGE_KEYS, name, "image")
        kind, shape = "image", tuple(features[feature].shape)
    else:
        feature = _find_key(features, _TEXT_KEYS, name, "image or text")
        kind, shape = "text", None
    # Prefer a labelled validation split: some test splits (GLUE) carry no labels. Mocked
    # builders (tfds.testing.mock_data) may know no splits; they serve any name.
    splits = list(builder.info.splits) or (["train", "validation"] if name.startswith("glue/") else ["train", "test"])
    test_split = next((s for s in ("validation", "test") if s in splits), None)
    if "train" not in splits or test_split is None:
        raise UsageError(
            f"dataset {name!r} needs a train split and a validation or test split; it has {', '.join(splits)}"
        )
    if kind == "image" and None in shape:
        raise UsageError(f"dataset {name!r} has images of varying size {shape}; tfmp needs a fixed image shape")
    train_size = builder.info.splits["train"].num_examples if builder.info.splits else None

    def read(split):
        ds = builder.as_dataset(split=split, read_config=tfds.ReadConfig(shuffle_seed=0))
        return ds.map(lambda ex: {feature: ex[feature], "label": ex[label]})

    source = Source(name, kind, feature, num_classes, shape, train_size, test_split)
    return source, read("train"), read(test_split)


def load_source(name, data_dir=None, kind="image", download=True):
    """Opens a dataset by name.

    Args:
        name: `digits` or `sentiment` (shipped), `synthetic`, a TFDS name (`mnist`,
            `cifar10`, `imdb_reviews`, `glue/sst2`, ...), or a prepared TFDS directory.
        data_dir: where TFDS looks for prepared data.
        kind: for `synthetic`: "image" or "text".
        download: let TFDS download and prepare a registered dataset that is missing.

    Returns:
        (Source, train dataset, test dataset), unbatched dict examples.

    Raises:
        UsageError: for an unknown, unprepared or unsuitable dataset.
    """
    if name == "digits":
        return _digits()
    if name == "sentiment":
        return _sentiment()
    if name == SYNTHETIC:
        return synthetic(kind)
    return _tfds(name, data_dir, download)
