"""The versions of tfmp's dependencies that CI tests, and one warning at import for others.

CI's first leg installs the newest version below each ceiling, its second leg each floor
(.ci/floors.txt, generated from requirements.txt, on Python 3.10 where the machine has it).
requirements.txt, pyproject.toml and README's support matrix state the same ranges;
tests/test_package.py checks that they agree with `TESTED`.
"""

import importlib.metadata
import re
import warnings

# Distribution: (floor, ceiling). CI tests the floor and the newest release below the ceiling.
TESTED = {
    "tensorflow": ("2.18", "2.22"),
    "keras": ("3.10", "3.16"),
    "tensorflow-datasets": ("4.9.7", "5"),
}
# Other distributions that install the same package (TensorFlow's release candidates pull
# in keras-nightly, not keras).
_ALIASES = {
    "tensorflow": ("tensorflow", "tensorflow-cpu", "tensorflow-macos", "tf-nightly"),
    "keras": ("keras", "keras-nightly"),
}


def _release(version):
    """(2, 21, 0) for "2.21.0rc1": the release numbers, to compare."""
    match = re.match(r"\d+(\.\d+)*", version)
    return tuple(int(part) for part in match.group(0).split(".")) if match else ()


def installed(name):
    """The installed version of distribution `name` (or of one of its aliases), or None."""
    for alias in _ALIASES.get(name, (name,)):
        try:
            return importlib.metadata.version(alias)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def outside_tested():
    """One sentence per installed dependency outside its tested range (empty when all are in)."""
    problems = []
    for name, (floor, ceiling) in TESTED.items():
        version = installed(name)
        if version is None:
            continue
        release = _release(version)
        if release < _release(floor) or release >= _release(ceiling):
            problems.append(f"{name} {version} (tested: >={floor},<{ceiling})")
    return problems


def warn_outside_tested():
    """Warns once (at `import tfmp`) when a dependency is outside the range CI tests."""
    problems = outside_tested()
    if problems:
        warnings.warn(
            f"tfmp is untested with {'; '.join(problems)}; it may fail in float8, data loading or "
            "distributed training. Install the tested ranges with `pip install -r requirements.txt`.",
            stacklevel=3,
        )
