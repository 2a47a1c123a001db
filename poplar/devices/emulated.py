"""One emulated GPU: real work on the CPU, at the pace of a declared device and network.

Every rank runs the real forward, backward, optimizer update and gloo collectives, so
the numbers it trains are real. Its *time* is the declared model's:

- Compute. Inside a step, every operator adds its modelled GPU time
  (:mod:`poplar.emulate.model`) to the rank's device clock ``T``.
- Collectives. Each is launched at the rank's ``T``; a small all-reduce beside it, on
  the same process group, tells its ranks the latest launch. The collectives of one
  group hold its links one after another, in issue order (as on a GPU's communication
  stream): one in a step starts at the later of its latest launch and the end of the
  group's one before it, and takes its time over the links among the group's ranks
  (:mod:`poplar.emulate.network`). Every rank of a group issues the same collectives on
  it, so they agree on when the group's link is free; a node's group and the world's
  have a queue each. It overlaps compute as on a GPU: a
  rank that waits for it later than that waits for nothing.
- Pace. One time dilation ``D`` for the whole cluster maps device seconds to wall
  seconds. Wherever the rank could be observed (a wait for a collective, a read of the
  clock) it sleeps until the wall clock reads ``origin + D * T``. ``D`` is chosen at
  start from the host (:func:`poplar.emulate.dilation.choose_dilation`), large enough
  that the real work fits inside its declared time, so ranks sharing cores or a noisy
  host change nothing. A span whose real work ran past its declared time is an
  *overrun*: counted (``overruns``) and reported with the results.

Memory is measured as before: the model-state bytes the engine holds (its
``held_state``) plus the bytes autograd saves for the backward pass, each storage once
while it lives, against the (scaled) capacity; the allocation that would overflow it
raises ``torch.OutOfMemoryError``, as the CUDA allocator does.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from dataclasses import dataclass
import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from poplar.cluster.spec import ClusterSpec
from poplar.devices.base import Device, Held
from poplar.emulate.model import GpuModel, WorkCounter
from poplar.emulate.network import NetworkModel
from poplar.models.checkpointing import recomputation_seen_by

# the side all-reduce must bypass any wrapper a peer installs over torch.distributed (it would recurse)
_side_all_reduce = dist.all_reduce
OVERRUN_TOLERANCE = 0.01      # of the step's time so far: lateness below this is timer noise, not an overrun
OVERRUN_FLOOR_S = 0.002       # wall seconds of lateness never counted as an overrun


@dataclass
class _Launched:
    """One collective launched on this rank: its launch-time all-reduce, and when it is done (once known)."""

    side: Any
    launched: torch.Tensor
    op: str
    nbytes: int
    in_step: bool        # outside a step (set-up, barriers between steps) a collective holds no step's link
    ranks: tuple[int, ...] | None = None   # its group's global ranks (None: the world)
    groups: int = 1      # reduce_across: the groups it sums across
    done: float | None = None


class EmulatedDevice(Device):
    """Rank ``rank`` of the emulated ``cluster``. Enter it on every rank at once (it agrees a clock)."""

    timing_repeats = 1   # its time is its declared model's: deterministic, one timed round is the figure

    def __init__(self, cluster: ClusterSpec, rank: int, dilation: float | None = None,
                 probe: Callable[[int], Any] | None = None):
        """``dilation``: a fixed one (default: chosen at start); ``probe(m)``: the work the rank will run,
        a forward and backward of ``m`` samples, so the dilation fits it (see :mod:`poplar.emulate.dilation`)."""
        super().__init__()
        self.cluster, self.rank = cluster, rank
        self.kind = cluster.device(rank)
        self.gpu = GpuModel.of(self.kind)
        self.network = NetworkModel.of(cluster)
        self.capacity = cluster.memory_bytes(self.kind)
        self.fixed_dilation, self.probe = dilation, probe
        self.dilation = dilation or 1.0
        self.origin = time.time()
        self.T = 0.0                   # the device clock, in declared seconds since origin
        self._step_T = 0.0             # where the step in progress began
        self.peak_state_bytes = 0
        self._on_link: deque[weakref.ref] = deque()   # launched collectives whose time on the link is not known yet
        self._link_free: dict = {}     # per group (its ranks; None: the world): when its link has carried
        #                                every collective settled so far

    # -- start: one clock for the cluster -----------------------------------------------
    def start(self) -> None:
        from poplar.emulate.dilation import choose_dilation

        world = dist.get_world_size() if dist.is_initialized() else 1
        dilation = self.fixed_dilation or choose_dilation(self, self.probe)
        self.probe = None     # its copy of the model is not kept beside the engine's
        figures = torch.tensor([dilation, time.time()], dtype=torch.float64)
        if world > 1:
            dilation = figures[:1].clone()
            dist.all_reduce(dilation, op=dist.ReduceOp.MAX)
            dist.broadcast(figures, src=0)
            figures[0] = dilation[0]
        self.dilation, self.origin = float(figures[0]), float(figures[1])
        self._follow_wall()

    def _wall_T(self) -> float:
        return (time.time() - self.origin) / self.dilation

    def _follow_wall(self) -> None:
        """Outside a step the device idles: its clock is the wall's."""
        self.T = max(self.T, self._wall_T())

    def _pace(self) -> None:
        """Sleep until the wall clock reaches the device clock; count real work that ran past it."""
        target = self.origin + self.dilation * self.T
        now = time.time()
        if now < target:
            time.sleep(target - now)
            return
        # a small lag is timer noise, made up by the next sleeps; the clock stays the declared one
        late = now - target
        span = self.dilation * (self.T - self._step_T)   # judged against the step's time so far
        if late > max(OVERRUN_FLOOR_S, OVERRUN_TOLERANCE * span):
            self.overruns += 1
            self.late_s += late / self.dilation
            self.T = (now - self.origin) / self.dilation   # the real work ran past: the device is late

    # -- the seam -----------------------------------------------------------------------
    def launch(self, op: str, nbytes: int, group=None, groups: int = 1) -> Any:
        if not self._in_step:
            self._follow_wall()
        launched = torch.tensor([self.T], dtype=torch.float64)
        # launches meet in issue order on every rank of the group, so this pairs with the same collective
        side = (_side_all_reduce(launched, op=dist.ReduceOp.MAX, group=group, async_op=True)
                if dist.is_initialized() else None)
        ranks = None if group is None else tuple(dist.get_process_group_ranks(group))
        token = _Launched(side, launched, op, nbytes, self._in_step, ranks, groups)
        # weakly: a collective nobody will wait for (a step given up) must not keep its process group alive
        self._on_link.append(weakref.ref(token))
        return token

    def _settle(self, token: "_Launched") -> float:
        """When ``token`` is done: the collectives before it, in issue order, hold the link first."""
        while token.done is None:
            first = self._on_link.popleft()()
            if first is None:     # dropped unwaited: it holds the link no longer
                continue
            if first.side is not None:
                first.side.wait()
            seconds = self.network.seconds(first.op, first.nbytes, first.ranks, first.groups)
            if first.in_step:
                free = max(float(first.launched[0]), self._link_free.get(first.ranks, 0.0))
                first.done = self._link_free[first.ranks] = free + seconds
            else:
                first.done = float(first.launched[0]) + seconds
        return token.done

    def wait(self, token: Any, real_wait: Callable[[], Any]) -> None:
        before = self.T
        real_wait()
        done = self._settle(token)
        ops = self.T - before    # operators the wait itself ran (a gloo work's copies): compute, after it
        if not self._in_step:
            self._follow_wall()
            return
        self.T = max(before, done) + ops
        self._pace()
        self.wait_s += self.T - before - ops

    # -- time ---------------------------------------------------------------------------
    def clock(self) -> float:
        if self._in_step:
            self._pace()
        else:
            self._follow_wall()
        return self.T

    @contextlib.contextmanager
    def _step_context(self, held: Held | None):
        self._step_T = self.T     # the step's clock() at its start has just followed the wall
        with contextlib.ExitStack() as stack:
            if held is not None:
                stack.enter_context(self._memory(held))
            stack.enter_context(WorkCounter(self.gpu, add=self._advance))
            yield

    def slow(self, factor: float) -> None:
        """From the next step on, compute at ``factor`` of the declared speed (1: as declared again)."""
        self.gpu = GpuModel.of(self.kind.slowed(factor))

    def _advance(self, seconds: float) -> None:
        self.T += seconds

    # -- memory -------------------------------------------------------------------------
    @contextlib.contextmanager
    def _memory(self, held: Held, limit: bool = True):
        state_bytes, storages = held()
        self.peak_state_bytes = max(self.peak_state_bytes, state_bytes)
        live = [state_bytes]
        self.peak_bytes = max(self.peak_bytes, state_bytes)
        self._check(state_bytes, 0)
        seen: set[int] = set(storages)

        def release(key: int, nbytes: int) -> None:
            live[0] -= nbytes
            seen.discard(key)

        def pack(t: torch.Tensor):
            st = t.untyped_storage()
            key, nbytes = st._cdata, st.nbytes()
            if key not in seen and nbytes > 0:
                if limit:
                    self._check(live[0], nbytes)
                seen.add(key)
                live[0] += nbytes
                self.peak_bytes = max(self.peak_bytes, live[0])
                weakref.finalize(st, release, key, nbytes)
            return t

        # a checkpointed block's re-run saves through checkpointing's own hooks, not these: what it makes counts
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                recomputation_seen_by(lambda: _Made(pack)):
            yield

    @contextlib.contextmanager
    def memory_probe(self, model, state_bytes: int):
        """Yields ``fits(run)``: ``run`` under this device's memory accounting (no clock), ``model``'s own
        parameters counted among ``state_bytes``, not again when autograd saves them."""
        own = {p.untyped_storage()._cdata for p in model.parameters()}

        def fits(run: Callable[[], Any]) -> bool:
            try:
                self.check_fits(lambda: (state_bytes, own), run)
                return True
            except torch.OutOfMemoryError:
                return False
            finally:
                model.zero_grad(set_to_none=True)
                self.free_memory()
        yield fits

    def saved_bytes(self, model, run: Callable[[], Any]) -> int:
        """The most bytes ``run`` (a forward and backward of ``model``) holds beside ``model``'s parameters, as a
        step's are counted, whatever the capacity (no clock; the device's own peak left as it was)."""
        own = {p.untyped_storage()._cdata for p in model.parameters()}
        peak, self.peak_bytes = self.peak_bytes, 0
        try:
            with self._memory(lambda: (0, own), limit=False):
                run()
            return self.peak_bytes
        finally:
            self.peak_bytes = peak
            model.zero_grad(set_to_none=True)
            self.free_memory()

    def check_fits(self, held: Held, fn: Callable[[], Any]) -> None:
        """Run ``fn`` (a forward and backward) under this device's memory accounting only (no clock)."""
        with self._memory(held):
            fn()

    def _check(self, used: int, more: int) -> None:
        if used + more > self.capacity:
            gib = 2**30
            raise torch.OutOfMemoryError(
                f"emulated {self.kind.kind} (rank {self.rank}) out of memory: tried to allocate "
                f"{more / gib:.4f} GiB with {used / gib:.4f} GiB in use of its {self.capacity / gib:.4f} GiB "
                "capacity; use a smaller micro-batch or a higher ZeRO stage")


class _Made(TorchDispatchMode):
    """Hands every tensor an operator returns to ``seen`` (which counts a storage once, until it dies)."""

    def __init__(self, seen: Callable[[torch.Tensor], Any]):
        super().__init__()
        self.seen = seen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.seen(t)
        return out
