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
import math
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field
from scipy.interpolate import CubicSpline

from poplar.engine.config import EngineConfig


class StepAnatomy(BaseModel):
    """Where one step's compute falls between its collectives, measured on a step of one micro-batch.

    Shares are of the micro-step's compute (from the step's start to the root unit's
    gradient collective), per engine unit, the root first. The root's forward share is
    what runs before the first layer (embeddings), its backward share what runs after the
    last layer's backward (the embeddings' gradient), and ``root_middle`` what runs
    between the last layer's forward and its backward (the head and the loss). The step's
    once-per-step work before the loss's all-reduce and between it and the gradient
    norm's (stages 1-3) is in seconds (of the first, what runs before the gradient
    collectives are waited for and between those waits too); the rest of ``per_step_s``
    follows the norm: the update,
    and in stages 1-2 the parameters' all-gathers, whose own work (each one's slice made
    ready before its launch, copied out after its wait) is in seconds too.
    """

    model_config = ConfigDict(extra="forbid")

    micro_batch: int = Field(ge=1, description="the micro-batch the step was measured at")
    forward: list[float] = Field(description="each unit's share of the forward (the root's: before the layers)")
    backward: list[float] = Field(description="each unit's share of the backward (the root's: after the layers)")
    root_middle: float = Field(ge=0, description="share between the last layer's forward and its backward")
    before_loss_s: float = Field(ge=0, description="seconds after the micro-steps, before the loss's all-reduce")
    before_norm_s: float = Field(ge=0, description="seconds between the loss's and the norm's all-reduce")
    gather_issue_s: float = Field(0.0, ge=0, description="seconds between the first and the last parameter "
                                  "all-gather's launch after the update (stages 1-2)")
    gather_copy_s: float = Field(0.0, ge=0, description="seconds after the last parameter all-gather's launch to "
                                 "the step's end (stages 1-2: unlike slices copied out)")
    before_waits_s: float = Field(0.0, ge=0, description="of before_loss_s: seconds between the root's gradient "
                                  "collective's launch and the first wait for a gradient collective")
    between_waits_s: float = Field(0.0, ge=0, description="of before_loss_s: seconds between the first and the last "
                                   "of those waits (each reduced gradient's own work, as it is waited for)")


# What a stage profile's note says where a device holds no sample beside an even share of the states (the
# profiler and the simulator alike; the planner reads them).
NOT_TIMED = "not timed: a device of this cluster does not fit micro-batch 1"
DOES_NOT_FIT = "does not fit micro-batch 1 beside this stage's model states, even with none of the sharded ones"
FITS_WITH_LESS = "fits a sample only beside a smaller share of the sharded states than an even one"
AT_LARGER_SHARE = "timed holding more than an even share of the states (another kind holds a sample only with less)"


