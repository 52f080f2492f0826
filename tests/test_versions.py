"""The version ranges tfmp declares are the ones CI tests: requirements.txt, pyproject.toml,
.ci/floors.txt (CI's floor leg), README's support matrix and tfmp.versions say the same;
outside them, `import tfmp` warns once."""

import importlib.metadata
import os
import re
import subprocess
import sys

import pytest
from conftest import REPO

from tfmp import versions


def _read(name):
    with open(os.path.join(REPO, name)) as f:
        return f.read()


def _ranges(text):
    """{name: (floor, ceiling or None)} of lines like `name>=1.2,<3`."""
    found = {}
    for name, floor, ceiling in re.findall(r'^"?\s*([A-Za-z0-9_.\-]+)>=([\d.]+)(?:,<([\d.]+))?', text, re.M):
        found[name] = (floor, ceiling or None)
    return found


def test_requirements_pyproject_and_tfmp_versions_declare_the_same_ranges():
    requirements = _ranges(_read("requirements.txt"))
    dependencies = re.search(r"dependencies = \[(.*?)\]", _read("pyproject.toml"), re.S).group(1)
    assert _ranges("\n".join(line.strip().strip(",") for line in dependencies.splitlines())) == requirements
    for name, (floor, ceiling) in versions.TESTED.items():
        assert requirements[name] == (floor, ceiling), name


def test_the_floor_constraints_are_generated_from_requirements():
    generated = subprocess.run(
        [sys.executable, os.path.join(REPO, ".ci", "floors.py")], capture_output=True, text=True, check=True
    ).stdout
    assert _read(".ci/floors.txt") == generated, "run: python .ci/floors.py > .ci/floors.txt"
    pins = dict(line.split("==") for line in generated.splitlines() if not line.startswith("#"))
    assert pins == {name: floor for name, (floor, _) in _ranges(_read("requirements.txt")).items()}


def test_readme_support_matrix_states_the_tested_ranges():
    readme = _read("README.md")
    python = re.search(r'requires-python = ">=([\d.]+)"', _read("pyproject.toml")).group(1)
    assert re.search(rf"^\| Python \| {re.escape(python)} \|", readme, re.M), "README: the Python row"
    for name, (floor, ceiling) in versions.TESTED.items():
        row = rf"^\| {re.escape(name)} \| {re.escape(floor)} \| <{re.escape(ceiling)} \|"
        assert re.search(row, readme, re.M), f"README's support matrix: no row {name} | {floor} | <{ceiling}"


@pytest.mark.parametrize(
    "installed, expected",
    [
        ({"tensorflow": "2.22.0", "keras": "3.15.1"}, ["tensorflow 2.22.0 (tested: >=2.18,<2.22)"]),
        ({"tensorflow": "2.22.0rc1", "keras": "3.9.2"}, ["tensorflow 2.22.0rc1", "keras 3.9.2 (tested: >=3.10,<3.16)"]),
        ({"tensorflow": "2.18.0", "keras": "3.15.1", "tensorflow-datasets": "4.9.7"}, []),
    ],
)
def test_versions_outside_the_tested_range_are_named(monkeypatch, installed, expected):
    monkeypatch.setattr(versions, "installed", installed.get)
    problems = versions.outside_tested()
    assert len(problems) == len(expected) and all(p.startswith(e) for p, e in zip(problems, expected, strict=True))


def test_a_nightly_distribution_is_read_as_its_package(monkeypatch):
    """keras-nightly (what TensorFlow's release candidates install) is Keras: its version is checked."""
    metadata = {"tf-nightly": "2.22.0.dev20261001", "keras-nightly": "3.16.0.dev2026102704"}

    def version(name):
        if name not in metadata:
            raise importlib.metadata.PackageNotFoundError(name)
        return metadata[name]

    monkeypatch.setattr(importlib.metadata, "version", version)
    assert versions.installed("keras") == "3.16.0.dev2026102704"
    assert versions.outside_tested() == [
        "tensorflow 2.22.0.dev20261001 (tested: >=2.18,<2.22)",
        "keras 3.16.0.dev2026102704 (tested: >=3.10,<3.16)",
    ]


def test_import_warns_once_above_the_ceiling():
    """A fresh process whose metadata says TensorFlow 9.0 (the real one is not imported)."""
    code = (
        "import importlib.metadata as m, warnings; real = m.version\n"
        "m.version = lambda n: '9.0' if n == 'tensorflow' else real(n)\n"
        "warnings.simplefilter('always')\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    import tfmp, tfmp.errors; import importlib; importlib.import_module('tfmp')\n"
        "print(len(caught)); print(caught[0].message)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    count, message = out.splitlines()
    assert count == "1" and "tensorflow 9.0 (tested: >=2.18,<2.22)" in message and "requirements.txt" in message
