"""Real accuracy on real data, read through the TFDS code path, under float32 and bfloat16.

Each case takes under a minute on 2 CPU cores (one or two epochs; they reach 0.99 and
0.83). These tests fail if learning breaks: a random model scores 0.10 on digits and 0.50
on sentences.
"""

import os

import pytest
from conftest import REPO

from tfmp import training

SHARED = os.path.join(os.path.dirname(REPO), "shared", "datasets")
pytestmark = pytest.mark.skipif(not os.path.isdir(SHARED), reason=f"no real datasets at {SHARED}")

CASES = {
    # model, dataset, epochs, global batch, learning rate, threshold
    "cnn-digits": ("cnn", "mnist_t10k", 2, 128, 2e-3, 0.97),
    "lstm-sst2": ("lstm", "sst2", 1, 512, 3e-3, 0.80),
}


@pytest.mark.parametrize("case", list(CASES))
def test_real_accuracy_float32_and_bfloat16(tmp_path, case):
    model, dataset, epochs, batch, learning_rate, threshold = CASES[case]
    accuracy = {}
    for policy in ("float32", "mixed_bfloat16"):
        config = training.Config(
            model=model,
            dataset=dataset,
            data_dir=SHARED,
            download=False,
            precision=policy,
            epochs=epochs,
            batch_size=batch,
            learning_rate=learning_rate,
            seed=0,
            deterministic=True,  # Same figures run to run: the comparison is not a coin toss.
            jit_compile="false",  # Not timed against XLA here: accuracy is what is measured.
            model_dir=str(tmp_path / policy),
            verbose=0,
        )
        metrics = training.train_and_evaluate(config)
        assert metrics["policy"] == policy
        accuracy[policy] = metrics["test_accuracy"]
    assert min(accuracy.values()) >= threshold, accuracy
    assert abs(accuracy["float32"] - accuracy["mixed_bfloat16"]) <= 0.015, accuracy
