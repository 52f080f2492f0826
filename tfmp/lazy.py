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
            sorted imports have it; TensorFlow's import loads it too), else with the first
            public name used.
    """
    package = namespace["__name__"]

    def register():
        for module in serializable:
            importlib.import_module(module)

    if "keras" in sys.modules:
        register()

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
