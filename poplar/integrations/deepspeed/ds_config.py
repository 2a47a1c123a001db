"""A DeepSpeed ZeRO config read for Poplar: :func:`read_ds_config` -> :class:`DsSettings`.

Fields that mean the same here are used: ``train_batch_size`` (or
``train_micro_batch_size_per_gpu`` x ``gradient_accumulation_steps`` x world size, as
DeepSpeed derives it), ``zero_optimization.stage``, ``gradient_clipping``,
``bf16.enabled``, ``fp16`` (its dynamic loss scaler's fields, with DeepSpeed's meanings:
``loss_scale`` 0 dynamic, else the static scale; ``initial_scale_power``,
``loss_scale_window``, ``hysteresis``, ``consecutive_hysteresis``, ``min_loss_scale``;
the scale grows after ``loss_scale_window`` good steps in a row, where DeepSpeed's first
growth waits one more), ``optimizer`` (Adam, AdamW, SGD and their ``params``). With a plan or
a cluster, Poplar plans every rank's micro-batches and accumulation itself, so the per-GPU
micro-batch and accumulation count only give the global batch; with neither, the three
batch fields give the even split DeepSpeed would use, with its consistency rules
(:class:`~poplar.integrations.batch_settings.BatchSettings`). Fields that tune DeepSpeed's own
machinery (buckets, overlap, logging) have no meaning here: they are named in one line
and ignored. Fields whose meaning Poplar cannot honour (apex's ``amp``, offload,
DeepSpeed's schedulers) are refused in one line that says what to change. A ``poplar``
section may name the plan, the cluster and the workload.

>>> s = read_ds_config({"train_batch_size": 12, "zero_optimization": {"stage": 2, "overlap_comm": True}}, 3)
>>> s.global_batch, s.stage, s.ignored
(12, 2, ['zero_optimization.overlap_comm'])
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from poplar.integrations.batch_settings import DEEPSPEED, BatchSettings

_USED = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping",
         "zero_optimization", "bf16", "fp16", "amp", "optimizer", "scheduler", "poplar"}
_POPLAR_KEYS = {"plan", "cluster", "workload", "stages", "seed", "replan"}
_OPTIMIZERS = {"adam", "adamw", "sgd"}


@dataclass
class DsSettings:
    """What a DeepSpeed config tells Poplar."""

    global_batch: int
    stage: int | None                  # None: the config names none (every stage may be planned)
    clip_grad_norm: float | None
    precision: str                     # "bf16", "fp16" or "fp32"
    optimizer: dict | None             # {"type": ..., "params": {...}} or None
    poplar: dict = field(default_factory=dict)
    loss_scale: dict = field(default_factory=dict)   # fp16's LossScaleConfig fields
    ignored: list[str] = field(default_factory=list)
    batch: BatchSettings | None = None     # the three batch fields as given: the even split with no plan or cluster

    def ignored_line(self) -> str | None:
        """The one line naming what is ignored (None: nothing is)."""
        if not self.ignored:
            return None
        return (f"poplar: ignoring DeepSpeed config fields with no meaning here: {', '.join(self.ignored)} "
                "(Poplar plans each rank's micro-batches, buckets and overlap itself); remove them to silence this")


def load_ds_config(config: str | Path | dict) -> dict:
    """The config as a dict, from itself or a JSON file."""
    if isinstance(config, dict):
        return config
    from poplar.runtime.plans import read_json

    path = Path(config)
    data = read_json(path, f"config {path}", "give a DeepSpeed JSON config or a dict", "correct the file")
    if not isinstance(data, dict):
        raise ValueError(f"config {path}: a DeepSpeed config is a JSON object, got {type(data).__name__}")
    return data


def read_ds_config(config: str | Path | dict, world_size: int) -> DsSettings:
    """Read ``config`` for a group of ``world_size`` ranks; refuse, in one line, what cannot be honoured."""
    data = load_ds_config(config)
    ignored = [k for k in data if k not in _USED]
    zero = _section(data, "zero_optimization")
    stage = _stage(zero)
    ignored += [f"zero_optimization.{k}" for k in zero if k != "stage" and not _offload(k, zero[k])]
    poplar = _section(data, "poplar")
    unknown = sorted(set(poplar) - _POPLAR_KEYS)
    if unknown:
        raise ValueError(f"config: poplar.{unknown[0]} is not a Poplar field; the poplar section takes "
                         f"{', '.join(sorted(_POPLAR_KEYS))}")
    if "replan" in poplar:
        from poplar.runtime.replan_settings import replan_config

        try:
            replan_config(poplar["replan"])
        except ValueError as e:
            raise ValueError(f"config: poplar.{e}") from None
    if "scheduler" in data:
        raise ValueError("config: Poplar does not build DeepSpeed's schedulers: remove `scheduler` and pass a torch "
                         "scheduler built on your optimizer (lr_scheduler=...)")
    batch = _batch_settings(data)
    return DsSettings(global_batch=_global_batch(batch, world_size), stage=stage, clip_grad_norm=_clip(data),
                      precision=_precision(data), optimizer=_optimizer(data), poplar=poplar, ignored=ignored,
                      loss_scale=_loss_scale(_section(data, "fp16")), batch=batch)


def _section(data: dict, name: str) -> dict:
    value = data.get(name) or {}
    if not isinstance(value, dict):
        raise ValueError(f"config: `{name}` must be an object, got {value!r}")
    return value


def _stage(zero: dict) -> int | None:
    if "stage" not in zero:
        return None
    stage = zero["stage"]
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ValueError(f"config: zero_optimization.stage = {stage!r}; Poplar runs ZeRO stages 0, 1, 2 and 3")
    return stage


def _offload(key: str, value: Any) -> bool:
    """Refuse an offload to the CPU or NVMe (True: the key is an offload, and it is off)."""
    if key not in ("offload_optimizer", "offload_param", "cpu_offload", "cpu_offload_params"):
        return False
    device = value.get("device", "none") if isinstance(value, dict) else ("cpu" if value else "none")
    if device not in (None, "none"):
        raise ValueError(f"config: zero_optimization.{key} sends states to {device}; Poplar keeps them on the GPUs "
                         "and plans around their memory: remove the offload")
    return True


def _batch_settings(data: dict) -> BatchSettings:
    try:
        return BatchSettings(data.get("train_batch_size"), data.get("train_micro_batch_size_per_gpu"),
                             data.get("gradient_accumulation_steps"), DEEPSPEED)
    except ValueError as e:
        raise ValueError(f"config: {e}") from None


def _global_batch(batch: BatchSettings, world_size: int) -> int:
    try:
        return batch.global_batch_size(world_size)
    except ValueError as e:
        raise ValueError(f"config: {e}") from None


def _clip(data: dict) -> float | None:
    clip = data.get("gradient_clipping", 0)
    if isinstance(clip, bool) or not isinstance(clip, (int, float)) or clip < 0:
        raise ValueError(f"config: gradient_clipping = {clip!r} must be a number >= 0 (0: off)")
    return float(clip) or None


def _precision(data: dict) -> str:
    if _section(data, "amp").get("enabled", False):
        raise ValueError("config: amp.enabled (apex's mixed precision): Poplar computes in fp16 with a dynamic loss "
                         "scale, bf16 or fp32: set fp16.enabled or bf16.enabled instead")
    on = [name for name in ("bf16", "fp16") if _section(data, name).get("enabled", False)]
    if len(on) > 1:
        raise ValueError("config: bf16.enabled and fp16.enabled are both true: enable one")
    return on[0] if on else "fp32"


# DeepSpeed's fp16 fields -> poplar.engine.loss_scale.LossScaleConfig's
_FP16_FIELDS = {"initial_scale_power": "init_scale", "loss_scale_window": "growth_interval",
                "hysteresis": "hysteresis", "consecutive_hysteresis": "consecutive_hysteresis",
                "min_loss_scale": "min_scale"}
_FP16_DEFAULTS = {"initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1}


def _loss_scale(fp16: dict) -> dict:
    """The loss scaler a config's ``fp16`` section describes, with DeepSpeed's defaults."""
    unknown = sorted(set(fp16) - set(_FP16_FIELDS) - {"enabled", "loss_scale", "auto_cast"})
    if unknown:
        raise ValueError(f"config: fp16.{unknown[0]} has no meaning here; fp16 takes enabled, loss_scale, "
                         f"{', '.join(_FP16_FIELDS)}")
    if fp16.get("auto_cast", False):
        raise ValueError("config: fp16.auto_cast: Poplar casts the whole model to fp16 (fp32 master weights); "
                         "remove auto_cast")
    given = {**_FP16_DEFAULTS, **{k: v for k, v in fp16.items() if k in _FP16_FIELDS}}
    out = {_FP16_FIELDS[k]: v for k, v in given.items()}
    out["init_scale"] = 2.0 ** given["initial_scale_power"]
    static = fp16.get("loss_scale", 0)
    if isinstance(static, bool) or not isinstance(static, (int, float)) or static < 0:
        raise ValueError(f"config: fp16.loss_scale = {static!r} must be a number >= 0 (0: dynamic)")
    if static:
        out.update(init_scale=float(static), dynamic=False, min_scale=min(float(static), out["min_scale"]))
    return out


def _optimizer(data: dict) -> dict | None:
    opt = _section(data, "optimizer")
    if not opt:
        return None
    kind = str(opt.get("type", "")).lower()
    if kind not in _OPTIMIZERS:
        raise ValueError(f"config: optimizer.type {opt.get('type')!r}: Poplar builds Adam, AdamW and SGD from a "
                         "config; pass another optimizer as optimizer=")
    return {"type": kind, "params": dict(opt.get("params") or {})}


def build_optimizer(spec: dict):
    """A factory of the torch optimizer a config's ``optimizer`` section names (DeepSpeed's Adam decouples weight
    decay unless ``adam_w_mode`` is false)."""
    params = dict(spec["params"])
    if spec["type"] == "sgd":
        return lambda ps: torch.optim.SGD(ps, **params)
    decoupled = spec["type"] == "adamw" or params.pop("adam_w_mode", True)
    params.pop("torch_adam", None)
    params.pop("adam_w_mode", None)
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    return lambda ps: cls(ps, **params)
