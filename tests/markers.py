"""The suite's two markers, declared by what a test does; no list of paths does it for it.

- ``slow``: starts processes (ranks, the CLI, torchrun, a worker). Declared where the process is started: on
  the test (``@pytest.mark.slow``), on its module (``pytestmark = pytest.mark.slow``), or by a fixture that
  starts them requesting :func:`starts_processes`: every test that uses such a fixture, directly or through
  another, is marked. ``python -m pytest -q -m "not slow"`` runs the rest in under a minute and starts no
  process: ``tests/no_process.py`` fails a test not marked ``slow`` that starts one, in every run.
- ``paced``: asserts about time (an emulated device keeping its declared pace, heartbeats, deadlines, a run
  held to its prediction). Declared on the test or its module. It runs with no other test beside it, also
  under pytest-xdist (``tests/parallel.py``); ``-m paced`` runs them alone.

A pytest plugin, registered by ``tests/conftest.py``.
"""

from __future__ import annotations

import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: starts processes (ranks, the CLI, torchrun); -m 'not slow' skips it")
    config.addinivalue_line("markers", "paced: asserts about time; runs with no other test beside it")


@pytest.fixture(scope="session")
def starts_processes():
    """Requested by a fixture (or test) that starts processes: each test that uses it is marked ``slow``::

        @pytest.fixture(scope="module")
        def ranks(starts_processes):
            return spawn(work, 2)
    """


@pytest.hookimpl(tryfirst=True)     # before -m deselects by the markers
def pytest_collection_modifyitems(config, items):
    for item in items:
        if "starts_processes" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
