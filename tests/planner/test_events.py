import random

import pytest

from poplar.planner.events import Compute, Issue, StepEnd, Wait, follow_ranks, repeated


def _reference(ranks: list[list]) -> tuple[float, list[float], list[list[float]]]:
    """The ranks followed in rounds: every collective whose ranks have all issued it starts (in rank order), then
    every rank that can goes on: the plain reading of the rule that :func:`follow_ranks` keeps event by event."""
    issuers: dict[str, list[int]] = {}
    for r, events in enumerate(ranks):
        for e in events:
            if isinstance(e, Issue):
                issuers.setdefault(e.key, []).append(r)
    clock, busy, pos = [0.0] * len(ranks), [0.0] * len(ranks), [0] * len(ranks)
    ends: list[list[float]] = [[] for _ in ranks]
    done: dict[str, float] = {}
    link_free: dict[str, float] = {}
    while True:
        for r, events in enumerate(ranks):     # each rank as far as it goes
            while pos[r] < len(events):
                e = events[pos[r]]
                if isinstance(e, Compute):
                    clock[r] += e.seconds
                    busy[r] += e.seconds
                elif isinstance(e, StepEnd):
                    ends[r].append(clock[r])
                elif isinstance(e, Wait) and e.key in done:
                    clock[r] = max(clock[r], done[e.key])
                else:
                    break
                pos[r] += 1
        at = [events[p] if p < len(events) else None for p, events in zip(pos, ranks)]
        ready = {e.key: e for e in at if isinstance(e, Issue)
                 and sum(isinstance(a, Issue) and a.key == e.key for a in at) == len(issuers[e.key])}
        if not ready:
            assert all(a is None for a in at), "stuck"
            return max(clock), busy, ends
        for key, e in ready.items():
            start = max(max(clock[q] for q in issuers[key]), link_free.get(e.link, 0.0))
            done[key] = link_free[e.link] = start + e.seconds
            for q in issuers[key]:
                pos[q] += 1


def _random_ranks(rng: random.Random) -> list[list]:
    """Ranks in groups (each a link of its own, beside the world's), issuing their collectives in one global
    order, computing between, each waiting for some of its collectives a while after issuing them."""
    n = rng.randrange(1, 7)
    groups = rng.randrange(1, n + 1)
    group_of = [rng.randrange(groups) for _ in range(n)]
    order = []       # (key, link, seconds, issuers)
    for i in range(rng.randrange(1, 25)):
        if rng.random() < 0.4:
            order.append((f"w{i}", "", rng.uniform(0, 2), list(range(n))))
        else:
            g = rng.randrange(groups)
            members = [r for r in range(n) if group_of[r] == g]
            if members:
                order.append((f"g{i}", f"n{g}", rng.uniform(0, 2), members))
    ranks = []
    for r in range(n):
        events, open_keys = [], []
        for key, link, seconds, members in order:
            if r not in members:
                continue
            events += [Compute(rng.uniform(0, 3))] * rng.randrange(0, 3)
            events.append(Issue(key, seconds, link))
            open_keys.append(key)
            while open_keys and rng.random() < 0.5:
                events.append(Wait(open_keys.pop(rng.randrange(len(open_keys)))))
        events += [Compute(rng.uniform(0, 3)), *(Wait(k) for k in open_keys)]
        ranks.append(events)
    return ranks


@pytest.mark.parametrize("seed", range(300))
def test_ranks_followed_event_by_event_are_the_ranks_followed_in_rounds(seed):
    rng = random.Random(seed)
    ranks = _random_ranks(rng)
    if rng.random() < 0.3:
        ranks = [repeated(events, 2) for events in ranks]
    end, busy, ends = follow_ranks(ranks)
    want_end, want_busy, want_ends = _reference(ranks)
    assert end == pytest.approx(want_end, rel=1e-12)
    assert busy == pytest.approx(want_busy, rel=1e-12)
    assert [e == pytest.approx(w, rel=1e-12) for e, w in zip(ends, want_ends)] == [True] * len(ranks)


def test_ranks_of_a_group_that_issue_other_sequences_are_refused():
    a = [Issue("x", 1.0), Issue("y", 1.0), Wait("x"), Wait("y")]
    b = [Issue("y", 1.0), Issue("x", 1.0), Wait("x"), Wait("y")]
    with pytest.raises(ValueError, match="rank 1 issues other collectives than rank 0 on link world"):
        follow_ranks([a, b])
    c = [Issue("x", 1.0, "n0"), Wait("x")]
    d = [Wait("x"), Issue("x", 1.0, "n0")]     # waits for a collective before it issues it: never starts
    with pytest.raises(ValueError, match="cannot all start"):
        follow_ranks([c, d])
