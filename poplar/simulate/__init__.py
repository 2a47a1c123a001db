"""The simulator: what Poplar would do for a model and a cluster, counted instead of run (see ``profile``)."""

from poplar.simulate.profile import simulate_profile, simulate_stages

__all__ = ["simulate_profile", "simulate_stages"]
