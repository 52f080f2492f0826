"""Public names a package loads on first use (PEP 562), so that importing the package loads
no TensorFlow: the command-line entry points silence its start-up lines before it loads."""

import importlib
import sys


def names(namespace, exports, modules=(), serializable=()):
    """(`__getattr__`, `__dir__`) for the package whose globals are `namespace`.

    Args:
        namespace: the package's `globals()`, its `__all__` defined; a name, once loaded, is kept there.
        exports: {public name: the module that defines it}.
        modules: submodules offered as attributes (`tfmp.float8`).
        serializable: the modules that register classes with Keras' saving, which finds a
            class a `.keras` file names ("tfmp>ClassificationHead") only once its module has
            run: loaded now where Keras is loaded already (imported before the package, as
            sorted imports have it), else as soon as Keras' import ends, or with the first
            public name used if that comes first.
    """
    package = namespace["__name__"]
    hook = None

    def register():
        if hook in sys.meta_path:
            sys.meta_path.remove(hook)
        for module in serializable:
            importlib.import_module(module)

    if serializable and "keras" in sys.modules:
        register()
    elif serializable:
        hook = AfterImport(("keras", "tensorflow"), register, within=package)
        sys.meta_path.insert(0, hook)

    def __getattr__(name):
        if name in modules:
            value = importlib.import_module(f"{package}.{name}")
        elif name in exports:
            value = namespace[name] = getattr(importlib.import_module(exports[name]), name)
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        register()
        return value

    def __dir__():
        return list(namespace["__all__"])

    return __getattr__, __dir__


class AfterImport:
    """An import hook (a finder on `sys.meta_path`) that calls `then()` once Keras has been
    imported: when the outermost import under way of the `watched` packages or of the modules
    `within` a package ends, where Keras is then loaded. Not before: TensorFlow's import
    imports Keras partway through, a module of the package may import Keras before it defines
    what `then` imports from it, and `then` needs them whole. The finder finds nothing itself;
    it wraps the loader the other finders give, for that module's execution only."""

    def __init__(self, watched, then, within):
        self.watched, self.then, self.prefix = watched, then, within + "."
        self.running = 0  # Imports under way that it watches (nested: TensorFlow's holds Keras').
        self.searching = False

    def find_spec(self, name, path=None, target=None):
        if not (name in self.watched or name.startswith(self.prefix)) or self.searching:
            return None
        self.searching = True  # Another finder may search sys.meta_path itself.
        try:
            spec = next((s for s in (_spec(f, name, path, target) for f in sys.meta_path if f is not self) if s), None)
        finally:
            self.searching = False
        if spec is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _Watched(spec.loader, self)
        return spec

    def ran(self, loader, module):
        module.__spec__.loader = module.__loader__ = loader  # The module keeps its own loader.
        self.running += 1
        try:
            loader.exec_module(module)
        finally:
            self.running -= 1
        if not self.running and "keras" in sys.modules:
            self.then()


def _spec(finder, name, path, target):
    find_spec = getattr(finder, "find_spec", None)
    return find_spec(name, path, target) if find_spec else None


class _Watched:
    """A loader that runs another's `exec_module` under an `AfterImport`'s count, and is that
    loader for everything else (`python -m` runs a module through `get_code`, not `exec_module`)."""

    def __init__(self, loader, hook):
        self.loader, self.hook = loader, hook

    def __getattr__(self, name):
        return getattr(self.loader, name)

    def exec_module(self, module):
        self.hook.ran(self.loader, module)
