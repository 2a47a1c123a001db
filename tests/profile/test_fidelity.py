"""The profiler against the declared model: its fitted curve within 3% at every micro-batch size.

The emulated devices' time is their declared model's, and the profiler only measures
(it never reads the model), so the fitted spline against the model counted operator by
operator is a real test of the profiler's sizes, its split of a step and the spline.
"""

from __future__ import annotations

import numpy as np
import pytest

from poplar.cluster.spec import load_cluster
from poplar.processes.spawn import spawn
from poplar.profile.profiler import profile_cluster
from tests.profile.workers import declared_step_times

pytestmark = [pytest.mark.slow, pytest.mark.paced]

LIMIT = 24     # the largest micro-batch searched: keeps the real work of every size small


@pytest.mark.parametrize("preset", ["both-differ"])   # its kinds differ in compute and in memory
def test_the_fitted_curve_is_the_declared_model_at_every_size(preset, tmp_path):
    spec = load_cluster(preset)
    profile, summary = profile_cluster("tiny", spec.model_dump(), stages=(0,), cache_dir=tmp_path,
                                       max_micro_batch=LIMIT, timeout_s=400)
    limits = {k: d.stages[0].max_micro_batch for k, d in profile.devices.items()}
    rank_limits = [limits[k] for k in profile.ranks]
    top = max(rank_limits)
    rows = [[min(m, lim) for lim in rank_limits] for m in range(1, top + 1)]
    declared = spawn(declared_step_times, spec.world_size, spec.model_dump(), 0, rows, timeout_s=400)
    for rank, kind in enumerate(profile.ranks):
        sp = profile.stage(kind, 0)
        sizes = sorted({m for m, _ in declared[rank]})
        truth = {m: t for m, t in declared[rank]}
        fitted = np.asarray(sp.time(np.array(sizes)))
        errors = np.abs(fitted / np.array([truth[m] for m in sizes]) - 1)
        assert len(sizes) == limits[kind] and limits[kind] > 8
        assert errors.max() < 0.03, (kind, dict(zip(sizes, errors.round(4))))
