"""Saving and loading the engine's state: full (unsharded) and sharded state dicts.

Functions of the engine; :class:`~poplar.engine.engine.Engine` exposes them as its
methods of the same names.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from poplar.engine.engine import Engine


def full_state_dict(engine: Engine) -> dict[str, torch.Tensor]:
    """Full, unsharded fp32 parameters (and buffers) keyed like ``model.state_dict()``, on every rank.

    A collective in stages 1-3: call it on every rank.
    """
    full: dict[int, torch.Tensor] = {}
    for unit in engine.units:
        flat = unit.full_master()
        for s in unit.slots:
            full[id(s.param)] = flat[s.offset:s.offset + s.numel].view(s.shape).clone()
    out = {}
    for key, t in engine.model.state_dict(keep_vars=True).items():
        out[key] = full[id(t)] if id(t) in full else t.detach().clone()
    return out


def load_full_state_dict(engine: Engine, state: dict[str, torch.Tensor]) -> None:
    """Load full parameters (e.g. from :meth:`full_state_dict`) on every rank."""
    own = engine.model.state_dict(keep_vars=True)
    missing, unexpected = set(own) - set(state), set(state) - set(own)
    if missing or unexpected:
        raise ValueError(f"state dict does not match the model: missing {sorted(missing)[:5]}, "
                         f"unexpected {sorted(unexpected)[:5]}")
    slot_of = {id(s.param): (u, s) for u in engine.units for s in u.slots}
    flats = {u.index: torch.zeros(u.padded_numel, device=engine.device) for u in engine.units}
    with torch.no_grad():
        for key, t in own.items():
            value = state[key].to(engine.device)
            if id(t) in slot_of:
                u, s = slot_of[id(t)]
                if tuple(value.shape) != tuple(s.shape):
                    raise ValueError(f"{key}: shape {tuple(value.shape)} in the state dict, "
                                     f"{tuple(s.shape)} in the model")
                flats[u.index][s.offset:s.offset + s.numel].copy_(value.reshape(-1))
            else:
                t.data.copy_(value)
    for u in engine.units:
        u.load_full_master(flats[u.index])


def _shard_tag(engine: Engine) -> str:
    """The key prefix of what the stage shards: every rank saves its own under its own keys."""
    return f"rank{engine.rank}." if engine.stage.shards_optimizer else ""


def sharded_state_dict(engine: Engine) -> dict:
    """This rank's share of the training state, for ``torch.distributed.checkpoint``.

    fp32 masters and optimizer states under keys that name the rank where the stage
    shards them (``rank1.unit0.master``), so every rank writes its own shard; what
    every rank holds alike (stage-0 states, buffers, hyper-parameters, the step count)
    under plain keys, written once. Tensors are the engine's own: loading into this
    dict restores them in place (see :meth:`load_sharded_state_dict`).
    """
    tag = _shard_tag(engine)
    out: dict = {f"{tag}unit{u.index}.master": u.master.data for u in engine.units}
    opt = engine.optimizer.state_dict()
    for idx, state in opt["state"].items():
        for name, value in state.items():
            out[f"{tag}optim.{idx}.{name}"] = value if isinstance(value, torch.Tensor) else torch.tensor(value)
    out["optim.param_groups"] = opt["param_groups"]
    for name, buf in engine.model.named_buffers():
        out[f"buffer.{name}"] = buf
    out["global_steps"] = torch.tensor(engine.global_steps)
    return out


def prepare_sharded_load(engine: Engine) -> dict:
    """A state dict shaped like a saved one, for ``dcp.load`` to fill before :meth:`load_sharded_state_dict`.

    A fresh optimizer has no state yet: one step with zero gradients creates it (every
    value is overwritten by the load, the parameters included).
    """
    if not engine.optimizer.state:
        for u in engine.units:
            u.master.grad = torch.zeros_like(u.master)
        engine.optimizer.step()
        for u in engine.units:
            u.master.grad = None
    return sharded_state_dict(engine)


@torch.no_grad()
def load_sharded_state_dict(engine: Engine, state: dict) -> None:
    """Restore from a dict that ``dcp.load`` filled (from :meth:`prepare_sharded_load`). Same world and stage."""
    tag = _shard_tag(engine)
    for u in engine.units:
        u.master.data.copy_(state[f"{tag}unit{u.index}.master"])
    opt = engine.optimizer.state_dict()
    for idx, st in opt["state"].items():
        for name in list(st):
            st[name] = state[f"{tag}optim.{idx}.{name}"]
    opt["param_groups"] = state["optim.param_groups"]
    engine.optimizer.load_state_dict(opt)
    for name, buf in engine.model.named_buffers():
        buf.copy_(state[f"buffer.{name}"])
    engine.global_steps = int(state["global_steps"])
    works = [w for w in (u.refresh_params_after_step() for u in engine.units) if w is not None]
    for w in works:
        w.wait()
