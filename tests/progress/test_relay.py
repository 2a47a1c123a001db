"""Every rank's progress events reach rank 0's display: real ranks (``poplar.processes.spawn.spawn``) and their store."""

import re

import pytest

from poplar.processes.spawn import spawn
from tests.progress.relay_workers import KINDS, report_twice


@pytest.mark.slow
def test_rank_zero_shows_every_ranks_stages_each_wait_its_own():
    printed = spawn(report_twice, 3, timeout_s=120)[0]
    for wait, text in zip(("first", "second"), printed):
        lines = text.splitlines()
        assert lines[0] == f"{wait}: profiling"
        for kind in KINDS:
            for stage in (0, 1):
                mine = [line for line in lines if line.startswith(f"{wait}: {kind} stage {stage}: ")]
                assert mine[0] == f"{wait}: {kind} stage {stage}: memory", text
                assert len(mine) == 2 and re.fullmatch(rf"{wait}: {kind} stage {stage}: done \(\d+ s\)", mine[1])
        assert len(lines) == 1 + 2 * 2 * len(KINDS)    # each event once, none of the other wait's
