"""PyTorch Lightning on Poplar: ``PoplarStrategy`` trains exactly as one device would, resumes on another world size,
and refuses bad input in one line before anything starts.

Real processes (``poplar.processes.spawn.spawn``) on emulated clusters: every ZeRO stage with an uneven
plan in one process group of 3 ranks (``examples/cluster-3.yaml``), ZeRO-3 validating at each
epoch's end, ZeRO-2 clipping and saving checkpoints (after an epoch's last step, at the epoch's
end, mid-epoch), which 2 of the ranks, as a new group on another cluster (``both-differ``) with
another plan, then finish. A LambdaLR scheduler steps every run, so the optimizer handed to the
engine must be the very one Lightning's scheduler drives. The bad-input tests start no process.
"""

from __future__ import annotations

import functools
import os
import time

import pytest
import torch
import torch.distributed as dist

import poplar
from poplar.processes.spawn import spawn

pl = pytest.importorskip("lightning.pytorch")

from poplar.integrations.lightning.strategy import PoplarStrategy  # noqa: E402
from tests.integrations import assert_profiling_shown  # noqa: E402
from tests.integrations.lightning_workers import (  # noqa: E402
    CLUSTER, EPOCH_END, GLOBAL_BATCH, LAST_STEP, MID_EPOCH, N_STEPS, OPTIMIZER, QUIET, LitTiny, dataset, even_runs,
    fit_twice_from_cluster, global_batches, lightning_runs, schedule, val_set)
from tests.helpers.models import lm_loss, reference_train  # noqa: E402

CLIP = 0.05
# (plan, gradient_clip_val, checkpoints, validation at each epoch's end): a global batch of 10 on 3 ranks
CASES = [
    ({"zero_stage": 0, "micro_batch_sizes": [3, 1, 2], "accum_steps": [1, 3, 2]}, None, False, False),
    ({"zero_stage": 1, "micro_batch_sizes": [2, 3, 1], "accum_steps": [2, 1, 3]}, None, False, False),
    ({"zero_stage": 2, "micro_batch_sizes": [2, 1, 2], "accum_steps": [2, 2, 2]}, CLIP, True, False),
    ({"zero_stage": 3, "micro_batch_sizes": [3, 1, 2], "accum_steps": [2, 2, 2], "local_batch_sizes": [5, 2, 3]},
     None, False, True),
]
RESUMED = 2   # the case whose checkpoints are resumed
TWO_RANKS = {"zero_stage": 3, "micro_batch_sizes": [4, 2], "accum_steps": [2, 2], "local_batch_sizes": [7, 3]}


@pytest.fixture(autouse=True)
def pace(monkeypatch):
    monkeypatch.setenv("POPLAR_DILATION", "3")     # the emulated devices' pace: fast
    monkeypatch.delenv("POPLAR_PLAN", raising=False)
    monkeypatch.delenv("POPLAR_CLUSTER", raising=False)


@functools.cache
def ranks(ckpt_dir: str):
    """What every rank returned: the runs on 3 ranks, then (ranks 0 and 1) the resumed runs on 2."""
    return spawn(lightning_runs, 3, CASES, ckpt_dir, TWO_RANKS, CLIP, timeout_s=300)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(tmp_path_factory.mktemp("lightning"))


def reference(clip):
    """One device, the whole global batches, the same optimizer and scheduler; the validation loss after each step."""
    val = {}

    def validate(step, model):
        with torch.no_grad():
            val[step] = lm_loss(model, val_set().tensors).item()
    state, losses = reference_train(global_batches(), clip=clip, optimizer=OPTIMIZER, schedule=schedule,
                                    after_step=validate)
    return {f"net.{k}": v for k, v in state.items()}, losses, val


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(CASES)), ids=[f"stage{c[0]['zero_stage']}" for c in CASES])
def test_every_stage_matches_single_device_training(index, ckpt):
    runs = [r["runs"][index] for r in ranks(ckpt)]
    ref_state, ref_losses, ref_val = reference(CASES[index][1])
    for key, ref in ref_state.items():
        torch.testing.assert_close(runs[0]["state"][key], ref, atol=1e-5, rtol=0, msg=lambda m, key=key: f"{key}: {m}")
    for r in runs:   # Lightning logs the global batch's mean loss, the same on every rank
        assert r["losses"] == pytest.approx(ref_losses, abs=1e-5)
        assert r["steps"] == r["timed_steps"] == N_STEPS
    if CASES[index][3]:   # ZeRO-3 evaluation on the engine's weights (every rank the whole set)
        assert [step for step, _ in runs[0]["val"]] == [2, 4]
        for r in runs:
            assert [loss for _, loss in r["val"]] == pytest.approx([ref_val[2], ref_val[4]], abs=1e-5)
    for r in runs:   # the plan's slices, and no sampler of Lightning's
        assert r["samplers"] == ["EpochBatchSampler"]


