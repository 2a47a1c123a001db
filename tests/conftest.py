"""How the suite is run: which tests are slow, and which must not share the machine's cores.

- ``slow``: tests that start processes (ranks, the CLI, torchrun). ``python -m pytest -q -m
  "not slow"`` runs the rest in seconds.
- ``paced``: tests whose assertions are about time (an emulated device keeping its declared
  pace, heartbeats, deadlines): run them on a quiet machine (``-m paced``). They are why the
  suite runs one test at a time: two of them side by side compete for the cores.
"""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

# modules whose tests start processes
SLOW = {
    "data/test_text.py", "devices/test_base.py", "devices/test_emulated.py", "engine/test_collectives.py",
    "engine/test_equivalence.py", "engine/test_errors.py", "engine/test_features.py", "engine/test_memory.py",
    "engine/test_shapes.py",
    "engine/test_nonfinite.py", "peers/test_deepspeed.py", "planner/test_planner.py", "profile/test_discover.py",
    "profile/test_fidelity.py", "profile/test_profiler.py", "profile/test_units.py", "simulate/test_profile.py",
    "cli/test_simulate.py",
    "test_bad_input.py",
    "test_bench.py", "test_bench_engine.py", "test_demo.py", "test_launch.py", "train/test_checkpoint.py",
    "train/test_faults.py", "train/test_real_devices.py", "train/test_train.py", "train/test_two_node.py",
    "train/test_watchdog.py", "train/test_your_model.py",
    "cli/test_before_torch.py", "engine/test_flight.py", "engine/test_fp16.py", "engine/test_set_plan.py",
    "engine/test_weights.py", "integrations/test_deepspeed_config.py", "integrations/test_hf.py",
    "integrations/test_lightning.py", "integrations/test_lightning_cuda.py", "integrations/test_replan.py",
    "profile/test_anatomy.py",
    "profile/test_procedure.py", "test_sigterm.py", "test_workload.py", "train/test_precision.py",
    "train/test_replan_runs.py",
}
# modules whose assertions are about time
PACED = {
    "devices/test_emulated.py", "profile/test_fidelity.py", "profile/test_profiler.py", "peers/test_deepspeed.py",
    "train/test_two_node.py", "train/test_watchdog.py", "engine/test_errors.py", "test_launch.py",
}


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: starts processes (ranks, the CLI, torchrun); -m 'not slow' skips it")
    config.addinivalue_line("markers", "paced: asserts about time; never beside another paced test")


def pytest_sessionstart(session):
    # as Poplar's own processes do (poplar.lazy.imported_for_good): what the tests import lives as long as the
    # session, and a collection (the simulator's, in this process) scans only what the tests make
    import torch  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401

    import poplar.simulate.profile  # noqa: F401
    from poplar.lazy import imported_for_good

    imported_for_good()


def pytest_collection_modifyitems(config, items):
    for item in items:
        where = Path(item.fspath).resolve().relative_to(HERE).as_posix()
        if where in SLOW:
            item.add_marker(pytest.mark.slow)
        if where in PACED:
            item.add_marker(pytest.mark.paced)
