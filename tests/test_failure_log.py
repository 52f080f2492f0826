"""tests/failure_log.py: a failure's report reaches TFMP_FAILURES as the test fails, once,
with and without pytest-xdist; a run where nothing fails writes nothing."""

import os
import subprocess
import sys

import pytest
from conftest import REPO

PASSES = "def test_passes():\n    assert True\n"
FAILS = 'def test_fails():\n    observed = 41\n    assert observed == 42, "the answer drifted"\n'


def _pytest(tmp_path, cases, workers=None):
    """pytest over `cases` with the plugin alone (not tfmp's conftest): (exit code, log path)."""
    (tmp_path / "test_cases.py").write_text(cases)
    log = tmp_path / "failures.log"
    env = {**os.environ, "TFMP_FAILURES": str(log), "PYTHONPATH": os.path.join(REPO, "tests")}
    env.pop("PYTEST_XDIST_WORKER", None)  # This test may itself run in a worker.
    command = [sys.executable, "-m", "pytest", "-q", "-p", "failure_log", "-p", "no:cacheprovider", "-p", "no:randomly"]
    command += ["-n", workers] if workers else ["-p", "no:xdist"]
    command += ["--rootdir", str(tmp_path), "-c", os.devnull, str(tmp_path / "test_cases.py")]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    return result.returncode, log, result.stdout[-2000:] + result.stderr[-2000:]


@pytest.mark.parametrize("workers", [None, "2"])
def test_each_failure_is_written_once_as_it_happens(tmp_path, workers):
    code, log, output = _pytest(tmp_path, PASSES + FAILS, workers)
    assert code == 1, output
    text = log.read_text()
    assert text.count("=== ") == 1 and "test_cases.py::test_fails (call)" in text
    assert "the answer drifted" in text and "assert 41 == 42" in text and "test_passes" not in text


def test_nothing_is_written_without_a_failure(tmp_path):
    code, log, output = _pytest(tmp_path, PASSES)
    assert code == 0, output
    assert not log.exists()
