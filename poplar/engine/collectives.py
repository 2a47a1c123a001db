"""The collectives the engine uses, in one place: all-reduce, reduce-scatter, all-gather, broadcast.

All take flat, contiguous tensors whose length is a multiple of the world size (units
are padded for that), so they map onto the even-sized collectives every backend has.
Shards of unlike sizes (a plan's ``shard_shares``) are the exception: their
reduce-scatter takes the list form (uneven lists work on gloo and NCCL alike), their
all-gather gathers slices padded to the largest into a buffer of its own and copies each
rank's part out when waited for (gloo cannot all-gather uneven lists).

They are methods of a :class:`Comm`, bound to one process group (``None``: the default
group, looked up at each call, so a group rebuilt after a failure is picked up). The
engine is given its ``Comm`` and issues every collective through it; a second engine,
or one on a sub-group, has its own. Whatever wants to observe or pace the communication
(a GPU timer separating compute from waiting, a modelled cluster's network) gives an
:class:`ObservedComm`: every collective then tells its observer ``launch(op, nbytes,
group, groups)`` before it is issued, and its wait goes through ``wait(token, real_wait)``.
A comm on a sub-group (:meth:`Comm.on_group`) tells the same observer. A device
hands out its own as ``device.comm``. The engine never sees the difference.

>>> class Counter:
...     def __init__(self): self.ops = []
...     def launch(self, op, nbytes, group=None, groups=1): self.ops.append((op, nbytes))
...     def wait(self, token, real_wait): real_wait()
>>> counter = Counter()
>>> comm = ObservedComm(counter)
>>> comm.all_reduce(torch.ones(4))   # doctest: +SKIP
>>> counter.ops                      # doctest: +SKIP
[('all_reduce', 16)]

(The all-reduce needs a process group: ``torch.distributed.init_process_group`` first.)
"""

from __future__ import annotations

from itertools import groupby
from typing import Any, Callable, Protocol, Sequence

import torch
import torch.distributed as dist

from poplar.engine import flight
from poplar.engine.dist import init_distributed

# torch 2.13 renamed the *_tensor collectives; keep working on older releases too.
all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

SUM = dist.ReduceOp.SUM


class TorchCollectives:
    """The collectives themselves: torch.distributed's, looked up at each call (a wrapper a peer installs over
    them is seen). A :class:`Comm` issues every collective through its ``collectives``; a comm that runs none
    (the simulator's) gives its own, and everything around them runs as it does here."""

    def __getattr__(self, name: str):
        return getattr(dist, name)

    all_gather_tensor = staticmethod(all_gather_tensor)
    reduce_scatter_tensor = staticmethod(reduce_scatter_tensor)

    @staticmethod
    def reduce_scatter_uneven(output, input, sizes, group=None, async_op=False):
        """The list form of a reduce-scatter, ``input`` cut at ``sizes`` (views, cut here: a comm that issues
        nothing cuts nothing, where there are thousands of ranks)."""
        return dist.reduce_scatter(output, list(input.split(list(sizes))), op=SUM, group=group, async_op=async_op)


TORCH = TorchCollectives()


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _even(sizes: Sequence[int] | None) -> bool:
    return sizes is None or len(set(sizes)) <= 1


def _runs(sizes: Sequence[int]) -> list[tuple[int, int]]:
    """``(size, count)`` of each run of equal sizes, in order."""
    return [(n, sum(1 for _ in run)) for n, run in groupby(sizes)]


class _UnevenGather:
    """An all-gather of shards of unlike sizes: each padded to the largest and gathered into a buffer of its
    own; every rank's part is copied into ``output`` when the gather is waited for."""

    def __init__(self, output: torch.Tensor, input: torch.Tensor, sizes: list[int], group, collectives=TORCH):
        self.output, self.sizes, self.group, self.collectives = output, sizes, group, collectives
        self.largest = max(sizes)
        self.gathered = torch.empty(len(sizes) * self.largest, dtype=output.dtype, device=output.device)
        self.mine = torch.zeros(self.largest, dtype=output.dtype, device=output.device)
        self.mine[:input.numel()].copy_(input)
        self._work = None

    def issue(self, async_op: bool):
        self._work = self.collectives.all_gather_tensor(self.gathered, self.mine, group=self.group, async_op=True)
        if async_op:
            return self
        self.wait()
        return None

    def wait(self, *args, **kwargs) -> bool:
        if self._work is not None:
            work, self._work = self._work, None
            work.wait(*args, **kwargs)
            # ranks of one size in a row, as one strided copy (a cluster's kinds: a few, not one a rank)
            at, first, width = 0, 0, self.largest
            for size, ranks in _runs(self.sizes):
                if size:     # ranks that hold nothing: nothing to copy (no launch)
                    block = self.gathered[first * width:(first + ranks) * width].view(ranks, width)[:, :size]
                    self.output[at:at + ranks * size].view(ranks, size).copy_(block)
                at, first = at + ranks * size, first + ranks
            self.gathered = self.mine = None
        return True

    def is_completed(self) -> bool:
        return self._work is None or self._work.is_completed()