@pytest.mark.slow
@pytest.mark.parametrize("name, start", [(LAST_STEP, 2), (EPOCH_END, 2), (MID_EPOCH, 3)],
                         ids=["last-step", "epoch-end", "mid-epoch"])
def test_resume_on_two_ranks_of_another_cluster(name, start, ckpt):
    got = ranks(ckpt)
    whole = got[0]["runs"][RESUMED]
    assert os.path.isfile(os.path.join(ckpt, name, "lightning.pt"))   # a checkpoint is a directory
    assert got[2]["resumed"] is None
    moved = got[0]["resumed"][name]
    assert moved["steps"] == N_STEPS and moved["losses"] == pytest.approx(whole["losses"][start:], abs=1e-6)
    for key, value in whole["state"].items():
        torch.testing.assert_close(moved["state"][key], value, atol=1e-6, rtol=0, msg=lambda m, key=key: f"{key}: {m}")


@pytest.mark.slow
def test_an_optimizer_with_unlike_groups_is_refused_on_every_rank(ckpt):
    for r in ranks(ckpt)[:2]:   # before the engine was built, in one line
        refused = r["resumed"]["refused"]
        assert "parameter groups differ in weight_decay" in refused and "\n" not in refused


# ---------------------------------------------------------------------- bad input, before any process starts
def one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message, message
    return message


def test_a_plan_for_another_world_size_is_refused(monkeypatch):
    with pytest.raises(ValueError) as e:
        PoplarStrategy(plan=poplar.Plan(0, [1, 1]), cluster=CLUSTER)
    assert "the plan is for 2 ranks but the cluster has 3 devices" in one_line(e)
    monkeypatch.setenv("WORLD_SIZE", "3")     # launched by torchrun on 3 ranks
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError) as e:
        pl.Trainer(strategy=PoplarStrategy(plan=poplar.Plan(0, [1, 1])), **QUIET)
    assert "the plan is for 2 ranks" in one_line(e) and "3 were launched" in one_line(e)


def test_a_stage_2_plan_with_unequal_accumulation_is_refused():
    with pytest.raises(ValueError) as e:
        PoplarStrategy(plan={"zero_stage": 2, "micro_batch_sizes": [2, 1], "accum_steps": [1, 2]})
    assert "same number of accumulation steps" in one_line(e)


@pytest.mark.parametrize("options, says", [
    ({"accumulate_grad_batches": 2}, "accumulate_grad_batches=2: the Poplar plan decides"),
    ({"gradient_clip_val": 1.0, "gradient_clip_algorithm": "value"}, "clips the global gradient norm only"),
    ({"precision": "64-true"}, "trains in '32-true', 'bf16-mixed' or '16-mixed'"),
])
def test_trainer_options_poplar_does_itself_are_refused_before_the_group(options, says):
    trainer = pl.Trainer(strategy=PoplarStrategy(plan=poplar.Plan(0, [GLOBAL_BATCH])), max_steps=1,
                         **{**QUIET, **options})
    with pytest.raises(ValueError) as e:
        trainer.fit(LitTiny(), torch.utils.data.DataLoader(dataset()))
    assert says in one_line(e)
    assert not dist.is_initialized()