class StageProfile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_micro_batch: int = Field(ge=0, description="largest micro-batch that fits; 0: not even 1")
    state_bytes: int = Field(ge=0, description="model-state bytes held in this stage")
    points: list[tuple[int, float]] = Field(default_factory=list, description="(micro_batch, seconds) measured")
    per_step_s: float = Field(0.0, ge=0, description="the part of every point spent once per optimizer step "
                              "(synchronisation, the optimizer update), not again per micro-step; 0 if not "
                              "measured")
    note: str = ""
    anatomy: list[StepAnatomy] | None = Field(None, description="where a step's compute falls between its "
                                              "collectives, at a few micro-batches (poplar.planner.schedule); "
                                              "empty where the marks were not all seen, None where not measured")
    memory_points: list[tuple[int, int]] = Field(default_factory=list, description="(model-state bytes held, the "
                                                 "largest micro-batch beside them) measured, fewer states first: "
                                                 "how the micro-batch grows as a rank holds less (stages 1-3: "
                                                 "none of the sharded states, and its even share)")
    share_steps: list[tuple[float, float]] = Field(default_factory=list, description="(fraction of the sharded "
                                                   "states held, per_step_s) measured with the ranks holding unlike "
                                                   "shares (stages 1-3; empty where not measured)")
    share_gathers: list[tuple[float, float, float]] = Field(default_factory=list, description="(fraction of the "
                                                            "sharded states held, gather_issue_s, gather_copy_s) "
                                                            "measured beside share_steps (stages 1-2; see "
                                                            "StepAnatomy)")

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

    def anatomy_at(self, micro_batch: float) -> StepAnatomy | None:
        """The step's anatomy at ``micro_batch``: shares interpolated between the measured sizes."""
        if not self.anatomy:
            return None
        sizes = [a.micro_batch for a in self.anatomy]
        j = int(np.clip(np.searchsorted(sizes, micro_batch), 1, max(1, len(sizes) - 1)))
        lo, hi = self.anatomy[max(0, j - 1)], self.anatomy[min(j, len(sizes) - 1)]
        w = 0.0 if hi.micro_batch == lo.micro_batch else float(np.clip(
            (micro_batch - lo.micro_batch) / (hi.micro_batch - lo.micro_batch), 0.0, 1.0))
        mix = lambda a, b: (1 - w) * a + w * b   # noqa: E731
        return StepAnatomy(micro_batch=max(1, round(micro_batch)),
                           forward=[mix(a, b) for a, b in zip(lo.forward, hi.forward)],
                           backward=[mix(a, b) for a, b in zip(lo.backward, hi.backward)],
                           root_middle=mix(lo.root_middle, hi.root_middle),
                           before_loss_s=mix(lo.before_loss_s, hi.before_loss_s),
                           before_norm_s=mix(lo.before_norm_s, hi.before_norm_s),
                           gather_issue_s=mix(lo.gather_issue_s, hi.gather_issue_s),
                           gather_copy_s=mix(lo.gather_copy_s, hi.gather_copy_s),
                           before_waits_s=mix(lo.before_waits_s, hi.before_waits_s),
                           between_waits_s=mix(lo.between_waits_s, hi.between_waits_s))

    def max_micro_batch_at(self, state_bytes: float, capacity: float) -> int:
        """The largest micro-batch beside ``state_bytes`` of model states on a device of ``capacity`` bytes.

        Between the measured :attr:`memory_points`, on the line through them (a sample's
        activations take a fixed number of bytes), rounded down; with fewer states than
        measured, no more than the most measured. With more states than measured, along that
        line, or where the points do not show the slope (one point, or the same micro-batch at
        both), as if every sample took all the free memory measured (which no sample does:
        the estimate is low, never high).
        """
        pts = sorted(self.memory_points) or [(self.state_bytes, self.max_micro_batch)]
        (s0, m0), (s1, m1) = pts[0], pts[-1]
        if m0 == m1:
            if m1 == 0 or state_bytes <= s1:
                return m1
            per_sample = max(capacity - s1, 1.0) / m1
        else:
            per_sample = (s1 - s0) / (m0 - m1)
        return int(max(0, min(m0, math.floor(m1 + (s1 - state_bytes) / per_sample + 1e-9))))

    def throughput(self, micro_batch: float) -> float:
        """Samples per second at this micro-batch size."""
        return micro_batch / self.time(micro_batch)


class DeviceProfile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: str
    memory_gb: float
    rated_tflops: float | None = Field(None, description="the data sheet's (or the cluster file's) peak dense "
                                       "TFLOP/s in the profile's dtype: the rating a Whale-style split uses")
    memory_bandwidth_gbs: float | None = Field(None, description="the data sheet's (or the cluster file's) memory "
                                               "bandwidth, GB/s: what an update of a larger shard than the profile's "
                                               "costs more (a shard group's, poplar.planner.shape)")
    stages: dict[int, StageProfile] = Field(default_factory=dict)


def _on_pieces(full_s: float, latency_s: float, numel: float, timed_numel: int,
               between: list[tuple[int, float]] | None = None) -> float:
    """A collective on ``numel`` elements, from its time on ``timed_numel``: the latency plus its share of the rest,
    on a line through the latency and each size timed ``between`` (``(numel, seconds)``), as NCCL's choice of ring or
    tree bends it; beyond the last size on the last piece's slope."""
    latency = min(latency_s, full_s)
    inner = {float(n): s for n, s in between or [] if 0 < n < timed_numel}
    points = [(0.0, latency), *sorted(inner.items()), (float(timed_numel), full_s)]
    for (n0, s0), (n1, s1) in zip(points, points[1:]):
        if numel <= n1:
            break
    return s0 + (s1 - s0) * (numel - n0) / (n1 - n0)


