"""Each rank's last collective, kept where its launcher can read it after the rank died.

gloo ends a rank with SIGABRT, not a Python exception, when a collective's size differs
from its peers' ("Received data size doesn't match expected size"): nothing in the rank
can say which collective it was. So, where ``POPLAR_FLIGHT_RECORD_DIR`` names a folder
(the launcher sets it; a user can under torchrun), every rank keeps a small file there,
mapped into memory, holding the plan it runs and the last collective it issued (a count,
the operation, its bytes, its ranks). Writing it is a copy into memory, no system call, and
the page outlives the process. :func:`mismatch_line` reads every rank's and says, in one
line, which rank died in which collective and how the ranks' last collectives differ.

>>> import tempfile
>>> folder = tempfile.mkdtemp()
>>> for rank, nbytes in ((0, 4320), (1, 4312)):
...     rec = FlightRecord(folder, rank)
...     rec.note("plan: ZeRO-1, shard groups [[0], [1]]")
...     rec.record("broadcast", nbytes, None)
>>> print(mismatch_line(folder, 1, 2))
rank 1 died in a collective its peers ran with other sizes (a collective mismatch): its #1 broadcast of 4312 bytes over the world, rank 0's #1 broadcast of 4320 bytes over the world; plan: ZeRO-1, shard groups [[0], [1]]
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

ENV = "POPLAR_FLIGHT_RECORD_DIR"
SIZE = 2048    # bytes per rank: the plan's line and the last few collectives
KEPT = 4       # collectives kept: a peer that got past the one a rank died in is a few ahead of it


class FlightRecord:
    """This rank's record in ``folder``: :meth:`note` what it runs, :meth:`record` each collective issued."""

    def __init__(self, folder: str | os.PathLike, rank: int):
        path = Path(folder) / f"rank-{rank}"
        with open(path, "wb+") as f:
            f.truncate(SIZE)
            self._map = mmap.mmap(f.fileno(), SIZE)
        self._note, self._count = "", 0
        self._last: list[str] = []

    def note(self, text: str) -> None:
        self._note = " ".join(text.split())[:SIZE // 2]

    def record(self, op: str, nbytes: int, ranks: tuple[int, ...] | None) -> None:
        self._count += 1
        where = "the world" if ranks is None else f"ranks {list(ranks)}"
        self._last = [*self._last[-(KEPT - 1):], f"#{self._count} {op} of {nbytes} bytes over {where}"]
        text = "\n".join([self._note, *self._last]).encode()[:SIZE - 1]
        self._map[:len(text) + 1] = text + b"\0"


_record: FlightRecord | None | bool = False   # False: not looked up yet in this process


def recorder() -> FlightRecord | None:
    """This process's record, where the environment asks for one (looked up once, after the group exists)."""
    global _record
    if _record is False:
        import torch.distributed as dist

        folder = os.environ.get(ENV)
        _record = FlightRecord(folder, dist.get_rank()) if folder and dist.is_initialized() else None
    return _record


def read(folder: str | os.PathLike, rank: int) -> tuple[str, list[str]] | None:
    """(the plan's note, the last few collectives, oldest first) of ``rank``'s record; None where it issued none."""
    path = Path(folder) / f"rank-{rank}"
    if not path.exists():
        return None
    note, *issued = path.read_bytes().split(b"\0", 1)[0].decode(errors="replace").split("\n")
    return (note, issued) if issued else None


def mismatch_line(folder: str | os.PathLike, dead: int, world_size: int) -> str | None:
    """One line on the collective ``dead`` died in (its last), beside each peer's collective of the same number;
    None without records."""
    records = {r: read(folder, r) for r in range(world_size)}
    if records.get(dead) is None:
        return None
    note, issued = records[dead]
    last = issued[-1]
    number = last.split(" ", 1)[0]
    peers = {}
    for r, rec in records.items():
        if r != dead and rec is not None:
            same = [x for x in rec[1] if x.split(" ", 1)[0] == number]
            peers[r] = same[0] if same else None
    differ = [r for r, x in peers.items() if x is not None and x != last]
    what = ("died in a collective its peers ran with other sizes (a collective mismatch)" if differ
            else "died in a collective")
    others = "".join(f", rank {r}'s {peers[r]}" for r in differ[:3])
    return f"rank {dead} {what}: its {last}{others}" + (f"; {note}" if note else "")
