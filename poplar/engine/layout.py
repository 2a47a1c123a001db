"""Where each rank's shard lies, and the collectives shaped to the shard groups: :class:`ShardLayout`.

Flat (the default), every rank is in one group: a unit's flat buffer is padded to a
multiple of the world size and rank ``r`` owns its ``r``-th equal slice.

Hybrid (``plan.shard_groups``), the ranks are split into groups, usually one per node.
Each group holds one whole copy of the states, sharded among its ``n`` ranks exactly
as a flat world of ``n`` ranks would shard it: the unit is padded to a multiple of
``n`` and the group's ``i``-th rank owns the ``i``-th slice. Groups may differ in size,
so their slices differ too. Gathers and reduce-scatters run inside the group (over the
fast links); the groups' partial gradients are then summed across groups by
:meth:`ShardLayout.reduce_across`. Where the groups are alike (one size, even shares:
a node each, as a hybrid plan usually is) and three or more, each slice lies on one rank
of every group, its counterparts, and the sum is one all-reduce among them (each rank
moves ``2(k-1)/k`` of its slice over ``k`` groups, as NCCL's ring does). Otherwise each rank
sends the part of its slice that another group's rank owns straight to that rank (one
all-to-all over the world: ``k-1`` copies) and every rank adds the groups' parts in group
order. Either way every copy gets the same bits.

>>> layout = ShardLayout(4, [[0, 1, 2], [3]], 1)   # where rank 1's shards lie (no process group needed)
>>> layout.shard_size, layout.shard_index, layout.replicas
(3, 1, 2)
>>> layout.shard_range(10)      # 10 elements padded to 12, three slices of 4
(4, 8)

Uneven (``plan.shard_shares``), a group's slices follow its ranks' shares: each rank's
slice is its share of the padded unit rounded down, the last rank with a share takes
what the rounding leaves, so equal shares cut it exactly where the even layout does, and ranks
of one share hold slices of one size.

>>> ShardLayout(2, None, 0, shares=[3, 1]).slice_sizes(10)    # 7.5 rounded down, and the rest
(7, 3)
"""

from __future__ import annotations

import functools
from bisect import bisect_right
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction
from itertools import accumulate
from typing import Sequence

import torch
import torch.distributed as dist

from poplar.engine.collectives import Comm


@dataclass(frozen=True)
class _Exchange:
    """One unit's cross-group exchange for this rank (only elements before ``numel`` move).

    A part of this rank's slice that another group's rank owns is sent to that rank, and
    that rank's partial sum over the same part comes back: the sizes are symmetric.
    """

    sizes: list[int]                     # elements to and from each rank, in rank order
    send: list[tuple[int, int]]          # (offset in the slice, length) of each part sent, in rank order
    parts: list[list[tuple[int, int]]]   # per group: (offset in the received buffer, length), in slice order
    valid: int                           # elements of the slice before numel


