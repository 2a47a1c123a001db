"""`poplar demo`'s closing table where the GPUs cannot hold the real model (the demo itself, as a user runs it:
tests/compare/test_demo.py)."""

import io

import pytest
from rich.console import Console

from poplar.cli.demo import show_real_size


@pytest.mark.slow      # each card alone is simulated in a worker process
def test_a_real_model_these_gpus_cannot_hold_is_said_in_a_line_and_the_demo_stands():
    # the closing table on GPUs that hold Llama-1B in no stage at full memory (two 16 GB cards): a line saying so
    # and what to give, not a failure after the demo's own runs
    out = io.StringIO()
    assert show_real_size(Console(file=out, width=200), None, "compute-differs", "llama-1b") is None
    said = " ".join(out.getvalue().split())
    assert "llama-1b at full memory on these GPUs: no plan (no stage can run this job" in said, said
    assert "give --real-model a smaller preset, or none" in said, said
