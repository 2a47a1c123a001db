"""The profile cache a re-planning test reads: the simulator's profile of a cluster (the measured one, to the
declared model's precision, tests/simulate), saved for the cluster and for it with rank 0 at half its speed
(a cluster whose profile was taken on the full-speed one). Minutes of profiling are not what those tests test."""

from pathlib import Path

from poplar.cluster.spec import load_cluster
from poplar.profile.cache import ProfileCache
from poplar.profile.options import ProfileOptions
from poplar.simulate import simulate_profile


def seed_profiles(root: Path, wl, cluster: str, max_micro_batch: int, config, stages=(0, 1, 2, 3)) -> None:
    """The ``stages``' profiles of ``wl`` on ``cluster`` (and on it with rank 0 slowed to half) into ``root``,
    keyed as a run of ``config`` (an :class:`~poplar.engine.config.EngineConfig`) looks it up."""
    spec = load_cluster(cluster)
    options = ProfileOptions(stages=tuple(stages), max_micro_batch=max_micro_batch, precision=config.mixed_precision)
    simulated = simulate_profile(wl, spec, options, config)
    for each in (spec, spec.slowed(0, 0.5)):
        cache = ProfileCache(root, wl, each, options.stages, options.precision, options.max_micro_batch, config)
        kinds = [g.kind for g in each.devices]
        cache.save({(k, s): simulated.devices[k.removesuffix("-slowed")].stages[s]
                    for k in kinds for s in options.stages}, simulated.comm)
