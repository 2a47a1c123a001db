"""Tests of the integrations; :func:`profile_cache_files` is what their cluster-alone runs compare,
:func:`printed` and :func:`assert_profiling_shown` what their rank 0 prints while it plans."""

import contextlib
import io
import os
import re
from pathlib import Path


def profile_cache_files() -> dict:
    """Every file of the profile cache (``POPLAR_CACHE_DIR``) and when it was written: a run that profiled
    changes it, one that read its profile from the cache does not."""
    root = Path(os.environ["POPLAR_CACHE_DIR"])
    return {str(p): p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()} if root.exists() else {}


@contextlib.contextmanager
def printed(rank: int):
    """What rank 0 prints inside, as into a log (a pipe, no terminal); nothing on the other ranks."""
    text = io.StringIO()
    with contextlib.redirect_stdout(text) if rank == 0 else contextlib.nullcontext():
        yield text


def assert_profiling_shown(first: str, second: str, cluster: str, model: str, stage: int) -> None:
    """On ``examples/cluster-3.yaml`` (an A100 on rank 0, the T4s' first on rank 1): the first run's rank 0 said
    what it profiles, each kind's stage as it began and ended (the T4's relayed from rank 1), and the plan it
    chose; the second, its profile read from the cache, measured nothing and said so with its plan."""
    title = (f"{cluster}: profiling {model} on 1 x a100-80gb, 2 x t4-16gb in ZeRO stage {stage} (cached after "
             "the first run): each stage is shown as it ends")
    where = re.escape(cluster)
    plan = rf"Plan\(stage {stage}, global batch \d+: r0:.*\); stage {stage}[^;]*: [\d.]+ samples/s predicted"
    lines = ours(first, cluster)      # the framework's own lines (a warning, a loss) may come between
    assert lines[0] == title, first
    for kind in ("a100-80gb", "t4-16gb"):
        began = [line for line in lines if line.startswith(f"{cluster}: {kind} stage {stage}: ")]
        assert began and not began[0].endswith(" s)"), first     # the stage's first step, when it began
        assert re.fullmatch(rf"{where}: {kind} stage {stage}: done \(\d+ s\)", began[-1]), first
    assert re.fullmatch(rf"{where}: profiled and planned in \d+ s: {plan}.*", lines[-1]), first
    lines = ours(second, cluster)
    assert lines[0] == title and len(lines) == 2, second
    assert re.fullmatch(rf"{where}: planned \(the profile read from the cache\) in \d+ s: {plan}.*", lines[1]), second


def ours(text: str, cluster: str) -> list[str]:
    """The lines of ``text`` that planning on ``cluster`` printed (each begins with its name)."""
    return [line for line in text.splitlines() if line.startswith(f"{cluster}: ")]


def one_device_batches(tensors, n_samples: int, global_batch: int, seed: int, n_steps: int) -> list[tuple]:
    """The global batches a run over ``tensors`` draws, in order, as one rank taking them whole: the plan's sampler
    (:class:`poplar.integrations.sampler.PlanBatchSampler`, shuffled with ``seed``), epoch after epoch."""
    import poplar
    from poplar.integrations.sampler import PlanBatchSampler

    sampler = PlanBatchSampler(n_samples, poplar.Plan(0, [global_batch]), 0, shuffle=True, seed=seed)
    out, epoch = [], 0
    while len(out) < n_steps:
        sampler.set_epoch(epoch)
        out += [tuple(t[idx] for t in tensors) for idx in sampler]
        epoch += 1
    return out[:n_steps]
