"""The three tiers, read from the source: the library (tfmp/) imports neither the training
application (tfmp/app/) nor the benchmark (tfmp/bench/); the application imports no
benchmark; no module imports an entry point (`__main__`); tfmp's modules import each other
at module level only (no import inside a function dodging a circle), and in no circle."""

import ast
import pathlib

from conftest import REPO

TFMP = pathlib.Path(REPO) / "tfmp"
TIERS = {"library": 0, "app": 1, "bench": 2}


def module_name(path):
    parts = list(path.relative_to(TFMP.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def tier(module):
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ("app", "bench") else "library"


def is_module(name):
    base = TFMP.parent.joinpath(*name.split("."))
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def imports(tree):
    """(the tfmp modules imported, line, whether at module level) for every import."""
    top = {id(node) for node in tree.body}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # A name that is a module is an edge to it; any other name, to the module it is in.
            names = [
                f"{node.module}.{a.name}" if is_module(f"{node.module}.{a.name}") else node.module for a in node.names
            ]
        else:
            continue
        for name in names:
            if name.split(".")[0] == "tfmp" and is_module(name):
                yield name, node.lineno, id(node) in top


def graph():
    edges = {}
    for path in sorted(TFMP.rglob("*.py")):
        edges[module_name(path)] = list(imports(ast.parse(path.read_text(), str(path))))
    return edges


def test_every_tier_imports_only_its_own_and_lower_ones():
    wrong = [
        f"{module} ({tier(module)}) imports {name} ({tier(name)}), line {line}"
        for module, names in graph().items()
        if not module.endswith("__main__")
        for name, line, _ in names
        if TIERS[tier(name)] > TIERS[tier(module)]
    ]
    assert not wrong, "\n".join(wrong)


def test_nothing_imports_an_entry_point_or_imports_inside_a_function():
    wrong = [
        f"{module} line {line}: {name}"
        for module, names in graph().items()
        for name, line, top in names
        if name.endswith("__main__") or not top
    ]
    assert not wrong, "\n".join(wrong)


def test_no_import_circle():
    edges = {m: {n for n, _, _ in names if n != m} for m, names in graph().items()}
    state = {}

    def visit(module, path):
        state[module] = "open"
        for name in sorted(edges.get(module, ())):
            if state.get(name) == "open":
                raise AssertionError("import circle: " + " -> ".join([*path[path.index(name) :], name]))
            if name not in state:
                visit(name, [*path, name])
        state[module] = "done"

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])


def test_the_checker_sees_a_wrong_import(tmp_path):
    """The rules above catch what they are for: an upward import and a function-level one."""
    tree = ast.parse("from tfmp.app import training\n\ndef f():\n    from tfmp import loop\n")
    found = sorted(imports(tree))
    assert ("tfmp.app.training", 1, True) in found and ("tfmp.loop", 4, False) in found
    assert TIERS[tier("tfmp.app.training")] > TIERS[tier("tfmp.loop")]
