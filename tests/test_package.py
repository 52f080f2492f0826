"""`pip install .` installs tfmp's three tiers (library, tfmp.app with the bundled models,
tfmp.bench), its version and shipped samples, and no top-level `models` package; every
documented entry point works from a directory outside the checkout."""

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile

import pytest
from conftest import REPO

import tfmp


def missing_build_backend():
    """Why pyproject.toml's build backend is not installed here at the version it asks for,
    or None. The wheel is built with the installed one, without pip's build isolation,
    which would download it: machines without a network (an offline GPU box) build too."""
    fix = "pip install -r requirements-test.txt"
    with open(os.path.join(REPO, "pyproject.toml")) as f:
        name, floor = re.search(r'requires = \["(\w+)>=([\d.]+)"\]', f.read()).groups()
    try:
        installed = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return f"the build backend {name}>={floor} is not installed ({fix})"
    if tuple(map(int, installed.split(".")[:2])) < tuple(map(int, floor.split(".")[:2])):
        return f"the build backend is {name} {installed}; pyproject.toml needs >={floor} ({fix})"
    return None


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """Built from a copy of the sources: a build/ left in the checkout would leak stale modules."""
    missing = missing_build_backend()
    if missing:
        pytest.skip(missing)
    source, out = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("wheel")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(REPO, name), source)
    shutil.copytree(os.path.join(REPO, "tfmp"), source / "tfmp", ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation", "-q", "-w", str(out)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    (path,) = out.glob("tfmp-*.whl")
    return path


def _is_checkout(path):
    return os.path.isdir(os.path.join(path, "tfmp")) or os.path.realpath(path) == os.path.realpath(REPO)


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory):
    """(site directory, a run(*args) in another directory with only that site on the path)."""
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    # The site first, then what the path held where TensorFlow itself comes by PYTHONPATH (a
    # GPU machine's /tmp/site): never this checkout, whose tfmp the wheel's must not meet.
    kept = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and not _is_checkout(p)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(target), *kept]), "TF_CPP_MIN_LOG_LEVEL": "2"}

    def run(*args, timeout=300):
        result = subprocess.run(
            [sys.executable, *args], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=timeout
        )
        assert result.returncode == 0, result.stdout[-1500:] + result.stderr[-2000:]
        return result

    return target, elsewhere, run


def test_wheel_holds_the_three_tiers_and_no_top_level_models(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert wheel.name.startswith(f"tfmp-{tfmp.__version__}-")
    assert {n.split("/")[0] for n in names} == {"tfmp", f"tfmp-{tfmp.__version__}.dist-info"}
    for name in ("loop.py", "data/samples/digits.npz", "app/models/cnn.py", "bench/__main__.py", "doctor/__main__.py"):
        assert f"tfmp/{name}" in names


FIT = """import keras, numpy as np, tensorflow as tf, tfmp
assert tfmp.__file__.startswith({site!r}), tfmp.__file__
strategy = tfmp.get_strategy("auto")
with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(tfmp.wrap_optimizer(keras.optimizers.SGD(0.1)), "mse")
ds = tf.data.Dataset.from_tensor_slices((np.ones((8, 4), "float32"), np.ones((8, 1), "float32"))).batch(4)
print(tfmp.__version__, len(tfmp.fit(model, ds, epochs=2, verbose=0, strategy=strategy).history["loss"]))
"""


def test_fit_and_launch_from_another_directory(installed):
    target, elsewhere, run = installed
    script = elsewhere / "fit.py"
    script.write_text(FIT.format(site=str(target)))
    lines = run(str(script)).stdout.splitlines()
    assert lines[0].startswith("tfmp: strategy ") and lines[-1].split() == [tfmp.__version__, "2"], lines
    launched = run("-m", "tfmp.launch", "--workers=1", str(script))
    assert f"{tfmp.__version__} 2" in launched.stdout
    assert not (target / "models").exists()


def test_doctor_from_another_directory(installed):
    _, elsewhere, run = installed
    out = elsewhere / "doctor"
    result = run("-m", "tfmp.doctor", "--model=cnn", "--steps=1", "--batch_size=16", f"--output_dir={out}")
    assert "recommended initial loss scale" in result.stdout
    assert json.loads((out / "diagnosis.json").read_text())["layers"]


def test_bench_from_another_directory(installed):
    _, elsewhere, run = installed
    out = elsewhere / "bench"
    run(
        "-m",
        "tfmp.bench",
        "--models=cnn",
        "--policies=float32",
        "--batch_size=16",
        "--rounds=1",
        "--round_seconds=1",
        "--max_steps=2",
        "--matmul_size=64",
        "--autotune_runs=0",
        "--sparse_vocab=",
        "--overhead_rounds=0",
        "--update_models=",
        f"--output_dir={out}",
        timeout=600,
    )
    (row,) = json.loads((out / "bench.json").read_text())["rows"]
    assert row["model"] == "cnn" and row["examples_per_second"] > 0