@pytest.mark.parametrize("precision, engine", [("32-true", "fp32"), ("bf16-mixed", "bf16"), ("16-mixed", "fp16")])
def test_lightnings_precisions_are_the_engines(precision, engine):
    """Lightning's names become the engine's precision ('16-mixed': fp16 with the engine's loss scale; on a CPU
    Lightning itself turns '16-mixed' into 'bf16-mixed' before a strategy sees it, and says so)."""
    from types import SimpleNamespace

    from poplar.engine.config import EngineConfig
    from poplar.integrations.lightning.options import engine_config

    trainer = SimpleNamespace(accumulate_grad_batches=1, gradient_clip_val=None, gradient_clip_algorithm=None)
    module = SimpleNamespace(automatic_optimization=True)
    config = engine_config(trainer, module, SimpleNamespace(precision=precision), EngineConfig())
    assert config.mixed_precision == engine


@pytest.mark.slow
def test_a_users_module_is_profiled_on_its_data_planned_and_trained_as_one_device_and_cached(tmp_path,
                                                                                            monkeypatch):
    """A cluster alone, no plan and no preset: the LightningModule itself is profiled on samples of its loader's
    dataset as the loader collates them, planned, trained exactly as one device; a second fit reads the profile
    from the cache."""
    monkeypatch.setenv("POPLAR_CACHE_DIR", str(tmp_path / "profiles"))
    first, second = spawn(fit_twice_from_cluster, 3, CLUSTER, timeout_s=600)[0]
    want, losses, _ = reference(None)
    for run in (first, second):
        plan = poplar.Plan.from_dict(run["plan"])
        assert plan.global_batch_size == GLOBAL_BATCH and plan.zero_stage == 1
        assert run["losses"] == pytest.approx(losses, abs=1e-5)
        for name, value in want.items():
            torch.testing.assert_close(run["state"][name], value, rtol=1e-5, atol=1e-5, msg=name)
    assert first["profiled"] and not second["profiled"]      # measured once, then read from the cache
    assert_profiling_shown(first["printed"], second["printed"], CLUSTER, "LitTiny", 1)


# ---------------------------------------------------------------------- no plan and no cluster: DDP's even split
EVEN_TWO = [((0, 1, 2, 3), 2, 3), ((3,), 5, 1), ((1, 2), 3, 2)]   # (stages, batch_size, accumulate_grad_batches)
EVEN_ONE = [((0, 1, 2, 3), 10, 1), ((3,), 3, 4)]


@pytest.fixture(scope="module")
def even(starts_processes):
    return spawn(even_runs, 2, EVEN_TWO, EVEN_ONE, timeout_s=300)


@pytest.mark.parametrize("world, cases", [(2, EVEN_TWO), (1, EVEN_ONE)], ids=["two-ranks", "one-rank"])
def test_no_plan_and_no_cluster_trains_the_loaders_batch_size_evenly_exactly_as_one_device(even, world, cases):
    """``PoplarStrategy()`` alone on 2 gloo ranks and on 1: every rank ``accumulate_grad_batches`` micro-batches of the
    loader's ``batch_size`` (DDP's split) in the lowest stage given, equal to one device on the same global batches to
    1e-5; rank 0 says the split and that a cluster plans it, once; the Trainer's ``accumulate_grad_batches`` given
    back."""
    for index, (stages, batch_size, accumulate) in enumerate(cases):
        runs = [r["two" if world == 2 else "one"][index] for r in even[:world]]
        global_batch = batch_size * accumulate * world
        assert runs[0]["plan"] == poplar.Plan(min(stages), [batch_size] * world, accumulate).to_dict()
        state, losses = reference_train(global_batches(N_STEPS, global_batch), optimizer=OPTIMIZER,
                                        schedule=schedule)
        for key, value in state.items():
            torch.testing.assert_close(runs[0]["state"][f"net.{key}"], value, atol=1e-5, rtol=0, msg=key)
        for r in runs:
            assert r["losses"] == pytest.approx(losses, abs=1e-5) and r["steps"] == N_STEPS
            assert r["accumulate"] == accumulate
        said = [line for line in runs[0]["printed"].splitlines() if "no plan and no cluster" in line]
        assert len(said) == 1 and f"takes {batch_size} samples x {accumulate} accumulation" in said[0], said
        assert "as DDP splits it" in said[0] and "mixed GPUs" in said[0]
        assert world == 1 or "no plan and no cluster" not in runs[1]["printed"]


