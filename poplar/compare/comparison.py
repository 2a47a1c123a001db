"""A comparison's result, one value for every command that compares: :class:`Comparison`.

``poplar bench`` measures Poplar's allocation of the global batch beside the baselines', ``poplar simulate``
predicts them (and each kind of device alone), ``poplar demo`` trains them (and each kind alone): each makes
a :class:`Comparison` whose ``allocations`` are :class:`Contender` s, Poplar's first. A contender has its
plan (or why it has none), what the planner predicted for it and, where it ran, what was measured
(:class:`Measured`); beside them stand the ideal bound (the batch shared so that every device finishes
together) and, measured in the same launch, the peers (DeepSpeed). (A contender is not the planner's
:class:`poplar.planner.result.Allocation`, which has no measured figures: :func:`planned` makes one of it.)

A contender's figure (:attr:`Contender.samples_per_s`) is the measured one where it ran, the predicted one
where it was simulated. :meth:`Comparison.to_dict` writes the comparison as JSON: its own fields (what
:meth:`Comparison.from_dict` reads back), then the figures derived from them that the commands have always
written (Poplar's throughput, its ratio to each other allocation and to the ideal, the baselines', each kind
alone's).

>>> from poplar.plan import Plan
>>> c = Comparison(model="tiny", cluster="two cards", world_size=2, seq_len=64, global_batch=16, zero_stage=0,
...                shape="flat", label="stage 0", reason="", ideal_samples_per_s=100.0, allocations=(
...                    Contender("poplar", Plan(0, [12, 4], 1), predicted_samples_per_s=95.0),
...                    Contender("uniform", Plan(0, [8, 8], 1), predicted_samples_per_s=50.0)))
>>> print(c)
tiny on two cards, global batch 16, stage 0: poplar 95.0 samples/s, 1.90x uniform, 95% of the ideal bound
>>> Comparison.from_dict(c.to_dict()) == c, c.to_dict()["poplar_vs_uniform"]
(True, 1.9)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from poplar.plan import Plan

# the ratios bench has always written, whether or not the allocation ran (None where it did not)
RATIOS = ("uniform", "proportional", "measured-peak", "deepspeed")


@dataclass(frozen=True)
class Measured:
    """What a run of an allocation measured (medians of its steady steps, on the devices' clock)."""

    samples_per_s: float
    step_s: float
    busy_s: list[float]              # each rank's
    overruns: int                    # spans whose real work ran past their declared time (0 on real devices)
    idle_s: list[float] | None = None
    first_loss: float | None = None
    last_loss: float | None = None
    alone: str = ""                  # measured in a launch of its own: why the plans' shared launch failed

    def to_dict(self) -> dict:
        out = {"samples_per_s": self.samples_per_s, "step_s": self.step_s, "busy_s": self.busy_s,
               "overruns": self.overruns}
        out.update({k: getattr(self, k) for k in ("idle_s", "first_loss", "last_loss") if getattr(self, k) is not None})
        return {**out, **({"measured_alone": self.alone} if self.alone else {})}

    @classmethod
    def from_dict(cls, row: dict) -> Measured:
        return cls(row["samples_per_s"], row["step_s"], row["busy_s"], row["overruns"], row.get("idle_s"),
                   row.get("first_loss"), row.get("last_loss"), row.get("measured_alone", ""))


@dataclass(frozen=True)
class Contender:
    """One way to run the global batch in a comparison (Poplar's allocation, a baseline's, a kind alone, a peer):
    its plan, what was predicted and what was measured."""

    name: str
    plan: Plan | None = None          # None: no plan (``why_not``), or a peer (its own ``setup``)
    predicted_samples_per_s: float | None = None
    predicted_step_s: float | None = None
    measured: Measured | None = None  # None: not run (simulated), or its run failed (``failed``)
    failed: str = ""                  # its run failed: the one line saying why
    why_not: str = ""                 # why it has no plan
    same_plan_as: str = ""            # another allocation whose plan is this one's: measured once, as that one
    kind: str = ""                    # one kind of device alone (its homogeneous cluster), of ``ranks`` ranks
    ranks: int | None = None
    label: str = ""                   # the stage and shape chosen for it (a kind alone)
    peak_tflops: float | None = None  # the rated TFLOP/s of the devices it runs on, in the compute dtype
    setup: dict = field(default_factory=dict)    # a peer's own settings, as it reports them
    failed_before: tuple[str, ...] = ()          # a peer: its launches that failed before (out of memory)

    @property
    def samples_per_s(self) -> float | None:
        """The comparison's figure: measured where it ran, predicted where it was simulated, None where neither."""
        if self.measured is not None:
            return self.measured.samples_per_s
        return None if self.failed else self.predicted_samples_per_s

    @property
    def prediction_error(self) -> float | None:
        """The predicted step time against the measured one (+0.05: predicted 5% slower), where both are known."""
        if self.measured is None or self.predicted_step_s is None:
            return None
        return self.predicted_step_s / self.measured.step_s - 1

    def to_dict(self, seq_len: int) -> dict:
        """Its row: the plan, the prediction, the figure (and its tokens of ``seq_len``), what was measured."""
        row = {**self.setup, "plan": None if self.plan is None else self.plan.to_dict(),
               "predicted_samples_per_s": self.predicted_samples_per_s, "predicted_step_s": self.predicted_step_s,
               "why_not": self.why_not}
        if self.kind:
            row.update(kind=self.kind, ranks=self.ranks)
        if self.kind or self.label:
            row["label"] = self.label
        if self.peak_tflops is not None:
            row["peak_tflops"] = self.peak_tflops
        if self.samples_per_s is not None:
            row.update(samples_per_s=self.samples_per_s, tokens_per_s=self.samples_per_s * seq_len)
        if self.measured is not None:
            row.update(self.measured.to_dict())
        if self.prediction_error is not None:
            row["prediction_error"] = self.prediction_error
        for name in ("failed", "same_plan_as"):
            if getattr(self, name):
                row[name] = getattr(self, name)
        if self.failed_before:
            row["failed_before"] = list(self.failed_before)
        return row

    @classmethod
    def from_dict(cls, name: str, row: dict) -> Contender:
        own = {f.name for f in fields(cls)} - {"name", "plan", "measured", "setup", "failed_before"}
        derived = {"samples_per_s", "tokens_per_s", "step_s", "busy_s", "overruns", "idle_s", "first_loss",
                   "last_loss", "measured_alone", "prediction_error"}
        return cls(name, plan=None if row.get("plan") is None else Plan.from_dict(row["plan"]),
                   measured=Measured.from_dict(row) if "step_s" in row else None,
                   setup={k: v for k, v in row.items() if k not in own | derived | {"plan", "failed_before"}},
                   failed_before=tuple(row.get("failed_before", ())), **{k: row[k] for k in own if k in row})


def planned(alloc, **more) -> Contender:
    """The planner's allocation (:class:`poplar.planner.result.Allocation`) as a comparison's, with ``more``."""
    predicted = alloc.predicted if alloc.plan is not None else None
    return Contender(more.pop("name", alloc.name), more.pop("plan", alloc.plan),
                      predicted_samples_per_s=None if predicted is None else predicted.samples_per_s,
                      predicted_step_s=None if predicted is None else predicted.step_s,
                      why_not=more.pop("why_not", alloc.why_not or ""), **more)


@dataclass(frozen=True)
class KindShare:
    """One device kind's part of Poplar's plan."""

    kind: str
    ranks: int
    samples: int          # a rank's samples a step (its largest, where ranks of the kind differ)
    micro_batch: int
    accum: int
    tflops: float         # model TFLOP/s a device computes, over the whole step
    mfu: float            # of the device's peak TFLOP/s in the compute dtype


@dataclass(frozen=True)
class Comparison:
    """Poplar's allocation of one global batch beside the others, on one cluster; see the module's docstring."""

    model: str
    cluster: str
    world_size: int
    seq_len: int
    global_batch: int
    zero_stage: int                   # Poplar's plan's
    shape: str
    label: str                        # Poplar's stage and shape, as the planner names them
    reason: str                       # why the planner chose it
    ideal_samples_per_s: float
    allocations: tuple[Contender, ...]          # Poplar's first, then the baselines, then each kind alone
    precision: str = "fp32"
    peers: dict[str, Contender | str] = field(default_factory=dict)   # measured beside them, or why not
    kinds: tuple[KindShare, ...] = ()            # each kind's part of Poplar's plan (simulated)
    tflops: float | None = None                  # Poplar's plan's model TFLOP/s, the cluster's (simulated)
    simulated_s: float | None = None             # how long the simulation took, and the planning after it
    planned_s: float | None = None

    @property
    def poplar(self) -> Contender:
        return self.allocations[0]

    @property
    def baselines(self) -> list[Contender]:
        return [a for a in self.allocations[1:] if not a.kind]

    @property
    def alone(self) -> list[Contender]:
        """Each kind of device alone."""
        return [a for a in self.allocations if a.kind]

    def allocation(self, name: str) -> Contender | None:
        """The allocation or the measured peer of that name (None: none)."""
        found = next((a for a in self.allocations if a.name == name), None)
        peer = self.peers.get(name)
        return found or (peer if isinstance(peer, Contender) else None)

    def speedup(self, samples_per_s: float | None) -> float | None:
        """Poplar's figure over ``samples_per_s`` (None where either is missing)."""
        mine = self.poplar.samples_per_s
        return mine / samples_per_s if mine and samples_per_s else None

    @property
    def overruns(self) -> int | None:
        """The overruns of every run measured (an allocation of another's plan counted once); None: none ran."""
        runs = [a for a in self.allocations if not a.same_plan_as]
        runs += [p for p in self.peers.values() if isinstance(p, Contender)]
        measured = [a.measured.overruns for a in runs if a.measured is not None]
        return sum(measured) if measured or any(a.failed for a in runs) else None

    def __str__(self) -> str:
        mine = self.poplar.samples_per_s
        ratios = [f"{self.speedup(a.samples_per_s):.2f}x {a.name}"
                  for a in [*self.allocations[1:], *self.peers.values()]
                  if isinstance(a, Contender) and self.speedup(a.samples_per_s)]
        figure = "no figure" if not mine else f"{mine:,.1f} samples/s"
        ideal = f"{100 * mine / self.ideal_samples_per_s:.0f}% of the ideal bound" if mine else ""
        return (f"{self.model} on {self.cluster}, global batch {self.global_batch}, {self.label}: poplar "
                + ", ".join(p for p in (figure, *ratios, ideal) if p))

    def to_dict(self) -> dict:
        """The comparison as JSON; see the module's docstring."""
        seq, mine, ideal = self.seq_len, self.poplar.samples_per_s, self.ideal_samples_per_s
        out = {"model": self.model, "cluster": self.cluster, "world_size": self.world_size, "seq_len": seq,
               "global_batch": self.global_batch, "precision": self.precision, "zero_stage": self.zero_stage,
               "shape": self.shape, "label": self.label, "reason": self.reason, "ideal_samples_per_s": ideal,
               "ideal_tokens_per_s": ideal * seq,
               "samples_per_s": mine, "tokens_per_s": None if mine is None else mine * seq,
               "allocations": {a.name: a.to_dict(seq) for a in self.allocations},
               "peers": {k: p.to_dict(seq) if isinstance(p, Contender) else p for k, p in self.peers.items()},
               "baselines": {a.name: a.samples_per_s for a in self.baselines},
               "alone": [{"kind": a.kind, "ranks": a.ranks, "label": a.label, "samples_per_s": a.samples_per_s,
                          "why_not": a.why_not} for a in self.alone]}
        others = {a.name: a.samples_per_s for a in self.baselines}
        others.update({k: p.samples_per_s for k, p in self.peers.items() if isinstance(p, Contender)})
        for name in dict.fromkeys([*RATIOS, *others]):
            out[f"poplar_vs_{name.replace('-', '_')}"] = self.speedup(others.get(name))
        out["poplar_of_ideal"] = mine / ideal if mine else None
        out["overruns"] = self.overruns
        out.update({k: getattr(self, k) for k in ("tflops", "simulated_s", "planned_s") if getattr(self, k) is not None})
        if self.kinds:
            out["kinds"] = [asdict(k) for k in self.kinds]
        return out

    @classmethod
    def from_dict(cls, data: dict) -> Comparison:
        """A comparison :meth:`to_dict` wrote (the derived figures are computed again, not read)."""
        peers = {k: Contender.from_dict(k, p) if isinstance(p, dict) else p for k, p in data.get("peers", {}).items()}
        plain = {"model", "cluster", "world_size", "seq_len", "global_batch", "zero_stage", "shape", "label",
                 "reason", "ideal_samples_per_s", "precision", "tflops", "simulated_s", "planned_s"}
        return cls(allocations=tuple(Contender.from_dict(k, a) for k, a in data["allocations"].items()),
                   peers=peers, kinds=tuple(KindShare(**k) for k in data.get("kinds", ())),
                   **{k: data[k] for k in plain if k in data})
