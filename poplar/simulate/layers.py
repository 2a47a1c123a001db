"""A deep model's step from two shallow ones: its alike layers counted once, not 32 or 80 times.

A decoder's layers are alike: the same operators on the same shapes, each its own unit
of the engine (its own flat buffers, shards and collectives). So a step of the model
with ``L`` layers runs the operators of the model with ``d`` layers, and ``L - d`` more
copies of one layer's: in its forward, its backward, its update and its gathers; the
few operators whose size grows with the layers (a stack of the units' norms) grow by the
same amount with each. :func:`deeper` finds those copies between the steps of ``d`` and
``d + 1`` layers (a diff of their operators, inserted runs only) and writes the step of
``L`` layers, marks, launches and waits included; where the steps do not differ so,
there is no such step (None) and the deep model is run as it is. The simulator checks the
result once against a step recorded at ``d + 2`` layers, ``d`` the fewest its stage allows
(:func:`shallowest`), then one more where that fails (:mod:`poplar.simulate.recording`).

:class:`Shallow` is the model source with fewer layers: the source's own
``build_layers`` (Hugging Face configs: ``num_hidden_layers``).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

import numpy as np

from poplar.simulate.trace import Trace

SHALLOW = 2     # the layers of the shallower step a deep one is drawn from, at most (the next one has one more)
DEEP = SHALLOW + 3     # a model of fewer layers is run as it is


def shallowest(stage: int) -> int:
    """The fewest layers a deep step of ``stage`` is drawn from: one, but two for ZeRO-3, whose gathers are
    prefetched a unit ahead: with one layer, what its last unit prefetches is the root's, with two the next
    layer's, so that a step of one layer is not one of two with a layer's runs taken out (the check finds it:
    Llama-7B's)."""
    return SHALLOW if stage == 3 else 1


@dataclass(frozen=True)
class Shallow:
    """``source`` with ``layers`` of its alike layers: a model source (:class:`~poplar.models.workload.ModelSource`)."""

    source: object
    layers: int

    @property
    def seq_len(self) -> int:
        return self.source.seq_len

    @property
    def name(self) -> str:
        return f"{self.source.name} ({self.layers} layers)"

    def build(self, seed: int = 0):
        return self.source.build_layers(self.layers, seed)

    def build_layers(self, layers: int, seed: int = 0):
        return self.source.build_layers(layers, seed)

    @property
    def loss(self):
        return self.source.loss

    def random_batch(self, n: int, seed: int = 0):
        return self.source.random_batch(n, seed)

    def n_params(self) -> int:
        import torch

        with torch.device("meta"):
            return sum(p.numel() for p in self.build().parameters())

    def identity(self) -> dict:
        return {**self.source.identity(), "layers": self.layers}

    def cache_dict(self) -> dict:
        return {**self.source.cache_dict(), "layers": self.layers}


def layers_of(source) -> int | None:
    """The alike layers of ``source`` where it can build fewer of them (``layers`` and ``build_layers``), else None."""
    if getattr(source, "build_layers", None) is None:
        return None
    return getattr(source, "layers", None)


def deeper(a: Trace, b: Trace, layers: int, depth_a: int) -> Trace | None:
    """The step of ``layers`` layers from ``a`` (of ``depth_a`` layers) and ``b`` (of one more): ``b``'s
    operators, marks, launches and waits, each run of them inserted between ``a`` and ``b`` repeated
    ``layers - depth_a`` times, the others' FLOPs and bytes drawn on through ``a`` and ``b``; None where ``b`` is
    not ``a`` with runs inserted, or the inserted marks are not those of one layer's units."""
    per_layer = b.n_units - a.n_units
    if per_layer < 1 or a.ops is None or b.ops is None:
        return None
    events_a, events_b = _events(a), _events(b)
    partner = _aligned(events_a, events_b)
    if partner is None:
        return None
    extra = layers - depth_a            # copies of each inserted run
    b_ops = np.array([e[2] if e[1] == "op" else -1 for e in events_b], dtype=np.int64)
    a_ops = np.array([e[2] if e[1] == "op" else -1 for e in events_a], dtype=np.int64)
    flops, nbytes = b.flops.astype(float), b.nbytes.astype(float)
    kept = (partner >= 0) & (b_ops >= 0)
    mine, theirs = b_ops[kept], a_ops[partner[kept]]
    flops[mine] = a.flops[theirs] + extra * (flops[mine] - a.flops[theirs])
    nbytes[mine] = a.nbytes[theirs] + extra * (nbytes[mine] - a.nbytes[theirs])
    placed = _placed(events_a, events_b, partner, extra, per_layer)
    if placed is None:
        return None
    order, at, launches, waits = placed
    return Trace(flops[order], nbytes[order], b.dtypes[order], at, launches, waits,
                 a.n_units + extra * per_layer, b.ops[order])


def _aligned(events_a: list[tuple], events_b: list[tuple]) -> np.ndarray | None:
    """For each of ``b``'s events, ``a``'s it is (-1: inserted), where ``b`` is ``a`` with runs inserted and some
    operators or launches of another size (what sums over the layers: their gradients' norm)."""
    partner = np.full(len(events_b), -1)
    matcher = difflib.SequenceMatcher(None, [e[0] for e in events_a], [e[0] for e in events_b], autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "insert":
            continue
        alike = i2 - i1 == j2 - j1 and all(x[0][:2] == y[0][:2] for x, y in zip(events_a[i1:i2], events_b[j1:j2]))
        if tag != "equal" and not alike:
            return None
        partner[j1:j2] = np.arange(i1, i2)
    return partner


def _events(t: Trace) -> list[tuple]:
    """The step's operators, marks, launches and waits in order, each ``(key, kind, value)``: the key says what
    it is (an operator, its dtype and its bytes; a mark's name and its unit's size; a launch's collective and its
    bytes)."""
    at: dict[int, list[tuple]] = {}      # at each position: its marks, launches and waits, each in their order
    for (what, unit), p in t.marks.items():     # a unit told apart by its size (a layer's alike, in place)
        size = t.units[unit] if unit < len(t.units) else unit == 0
        at.setdefault(p, []).append((("mark", what, size), "mark", (what, unit)))
    for op, nbytes, p in t.launches:
        at.setdefault(p, []).append((("launch", op, nbytes), "launch", (op, nbytes)))
    for p in t.waits:
        at.setdefault(p, []).append((("wait",), "wait", None))
    out = []
    for p in range(len(t.flops) + 1):
        out.extend(at.get(p, ()))
        if p < len(t.flops):
            out.append(((int(t.ops[p]), int(t.dtypes[p]), float(t.nbytes[p])), "op", p))
    return out


def _placed(events_a, events_b, partner, extra: int, per_layer: int):
    """The deep step's operators (``b``'s, in order: each inserted run ``extra`` times over), and its marks,
    launches and waits, each at the operators before it there (a run's copied with it); a launch's bytes drawn on
    as an operator's. None where the layers' marks cannot be numbered (:func:`_numbered`)."""
    order: list[int] = []
    at, launches, waits, layer_marks = {}, [], [], {}
    j = 0
    while j < len(events_b):
        end = j + 1
        if partner[j] < 0:          # a run of inserted events, copied
            while end < len(events_b) and partner[end] < 0:
                end += 1
        copies = range(extra) if partner[j] < 0 else [None]
        for copy in copies:
            for _, kind, value in events_b[j:end]:
                if kind == "op":
                    order.append(value)
                elif kind == "mark" and value[1] == 0:
                    at[(value[0], 0)] = len(order)
                elif kind == "mark":
                    layer_marks.setdefault(value[0], []).append((len(order), value[1], copy))
                elif kind == "wait":
                    waits.append(len(order))
                else:
                    size = value[1]
                    if copy is None:
                        before = events_a[partner[j]][2][1]
                        size = before + extra * (size - before)
                    launches.append((value[0], int(size), len(order)))
        j = end
    for what, found in layer_marks.items():
        numbered = _numbered(found, per_layer, extra)
        if numbered is None:
            return None
        at.update({(what, u): q for u, q in numbered})
    return np.array(order, dtype=np.int64), at, launches, waits


def _numbered(found: list[tuple[int, int, int | None]], per_layer: int, extra: int):
    """One mark's ``(unit, position)`` in the deep step from its ``(position, unit in b, copy)``, or None.

    Units are numbered in the model's order, each layer's ``per_layer`` of them one after another, so a unit
    ``per_layer`` on is the same unit a layer on. The copied marks must come together in the step, of
    ``per_layer`` units one of each place in a layer (a run may begin inside a layer); a step meets the layers
    in their order (forward) or backward, as its marks say. Forward, the copy ``k`` is ``k`` layers on and the
    marks after the copies move past them; backward, the marks before the copies and the earlier copies are the
    further layers."""
    found = sorted(found)
    copied = [i for i, (_, _, copy) in enumerate(found) if copy is not None]
    units = {u for _, u, copy in found if copy is not None}
    if (not copied or copied != list(range(copied[0], copied[-1] + 1)) or len(units) != per_layer
            or len({u % per_layer for u in units}) != per_layer):
        return None
    ascending = found[0][1] <= found[-1][1]
    out = []
    for i, (q, u, copy) in enumerate(found):
        if copy is not None:
            out.append((u + per_layer * (copy if ascending else extra - 1 - copy), q))
        else:
            moved = (i > copied[-1]) if ascending else (i < copied[0])
            out.append((u + (extra - 1) * per_layer if moved else u, q))
    if len({u for u, _ in out}) != len(out):
        return None
    return out


def deeper_units(a: tuple[int, ...], b: tuple[int, ...], extra: int) -> tuple[int, ...] | None:
    """The deep model's units' parameters: ``b``'s (``a``'s with one layer's inserted), that layer's ``extra``
    times."""
    per_layer = len(b) - len(a)
    p = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
    if per_layer < 1 or b[p + per_layer:] != a[p:]:
        return None
    return b[:p] + b[p:p + per_layer] * extra + b[p + per_layer:]


def deeper_info(a, b, layers: int, depth_a: int):
    """The deep model's :class:`~poplar.profile.profile.ModelInfo` from those of ``a`` (of ``depth_a`` layers) and
    ``b`` (of one more): its parameters drawn on, its units' parameters and FLOPs ``b``'s with the inserted layer's
    repeated (:func:`deeper_units`); None where ``b``'s units are not ``a``'s with one layer's inserted."""
    extra = layers - depth_a
    numels = deeper_units(tuple(a.unit_numels), tuple(b.unit_numels), extra)
    flops = deeper_units(tuple(a.unit_flops), tuple(b.unit_flops), extra)
    if numels is None or flops is None or len(numels) != len(flops):
        return None
    return b.model_copy(update={"n_params": a.n_params + extra * (b.n_params - a.n_params),
                                "frozen_params": a.frozen_params + extra * (b.frozen_params - a.frozen_params),
                                "unit_numels": list(numels), "unit_flops": list(flops)})


class DeepRecording:
    """A stage's recording (its steps and model states) of a model of ``layers`` layers, drawn from recordings of
    ``shallow`` layers and one more (``a``, ``b``: each with ``before``, ``most``, ``sharded``, ``units`` and
    ``trace(m, accumulation)``); ``full()`` makes the deep model's own, for a step not drawn so. ``check``: run
    once before the first step or the states at their most are drawn (False: the deep model's own instead)."""

    def __init__(self, a, b, layers: int, full, check=None, shallow: int = SHALLOW):
        self.a, self.b, self.layers, self._full, self._made = a, b, layers, full, None
        self.shallow = shallow
        self.extra = layers - shallow
        self.check, self._failed = check, False

    def _drawn(self, va: int, vb: int) -> int:
        return va + self.extra * (vb - va)

    def _is_drawn(self) -> bool:
        """Whether steps and the states at their most are drawn: the check (run once) passed, or there was none."""
        if self.check is not None:
            check, self.check = self.check, None
            self._failed = not check()
        return not self._failed

    def _own(self):
        """The deep model's own recording, made once."""
        self._made = self._made or self._full()
        return self._made

    @property
    def before(self) -> int:
        return self._drawn(self.a.before, self.b.before)

    @property
    def most(self) -> int:
        return self._drawn(self.a.most, self.b.most) if self._is_drawn() else self._own().most

    @property
    def sharded(self) -> int:
        return self._drawn(self.a.sharded, self.b.sharded)

    @property
    def units(self) -> tuple[int, ...]:
        return deeper_units(self.a.units, self.b.units, self.extra)

    def trace(self, m: int, accumulation: int) -> Trace:
        if self._is_drawn():
            drawn = deeper(self.a.trace(m, accumulation), self.b.trace(m, accumulation), self.layers, self.shallow)
            if drawn is not None:
                return drawn
        return self._own().trace(m, accumulation)

    def recut(self, shares: tuple[float, ...]) -> DeepRecording:
        """This recording with other ``shares`` of the states (:meth:`~poplar.simulate.recording.Recording.recut`),
        drawn where this one is."""
        return DeepRecording(self.a.recut(shares), self.b.recut(shares), self.layers,
                             lambda: self._own().recut(shares), self._is_drawn, self.shallow)

    def states_match(self, c) -> bool:
        """Whether the drawing at ``c``'s layers (``c``: a recording of ``shallow`` + 2) gives ``c``'s model
        states before a step and its units (no step run)."""
        at_c = DeepRecording(self.a, self.b, self.shallow + 2, None, shallow=self.shallow)
        return (at_c.before, at_c.sharded, at_c.units) == (c.before, c.sharded, c.units)

    def steps_match(self, c) -> bool:
        """Whether the drawing at ``c``'s layers gives ``c``'s steps (one micro-batch and two) to the last
        operator, and its states at their most."""
        for k in (1, 2):
            drawn = deeper(self.a.trace(1, k), self.b.trace(1, k), self.shallow + 2, self.shallow)
            if drawn is None or not drawn.same_as(c.trace(1, k)):
                return False
        return DeepRecording(self.a, self.b, self.shallow + 2, None, shallow=self.shallow).most == c.most