def test_no_plan_and_no_cluster_takes_the_trainers_devices_as_ddp_does(monkeypatch):
    for name in ("WORLD_SIZE", "LOCAL_RANK", "RANK"):
        monkeypatch.delenv(name, raising=False)
    trainer = pl.Trainer(strategy="poplar", **QUIET)
    assert isinstance(trainer.strategy, PoplarStrategy) and trainer.strategy.plan is None
    assert trainer.strategy.world_size == 1 and trainer.strategy.launcher is None
    trainer = pl.Trainer(strategy=PoplarStrategy(), devices=2, **QUIET)     # a plain run launches 2, as DDP does
    assert trainer.strategy.world_size == 2 and trainer.strategy.launcher is not None
    with pytest.raises(ValueError) as e:
        PoplarStrategy(workload="tiny")
    assert "give cluster= too" in one_line(e)


@pytest.mark.parametrize("world, strategy, loader, accumulate, says", [
    (2, dict(global_batch=10), dict(batch_size=4), 1,
     "global_batch 10 != the train DataLoader's batch_size 4 x accumulate_grad_batches 1 x 2 ranks: give global_batch "
     "8, or leave global_batch out"),
    (1, dict(global_batch=12), dict(batch_size=4), 2, "global_batch 12 != the train DataLoader's batch_size 4 x "
     "accumulate_grad_batches 2 x 1 rank: give global_batch 8"),
    (1, dict(), dict(batch_sampler=[[0, 1], [2, 3]]), 1, "the train DataLoader has no batch_size"),
], ids=["two-ranks", "accumulation", "no-batch-size"])
def test_an_even_split_that_does_not_add_up_is_refused_before_the_group(world, strategy, loader, accumulate, says,
                                                                       monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", str(world))     # launched by torchrun: rank 0 of ``world``
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("RANK", "0")
    trainer = pl.Trainer(strategy=PoplarStrategy(**strategy), max_steps=1, accumulate_grad_batches=accumulate,
                         default_root_dir=str(tmp_path), **QUIET)
    start = time.monotonic()
    with pytest.raises(ValueError) as e:
        trainer.fit(LitTiny(), torch.utils.data.DataLoader(dataset(), **loader))
    assert says in one_line(e) and time.monotonic() - start < 10
    assert not dist.is_initialized() and trainer.accumulate_grad_batches == accumulate
    assert not list(tmp_path.iterdir())     # nothing written


def test_the_registry_name_reads_the_plan_from_the_environment(tmp_path, monkeypatch):
    plan = poplar.Plan(1, [3], [2])
    plan.save(tmp_path / "plan.json")
    monkeypatch.setenv("POPLAR_PLAN", str(tmp_path / "plan.json"))
    trainer = pl.Trainer(strategy="poplar", **QUIET)
    assert isinstance(trainer.strategy, PoplarStrategy) and trainer.strategy.plan == plan
    assert trainer.strategy.world_size == 1 and trainer.strategy.launcher is None
    monkeypatch.setenv("POPLAR_CLUSTER", CLUSTER)    # a cluster of 3: a plain run launches 3 processes
    three = poplar.Plan(1, [3, 1, 2], [2, 1, 1])
    three.save(tmp_path / "plan.json")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    trainer = pl.Trainer(strategy="poplar", **QUIET)
    assert trainer.strategy.world_size == 3 and trainer.strategy.launcher is not None
    monkeypatch.delenv("POPLAR_PLAN")     # planned on the cluster when the ranks start
    for name, value in (("POPLAR_CLUSTER", "both-differ"), ("POPLAR_WORKLOAD", "tiny"), ("POPLAR_GLOBAL_BATCH", "8")):
        monkeypatch.setenv(name, value)
    trainer = pl.Trainer(strategy="poplar", **QUIET)
    assert trainer.strategy.plan is None and trainer.strategy.world_size == 2
