"""Ranks' events followed together: when each collective can start and how long each rank waits.

A rank's step is a list of events (:class:`Compute`, :class:`Issue`, :class:`Wait`,
:class:`StepEnd`). A collective starts once the *last* of the ranks that issue it has
issued it and its link is free of the ones before it (collectives of one process group
run one after another, in issue order, as NCCL's do on their stream and gloo's on its
thread). A rank computes until it must wait for a collective's result; the time it waits
is exposed. :mod:`poplar.planner.schedule` writes the events from the engine's schedule.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Compute:
    seconds: float


@dataclass(frozen=True)
class Issue:
    key: str                 # names the collective (the same on every rank of its group)
    seconds: float           # its time on the link once started
    link: str = ""           # its group's link ("": the world's)


@dataclass(frozen=True)
class Wait:
    key: str


@dataclass(frozen=True)
class StepEnd:
    """The rank's step ends here; the events after it are its next step, begun at once."""


def run_ranks(ranks: list[list]) -> tuple[float, list[float]]:
    """Follow every rank's events together: the step's end and each rank's busy (compute) time.

    A collective starts when every rank that issues it has, and its link is free.
    """
    end, busy, _ = follow_ranks(ranks)
    return end, busy


def _issuers(ranks: list[list]) -> dict[str, list[int]]:
    """The ranks that issue each collective; every rank on a link must issue the same sequence on it."""
    issuers: dict[str, list[int]] = {}
    on_link: dict[str, tuple[int, list[str]]] = {}   # per link: the first rank on it, and its sequence
    for r, events in enumerate(ranks):
        for e in events:
            if isinstance(e, Issue):
                issuers.setdefault(e.key, []).append(r)
        for link in dict.fromkeys(e.link for e in events if isinstance(e, Issue)):
            seq = [e.key for e in events if isinstance(e, Issue) and e.link == link]
            first, expected = on_link.setdefault(link, (r, seq))
            if seq != expected:
                raise ValueError(f"rank {r} issues other collectives than rank {first} on link {link or 'world'}: "
                                 "the ranks of a group must run the same sequence")
    return issuers


def follow_ranks(ranks: list[list]) -> tuple[float, list[float], list[list[float]]]:
    """:func:`run_ranks`, and each rank's clock at each of its :class:`StepEnd`.

    >>> a = [Compute(1.0), Issue("x", 0.5), Compute(3.0), Wait("x"), StepEnd()]
    >>> b = [Compute(2.0), Issue("x", 0.5), Compute(1.0), Wait("x"), StepEnd()]
    >>> follow_ranks([a, b])    # x runs 2-2.5: a ends at 4, b at 3
    (4.0, [4.0, 3.0], [[4.0], [3.0]])
    """
    issuers = _issuers(ranks)
    clock, busy, pos = [0.0] * len(ranks), [0.0] * len(ranks), [0] * len(ranks)
    ends: list[list[float]] = [[] for _ in ranks]
    done: dict[str, float] = {}
    link_free: dict[str, float] = {}

    def advance(r: int) -> Issue | str | None:
        """Run rank ``r`` until it issues a collective not started yet (returned), waits for one, or ends."""
        events = ranks[r]
        while pos[r] < len(events):
            e = events[pos[r]]
            if isinstance(e, Compute):
                clock[r] += e.seconds
                busy[r] += e.seconds
            elif isinstance(e, Wait):
                if e.key not in done:
                    return e.key
                clock[r] = max(clock[r], done[e.key])
            elif isinstance(e, StepEnd):
                ends[r].append(clock[r])
            else:
                return e
            pos[r] += 1
        return None

    at = [advance(r) for r in range(len(ranks))]
    while True:
        waiting = Counter(e.key for e in at if isinstance(e, Issue))   # ranks at each collective, not started
        ready = {e.key: e for e in at if isinstance(e, Issue) and waiting[e.key] == len(issuers[e.key])}
        if not ready:
            if any(a is not None for a in at):
                raise ValueError("the ranks' collectives cannot all start: ranks of a group must issue the same "
                                 "sequence on it")
            return max(clock), busy, ends
        moved = set()
        for key, e in ready.items():
            start = max(max(clock[q] for q in issuers[key]), link_free.get(e.link, 0.0))
            done[key] = link_free[e.link] = start + e.seconds
            for q in issuers[key]:
                pos[q] += 1
            moved.update(issuers[key])
        for r, a in enumerate(at):    # only a rank that issued, or waits for what is done now, goes on
            if r in moved or (isinstance(a, str) and a in done):
                at[r] = advance(r)


def repeated(events: list, steps: int) -> list:
    """``steps`` of a rank's step one after another, each ended by a :class:`StepEnd`, its collectives named
    apart (alike on every rank)."""
    out: list = []
    for k in range(steps):
        out += [replace(e, key=f"{k}:{e.key}") if isinstance(e, (Issue, Wait)) else e for e in events]
        out.append(StepEnd())
    return out
