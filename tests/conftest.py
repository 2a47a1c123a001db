"""How the suite is run: its markers (``slow``, ``paced``: ``tests/markers.py``), the guard that fails a test
not marked ``slow`` that starts a process (``tests/no_process.py``), and the tests side by side, paced ones
alone (``tests/parallel.py``)."""

from __future__ import annotations

pytest_plugins = ["pytester", "tests.markers", "tests.no_process", "tests.parallel"]


def pytest_sessionstart(session):
    # as Poplar's own processes do (poplar.lazy.imported_for_good): what the tests import lives as long as the
    # session, and a collection (the simulator's, in this process) scans only what the tests make
    import torch  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401

    import poplar.simulate.profile  # noqa: F401
    from poplar.lazy import imported_for_good

    imported_for_good()
