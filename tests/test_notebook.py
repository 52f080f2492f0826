"""The Colab TPU notebook's code, run on this CPU with STRATEGY = "auto"."""

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO

NOTEBOOK = os.path.join(REPO, "notebooks", "colab_tpu.ipynb")


@pytest.mark.slow
def test_notebook_code_runs_on_cpu(tmp_path):
    with open(NOTEBOOK) as f:
        cells = json.load(f)["cells"]
    source = "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    assert 'STRATEGY = "tpu"' in source and "tpu=TPU" in source
    script = tmp_path / "notebook.py"
    source = source.replace('STRATEGY = "tpu"', 'STRATEGY = "auto"', 1)
    # On a CPU with bfloat16 auto would time float32 against it: a path that depends on this
    # CPU's speed. float32 here (auto's trial has its own tests, with injected timings).
    assert source.count('precision="auto",') == 2
    source = source.replace('precision="auto",', 'precision="float32",')
    # 48 steps of each model, not three epochs and one: this test is that the cells run; the
    # models' accuracy on these data is train.py's default run and tests/test_accuracy.py's. At a
    # constant rate: the default cosine, squeezed into 48 steps, halves the mean rate, and the LSTM
    # had not left chance by then (0.513 on an AMD EPYC Zen 3; its whole epoch learns either way).
    assert source.count("epochs=3,") == 1 and source.count("steps_per_execution=8,") == 2
    source = source.replace("epochs=3,", "epochs=1,")
    shorter = 'steps_per_execution=8,\n        steps_per_epoch=48,\n        lr_schedule="constant",'
    source = source.replace("steps_per_execution=8,", shorter)
    script.write_text(source)
    env = {**os.environ, "TFMP_SKIP_INSTALL": "1", "TFMP_RUNS": str(tmp_path / "runs"), "TF_CPP_MIN_LOG_LEVEL": "2"}
    result = subprocess.run(
        [sys.executable, str(script)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    cnn = json.loads((tmp_path / "runs" / "colab_cnn" / "metrics.json").read_text())
    lstm = json.loads((tmp_path / "runs" / "colab_lstm" / "metrics.json").read_text())
    # It learnt (chance: 0.1 on digits, 0.51 on the sentences; 48 steps read 0.975 and 0.735 on
    # an AMD EPYC Zen 3), with margins that a CPU's float32 kernels cannot eat.
    assert cnn["test_accuracy"] > 0.9 and lstm["test_accuracy"] > 0.65
    assert cnn["steps"] == lstm["steps"] == 48
    assert "cnn   " in result.stdout and "lstm  " in result.stdout
