"""A pytest plugin (loaded by conftest.py): with TFMP_FAILURES=FILE, each failure's report
(its assertion or traceback) is appended to FILE as soon as the test fails, not only in the
summary at the end. A run cut off at its time limit (a lent GPU's few minutes) then still
says why its tests failed, where `-v` names only which."""

import os


def pytest_runtest_logreport(report):
    path = os.environ.get("TFMP_FAILURES")
    # Under pytest-xdist a report reaches this hook in the worker and again in the
    # controller, as the test ends: written once, by the controller (or the only process).
    if not path or not report.failed or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    with open(path, "a", encoding="utf-8") as f:
        f.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")
