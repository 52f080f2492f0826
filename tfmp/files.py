"""Files a run writes beside its checkpoints, written whole or not at all."""

import json
import os
import tempfile


def write_json(path, obj):
    """Writes `obj` as JSON to `path` via a temporary file in the same directory and a
    rename: a reader (or a run killed mid-write) never sees it half-written."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=directory, delete=False, suffix=".tmp") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        tmp = f.name
    os.replace(tmp, path)
