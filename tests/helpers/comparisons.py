"""What the comparisons' tests share (tests/compare): their model, and a profile of both-differ's kinds handed
to the benchmark instead of profiling them."""

from __future__ import annotations

from poplar.models.workload import Workload
from tests.planner.profiles import make_profile

WORKLOAD = Workload(model="llama-tiny", seq_len=32, vocab_size=512)

# both-differ's device kinds, profiled as lines: the planner's input without the profiler's minute
BOTH_DIFFER_PROFILE = make_profile({"a800-80gb": (1, 0.01, 0.002, 16), "v100s-32gb": (1, 0.02, 0.004, 8)}, seq_len=32)


def profiled_at_once(monkeypatch, profile=BOTH_DIFFER_PROFILE) -> None:
    """Every cluster profiled as ``profile``, at once and in this process."""
    import poplar.profile.profiler

    monkeypatch.setattr(poplar.profile.profiler, "profile_cluster", lambda *a, **k: (profile, {}))
