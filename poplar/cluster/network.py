"""The links of a cluster file's ``network``: inside a node, between nodes, between two particular nodes."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Link(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    bandwidth_gbs: float = Field(gt=0, description="GB/s one way, per rank")
    latency_us: float = Field(ge=0, description="microseconds per message")


class NodeLink(Link):
    """The link between two particular nodes."""

    nodes: tuple[int, int] = Field(description="the two nodes it joins")

    @model_validator(mode="after")
    def _two(self) -> NodeLink:
        if self.nodes[0] == self.nodes[1]:
            raise ValueError(f"nodes {list(self.nodes)}: a link joins two different nodes (inside one: intra_node)")
        return self


class Network(BaseModel):
    """Links inside a node and between nodes: ``inter_node``, or ``between`` two particular ones."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    intra_node: Link = Link(bandwidth_gbs=25.0, latency_us=10.0)
    inter_node: Link = Link(bandwidth_gbs=12.5, latency_us=20.0)
    between: tuple[NodeLink, ...] = Field((), description="links between particular nodes (else inter_node's)")

    @model_validator(mode="after")
    def _once(self) -> Network:
        pairs = [frozenset(link.nodes) for link in self.between]
        twice = next((sorted(p) for p in pairs if pairs.count(p) > 1), None)
        if twice:
            raise ValueError(f"the link between nodes {twice} is given twice: keep one")
        return self

    def link(self, a: int, b: int) -> Link:
        """The link between nodes ``a`` and ``b`` (the same node: ``intra_node``)."""
        if a == b:
            return self.intra_node
        found = next((k for k in self.between if set(k.nodes) == {a, b}), None)
        return Link(bandwidth_gbs=found.bandwidth_gbs, latency_us=found.latency_us) if found else self.inter_node