class Comm:
    """The collectives on one process group (``group=None``: the default group).

    Every method takes ``async_op``: when true it returns a work whose ``wait()``
    blocks until the collective is done, else it returns ``None`` once it is done.
    """

    collectives = TORCH   # what issues the collectives themselves

    def __init__(self, group: dist.ProcessGroup | None = None):
        self._group = group
        self._ranks: tuple[int, ...] | None = None   # the group's global ranks, once looked up

    @property
    def group(self) -> dist.ProcessGroup | None:
        return self._group

    def on_group(self, group: dist.ProcessGroup) -> "Comm":
        """The same kind of comm (observed by the same observer) on another process group."""
        return Comm(group)

    def torch_device(self) -> torch.device:
        """Where the tensors of its collectives live: the default group's device (the group joined, or one of this
        process alone made, as :func:`~poplar.engine.dist.init_distributed` does)."""
        return init_distributed().device

    @property
    def rank(self) -> int:
        return dist.get_rank(self._group)

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self._group)

    def run(self, op: str, nbytes: int, issue: Callable[[bool], Any], async_op: bool, groups: int = 1):
        """Issue one collective: ``issue(async_op)`` calls torch.distributed (``nbytes``: the full buffer's).

        ``groups``: for ``reduce_across`` (:mod:`poplar.engine.layout`), the groups it sums across.
        The rank's flight record (:mod:`poplar.engine.flight`), where there is one, notes it first.
        """
        record = flight.recorder()
        if record is not None:
            record.record(op, nbytes, self._group_ranks())
        return self._run(op, nbytes, issue, async_op, groups)

    def _run(self, op: str, nbytes: int, issue: Callable[[bool], Any], async_op: bool, groups: int):
        return issue(async_op)

    def _group_ranks(self) -> tuple[int, ...] | None:
        if self._group is None:
            return None
        if self._ranks is None:
            self._ranks = tuple(dist.get_process_group_ranks(self._group))
        return self._ranks

    def all_reduce(self, tensor: torch.Tensor, op=SUM, async_op: bool = False):
        g = self._group
        return self.run("all_reduce", _bytes(tensor),
                        lambda a: self.collectives.all_reduce(tensor, op=op, group=g, async_op=a), async_op)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False,
                       sizes: Sequence[int] | None = None):
        """Sum ``input`` (full, padded) over ranks; this rank receives its ``output`` shard (``sizes``: every
        rank's, in rank order, where they differ)."""
        g = self._group
        if _even(sizes):
            return self.run("reduce_scatter", _bytes(input),
                            lambda a: self.collectives.reduce_scatter_tensor(output, input, op=SUM, group=g,
                                                                                async_op=a), async_op)
        return self.run("reduce_scatter", _bytes(input),
                        lambda a: self.collectives.reduce_scatter_uneven(output, input, sizes, group=g, async_op=a),
                        async_op)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False,
                   sizes: Sequence[int] | None = None):
        """Concatenate every rank's ``input`` shard into ``output`` (full, padded; ``sizes``: every rank's
        shard, in rank order, where they differ)."""
        g = self._group
        if _even(sizes):
            return self.run("all_gather", _bytes(output),
                            lambda a: self.collectives.all_gather_tensor(output, input, group=g, async_op=a),
                            async_op)
        gather = _UnevenGather(output, input, list(sizes), g, self.collectives)   # padded here, before the issue
        return self.run("all_gather", len(sizes) * gather.largest * output.element_size(), gather.issue, async_op)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False):
        """``tensor`` from the group's rank ``src`` to every rank."""
        g = self._group
        src = src if g is None else dist.get_global_rank(g, src)
        return self.run("broadcast", _bytes(tensor),
                        lambda a: self.collectives.broadcast(tensor, src=src, group=g, async_op=a), async_op)

    def barrier(self) -> None:
        self.run("barrier", 0, lambda a: self.collectives.barrier(group=self._group, async_op=a), False)

    def agree(self, values: list[int], device: torch.device) -> tuple[list[int], list[int]]:
        """Element-wise (min, max) of integer ``values`` across ranks: one small all-reduce."""
        t = torch.tensor(values + [-v for v in values], dtype=torch.int64, device=device)
        self.all_reduce(t, op=dist.ReduceOp.MAX)
        n = len(values)
        return [-int(v) for v in t[n:].tolist()], [int(v) for v in t[:n].tolist()]


class Observer(Protocol):
    """What observes or paces the collectives of an :class:`ObservedComm` (a device)."""

    def launch(self, op: str, nbytes: int, group: dist.ProcessGroup | None = None, groups: int = 1) -> Any:
        """Called before a collective moving ``nbytes`` (the full buffer's size) over ``group`` (None: the
        default group) is issued; returns a token. ``groups``: see :meth:`Comm.run`."""

    def wait(self, token: Any, real_wait: Callable[[], Any]) -> None:
        """Called to wait for that collective; must call ``real_wait()``."""


class Work:
    """An issued collective; :meth:`wait` blocks until it is done, through the observer."""

    __slots__ = ("_work", "_observer", "_token")

    def __init__(self, work, obs: Observer, token: Any):
        self._work, self._observer, self._token = work, obs, token

    def wait(self, *args, **kwargs) -> bool:
        if self._work is not None:
            work, self._work = self._work, None   # a second wait is a no-op, as torch's is
            self._observer.wait(self._token, lambda: work.wait(*args, **kwargs))
        return True

    def is_completed(self) -> bool:
        return self._work is None or self._work.is_completed()


class ObservedComm(Comm):
    """A :class:`Comm` whose every collective ``observer`` sees launched and waited for."""

    def __init__(self, observer: Observer, group: dist.ProcessGroup | None = None):
        super().__init__(group)
        self.observer = observer

    def on_group(self, group: dist.ProcessGroup) -> "ObservedComm":
        return ObservedComm(self.observer, group)

    def _run(self, op: str, nbytes: int, issue: Callable[[bool], Any], async_op: bool, groups: int):
        obs = self.observer
        token = obs.launch(op, nbytes, self._group, groups)
        work = Work(issue(True), obs, token)
        if async_op:
            return work
        work.wait()
        return None
