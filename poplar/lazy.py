"""A package's names imported when first asked for (PEP 562): a command that refuses its input does so before
torch is imported (seconds)."""

from __future__ import annotations

import atexit
import functools
import gc
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


def imported_for_good() -> None:
    """Keep what this process has imported (torch, transformers: hundreds of thousands of objects, alive as long
    as the process) out of the garbage collector's reach, so that a collection scans only what was made since (the
    memory probe collects after every trial). Only in a process of Poplar's own (a rank, a worker, a command) and
    before it builds anything: an object alive now that later falls into a reference cycle is never freed."""
    gc.freeze()


@functools.cache   # registered once a process
def no_last_collection() -> None:
    """At this process's exit, its objects are left to the exit, not walked by one more collection of the whole heap
    first (most of a simulation's exit). Only in a command that writes and closes its files itself: a file left to
    the collector to close would not be flushed."""
    atexit.register(gc.freeze)