class ShardLayout:
    """This rank's place in the shard groups, and the collectives over them (see the module)."""

    def __init__(self, world_size: int, groups: Sequence[Sequence[int]] | None, rank: int,
                 shares: Sequence[float] | None = None):
        self.world_size, self.rank = world_size, rank
        self.shares = list(shares) if shares else None    # each rank's weight in its group (None: even)
        self.groups = [list(g) for g in groups] if groups else [list(range(world_size))]
        self.group_index = next(j for j, g in enumerate(self.groups) if rank in g)
        self.members = self.groups[self.group_index]
        self.shard_size = len(self.members)          # ranks sharing one copy of the states
        self.shard_index = self.members.index(rank)  # this rank's slice in its copy
        self.replicas = len(self.groups)             # copies of the states, one per group
        self.comm: Comm | None = None                # the world's (broadcasts, the loss, the norm)
        self.shard_comm: Comm | None = None          # this rank's group's
        self.across_comm: Comm | None = None         # this rank's counterparts' (:attr:`counterparts`), where alike
        self._exchanges: dict[int, _Exchange] = {}
        self._sizes: dict[tuple[int, int], tuple[int, ...]] = {}
        self._group_weights: dict[int, tuple] = {}

    @classmethod
    def build(cls, comm: Comm, groups: Sequence[Sequence[int]] | None,
              shares: Sequence[float] | None = None) -> "ShardLayout":
        """The layout of ``comm``'s rank, with a process group per shard group (every rank must call it)."""
        layout = cls(comm.world_size, groups, comm.rank, shares)
        layout.comm = comm
        layout.make_groups()
        return layout

    def make_groups(self) -> None:
        """Create the shard groups' process groups (again, after the world's group was rebuilt); every rank."""
        comm = self.comm
        if self.replicas == 1:
            self.shard_comm = comm
            return
        base = None if comm.group is None else dist.get_process_group_ranks(comm.group)
        for j, g in enumerate(self.groups):   # every rank creates every group, in one order
            pg = dist.new_group([r if base is None else base[r] for r in g])
            if j == self.group_index:
                self.shard_comm = comm.on_group(pg)
        if self.alike_groups:
            for i in range(self.shard_size):   # the ranks holding each slice, one in every group
                pg = dist.new_group([g[i] if base is None else base[g[i]] for g in self.groups])
                if i == self.shard_index:
                    self.across_comm = comm.on_group(pg)

    @property
    def hybrid(self) -> bool:
        return self.replicas > 1

    @property
    def alike_groups(self) -> bool:
        """Three groups or more, all of one size: cut evenly, each group's ``i``-th rank holds the same slice, and
        the sum across them is an all-reduce among those ranks. (Two groups exchange their parts in one hop each
        way; an all-reduce of two would move the same bytes in two.)"""
        return self.replicas > 2 and len({len(g) for g in self.groups}) == 1

    @property
    def counterparts(self) -> list[int] | None:
        """The ranks that hold this rank's slice, one in every group (this one among them), where every group's
        slices are alike (groups of one size, even shares); else None."""
        if not self.alike_groups or self.shares is not None:
            return None
        return [g[self.shard_index] for g in self.groups]

    # -- where shards lie ---------------------------------------------------------------
    def padded(self, numel: int, size: int | None = None) -> int:
        """``numel`` padded to a multiple of a group's size (this rank's by default)."""
        n = size or self.shard_size
        return -(-numel // n) * n

    @property
    def uneven(self) -> bool:
        return self.shares is not None

    def slice_sizes(self, numel: int, group: int | None = None, even: bool = False) -> tuple[int, ...]:
        """The sizes of a group's slices (this rank's group by default) of a unit of ``numel`` elements, padded
        (``even``: as if every share were equal)."""
        j = self.group_index if group is None else group
        if even or self.shares is None:
            g = self.groups[j]
            return (self.padded(numel, len(g)) // len(g),) * len(g)
        if (numel, j) not in self._sizes:
            total = self.padded(numel, len(self.groups[j]))
            # each its share rounded down, what rounding leaves to the last with a share: ranks of one share hold
            # slices of one size (a gather of them copies each run of alike ranks at once)
            distinct, which, whole, last = self._weights(j)
            size = [int(total * w // whole) for w in distinct]    # one a share (a cluster's kinds: a few)
            sizes = [size[k] for k in which]
            sizes[last] += total - sum(sizes)
            self._sizes[(numel, j)] = tuple(sizes)
        return self._sizes[(numel, j)]

    def _weights(self, j: int) -> tuple[list[Fraction], list[int], Fraction, int]:
        """Group ``j``'s distinct shares as exact fractions, the one each rank has (its index among them), their
        sum over the ranks and the last rank with a share (once a cut)."""
        if j not in self._group_weights:
            shares = [self.shares[r] for r in self.groups[j]]
            index = {w: k for k, w in enumerate(dict.fromkeys(shares))}
            distinct = [Fraction(w) for w in index]
            which = [index[w] for w in shares]
            counts = Counter(which)
            whole = sum(w * counts[k] for k, w in enumerate(distinct))
            self._group_weights[j] = (distinct, which, whole, max(i for i, w in enumerate(shares) if w))
        return self._group_weights[j]

    def shard_range(self, numel: int, group: int | None = None, index: int | None = None,
                    even: bool = False) -> tuple[int, int]:
        """``[start, stop)`` of the padded buffer that a rank owns (this one by default; ``even``: in the even
        cut)."""
        sizes = self.slice_sizes(numel, group, even)
        i = self.shard_index if index is None else index
        start = sum(sizes[:i])
        return start, start + sizes[i]

    # -- from one cut of the slices to another ---------------------------------------------
    def reslice(self, mine: torch.Tensor, numel: int, to_even: bool) -> torch.Tensor:
        """This rank's slice ``mine`` of a unit of ``numel`` elements as the shares cut it, as its slice of the
        even cut (``to_even``), or the other way round (:meth:`recut`)."""
        sizes = self.slice_sizes(numel), self.slice_sizes(numel, even=True)
        held, wanted = sizes if to_even else sizes[::-1]
        return self.recut(mine, held, wanted)

    def recut(self, mine: torch.Tensor, held: Sequence[int], wanted: Sequence[int]) -> torch.Tensor:
        """This rank's slice ``mine`` of the group's cut ``held`` (every rank's slice size, in group order) as its
        slice of the cut ``wanted``. Every rank of the shard group calls it at once: one all-to-all, each rank
        sending each other the part of its slice that the other is to hold."""
        me = self.shard_index
        out = torch.empty(wanted[me], dtype=mine.dtype, device=mine.device)
        send = overlaps(held, wanted, me)          # all of mine, in the order ranks hold it
        receive = overlaps(wanted, held, me)       # all of what I am to hold, in order
        # priced as the unit's all-gather: every element moves at most once
        comm = self.shard_comm
        comm.run("all_gather", out.element_size() * sum(held), lambda a: comm.collectives.all_to_all_single(
            out, mine.contiguous(), receive, send, group=comm.group, async_op=a), False)
        return out

    def set_shares(self, shares: Sequence[float] | None) -> None:
        """Cut the slices at ``shares`` from now on (None: evenly); what the old cut held is the caller's to move
        (:meth:`recut`)."""
        self.shares = list(shares) if shares else None
        self._sizes.clear()
        self._group_weights.clear()
        self._exchanges.clear()

    # -- the sum across groups ----------------------------------------------------------
    def _exchange(self, numel: int) -> _Exchange:
        if numel not in self._exchanges:
            lo, hi = (min(x, numel) for x in self.shard_range(numel))
            sizes, send, spans = [0] * self.world_size, [], []
            for j, g in enumerate(self.groups):
                for i, r in enumerate(g):
                    a, b = self.shard_range(numel, j, i)
                    n = max(0, min(hi, b) - max(lo, a))
                    if j != self.group_index and n:
                        sizes[r] = n
                        spans.append((r, j, max(lo, a) - lo))
            offsets = list(accumulate(sizes[:self.world_size - 1], initial=0))
            parts: list[list[tuple[int, int]]] = [[] for _ in self.groups]
            for r, j, at in sorted(spans):   # rank order: inside a group, also slice order
                send.append((at, sizes[r]))
                parts[j].append((offsets[r], sizes[r]))
            self._exchanges[numel] = _Exchange(sizes, send, parts, hi - lo)
        return self._exchanges[numel]

    def reduce_across(self, shard: torch.Tensor, numel: int, async_op: bool = False):
        """Sum this rank's ``shard`` (its slice of a unit of ``numel`` elements) across the groups, in place.

        Every rank of the world calls it for the same unit at once. Returns a work whose
        ``wait()`` finishes the sum, or ``None`` once it is done unless ``async_op``.
        """
        if self.counterparts is not None and self.across_comm is not None:
            # every group's copy of this slice lies on its counterparts: one all-reduce among them (as NCCL runs it,
            # 2(k-1)/k of the slice a rank), every copy the same bits
            lo, hi = (min(x, numel) for x in self.shard_range(numel))
            return self.across_comm.all_reduce(shard[:hi - lo], async_op=async_op)
        ex = self._exchange(numel)
        mine = shard[:ex.valid]

        def issue(_async):
            sendbuf = torch.cat([mine[a:a + n] for a, n in ex.send]) if ex.send else mine[:0].clone()
            recvbuf = torch.empty(sum(ex.sizes), dtype=shard.dtype, device=shard.device)
            work = self.comm.collectives.all_to_all_single(recvbuf, sendbuf, ex.sizes, ex.sizes,
                                                           group=self.comm.group, async_op=True)
            return SumAcross(work, recvbuf, mine, ex.parts, self.group_index)

        return self.comm.run("reduce_across", numel * shard.element_size(), issue, async_op, groups=self.replicas)


def overlaps(mine: Sequence[int], theirs: Sequence[int], me: int) -> list[int]:
    """How much of rank ``me``'s range in the cut ``mine`` each rank's range in the cut ``theirs`` covers (both cut
    one buffer in rank order): only the ranks whose ranges meet mine, found by bisection (thousands of ranks)."""
    ends = list(accumulate(theirs))
    lo = sum(mine[:me])
    hi = lo + mine[me]
    out = [0] * len(theirs)
    j = bisect_right(ends, lo)       # the first rank whose range ends after mine begins
    while j < len(theirs) and ends[j] - theirs[j] < hi:
        out[j] = max(0, min(hi, ends[j]) - max(lo, ends[j] - theirs[j]))
        j += 1
    return out


def check_collective_sizes(world_size: int, groups: Sequence[Sequence[int]] | None,
                           shares: Sequence[float] | None, numels: Sequence[int]) -> None:
    """Refuse (``ValueError``, one line) a shape whose cross-group exchange two ranks would size differently.

    Every rank's exchange of every unit (``numels``) is derived from the layout alone, so this runs anywhere,
    before any process starts: what rank ``r`` sends rank ``s`` must be what ``s`` expects from ``r``.
    """
    _check_sizes(world_size, tuple(map(tuple, groups)) if groups else None, tuple(shares) if shares else None,
                 tuple(sorted(set(numels))))


@functools.lru_cache(maxsize=64)
def _check_sizes(world_size: int, groups, shares, numels) -> None:
    """:func:`check_collective_sizes`, once a process for a shape (every engine of a simulation builds alike)."""
    if not groups or len(groups) == 1:
        return   # flat: every collective is the world's, of the unit's padded size on every rank alike
    layouts = [ShardLayout(world_size, groups, r, shares) for r in range(world_size)]
    for numel in numels:
        sizes = [layout._exchange(numel).sizes for layout in layouts]
        for r, s in ((r, s) for r in range(world_size) for s in range(r + 1, world_size)):
            if sizes[r][s] != sizes[s][r]:
                raise ValueError(f"shard groups {[list(g) for g in layouts[0].groups]}: in the sum across groups of "
                                 f"a unit of {numel} elements rank {r} would send rank {s} {sizes[r][s]} and rank "
                                 f"{s} would send back {sizes[s][r]}; the engine cannot run this shape")


class SumAcross:
    """The all-to-all in flight; ``wait()`` adds every group's part into the slice, in group order."""

    def __init__(self, work, recvbuf: torch.Tensor, mine: torch.Tensor, parts, own_group: int):
        self._work, self._recv, self._mine, self._parts, self._own = work, recvbuf, mine, parts, own_group

    def wait(self, *args, **kwargs) -> bool:
        if self._work is not None:
            work, self._work = self._work, None
            work.wait(*args, **kwargs)
            if not self._mine.numel():   # a slice of padding only: nothing to add
                return True
            total = None
            for j, parts in enumerate(self._parts):   # the same order on every copy: the same bits
                part = self._mine if j == self._own else torch.cat([self._recv[o:o + n] for o, n in parts])
                total = part.clone() if total is None else total.add_(part)
            self._mine.copy_(total)
        return True

    def is_completed(self) -> bool:
        return self._work is None or self._work.is_completed()
