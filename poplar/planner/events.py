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
from typing import NamedTuple

# Events are named tuples: immutable (a schedule's lists are shared), and made by the hundred thousand a plan.


class Compute(NamedTuple):
    seconds: float


class Issue(NamedTuple):
    key: str                 # names the collective (the same on every rank of its group)
    seconds: float           # its time on the link once started
    link: str = ""           # its group's link ("": the world's)


class Wait(NamedTuple):
    key: str


class StepEnd(NamedTuple):
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
        sequences: dict[str, list[str]] = {}
        for e in events:
            if type(e) is Issue:
                issuers.setdefault(e.key, []).append(r)
                sequences.setdefault(e.link, []).append(e.key)
        for link, seq in sequences.items():
            first, expected = on_link.setdefault(link, (r, seq))
            if seq != expected:
                raise ValueError(f"rank {r} issues other collectives than rank {first} on link {link or 'world'}: "
                                 "the ranks of a group must run the same sequence")
    return issuers


def follow_ranks(ranks: list[list]) -> tuple[float, list[float], list[list[float]]]:
    """:func:`run_ranks`, and each rank's clock at each of its :class:`StepEnd`.

    Each collective starts once its last rank has issued it; a rank goes on when it has issued a collective that
    starts, or the one it waits for is done. (A link's ranks issue one sequence on it, so one of its collectives
    at most is ready at a time: the order in which ready ones start does not change any time.)

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
    arrived: Counter = Counter()             # ranks at each collective not started yet
    blocked: dict[str, list[int]] = {}       # ranks waiting for each collective to be done
    ready: list[Issue] = []                  # collectives every rank that issues them has issued

    def advance(r: int) -> None:
        """Run rank ``r`` until it issues a collective, waits for one not done, or ends."""
        events, p, c, b = ranks[r], pos[r], clock[r], busy[r]
        while p < len(events):
            e = events[p]
            kind = type(e)
            if kind is Compute:
                c += e.seconds
                b += e.seconds
            elif kind is Wait:
                if e.key not in done:
                    blocked.setdefault(e.key, []).append(r)
                    break
                c = max(c, done[e.key])
            elif kind is StepEnd:
                ends[r].append(c)
            else:
                arrived[e.key] += 1
                if arrived[e.key] == len(issuers[e.key]):
                    ready.append(e)
                break
            p += 1
        pos[r], clock[r], busy[r] = p, c, b

    for r in range(len(ranks)):
        advance(r)
    while ready:
        e = ready.pop()
        start = max(max(clock[q] for q in issuers[e.key]), link_free.get(e.link, 0.0))
        done[e.key] = link_free[e.link] = start + e.seconds
        for q in issuers[e.key]:
            pos[q] += 1
            advance(q)
        for q in blocked.pop(e.key, ()):
            advance(q)
    if any(p < len(events) for p, events in zip(pos, ranks)):
        raise ValueError("the ranks' collectives cannot all start: ranks of a group must issue the same sequence on it")
    return max(clock), busy, ends


def repeated(events: list, steps: int) -> list:
    """``steps`` of a rank's step one after another, each ended by a :class:`StepEnd`, its collectives named
    apart (alike on every rank)."""
    out: list = []
    for k in range(steps):
        out += [e._replace(key=f"{k}:{e.key}") if type(e) in (Issue, Wait) else e for e in events]
        out.append(StepEnd())
    return out
