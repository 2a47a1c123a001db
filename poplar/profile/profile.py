"""The `Profile`: what every device kind can do in every ZeRO stage, as a readable JSON value.

Per device kind and stage: the largest micro-batch that fits, and measured points
``(micro_batch, seconds)`` of one training step with one micro-batch (forward, backward
and the stage's own per-step work; waits for other ranks excluded), and how much of
each point is spent once per step (``per_step_s``: synchronisation and the optimizer
update), so a step of ``a`` micro-batches takes ``a * (time(m) - per_step_s) +
per_step_s``. A cubic spline
through the points gives the time at any micro-batch size. Per cluster: the time of the
collectives the stages use, at the model's size.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field
from scipy.interpolate import CubicSpline


class StageProfile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_micro_batch: int = Field(ge=0, description="largest micro-batch that fits; 0: not even 1")
    state_bytes: int = Field(ge=0, description="model-state bytes held in this stage")
    points: list[tuple[int, float]] = Field(default_factory=list, description="(micro_batch, seconds) measured")
    per_step_s: float = Field(0.0, ge=0, description="the part of every point spent once per optimizer step "
                              "(synchronisation, the optimizer update), not again per micro-step; 0 if not "
                              "measured")
    note: str = ""

    def time(self, micro_batch):
        """Seconds of a step with one micro-batch of this size (spline through the points); arrays allowed."""
        if not self.points:
            raise ValueError(f"no measured points{': ' + self.note if self.note else ''}")
        m = np.array([p[0] for p in self.points], dtype=float)
        t = np.array([p[1] for p in self.points], dtype=float)
        x = np.asarray(micro_batch, dtype=float)
        if len(m) == 1:
            out = t[0] * x / m[0]
        elif len(m) == 2:
            out = t[0] + (t[1] - t[0]) * (x - m[0]) / (m[1] - m[0])
        else:
            out = CubicSpline(m, t, bc_type="natural")(x)
        return float(out) if np.ndim(out) == 0 else out

    def throughput(self, micro_batch: float) -> float:
        """Samples per second at this micro-batch size."""
        return micro_batch / self.time(micro_batch)


class DeviceProfile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: str
    memory_gb: float
    rated_tflops: float | None = Field(None, description="the data sheet's (or the cluster file's) peak dense "
                                       "TFLOP/s in the profile's dtype: the rating a Whale-style split uses")
    stages: dict[int, StageProfile] = Field(default_factory=dict)


def _latency_plus_share(full_s: float, latency_s: float, numel: float, timed_numel: int) -> float:
    """A collective on ``numel`` elements, from its time on ``timed_numel``: the latency plus its share of the rest."""
    latency = min(latency_s, full_s)
    return latency + (full_s - latency) * numel / timed_numel


class CommProfile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    numel: int = Field(description="elements moved: the model's (padded) parameter count, fp32")
    all_reduce_s: float
    reduce_scatter_s: float
    all_gather_s: float
    latency_s: dict[str, float] = Field(default_factory=dict, description="per collective: its time on a tiny "
                                        "buffer (a few elements a rank), what every call pays however small")
    shaped: ShapedComm | None = Field(None, description="on several nodes: the collectives inside each node and "
                                      "across them (hybrid sharding, two-level all-reduce)")

    def bandwidth_gbps(self, which: str) -> float:
        """Algorithm bandwidth in GB/s (bytes of the full buffer per second)."""
        return 4 * self.numel / getattr(self, f"{which}_s") / 1e9

    def seconds(self, which: str, numel: float) -> float:
        """Time of collective ``which`` on ``numel`` fp32 elements: its latency plus its share of the bandwidth.

        >>> round(CommProfile(numel=1000, all_reduce_s=0.011, reduce_scatter_s=0.0, all_gather_s=0.0,
        ...                   latency_s={"all_reduce": 0.001}).seconds("all_reduce", 500), 9)
        0.006
        """
        return _latency_plus_share(getattr(self, f"{which}_s"), self.latency_s.get(which, 0.0), numel, self.numel)


class ShapedComm(BaseModel):
    """The collectives shaped to the nodes, timed on them: each node's own, and the sum across nodes."""

    model_config = ConfigDict(extra="forbid")

    groups: list[list[int]] = Field(description="the ranks of each node")
    numel: int = Field(description="elements the sum across nodes was timed on: the model's, fp32")
    inside: list[CommProfile] = Field(description="per node: its collectives among its own ranks, over the "
                                      "model's size padded to its rank count")
    reduce_across_s: float = Field(description="the sum across nodes (poplar.engine.layout) of the model's size")
    across_latency_s: float = Field(0.0, description="the same on a tiny buffer")

    def across_seconds(self, numel: float) -> float:
        """The sum across nodes of ``numel`` fp32 elements: its latency plus its share of the bandwidth."""
        return _latency_plus_share(self.reduce_across_s, self.across_latency_s, numel, self.numel)


CommProfile.model_rebuild()


class ModelInfo(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    n_params: int
    seq_len: int
    unit_numels: list[int] = Field(default_factory=list, description="parameters of each engine unit (the root "
                                   "first); each is one gradient bucket")
    unit_flops: list[float] = Field(default_factory=list, description="forward FLOPs of one sample in each unit "
                                    "(the root first), each unit's own: its share of the compute, in the schedule "
                                    "(poplar.planner.schedule); empty in profiles written before it was recorded")
    dtype: str = "fp32"


class Profile(BaseModel):
    """Profiles of every device kind of a cluster (ranks in order), and its collectives."""

    model_config = ConfigDict(extra="forbid")

    model: ModelInfo
    ranks: list[str] = Field(description="device kind of each rank, in rank order")
    devices: dict[str, DeviceProfile]
    comm: CommProfile | None = None

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def stage(self, kind: str, zero_stage: int) -> StageProfile:
        return self.devices[kind].stages[zero_stage]

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.model_dump_json(indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "Profile":
        return cls.model_validate(json.loads(Path(path).read_text()))
