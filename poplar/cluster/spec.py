"""The cluster file: which devices the ranks are, on which nodes, joined by which links.

```yaml
memory_scale: 0.0005        # every device's memory times this (tiny models meet real limits)
network:                    # optional; these are the defaults
  intra_node: {bandwidth_gbs: 25, latency_us: 10}     # PCIe 4.0 between unlike cards
  inter_node: {bandwidth_gbs: 12.5, latency_us: 20}   # 100 Gb/s
  between:                  # optional: links between particular nodes, instead of inter_node
    - {nodes: [0, 2], bandwidth_gbs: 1.25, latency_us: 50}
devices:
  - kind: big               # a name for this kind
    gpu: A100-80GB          # figures from the catalogue (poplar.cluster.catalogue) ...
    count: 1
    node: 0                 # which node the ranks sit on (default 0)
  - kind: nvlinked
    gpu: A100-40GB
    count: 16
    gpus_per_node: 8        # 8 ranks a node, on the nodes after the previous kinds' (here 1 and 2)
    intra_node: {bandwidth_gbs: 300, latency_us: 3}    # their own link inside a node (NVLink)
  - kind: custom
    count: 2
    memory_gb: 24           # ... or declared here (these also override a catalogue entry's)
    tflops: {fp32: 20, bf16: 80}
    memory_bandwidth_gbs: 900
    node: 3
```

Ranks take the devices in file order (rank 0 is ``big``, ranks 1-16 ``nvlinked``,
17-18 ``custom``). An
emulated device is a model of a GPU (:mod:`poplar.emulate`): it computes for real and
takes the time its figures say. A cluster of real CUDA devices is not written by hand:
it is discovered from the launched ranks (:mod:`poplar.profile.discover`), and each of
its kinds carries the GPU's properties (``cuda``) instead of figures.
"""

from __future__ import annotations

import difflib
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from poplar.cluster.kinds import DeviceGroup, no_dtype_line
from poplar.cluster.network import Link, Network

PRESETS_DIR = Path(__file__).parent / "presets"
def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n:,}"


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.2f} MiB"


