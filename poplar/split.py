"""How samples are cut: into near-equal micro-batches, or into parts in proportion to weights."""

from __future__ import annotations

import math
from typing import Sequence


def near_equal(samples: int, parts: int) -> list[int]:
    """``samples`` cut into ``parts`` near-equal micro-batches, the larger first."""
    q, rem = divmod(samples, parts)
    return [q + 1] * rem + [q] * (parts - rem)


def apportion(samples: int, weights: Sequence[float]) -> list[int]:
    """``samples`` split in proportion to ``weights``: each part's floor, then one more to the largest remainders
    (the first on ties); a part may get none.

    >>> apportion(5, [6, 2, 4])
    [2, 1, 2]
    """
    total = float(sum(weights))
    exact = [samples * w / total for w in weights]
    out = [math.floor(x) for x in exact]
    for i in sorted(range(len(out)), key=lambda i: (out[i] - exact[i], i))[:samples - sum(out)]:
        out[i] += 1
    return out
