import os
import socket

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds
from conftest import NO_SHARED_DATASETS, SHARED_DATASETS

from tfmp import data, inputs
from tfmp.errors import UsageError


def test_shipped_digits_batches():
    ds = data.load("digits", 64, drop_remainder=True)
    assert ds.source.num_classes == 10 and ds.source.train_size == 8000
    images, labels = next(iter(ds.train))
    assert images.dtype == tf.float32 and tuple(images.shape) == (64, 28, 28, 1)
    assert 0.0 <= float(tf.reduce_min(images)) and float(tf.reduce_max(images)) <= 1.0
    assert float(tf.reduce_max(images)) > 0.5  # Real digits, not an empty canvas.
    assert labels.dtype == tf.int64 and set(labels.numpy()) <= set(range(10))
    assert sum(int(x.shape[0]) for x, _ in ds.test) == 1000


def test_shipped_sentiment_is_vectorized():
    ds = data.load("sentiment", 32, vocab_size=500, sequence_length=20)
    assert ds.source.kind == "text" and ds.source.test_split == "validation"
    tokens, labels = next(iter(ds.train))
    assert tuple(tokens.shape) == (32, 20) and tokens.dtype == tf.int64
    assert int(tf.reduce_max(tokens)) < 500 and int(tf.reduce_max(tokens)) > 1
    assert ds.vectorizer.vocabulary_size() == 500
    assert sum(int(x.shape[0]) for x, _ in ds.test) == 872


def test_a_text_with_no_word_reads_as_one_unknown_word():
    """Not a row of padding, which a masking embedding masks whole (cuDNN refuses that)."""
    vectorizer = data.make_vectorizer(tf.data.Dataset.from_tensor_slices(["a good film", "bad"]), 10, 5)
    ids = vectorizer(tf.constant(["a good film", ")", "", "zebra", "bad bad"])).numpy()
    assert ids[1].tolist() == ids[2].tolist() == [1, 0, 0, 0, 0]  # [UNK], then padding.
    assert ids[3].tolist() == [1, 0, 0, 0, 0]  # An unknown word was one already.
    assert (ids[0] > 1).sum() == 3 and ids[4].tolist()[:3] == [ids[4][0], ids[4][0], 0]
    assert vectorizer.get_vocabulary()[:2] == ["", "[UNK]"]


def test_shuffle_is_seeded():
    def first_labels(seed):
        return next(iter(data.load("digits", 16, seed=seed).train))[1].numpy()

    np.testing.assert_array_equal(first_labels(3), first_labels(3))
    assert not np.array_equal(first_labels(3), first_labels(4))


def test_augmentation_keeps_shape_and_changes_pixels():
    source, train, test = data.synthetic("image", 64, image_shape=(32, 32, 3))
    plain = data.build(source, train, test, 8, seed=1, drop_remainder=True)
    aug = data.build(source, train, test, 8, seed=1, augment=True, drop_remainder=True)
    a, b = next(iter(plain.train))[0], next(iter(aug.train))[0]
    assert a.shape == b.shape == (8, 32, 32, 3)
    assert not np.array_equal(a.numpy(), b.numpy())


@pytest.mark.parametrize("kind", ["image", "text"])
def test_synthetic(kind):
    ds = data.load("synthetic", 8, kind=kind, vocab_size=300, sequence_length=12)
    x, y = next(iter(ds.train))
    assert x.shape[0] == 8 and ds.source.kind == kind


@pytest.mark.parametrize(
    "name, kind, feature, classes, shape",
    [
        ("cifar10", "image", "image", 10, (32, 32, 3)),
        ("mnist", "image", "image", 10, (28, 28, 1)),
        ("imdb_reviews", "text", "text", 2, None),
        ("ag_news_subset", "text", "description", 4, None),
        ("glue/sst2", "text", "sentence", 2, None),
    ],
)
def test_tfds_by_name_with_mock_data(name, kind, feature, classes, shape):
    with tfds.testing.mock_data(num_examples=24):
        ds = data.load(name, 8, data_dir="/nonexistent/tfds", vocab_size=200, sequence_length=16, drop_remainder=True)
        x, y = next(iter(ds.train))
    assert (ds.source.kind, ds.source.feature, ds.source.num_classes, ds.source.image_shape) == (
        kind,
        feature,
        classes,
        shape,
    )
    assert x.shape[0] == 8 and x.dtype == (tf.float32 if kind == "image" else tf.int64)
    if shape:
        assert tuple(x.shape[1:]) == shape


@NO_SHARED_DATASETS
def test_prepared_directory_and_data_dir():
    by_dir = data.load_source(os.path.join(SHARED_DATASETS, "sst2", "1.0.0"))[0]
    by_name = data.load_source("mnist_t10k", SHARED_DATASETS, download=False)[0]
    assert (by_dir.kind, by_dir.feature, by_dir.test_split) == ("text", "sentence", "validation")
    assert (by_name.kind, by_name.image_shape, by_name.train_size) == ("image", (28, 28, 1), 8000)