class ClusterSpec(BaseModel):
    """The devices of a heterogeneous cluster in rank order, their nodes and the links between them."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    devices: list[DeviceGroup] = Field(min_length=1, description="device kinds, in rank order")
    memory_scale: float = Field(1.0, gt=0, description="every emulated device's memory times this")
    network: Network = Network()

    @model_validator(mode="after")
    def _consistent(self) -> ClusterSpec:
        if len({d.cuda is None for d in self.devices}) > 1:
            raise ValueError("mixes real CUDA devices with emulated ones: a cluster is either discovered or "
                             "emulated, not both")
        seen: dict[str, DeviceGroup] = {}
        for d in self.devices:
            placed = {"count": d.count, "node": d.node, "gpus_per_node": d.gpus_per_node}
            if d.kind in seen and seen[d.kind].model_copy(update=placed) != d:
                raise ValueError(f"kind {d.kind!r} is declared twice with different figures: give the second "
                                 "another name")
            seen[d.kind] = d
        return self

    @property
    def is_real(self) -> bool:
        """Real CUDA devices (discovered), not emulated ones."""
        return self.devices[0].cuda is not None

    @property
    def world_size(self) -> int:
        return sum(d.count for d in self.devices)

    def rank_devices(self) -> list[DeviceGroup]:
        """One entry per rank: the device that rank is."""
        return [d for d in self.devices for _ in range(d.count)]

    def rank_nodes(self) -> list[int]:
        """The node each rank sits on."""
        nodes: list[int] = []
        top = -1     # the highest node so far (an entry without one starts on the next)
        for d in self.devices:
            if d.gpus_per_node is None:
                nodes += [d.node] * d.count
            else:
                first = d.node if "node" in d.model_fields_set or not nodes else top + 1
                nodes += [first + i // d.gpus_per_node for i in range(d.count)]
            top = max(top, nodes[-1]) if nodes else top    # an entry's nodes rise: its last is its highest
        return nodes

    def intra_links(self) -> dict[int, Link]:
        """Each node's link among its own ranks: its kind's (``intra_node``), the network's where none is given;
        on a node of several kinds the slowest of theirs and the network's (unlike cards share no NVLink)."""
        kinds: dict[int, set] = {}
        for d, n in zip(self.rank_devices(), self.rank_nodes()):
            kinds.setdefault(n, set()).add(d.intra_node)
        out = {}
        for n, links in kinds.items():
            if len(links) > 1 or None in links:
                links = (links - {None}) | {self.network.intra_node}
            out[n] = Link(bandwidth_gbs=min(k.bandwidth_gbs for k in links), latency_us=max(k.latency_us for k in links))
        return out

    def node_groups(self) -> list[list[int]]:
        """The ranks on each node, node by node: the shard groups of a plan shaped to the nodes."""
        by: dict[int, list[int]] = {}
        for r, n in enumerate(self.rank_nodes()):
            by.setdefault(n, []).append(r)
        return [by[n] for n in sorted(by)]

    def subset(self, ranks: list[int]) -> ClusterSpec:
        """The cluster of ``ranks`` only, in that order, each on the node it had: where a plan that leaves the
        other devices out runs.

        >>> spec = parse_cluster({"devices": [{"kind": "a", "gpu": "A100-80GB"}, {"kind": "t", "gpu": "T4-16GB",
        ...                                    "count": 2}]})
        >>> [(d.kind, d.count) for d in spec.subset([0]).devices], spec.subset([1, 2]).world_size
        ([('a', 1)], 2)
        """
        devices, nodes = self.rank_devices(), self.rank_nodes()
        return self._regrouped([devices[r] for r in ranks], [nodes[r] for r in ranks])

    def slowed(self, rank: int, factor: float) -> ClusterSpec:
        """This cluster with rank ``rank``'s device at ``factor`` of its speed (:meth:`DeviceGroup.slowed`), a kind
        of its own (``KIND-slowed``): the cluster a card that throttles makes."""
        card = self.device(rank)
        devices = [card.slowed(factor, kind=f"{card.kind}-slowed") if r == rank else d
                   for r, d in enumerate(self.rank_devices())]
        return self._regrouped(devices, self.rank_nodes())

    def _regrouped(self, devices: list[DeviceGroup], nodes: list[int]) -> ClusterSpec:
        """This cluster's network with ``devices`` (one per rank, on ``nodes``), neighbours of a kind and node
        grouped."""
        groups: list[DeviceGroup] = []
        for d, node in zip(devices, nodes):
            if groups and groups[-1].kind == d.kind and groups[-1].node == node:
                groups[-1] = groups[-1].model_copy(update={"count": groups[-1].count + 1})
            else:
                groups.append(d.model_copy(update={"count": 1, "node": node, "gpus_per_node": None}))
        return self.model_copy(update={"devices": groups})

    def device(self, rank: int) -> DeviceGroup:
        ranks = self.rank_devices()
        if not 0 <= rank < len(ranks):
            raise ValueError(f"rank {rank} is outside this cluster's {len(ranks)} devices")
        return ranks[rank]

    def memory_bytes(self, kind: DeviceGroup) -> int:
        """A device's capacity: a real one's own; an emulated one's scaled by ``memory_scale``."""
        if kind.cuda is not None:
            return kind.cuda.total_memory
        return int(kind.memory_gib * self.memory_scale * 2**30)

    def check_holds_states(self, name: str, n_params: int, precision: str, frozen: int = 0) -> None:
        """Refuse (one line) a model of ``n_params`` trained parameters whose states these devices cannot hold
        together even in ZeRO-3 (one copy over the cluster, any shares: the stage's sharded bytes a parameter times
        the parameters), beside ``frozen`` parameters (LoRA's base weights) that every device holds whole, weights
        alone (:func:`~poplar.stages.frozen_bytes_per_param`)."""
        from poplar.stages import frozen_bytes_per_param
        from poplar.stages import stage as zero_stage

        per_param = zero_stage(3).sharded_bytes_per_param(precision)
        need = per_param * n_params
        each = frozen_bytes_per_param(precision) * frozen
        smallest = min(self.rank_devices(), key=self.memory_bytes)
        if each > self.memory_bytes(smallest):
            raise ValueError(f"{name}'s {_count(frozen)} frozen parameters take {_size(each)} on every device "
                             f"({frozen_bytes_per_param(precision)} bytes a parameter in {precision}), more than "
                             f"{smallest.kind}'s {_size(self.memory_bytes(smallest))}: use larger devices, a lower "
                             "precision, or choose a smaller model")
        held = sum(self.memory_bytes(d) - each for d in self.rank_devices())
        if need > held:
            beside = f" beside the frozen weights' {_size(each)} on each device" if frozen else ""
            raise ValueError(f"{name} has {_count(n_params)} {'trained ' if frozen else ''}parameters: its model "
                             f"states take at least {_size(need)} in ZeRO-3 ({per_param} bytes a parameter "
                             f"in {precision}){beside}, more than the {self.world_size} device"
                             f"{'s' * (self.world_size > 1)} of this cluster hold together ({_size(held)}): add "
                             "devices or larger ones, or choose a smaller model")

    def check_world_size(self, world_size: int) -> None:
        if world_size != self.world_size:
            counts = ", ".join(f"{d.count} x {d.kind}" for d in self.devices)
            raise ValueError(f"the cluster file describes {self.world_size} devices ({counts}) but {world_size} "
                             f"ranks were launched: launch {self.world_size} ranks or change the devices' counts")

    def check_precision(self, precision: str) -> None:
        """Every kind has hardware for ``precision`` (fp32, bf16, fp16): known before anything is profiled."""
        lacking = [g for g in self.devices if not g.computes(precision)]
        if lacking:
            raise ValueError(no_dtype_line(precision, [f"{g.kind} ({g.gpu or 'declared'})" for g in lacking]))

    def check_global_batch(self, global_batch: int) -> None:
        """Every rank takes at least one sample of every global batch: known before anything is profiled."""
        from poplar.plan import check_global_batch

        check_global_batch(global_batch, self.world_size)

    def describe(self) -> str:
        """One line a person reads: the kinds, their nodes and the links."""
        kinds = ", ".join(f"{d.count} x {d.kind}" + (f" ({d.gpu})" if d.gpu else "")
                          + (f" on node {d.node}" if len({x.node for x in self.devices}) > 1 else "")
                          for d in self.devices)
        net = self.network
        links = f"intra-node {net.intra_node.bandwidth_gbs:g} GB/s"
        nodes = sorted(set(self.rank_nodes()))
        if len(nodes) > 1:
            pairs = [(a, b) for i, a in enumerate(nodes) for b in nodes[i + 1:]]
            speeds = {net.link(a, b).bandwidth_gbs for a, b in pairs}
            links += (f", inter-node {speeds.pop():g} GB/s" if len(speeds) == 1 else ", " + ", ".join(
                f"nodes {a}-{b} {net.link(a, b).bandwidth_gbs:g} GB/s" for a, b in pairs))
        return f"{kinds}; {links}" + (f"; memory x{self.memory_scale:g}" if self.memory_scale != 1 else "")

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(), sort_keys=False)


