"""`pip install .` installs the tfmp library, with its version and shipped samples, and no
top-level `models` package; the installed library imports and trains from anywhere."""

import os
import subprocess
import sys
import zipfile

import pytest
from conftest import REPO

import tfmp


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", REPO, "--no-deps", "-q", "-w", str(out)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    (path,) = out.glob("tfmp-*.whl")
    return path


def test_wheel_holds_the_library_only(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert wheel.name.startswith(f"tfmp-{tfmp.__version__}-")
    assert {n.split("/")[0] for n in names} == {"tfmp", f"tfmp-{tfmp.__version__}.dist-info"}
    assert "tfmp/loop.py" in names and "tfmp/data/samples/digits.npz" in names


def test_installed_library_trains_outside_the_repository(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    script = (
        "import keras, numpy as np, tensorflow as tf, tfmp\n"
        f"assert tfmp.__file__.startswith({str(target)!r})\n"
        "model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])\n"
        "model.compile(tfmp.wrap_optimizer(keras.optimizers.SGD(0.1)), 'mse')\n"
        "ds = tf.data.Dataset.from_tensor_slices((np.ones((8, 4), 'float32'), np.ones((8, 1), 'float32'))).batch(4)\n"
        "print(tfmp.__version__, len(tfmp.fit(model, ds, epochs=2, verbose=0).history['loss']))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(target), "TF_CPP_MIN_LOG_LEVEL": "2"}
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == [tfmp.__version__, "2"]
    assert not (target / "models").exists()
