"""A package's names imported when first asked for (PEP 562): a command that refuses its input does so before
torch is imported (seconds)."""

from __future__ import annotations

import importlib


def lazy_attributes(package: str, attributes: dict[str, str]):
    """A module ``__getattr__`` for ``package``: each of ``attributes`` (name: the module that defines it), and the
    package's submodules, as eager imports would have left them."""
    def __getattr__(name: str):
        if name in attributes:
            return getattr(importlib.import_module(attributes[name]), name)
        if not name.startswith("_"):
            try:
                return importlib.import_module(f"{package}.{name}")
            except ModuleNotFoundError as e:
                if e.name != f"{package}.{name}":
                    raise
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    return __getattr__