def _field_errors(e: ValidationError) -> str:
    """What is wrong, a message once for all the fields it is said of (a file of one entry a node repeats an
    entry's mistake on every node it lists)."""
    said: dict[str, list[str]] = {}
    allowed = ", ".join(f for f in DeviceGroup.model_fields if f != "cuda")
    for err in e.errors():
        where = ".".join(str(p) for p in err["loc"]) or "(top level)"
        if err["type"] == "extra_forbid" or err["type"] == "extra_forbidden":
            if where.endswith(".speed"):
                what = ("a device is no longer a speed relative to this host: give gpu: NAME "
                        "(see poplar.cluster.catalogue) or tflops and memory_bandwidth_gbs")
            else:
                what = (f"unknown field (allowed under devices: {allowed}; at the top: devices, "
                        "memory_scale, network)")
        else:   # a validator's own message reads as it was written
            what = err["msg"].removeprefix("Value error, ")
        said.setdefault(what, []).append(where)
    return "; ".join(f"{_places(wheres)}: {what}" for what, wheres in said.items())


def _places(wheres: list[str]) -> str:
    """Fields a message is said of: all of them, or past three the first two, the last and how many."""
    if len(wheres) <= 3:
        return ", ".join(wheres)
    return f"{wheres[0]}, {wheres[1]}, ..., {wheres[-1]} ({len(wheres)} entries)"


def parse_cluster(data, source: str = "cluster") -> ClusterSpec:
    """Validate a cluster description (the YAML's content); errors name the field."""
    if isinstance(data, ClusterSpec):
        return data
    if not isinstance(data, dict):
        raise ValueError(f"{source}: expected a mapping with a 'devices' list, got {type(data).__name__}")
    try:
        return ClusterSpec.model_validate(data)
    except ValidationError as e:
        raise ValueError(f"{source}: {_field_errors(e)}") from None


def load_cluster(path_or_preset: str | Path) -> ClusterSpec:
    """Load a cluster file, or a preset by name (see :func:`presets`)."""
    path = Path(path_or_preset)
    if not path.is_file() and (PRESETS_DIR / f"{path_or_preset}.yaml").is_file():
        path = PRESETS_DIR / f"{path_or_preset}.yaml"
    if not path.is_file():
        close = difflib.get_close_matches(str(path_or_preset), presets(), n=1)
        raise FileNotFoundError(f"no cluster file {str(path_or_preset)!r}; " + (f"did you mean {close[0]}? " if close
                                else "") + f"give a YAML path or one of the presets: {', '.join(presets())}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:   # the place and the problem, on one line (yaml's own message is a drawing)
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ValueError(f"{path}: not valid YAML{where}: {getattr(e, 'problem', None) or e}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.start}): give a YAML cluster file") from None
    return parse_cluster(data, str(path))


def presets() -> list[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))
