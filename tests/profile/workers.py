"""Ranks for tests/profile (importable by spawned processes)."""

import torch

import poplar
from poplar.cluster.spec import parse_cluster
from poplar.devices.emulated import EmulatedDevice
from poplar.engine.layout import ShardLayout
from poplar.models import build_model, causal_lm_loss, random_token_batch


def train_at(rank, world_size, cluster: dict, micro_batch: int, stage: int = 0, accum: int = 1):
    """Two steps at ``micro_batch`` on rank ``rank``'s emulated device: None, or the out-of-memory message."""
    with EmulatedDevice(parse_cluster(cluster), rank) as device:
        engine = poplar.initialize(build_model("tiny"), lambda p: torch.optim.AdamW(p, lr=1e-4),
                                   poplar.Plan(stage, [micro_batch] * world_size, accum), comm=device.comm)
        try:
            for _ in range(2):
                with device.step(engine.held_state):
                    engine.train_batch(random_token_batch("tiny", micro_batch * accum), causal_lm_loss)
        except torch.OutOfMemoryError as e:
            return str(e)
    return None


def declared_step_times(rank, world_size, cluster: dict, stage: int, sizes: list[list[int]]):
    """The declared compute of a step of one micro-batch, per size: the model the profile must match.

    ``sizes[i]``: every rank's micro-batch in round ``i``. Counted by the device model
    itself (a WorkCounter around the step, not paced), after a warm-up step that creates
    the optimizer's states, as the profiler's warm-up round does.
    """
    from poplar.emulate import WorkCounter
    from poplar.models.workload import as_workload

    wl = as_workload("tiny")
    with EmulatedDevice(parse_cluster(cluster), rank, dilation=1.0) as device:
        out = []
        for row in sizes:
            engine = poplar.initialize(wl.build(), lambda p: torch.optim.AdamW(p, lr=1e-4), poplar.Plan(stage, row, 1),
                                       comm=device.comm)
            batch = wl.random_batch(row[rank])
            engine.train_batch(batch, wl.loss)
            with WorkCounter(device.gpu) as counter:
                engine.train_batch(batch, wl.loss)
            out.append((row[rank], counter.seconds))
            engine.close()
        return out


def engine_unit_numels(rank, world_size, unit_numel: int):
    """The parameters of each unit a real engine builds of the tiny model with ``unit_numel`` (the root first)."""
    from poplar.engine.config import EngineConfig

    engine = poplar.initialize(build_model("tiny"), lambda p: torch.optim.AdamW(p, lr=1e-4),
                               poplar.Plan(0, [1] * world_size, 1), EngineConfig(unit_numel=unit_numel))
    numels = [u.numel for u in engine.units]
    engine.close()
    return numels


def collectives_on_nodes(rank, world_size, cluster: dict, numel: int):
    """The profiler's collective timings on an emulated cluster of several nodes, and what its network declares."""
    from poplar.profile.timing import time_collectives

    spec = parse_cluster(cluster)
    groups = spec.node_groups()
    with EmulatedDevice(spec, rank, dilation=1000.0) as device:   # gloo's real gathers fit their declared time
        comm = time_collectives(device, numel, groups, repeats=1, units=(numel // 4, numel // 2))
        node = next(g for g in groups if rank in g)
        layout = ShardLayout(world_size, groups, rank)

        def across(n: int) -> float:
            if layout.counterparts is None:   # the exchange: k-1 copies of the buffer
                return device.network.seconds("reduce_across", 4 * n, None, len(groups))
            padded = -(-n // len(node)) * len(node)   # alike nodes: an all-reduce of this rank's slice, counterparts
            return device.network.seconds("all_reduce", 4 * padded // len(node), layout.counterparts)
        padded = -(-numel // len(node)) * len(node)
        return {"comm": comm.model_dump(), "declared_gather": device.network.seconds("all_gather", 4 * padded, node),
                "declared_across": across(numel), "alike": layout.counterparts is not None,
                "declared_between": [(n, across(n)) for n in (numel // 4, numel // 2)]}


def anatomy_at(rank, world_size, cluster: dict, stage: int, sizes: list[int], dilation: float | None = None):
    """The step anatomy the profiler measures on rank ``rank`` at ``sizes`` (every rank's micro-batch); ``dilation``:
    a fixed pace (by default chosen from the host, as profiling does)."""
    import os

    if dilation is not None:
        os.environ["POPLAR_DILATION"] = str(dilation)
    from poplar.engine.config import EngineConfig
    from poplar.profile.anatomy import measure_anatomy
    from poplar.profile.timing import RankRun
    from poplar.models.workload import as_workload

    from poplar.devices import rank_device

    wl = as_workload("tiny")
    with rank_device(parse_cluster(cluster), rank, wl) as device:   # the pace chosen from the host, as profiling
        run = RankRun(device, rank, world_size, wl, EngineConfig(), warmup=1, repeats=1)
        return {"anatomy": measure_anatomy(run, stage, sizes).model_dump(), "overruns": device.overruns}


def profiled_anatomy_sizes(rank, world_size, cluster: dict, patched: bool):
    """The micro-batches rank ``rank``'s profile of stage 0 measured its anatomy at; ``patched``: with the
    procedure's choice of sizes changed to the smallest only (as a test changes it in the simulator's process)."""
    from poplar.engine.config import EngineConfig
    from poplar.profile import procedure
    from poplar.profile.options import ProfileOptions
    from poplar.profile.rank import profile_rank

    if patched:
        procedure.anatomy_rows = lambda n: [0]
    options = ProfileOptions(stages=(0,), n_points=3, repeats=1, max_micro_batch=8)
    profile = profile_rank(rank, world_size, "tiny", cluster, options, EngineConfig())
    return [a.micro_batch for a in profile.stages[0].anatomy]
