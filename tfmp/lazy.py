"""Public names a package loads on first use (PEP 562), so that importing the package loads
no TensorFlow: the command-line entry points silence its start-up lines before it loads."""

import importlib


def names(namespace, exports, modules=()):
    """(`__getattr__`, `__dir__`) for the package whose globals are `namespace`.

    Args:
        namespace: the package's `globals()`, its `__all__` defined; a name, once loaded, is kept there.
        exports: {public name: the module that defines it}.
        modules: submodules offered as attributes (`tfmp.float8`).
    """
    package = namespace["__name__"]

    def __getattr__(name):
        if name in modules:
            return importlib.import_module(f"{package}.{name}")
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = namespace[name] = getattr(importlib.import_module(exports[name]), name)
        return value

    def __dir__():
        return list(namespace["__all__"])

    return __getattr__, __dir__
