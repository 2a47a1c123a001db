"""One rank's step as the engine promises it: every collective it issues, in order, on how many bytes, written from
the units' padded sizes and the schedule each stage promises (tests/engine/test_collectives.py says the schedule;
test_shapes.py holds the engine to it at every shape)."""

from __future__ import annotations

from poplar.engine.layout import ShardLayout
from tests.helpers.models import make_model

WORLD = 2
MODEL = {"layers": 3}


def unit_numels(model_kw: dict = MODEL) -> list[int]:
    """The units' sizes from the model itself: the root (embedding, final norm; the head is tied), then each block."""
    model = make_model(**model_kw)
    in_blocks = {id(p) for p in model.blocks.parameters()}
    root = sum(p.numel() for p in model.parameters() if id(p) not in in_blocks)
    return [root] + [sum(p.numel() for p in block.parameters()) for block in model.blocks]


def expected_step(stage: int, accum: int, itemsize: int, layout: ShardLayout | None = None,
                  model_kw: dict = MODEL, every_rank_norm: bool = False) -> list[tuple[str, int]]:
    """One rank's step: every collective as (op, bytes of the full buffer), and ("micro_step", k) where k starts.

    ``layout``: the rank's place in the plan's shard groups and shares (default: flat over ``WORLD`` ranks,
    even). Hybrid, its group's collectives are ``op/group``, every unit padded to the group's size; where the
    shares cut a group's slices unevenly, its all-gathers move every slice padded to the largest.
    ``every_rank_norm``: the plan gives its groups stages of their own, so every rank, a replicating one too,
    joins the sum of the gradient norm's squares.
    """
    layout = layout or ShardLayout(WORLD, None, 0)
    numels = unit_numels(model_kw)
    sizes = [layout.padded(n) for n in numels]
    gathered = [layout.shard_size * max(layout.slice_sizes(n)) for n in numels]
    hybrid, world = layout.hybrid, layout.world_size
    last = len(sizes) - 1
    tag = "/group" if hybrid else ""
    grad = lambda i: 4 * sizes[i]               # noqa: E731  fp32 gradient bucket
    param = lambda i: itemsize * gathered[i]    # noqa: E731  parameters in the compute precision
    reduce = "all_reduce" if stage == 0 and not hybrid else "reduce_scatter" + tag
    gather = "all_gather" + tag
    out = [("all_reduce", 8 * world)]        # every rank's local batch size, checked against the plan
    for k in range(accum):
        if stage == 3:
            out.append((gather, param(0)))    # the root, before anything of the micro-step runs
        out.append(("micro_step", k))
        if stage == 3:
            out += [(gather, param(i)) for i in range(1, last + 1)]        # forward, prefetched one ahead
            out += [(gather, param(last)), (gather, param(last - 1))]      # backward's first, and the next
            for i in range(last, 0, -1):
                out.append((reduce, grad(i)))
                if i - 2 >= 1:
                    out.append((gather, param(i - 2)))   # prefetched while unit i-1 computes
            out.append((reduce, grad(0)))                # the root's, last: the root stays gathered
        elif stage == 2 or k == accum - 1:
            out += [(reduce, grad(i)) for i in range(last, -1, -1)]
    if hybrid:
        out = _with_sums_across(out, stage, grad, numels, layout)
    out.append(("all_reduce", 4))                # the loss
    if stage >= 1 or every_rank_norm:
        out.append(("all_reduce", 4))            # the squared gradient norm, summed over the shards
    if stage in (1, 2):
        out += [(gather, param(i)) for i in range(last + 1)]   # the updated parameters
    return out


def _with_sums_across(out: list, stage: int, grad, numels: list[int], layout: ShardLayout) -> list:
    """The last micro-step's reduce-scatters each followed (once waited for) by the unit's sum across groups: among
    the rank's counterparts, its slice's unpadded part, where the groups are alike; else the exchange."""

    def summed(numel: int) -> tuple[str, int]:
        if layout.counterparts is None:
            return ("reduce_across", 4 * numel)
        lo, hi = (min(x, numel) for x in layout.shard_range(numel))
        return ("all_reduce/group", 4 * (hi - lo))

    order = list(range(len(numels) - 1, -1, -1))   # the units' reduce-scatters, in launch order
    start = max(i for i, c in enumerate(out) if c[0] == "micro_step")
    scatters = [i for i in range(start, len(out)) if out[i][0] == "reduce_scatter/group"]
    after = {pos: [] for pos in scatters}
    for p, unit in enumerate(order):   # stages 2-3 wait for a bucket when a third is launched; 0-1 at the end
        at = scatters[min(p + 2, len(order) - 1)] if stage >= 2 else scatters[-1]
        after[at].append(summed(numels[unit]))
    new = []
    for i, c in enumerate(out):
        new += [c] + after.get(i, [])
    if stage == 0:   # the two-level all-reduce's last level
        new += [("all_gather/group", grad(unit)) for unit in order]
    return new
