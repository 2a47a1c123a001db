"""Caches of a test's own, a fixed pace and a wide console: what a test of a command's output and files sets."""

from __future__ import annotations

from pathlib import Path


def own_caches(monkeypatch, root: Path) -> None:
    """Prepared data and profiles cached under ``root`` (nothing read from, or left in, the user's caches), the
    emulated pace fixed (dilation 3: no probe), and lines as wide as a command writes them (one line, unwrapped)."""
    monkeypatch.setenv("POPLAR_DATA_CACHE", str(root / "data"))
    monkeypatch.setenv("POPLAR_CACHE_DIR", str(root / "profiles"))
    monkeypatch.setenv("POPLAR_DILATION", "3")
    monkeypatch.setenv("COLUMNS", "300")
