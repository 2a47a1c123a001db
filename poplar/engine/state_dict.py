"""Saving and loading the engine's state: full (unsharded) and sharded state dicts.

:class:`EngineState` holds what it needs (the model, its units, the optimizer, the
communication object); :class:`~poplar.engine.engine.Engine` exposes its methods under
the same names (the step count is the engine's: passed in, and given back on a load).
"""

from __future__ import annotations

import torch
from torch import nn

from poplar.engine.collectives import Comm
from poplar.engine.flat_unit import FlatUnit


def _mesh(device: torch.device, comm: Comm):
    """A one-dimensional device mesh over the comm's ranks, on its current group (it may have been rebuilt)."""
    from torch.distributed.device_mesh import DeviceMesh

    if comm.group is not None:   # a shard group: its mesh over the group as it is, nothing created
        return DeviceMesh.from_group(comm.group, device.type)
    return DeviceMesh(device.type, list(range(comm.world_size)))


def _global(unit, flat: torch.Tensor, mesh):
    """``flat`` (a unit's master or optimizer state, as this rank holds it) as the unit's whole flat tensor.

    Where the stage shards it, rank ``r`` holds the ``r``-th ceil-sized chunk of the
    padded buffer: exactly a ``Shard(0)`` DTensor of the unpadded ``numel`` elements, so
    ``torch.distributed.checkpoint`` records the layout and reads any other one back.
    Elsewhere every rank holds it whole: a plain tensor, written once.
    """
    if not unit.shard_optim:
        return flat[:unit.numel]
    from torch.distributed.tensor import DTensor, Shard

    layout = unit.layout
    if layout.uneven:   # written as the even cut would hold it (a collective in the shard group): any layout reads it
        flat = layout.reslice(flat, unit.numel, to_even=True)
    start = layout.shard_range(unit.numel, even=True)[0]
    valid = max(0, min(flat.numel(), unit.numel - start))
    return DTensor.from_local(flat[:valid], mesh, [Shard(0)], run_check=False,
                              shape=torch.Size([unit.numel]), stride=(1,))


def _own(unit, value) -> torch.Tensor:
    """What ``dcp.load`` filled for ``unit`` (see :func:`_global`), as this rank holds it: resliced to the
    shares' cut where the layout is uneven."""
    src = _local(value)
    if not unit.shard_optim or not unit.layout.uneven:
        return src
    layout = unit.layout
    even = torch.zeros(layout.slice_sizes(unit.numel, even=True)[layout.shard_index], dtype=src.dtype,
                       device=src.device)
    even[:src.numel()].copy_(src)
    return layout.reslice(even, unit.numel, to_even=False)


def _is_flat_state(unit, value) -> bool:
    return isinstance(value, torch.Tensor) and value.shape == unit.master.shape


def _local(value) -> torch.Tensor:
    return value.to_local() if hasattr(value, "to_local") else value


