"""Tests of the integrations; :func:`profile_cache_files` is what their cluster-alone runs compare."""

import os
from pathlib import Path


def profile_cache_files() -> dict:
    """Every file of the profile cache (``POPLAR_CACHE_DIR``) and when it was written: a run that profiled
    changes it, one that read its profile from the cache does not."""
    root = Path(os.environ["POPLAR_CACHE_DIR"])
    return {str(p): p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()} if root.exists() else {}
