"""The order an epoch visits a data set's samples in: :func:`epoch_order`, one seed rule for every front end.

``poplar train``'s global batches (:class:`poplar.data.text.GlobalBatches`) and the
integrations' samplers (:class:`poplar.integrations.sampler.PlanBatchSampler`) both draw an
epoch's order here and cut global batch ``k`` of the epoch as ``order[k*G:(k+1)*G]``, so a
run resumed through another front end, with the same samples, seed and global batch, cuts
the very batches it would have.

>>> epoch_order(6, seed=0, epoch=0).tolist() == epoch_order(6, seed=0, epoch=0).tolist()
True
>>> sorted(epoch_order(6, seed=3, epoch=1).tolist())
[0, 1, 2, 3, 4, 5]
"""

from __future__ import annotations

import torch

SEED_STRIDE = 1_000_003   # a prime: seeds (seed, epoch) never meet another seed's epochs in any run's length


def epoch_order(n_samples: int, seed: int, epoch: int) -> torch.Tensor:
    """Epoch ``epoch``'s permutation of ``n_samples`` samples, drawn from ``seed * SEED_STRIDE + epoch``."""
    g = torch.Generator().manual_seed(seed * SEED_STRIDE + epoch)
    return torch.randperm(n_samples, generator=g)