class EngineState:
    """Saving and loading one engine's model and optimizer state (see the module's docstring)."""

    def __init__(self, model: nn.Module, units: list[FlatUnit], optimizer: torch.optim.Optimizer,
                 device: torch.device, comm: Comm):
        self.model, self.units, self.optimizer, self.device, self.comm = model, units, optimizer, device, comm

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full, unsharded fp32 parameters (and buffers) keyed like ``model.state_dict()``, on every rank.

        A collective in stages 1-3: call it on every rank.
        """
        full: dict[int, torch.Tensor] = {}
        for unit in self.units:
            flat = unit.full_master()
            for s in unit.slots:
                full[id(s.param)] = flat[s.offset:s.offset + s.numel].view(s.shape).clone()
        out = {}
        for key, t in self.model.state_dict(keep_vars=True).items():
            out[key] = full[id(t)] if id(t) in full else t.detach().clone()
        return out

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load full parameters (e.g. from :meth:`full_state_dict`) on every rank."""
        own = self.model.state_dict(keep_vars=True)
        missing, unexpected = set(own) - set(state), set(state) - set(own)
        if missing or unexpected:
            raise ValueError(f"state dict does not match the model: missing {sorted(missing)[:5]}, "
                             f"unexpected {sorted(unexpected)[:5]}")
        slot_of = {id(s.param): (u, s) for u in self.units for s in u.slots}
        flats = {u.index: torch.zeros(u.padded_numel, device=self.device) for u in self.units}
        with torch.no_grad():
            for key, t in own.items():
                value = state[key].to(self.device)
                if id(t) in slot_of:
                    u, s = slot_of[id(t)]
                    if tuple(value.shape) != tuple(s.shape):
                        raise ValueError(f"{key}: shape {tuple(value.shape)} in the state dict, "
                                         f"{tuple(s.shape)} in the model")
                    flats[u.index][s.offset:s.offset + s.numel].copy_(value.reshape(-1))
                else:
                    t.data.copy_(value)
        for u in self.units:
            u.load_full_master(flats[u.index])

    def sharded_state_dict(self, global_steps: int, for_load: bool = False) -> dict:
        """The training state for ``torch.distributed.checkpoint``, under global keys with its layout.

        Each unit's fp32 master and per-element optimizer states (``unit3.master``,
        ``optim.3.exp_avg``) are the whole unit's flat tensor, sharded as the stage shards
        it (see :func:`_global`): a checkpoint written with one world size, plan and stage
        loads into any other. Buffers, the optimizer's scalar states and the step count are
        plain tensors. The optimizer's hyper-parameters are not tensors: see
        :meth:`optimizer_hyperparameters`. Tensors share the engine's storage where they can;
        :meth:`load_sharded_state_dict` copies back what ``dcp.load`` filled.

        Hybrid, each group holds a copy sharded over its own ranks (in its own stage, where the
        plan gives each group one): the first group's is written, and every rank reads back its
        own slice (``for_load``) or, replicating, the whole unit.
        """
        layout = self.units[0].layout if self.units else None
        mesh = _mesh(self.device, layout.shard_comm) if any(u.shard_optim for u in self.units) else None
        # a copy that another group also writes would be written twice, and overlap (a group that replicates beside
        # a sharding one would write it whole where that one writes shards: the first group's copy alone is written)
        write = for_load or layout is None or not layout.hybrid or layout.group_index == 0
        out: dict = {f"unit{u.index}.master": _global(u, u.master.data, mesh) for u in self.units if write}
        for idx, state in self.optimizer.state_dict()["state"].items():
            u = self.units[idx]
            for name, value in state.items():
                if _is_flat_state(u, value):
                    if write:
                        out[f"optim.{idx}.{name}"] = _global(u, value, mesh)
                else:
                    out[f"optim.{idx}.{name}"] = value if isinstance(value, torch.Tensor) else torch.tensor(value)
        for name, buf in self.model.named_buffers():
            out[f"buffer.{name}"] = buf
        out["global_steps"] = torch.tensor(global_steps)
        return out

    def optimizer_hyperparameters(self) -> list[dict]:
        """The optimizer's parameter groups without their parameters, as JSON values (lr, betas, ...)."""
        groups = []
        for g in self.optimizer.state_dict()["param_groups"]:
            clean = {}
            for k, v in g.items():
                if k == "params":
                    continue
                if isinstance(v, torch.Tensor):
                    v = v.tolist()
                if isinstance(v, tuple):
                    v = list(v)
                if v is None or isinstance(v, (bool, int, float, str, list)):
                    clean[k] = v
            groups.append(clean)
        return groups

    def layout(self) -> list[dict]:
        """The units as a checkpoint records them: a checkpoint loads only into the same units."""
        return [{"name": u.name, "numel": u.numel} for u in self.units]

    def prepare_sharded_load(self, global_steps: int) -> dict:
        """A state dict shaped like a saved one, for ``dcp.load`` to fill before :meth:`load_sharded_state_dict`.

        A fresh optimizer has no state yet: one step with zero gradients creates it (every
        value is overwritten by the load, the parameters included).
        """
        if not self.optimizer.state:
            for u in self.units:
                u.attach_grad(torch.zeros_like(u.master))
            self.optimizer.step()
            for u in self.units:
                u.attach_grad(None)
        return self.sharded_state_dict(global_steps, for_load=True)

    @torch.no_grad()
    def load_sharded_state_dict(self, state: dict, hyperparameters: list[dict] | None = None) -> int:
        """Restore from a dict that ``dcp.load`` filled (from :meth:`prepare_sharded_load`), any layout saved.

        ``hyperparameters``: the optimizer's groups as :meth:`optimizer_hyperparameters`
        gave them when saving (kept as they are when ``None``). Returns the step count saved.
        """
        for u in self.units:
            src = _own(u, state[f"unit{u.index}.master"])
            u.master.data[:src.numel()].copy_(src)
        opt = self.optimizer.state_dict()
        for idx, st in opt["state"].items():
            u = self.units[idx]
            for name in list(st):
                if _is_flat_state(u, st[name]):
                    src = _own(u, state[f"optim.{idx}.{name}"])
                    st[name][:src.numel()].copy_(src)
                else:
                    st[name] = _local(state[f"optim.{idx}.{name}"])
        if hyperparameters is not None:
            if len(hyperparameters) != len(opt["param_groups"]):
                raise ValueError(f"the checkpoint's optimizer has {len(hyperparameters)} parameter groups, this one "
                                 f"{len(opt['param_groups'])}: resume with the optimizer it was written with")
            for group, saved in zip(opt["param_groups"], hyperparameters):
                group.update({k: tuple(v) if isinstance(group.get(k), tuple) else v for k, v in saved.items()})
        self.optimizer.load_state_dict(opt)
        for name, buf in self.model.named_buffers():
            buf.copy_(state[f"buffer.{name}"])
        works = [w for w in (u.refresh_params_after_step() for u in self.units) if w is not None]
        for w in works:
            w.wait()
        return int(state["global_steps"])
