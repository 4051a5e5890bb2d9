"""Lazy package exports (PEP 562): a package names what it exports and from which module; a name's module is
imported the first time the name is used, so that importing the package (e.g. for the ``launch`` command line,
which needs neither Lightning nor TorchRec) costs only the modules it actually uses."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable, Mapping
from typing import Any


def exports(package: str, names: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package`` exporting each ``name`` of ``names`` from the module
    ``names[name]``; a public name that is no export but a submodule of ``package`` imports that submodule."""

    def __getattr__(name: str) -> Any:
        module = names.get(name)
        if module is not None:
            value = getattr(importlib.import_module(module), name)
        elif not name.startswith("_") and importlib.util.find_spec(f"{package}.{name}") is not None:
            value = importlib.import_module(f"{package}.{name}")
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        setattr(sys.modules[package], name, value)  # the next use finds it without this function
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *names})

    return __getattr__, __dir__