def test_missing_dataset_is_one_line(tmp_path):
    with pytest.raises(UsageError) as e:
        data.load_source("mnist", str(tmp_path), download=False)
    assert "'mnist' is not prepared in" in str(e.value) and str(tmp_path) in str(e.value)
    assert "\n" not in str(e.value)
    with pytest.raises(UsageError, match="unknown dataset 'no_such_set'.*digits, sentiment, synthetic"):
        data.load_source("no_such_set", str(tmp_path))
    with pytest.raises(UsageError, match="not a prepared TFDS dataset directory"):
        data.load_source(str(tmp_path))


def test_a_download_without_network_is_tried_once(tmp_path, monkeypatch):
    """Offline, TFDS retried a download 10 times with backoff: 3 min 24 s before train.py said it could not
    download. Where the resolver knows no download host, it is tried once; a proxy may resolve what this machine
    cannot, and a builder that needs no network (mock data) prepares as before."""
    from tensorflow_datasets.core.download import downloader

    from tfmp.data import sources

    def no_dns(*args, **kwargs):
        raise socket.gaierror(-2, "Name or service not known")

    retries = []

    def download(*args, **kwargs):
        retries.append(downloader.MAX_RETRIES)
        raise ConnectionError("offline")

    original = tfds.core.DatasetBuilder.download_and_prepare
    monkeypatch.setattr(sources.socket, "getaddrinfo", no_dns)
    monkeypatch.setattr(tfds.core.DatasetBuilder, "download_and_prepare", download)
    for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(UsageError, match=r"could not be downloaded \(ConnectionError; no network: storage.googleapis"):
        data.load_source("mnist", str(tmp_path), download=True)
    monkeypatch.setattr(sources.socket, "getaddrinfo", lambda *args, **kwargs: [])  # Online.
    with pytest.raises(UsageError, match=r"could not be downloaded \(ConnectionError\);"):
        data.load_source("mnist", str(tmp_path), download=True)
    assert retries == [0, 10] and downloader.MAX_RETRIES == 10  # Put back after the one try.
    monkeypatch.setattr(sources.socket, "getaddrinfo", no_dns)
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")  # (Not a builder's: TF's GCS reads would retry it.)
    assert sources._offline() is None  # noqa: SLF001 - a proxy may resolve what this machine cannot.
    monkeypatch.delenv("HTTPS_PROXY")
    monkeypatch.setattr(tfds.core.DatasetBuilder, "download_and_prepare", original)
    with tfds.testing.mock_data(num_examples=8):  # Prepares without the network.
        assert data.load_source("mnist", str(tmp_path), download=True)[0].num_classes == 10


def test_each_input_pipeline_reads_its_own_shard():
    source, train, test = data.synthetic("image", 64)
    ds = data.build(source, train, test, global_batch=8, drop_remainder=True)
    seen = []
    for pipeline in range(2):
        context = tf.distribute.InputContext(num_input_pipelines=2, input_pipeline_id=pipeline, num_replicas_in_sync=4)
        batches = list(ds.make_train(context))
        assert all(x.shape[0] == 2 for x, _ in batches)  # Per-replica batch: 8 / 4.
        seen.append({x.numpy().tobytes() for batch, _ in batches for x in batch})
    assert len(seen[0]) == len(seen[1]) == 28 and not seen[0] & seen[1]


def test_fits_input_feeds_every_replica_its_own_shard(mirrored):
    ds = data.load("digits", 16, drop_remainder=True)
    batch = next(inputs.Input(ds.make_train, mirrored, 4, 1, "data").stream(0))
    per_replica = mirrored.experimental_local_results(batch[0])
    assert [tuple(x.shape) for x in per_replica] == [(8, 28, 28, 1), (8, 28, 28, 1)]
    assert not np.array_equal(per_replica[0].numpy(), per_replica[1].numpy())


def test_resume_position_is_exact_and_its_cost_does_not_grow_with_the_step():
    """In-memory data: the batch at step k of a fresh stream is the first batch of a stream
    resumed at k, across epoch boundaries; resuming at step 10^9 skips integers only (a
    decoded skip of 10^9 batches would never finish under the test timeout)."""
    ds = data.load("digits", 128, repeat=True, drop_remainder=True, seed=3)
    stream = iter(ds.make_train())
    batches = [next(stream) for _ in range(130)]  # 62.5 batches an epoch: two epoch boundaries.
    for k in (0, 1, 61, 62, 63, 125, 129):
        x, y = next(iter(ds.make_train(skip=k)))
        np.testing.assert_array_equal(x.numpy(), batches[k][0].numpy())
        np.testing.assert_array_equal(y.numpy(), batches[k][1].numpy())
    x, _ = next(iter(ds.make_train(skip=10**9)))
    assert x.shape == (128, 28, 28, 1)
