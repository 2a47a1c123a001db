"""A simulated GPU: the emulated device's model of time and memory, on meta tensors, alone.

The simulator (:mod:`poplar.simulate`) profiles a model of any size without running it:
every tensor is a meta one (a shape and a dtype, no data; :mod:`poplar.simulate.fake`), and one
rank stands for each device kind. Its device is the emulated one's model, unchanged:
every operator costs what :mod:`poplar.emulate.model` says, saved activations and the
engine's states count against the same capacity. What it lacks is the rest of the
cluster and the wall clock: its collectives are not issued, they take the time the
network model gives them (:mod:`poplar.emulate.network`), and nothing sleeps.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

from poplar.cluster.spec import ClusterSpec
from poplar.devices.emulated import EmulatedDevice, _Launched
from poplar.engine.collectives import ObservedComm


class Issued:
    """What a collective that was not issued hands back: it is done when waited for."""

    def wait(self, *args, **kwargs) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


@dataclass(frozen=True)
class SimulatedGroup:
    """A group of ranks no process group stands for: the network model needs only who is in it."""

    ranks: tuple[int, ...]


class NoCollectives:
    """Collectives that are not issued: each is done when waited for (what runs around them still runs)."""

    def __getattr__(self, name: str):
        return lambda *args, **kwargs: Issued()


class SimulatedComm(ObservedComm):
    """Rank ``rank`` of ``world_size`` as the engine sees it; every collective is timed by the device, not run
    (the work around it, padding and copies, runs)."""

    collectives = NoCollectives()

    def __init__(self, observer, rank: int, world_size: int, group=None):
        super().__init__(observer, group)
        self._rank, self._world_size = rank, world_size

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    def torch_device(self):
        """The device's (no process group: a simulated rank issues no collective)."""
        return self.observer.torch_device

    def on_group(self, group) -> SimulatedComm:
        return SimulatedComm(self.observer, self._rank, self._world_size, group)

    def among(self, ranks: list[int]) -> SimulatedComm:
        """The collectives among ``ranks`` only (global ranks; this rank among them), over their own links."""
        return SimulatedComm(self.observer, ranks.index(self._rank), len(ranks), SimulatedGroup(tuple(ranks)))

    def agree(self, values: list[int], device) -> tuple[list[int], list[int]]:
        """The (min, max) across ranks of values every rank holds alike (this one stands for all): its own."""
        self.run("all_reduce", 16 * len(values), lambda a: Issued(), False)
        return list(values), list(values)



class SimulatedDevice(EmulatedDevice):
    """Rank ``rank`` of ``cluster``, simulated: its tensors are on the meta device
    (:func:`poplar.simulate.fake.fake_tensors`)."""

    torch_device = torch.device("meta")

    def __init__(self, cluster: ClusterSpec, rank: int):
        super().__init__(cluster, rank, dilation=1.0)
        self.comm = SimulatedComm(self, rank, cluster.world_size)

    def start(self) -> None:
        self.T = 0.0

    def free_memory(self) -> None:
        pass     # meta tensors hold no memory (a full collection here was a second a simulation)

    def _follow_wall(self) -> None:
        pass

    def _pace(self) -> None:
        pass

    def launch(self, op: str, nbytes: int, group=None, groups: int = 1) -> Any:
        ranks = group.ranks if isinstance(group, SimulatedGroup) else None
        # the launch time as a number, not a (fake) tensor: no other rank's launch is waited for
        token = _Launched(None, [self.T], op, nbytes, self._in_step, ranks, groups)
        self._on_link.append(weakref.ref(token))
        return token