class CommProfile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    numel: int = Field(description="elements moved: the model's (padded) parameter count, fp32")
    all_reduce_s: float
    reduce_scatter_s: float
    all_gather_s: float
    latency_s: dict[str, float] = Field(default_factory=dict, description="per collective: its time on a tiny "
                                        "buffer (a few elements a rank), what every call pays however small")
    between_s: dict[str, list[tuple[int, float]]] | None = Field(
        None, description="per collective: its time at sizes between the tiny buffer and the model's (the engine's "
        "unit sizes: a bucket's), where NCCL's choice of ring or tree bends the line through the two; None in "
        "profiles written before they were timed")
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
        return _on_pieces(getattr(self, f"{which}_s"), self.latency_s.get(which, 0.0), numel, self.numel,
                          (self.between_s or {}).get(which))


class ShapedComm(BaseModel):
    """The collectives shaped to the nodes, timed on them: each node's own, and the sum across nodes."""

    model_config = ConfigDict(extra="forbid")

    groups: list[list[int]] = Field(description="the ranks of each node")
    numel: int = Field(description="elements the sum across nodes was timed on: the model's, fp32")
    inside: list[CommProfile] = Field(description="per node: its collectives among its own ranks, over the "
                                      "model's size padded to its rank count")
    reduce_across_s: float = Field(description="the sum across nodes (poplar.engine.layout) of the model's size: "
                                   "its time on the links")
    across_latency_s: float = Field(0.0, description="the same on a tiny buffer")
    across_between_s: list[tuple[int, float]] = Field(default_factory=list, description="the same at the sizes "
                                                      "between (CommProfile.between_s)")
    sum_s: float | None = Field(None, description="the sum's compute after the exchange (the parts added), at the "
                                "model's size; None in profiles that timed it with the exchange")
    sum_latency_s: float = Field(0.0, description="the same on a tiny buffer")

    def across_seconds(self, numel: float) -> float:
        """The sum across nodes of ``numel`` fp32 elements on the links: its latency plus its share of the bandwidth."""
        return _on_pieces(self.reduce_across_s, self.across_latency_s, numel, self.numel, self.across_between_s)

    def sum_seconds(self, numel: float) -> float:
        """The compute that adds the parts of ``numel`` fp32 elements once they are across."""
        return _on_pieces(self.sum_s or 0.0, self.sum_latency_s, numel, self.numel)


CommProfile.model_rebuild()


class ModelInfo(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    n_params: int
    frozen_params: int = Field(0, ge=0, description="of them, those not trained (LoRA's base weights): held whole "
                               "on every rank in the compute precision, with no gradient, master or optimizer "
                               "state, never sharded nor communicated (in state_bytes as they are)")
    seq_len: int
    unit_numels: list[int] = Field(default_factory=list, description="parameters of each engine unit (the root "
                                   "first); each is one gradient bucket")
    unit_flops: list[float] = Field(default_factory=list, description="forward FLOPs of one sample in each unit "
                                    "(the root first), each unit's own: its share of the compute, in the schedule "
                                    "(poplar.planner.schedule); empty in profiles written before it was recorded")
    dtype: str = "fp32"

    @property
    def trained_params(self) -> int:
        """The parameters the engine trains: what its stages shard and its collectives move."""
        return self.n_params - self.frozen_params


_ENGINE = EngineConfig.model_fields   # the engine's defaults, not a copy of them


class EngineOptions(BaseModel):
    """The engine's options a profile was measured with that change how a step runs (the cost model follows them)."""

    model_config = ConfigDict(extra="forbid")

    max_inflight_reduces: int = Field(_ENGINE["max_inflight_reduces"].default, ge=1,
                                      description="ZeRO-2/3 gradient reductions in flight")
    prefetch: bool = Field(_ENGINE["prefetch"].default, description="ZeRO-3: the next unit gathered while one "
                           "computes")
    unit_numel: int = Field(_ENGINE["unit_numel"].default, gt=0, description="other modules with this many "
                            "parameters become units")


class Profile(BaseModel):
    """Profiles of every device kind of a cluster (ranks in order), and its collectives."""

    model_config = ConfigDict(extra="forbid")

    model: ModelInfo
    ranks: list[str] = Field(description="device kind of each rank, in rank order")
    devices: dict[str, DeviceProfile]
    comm: CommProfile | None = None
    engine: EngineOptions = Field(default_factory=EngineOptions, description="the engine options it was measured "
                                  "with (the defaults in profiles written before they were recorded)")

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
