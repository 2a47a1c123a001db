"""`poplar.initialize(model=..., config=ds_config)`: DeepSpeed's loop on Poplar's engine, exact on uneven plans."""

from __future__ import annotations

import itertools
import json
import random
import time
from pathlib import Path

import pytest
import torch

import poplar
from poplar.engine.loss_scale import LossScaleConfig
from poplar.integrations.sampler import PlanBatchSampler
from poplar.integrations.deepspeed.ds_config import read_ds_config
from poplar.integrations.session import optimizer_factory, resolve_plan
from poplar.runtime.plans import load_plan
from poplar.processes.spawn import spawn
from tests.integrations import assert_profiling_shown, ds_workers
from tests.helpers.models import make_model, reference_train, reference_train_fp16

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = str(ROOT / "examples" / "cluster-3.yaml")      # an A100-80GB beside two T4-16GB
N_STEPS = 4
PLANS = {   # 3 ranks, each stage uneven (stages 2-3: the same number of micro-batches on every rank)
    0: poplar.Plan(0, [3, 1, 2], [1, 3, 2]),
    1: poplar.Plan(1, [2, 1, 1], [2, 3, 1]),
    2: poplar.Plan(2, [4, 1, 2], [1, 1, 1]),
    3: poplar.Plan(3, [3, 2, 2], [2, 2, 2]).with_shard_shares([3, 1, 0]),
}


@pytest.fixture(autouse=True)
def fast_pace(monkeypatch):
    monkeypatch.setenv("POPLAR_DILATION", "3")     # the emulated devices' pace: the numbers do not depend on it
    for name in ("POPLAR_PLAN", "POPLAR_CLUSTER", "POPLAR_WORKLOAD", "POPLAR_GLOBAL_BATCH"):
        monkeypatch.delenv(name, raising=False)


def config(stage: int, batch: int, **more) -> dict:
    return {"train_batch_size": batch, "zero_optimization": {"stage": stage}, **more}


def reference(global_batch: int, clip=None):
    """Single-device training on the global batches the loader gives (its epoch order)."""
    data = ds_workers.dataset(N_STEPS, global_batch)
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(0))
    batches = [data[order[s * global_batch:(s + 1) * global_batch]] for s in range(N_STEPS)]
    return reference_train(batches, clip=clip)[0]


def assert_same(state, ref, atol):
    for key, value in ref.items():
        torch.testing.assert_close(state[key], value, atol=atol, rtol=0, msg=lambda m, key=key: f"{key}: {m}")


@pytest.mark.slow
def test_deepspeed_loop_on_three_uneven_emulated_ranks_matches_single_device_in_every_stage():
    cases = [(p.to_dict(), config(s, p.global_batch_size, **({"gradient_clipping": 0.05} if s == 1 else {})))
             for s, p in PLANS.items()]
    ranks = spawn(ds_workers.train, 3, cases, CLUSTER, N_STEPS, timeout_s=240)
    for (stage, plan), got, last in zip(PLANS.items(), ranks[0], ranks[-1]):
        assert got["steps"] == N_STEPS, stage
        assert_same(got["state"], reference(plan.global_batch_size, clip=0.05 if stage == 1 else None), 1e-5)
        trained = make_model()
        trained.load_state_dict(got["state"])
        with torch.no_grad():   # an evaluation forward through the engine is the trained model's, on every rank
            want = trained(ds_workers.dataset(1, 2).tensors[0])
        for logits in (got["logits"], last["logits"]):
            torch.testing.assert_close(logits, want, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_the_fp16_section_trains_as_one_device_with_grad_scaler_skipped_steps_too():
    """DeepSpeed's fp16 spelling on 3 uneven ranks: the update of one device with GradScaler on the same micro-batches
    (tests/engine/test_fp16.py says why the same), the scale read as DeepSpeed's ``cur_scale``; a micro-step run at
    2^16 overflows, so steps 1 and 4 are skipped."""
    plan = PLANS[3]
    fp16 = {"enabled": True, "initial_scale_power": 16, "loss_scale_window": 2, "hysteresis": 1}
    got = spawn(ds_workers.train, 3, [(plan.to_dict(), config(3, plan.global_batch_size, fp16=fp16))], CLUSTER,
                N_STEPS, overflow_from=2.0 ** 16, timeout_s=240)[0][0]
    data = ds_workers.dataset(N_STEPS, plan.global_batch_size)
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(0))
    batches = [data[order[s * plan.global_batch_size:(s + 1) * plan.global_batch_size]] for s in range(N_STEPS)]
    state, _, scales = reference_train_fp16(batches, scaler_kw={"init_scale": 2.0 ** 16, "growth_interval": 2},
                                            overflow_from=2.0 ** 16,
                                            micro_batches=[plan.micro_batches(r) for r in range(3)])
    assert scales == [2 ** 16, 2 ** 15, 2 ** 15, 2 ** 16]
    assert got["scales"][::plan.accum_steps[0]] == scales and (got["steps"], got["skipped"]) == (N_STEPS, 2)
    assert_same(got["state"], state, 1e-5)


@pytest.mark.slow
def test_resume_on_two_ranks_from_three_continues_exactly(tmp_path):
    three, two = poplar.Plan(1, [3, 1, 3], [1, 3, 1]), poplar.Plan(2, [5, 4], [1, 1])   # 9 samples each
    whole = spawn(ds_workers.train, 3, [(three.to_dict(), config(1, 9))], CLUSTER, N_STEPS, save_at=2,
                  out=str(tmp_path / "ckpt"), timeout_s=120)[0][0]
    resumed = spawn(ds_workers.train, 2, [(two.to_dict(), config(2, 9))], "both-differ", N_STEPS,
                    load=str(tmp_path / "ckpt"), timeout_s=120)[0][0]
    assert resumed["client"] == {"saved_at": 2} and resumed["steps"] == N_STEPS
    assert_same(resumed["state"], whole["state"], 1e-6)


@pytest.mark.slow
def test_without_a_plan_the_ranks_profile_the_named_workload_on_the_cluster_and_plan_their_split(tmp_path):
    config = {"train_batch_size": 16, "zero_optimization": {"stage": 1},
              "poplar": {"cluster": "both-differ", "workload": "tiny"}}
    ranks = spawn(ds_workers.planned_here, 2, str(tmp_path / "cache"), config, timeout_s=240)
    plan = poplar.Plan.from_dict(ranks[0]["plan"])
    assert ranks[0]["plan"] == ranks[1]["plan"] and ranks[0]["steps"] == 2
    assert plan.zero_stage == 1 and plan.global_batch_size == 16   # (its split follows the profile's times,
    #                                                                  which a busy host at this fixed pace can skew)


@pytest.mark.slow
def test_with_a_cluster_alone_the_model_given_is_profiled_on_its_data_planned_and_trained_as_one_device(
        tmp_path, monkeypatch):
    """No plan, no preset: the ranks profile the user's module with its loss on samples of its training data, plan,
    and train exactly as one device; a second run reads the profile from the cache."""
    monkeypatch.setenv("POPLAR_CACHE_DIR", str(tmp_path / "cache"))
    cases = [(None, config(1, 12))] * 2
    ranks = spawn(ds_workers.train, 3, cases, CLUSTER, N_STEPS, timeout_s=300)
    for got in ranks[0]:
        assert got["steps"] == N_STEPS and poplar.Plan.from_dict(got["plan"]).global_batch_size == 12
        assert_same(got["state"], reference(12), 1e-5)
    first, second = (got["cache"] for got in ranks[0])
    assert first and first == second      # the profiles written by the first run, read (not rewritten) by the second
    assert_profiling_shown(*(got["printed"] for got in ranks[0]), CLUSTER, "TinyLM", 1)


def test_a_workload_that_is_not_the_model_is_refused_before_profiling():
    from poplar.models.workload import Workload

    with pytest.raises(ValueError, match="workload small has .* the model trained has"):
        resolve_plan(2, None, cluster="both-differ", workload="small", global_batch=16,
                     model=Workload(model="tiny").build())


# -- bad input: one line each, before any process group ----------------------------------------
@pytest.mark.parametrize("fields, words", [
    ({"amp": {"enabled": True}}, "set fp16.enabled or bf16.enabled"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "enable one"),
    ({"fp16": {"enabled": True, "loss_scale": -1}}, "fp16.loss_scale = -1 must be a number >= 0"),
    ({"fp16": {"enabled": True, "initial_scale": 8}}, "fp16.initial_scale has no meaning here"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}, "remove the offload"),
    ({"scheduler": {"type": "WarmupLR"}}, "pass a torch scheduler"),
    ({"zero_optimization": {"stage": 4}}, "stages 0, 1, 2 and 3"),
    ({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}, "train_batch_size 12 != "),
    ({"optimizer": {"type": "Lamb"}}, "Adam, AdamW and SGD"),
    ({"poplar": {"plam": "x"}}, "poplar.plam is not a Poplar field"),
    ({"poplar": {"replan": "sometimes"}}, "poplar.replan.mode: Input should be 'auto' or 'off'"),
    ({"poplar": {"replan": {"patience": 0}}}, "poplar.replan.patience: Input should be greater than or equal to 1"),
])
def test_a_config_poplar_cannot_honour_is_refused_in_one_line(fields, words):
    with pytest.raises(ValueError, match=words) as e:
        read_ds_config({"train_batch_size": 12, **fields}, world_size=3)
    assert "\n" not in str(e.value)


def test_the_fp16_section_keeps_deepspeeds_meanings():
    s = read_ds_config({"train_batch_size": 12, "fp16": {"enabled": True}}, world_size=3)
    assert s.precision == "fp16"   # DeepSpeed's defaults: 2^16, a window of 1000, hysteresis 2, minimum 1
    assert LossScaleConfig(**s.loss_scale) == LossScaleConfig(init_scale=2.0 ** 16, growth_interval=1000,
                                                              hysteresis=2, min_scale=1)
    s = read_ds_config({"train_batch_size": 12, "fp16": {"enabled": True, "initial_scale_power": 12,
                                                         "loss_scale_window": 50, "hysteresis": 1,
                                                         "consecutive_hysteresis": True, "min_loss_scale": 4}}, 3)
    assert LossScaleConfig(**s.loss_scale) == LossScaleConfig(init_scale=2.0 ** 12, growth_interval=50, hysteresis=1,
                                                              consecutive_hysteresis=True, min_scale=4)
    static = read_ds_config({"train_batch_size": 12, "fp16": {"enabled": True, "loss_scale": 128}}, 3)
    assert LossScaleConfig(**static.loss_scale).dynamic is False and static.loss_scale["init_scale"] == 128


def test_fields_with_no_meaning_here_are_named_in_one_line_and_the_rest_is_read(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                                "steps_per_print": 10, "gradient_clipping": 1.0, "bf16": {"enabled": True},
                                "zero_optimization": {"stage": 2, "overlap_comm": True,
                                                      "offload_optimizer": {"device": "none"}}}))
    s = read_ds_config(path, world_size=3)
    assert (s.global_batch, s.stage, s.clip_grad_norm, s.precision) == (12, 2, 1.0, "bf16")
    line = s.ignored_line()
    assert "steps_per_print, zero_optimization.overlap_comm" in line and "\n" not in line


def test_a_plan_for_another_world_or_batch_or_stage_is_refused_in_one_line():
    two = poplar.Plan(1, [3, 1], [1, 3])
    with pytest.raises(ValueError, match="the plan is for 2 ranks .* 3 were launched"):
        resolve_plan(3, two)
    with pytest.raises(ValueError, match="splits a global batch of 6 samples, the configuration asks for 8"):
        resolve_plan(2, two, global_batch=8)
    with pytest.raises(ValueError, match="ZeRO stage 2 .* every rank must run the same number of accumulation steps"):
        load_plan({"zero_stage": 2, "micro_batch_sizes": [2, 1], "accum_steps": [1, 2]})
    with pytest.raises(ValueError, match="needs a plan"):
        resolve_plan(2, None, global_batch=8)
    from poplar.integrations.deepspeed.initialize import plan_of

    settings = read_ds_config({"train_batch_size": 6, "zero_optimization": {"stage": 3}}, world_size=2)
    with pytest.raises(ValueError, match="the plan is for ZeRO stage 1, the config's zero_optimization.stage is 3"):
        plan_of(2, settings, poplar.EngineConfig(), two, None, None)


def test_an_optimizer_is_rebound_to_the_engine_parameters_only_with_one_set_of_settings():
    w, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([{"params": [w], "weight_decay": 0.1}, {"params": [b], "weight_decay": 0.0}])
    with pytest.raises(ValueError, match="parameter groups differ in weight_decay"):
        optimizer_factory(opt)
    same = torch.optim.SGD([{"params": [w]}, {"params": [b]}], lr=0.5)
    flat = torch.nn.Parameter(torch.zeros(4))
    rebound = optimizer_factory(same)([flat])
    assert rebound is same and same.param_groups[0]["params"] == [flat] and same.param_groups[0]["lr"] == 0.5


def test_every_rank_takes_its_slice_of_the_same_global_batches_whatever_the_plan():
    three, two = poplar.Plan(1, [3, 1, 3], [1, 3, 1]), poplar.Plan(2, [5, 4], [1, 1])
    for plan in (three, two):
        steps = zip(*[list(PlanBatchSampler(27, plan, r, seed=4)) for r in range(plan.world_size)])
        joined = [sum(parts, []) for parts in steps]
        assert len(joined) == 3
        if plan is three:
            first = joined
    assert joined == first and sorted(sum(first, [])) == list(range(27))


# -- a config and nothing else: DeepSpeed's even split ---------------------------------------------
OPTIMIZER_SECTION = {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}}   # tests.helpers.models.OPTIMIZER's
FIELDS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def split_config(world: int, micro: int, accum: int, stage: int, given: tuple[str, ...]) -> tuple[dict, int]:
    """A config giving ``given`` of the three batch fields of ``micro`` x ``accum`` x ``world``; its global batch."""
    values = dict(zip(FIELDS, (micro * accum * world, micro, accum)))
    return ({**{k: values[k] for k in given}, "zero_optimization": {"stage": stage},
             "optimizer": OPTIMIZER_SECTION}, micro * accum * world)


def even_cases(world: int, fixed, n_sampled: int, seed: int = 63) -> list[tuple[dict, int, tuple]]:
    """``fixed`` (micro, accum, stage, given) cases, then ``n_sampled`` drawn from ``seed``: (config, global batch,
    the split DeepSpeed makes of it)."""
    rng = random.Random(seed + world)
    choices = [FIELDS, FIELDS[:2], FIELDS[::2], FIELDS[1:], FIELDS[:1], FIELDS[1:2]]
    drawn = [(rng.randint(1, 3), rng.randint(1, 3), rng.randint(0, 3), rng.choice(choices)) for _ in range(n_sampled)]
    cases = []
    for micro, accum, stage, given in [*fixed, *drawn]:
        accum = accum if FIELDS[2] in given or set(FIELDS[:2]) <= set(given) else 1   # else DeepSpeed's 1
        config, batch = split_config(world, micro, accum, stage, given)
        cases.append((config, batch, (batch, micro, accum)))
    return cases


def deepspeed_split(config: dict, world: int, monkeypatch):
    """What DeepSpeed itself makes of ``config``'s batch fields on ``world`` ranks: (train_batch_size, micro,
    accumulation), or None where it refuses them (its own DeepSpeedConfig, its process group's size given)."""
    deepspeed = pytest.importorskip("deepspeed")
    from deepspeed.runtime.config import DeepSpeedConfig

    monkeypatch.setattr(deepspeed.comm, "get_rank", lambda *a, **k: 0)
    monkeypatch.setattr(deepspeed.comm, "get_world_size", lambda *a, **k: world)
    try:
        c = DeepSpeedConfig({k: v for k, v in config.items() if k in FIELDS})
    except AssertionError:
        return None
    return c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps


def poplar_split(config: dict, world: int):
    """Poplar's even split of ``config`` on ``world`` ranks, as DeepSpeed's triple (None: refused, in one line)."""
    try:
        micro, accum = read_ds_config(config, world).batch.even_split(world)
    except ValueError as e:
        assert "\n" not in str(e), e
        return None
    return micro * accum * world, micro, accum


def test_the_even_split_is_deepspeeds_own_on_every_combination_of_the_three_fields(monkeypatch):
    """Every combination of the three batch fields (each left out or 1-12, 1-4, 1-3) on 1-4 ranks: Poplar takes
    exactly the configs DeepSpeed 0.19's DeepSpeedConfig takes, with its split, and refuses the rest."""
    seen = {True: 0, False: 0}
    for world, batch, micro, accum in itertools.product(range(1, 5), [None, *range(1, 13)], [None, *range(1, 5)],
                                                       [None, 1, 2, 3]):
        config = {k: v for k, v in zip(FIELDS, (batch, micro, accum)) if v is not None}
        want = deepspeed_split(config, world, monkeypatch)
        assert poplar_split(config, world) == want, (config, world)
        seen[want is not None] += 1
    assert seen[True] > 100 and seen[False] > 100, seen


def test_the_batch_settings_examples_run():
    import doctest

    import poplar.integrations.batch_settings

    failed, tried = doctest.testmod(poplar.integrations.batch_settings)
    assert tried > 0 and failed == 0


@pytest.mark.parametrize("world, fields, words", [
    (1, {"train_batch_size": 12, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4},
     "config: train_batch_size 12 != train_micro_batch_size_per_gpu 2 x gradient_accumulation_steps 4 x 1 rank: "
     "give train_batch_size 8, or leave one of the three out to have it derived (DeepSpeed refuses it too)"),
    (3, {"train_batch_size": 10}, "train_batch_size 10 is not a multiple of the 3 ranks (DeepSpeed gives every rank "
     "the same micro-batch): give train_batch_size 9 or 12, or a cluster (or a plan) to have Poplar split it "
     "unevenly"),
    (2, {"train_batch_size": 10, "train_micro_batch_size_per_gpu": 3},
     "train_batch_size 10 is not a multiple of train_micro_batch_size_per_gpu 3 x the 2 ranks = 6"),
    (2, {"train_batch_size": 12, "gradient_accumulation_steps": 5},
     "train_batch_size 12 is not a multiple of gradient_accumulation_steps 5 x the 2 ranks = 10 (DeepSpeed gives every "
     "rank the same micro-batch): give train_batch_size 10 or 20"),
    (1, {"gradient_accumulation_steps": 2}, "config: give train_batch_size (the samples of every optimizer step) or "
     "train_micro_batch_size_per_gpu (each rank's micro-batch)"),
], ids=["inconsistent", "indivisible", "micro-indivisible", "accumulation-indivisible", "neither"])
def test_a_config_alone_deepspeed_refuses_is_refused_in_one_line_before_any_process_group(world, fields, words,
                                                                                         monkeypatch, tmp_path):
    import torch.distributed as dist

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WORLD_SIZE", str(world))   # as torchrun launches it; no process group yet
    monkeypatch.setenv("RANK", "0")
    model, start = make_model(), time.monotonic()
    with pytest.raises(ValueError) as e:
        poplar.initialize(model=model, model_parameters=model.parameters(), training_data=ds_workers.dataset(1, 4),
                          config={**fields, "optimizer": OPTIMIZER_SECTION})
    assert words in str(e.value) and "\n" not in str(e.value) and time.monotonic() - start < 10
    assert not dist.is_initialized() and not list(tmp_path.iterdir())     # nothing started, nothing written


ONE_RANK = [(2, 3, 0, FIELDS[:2]), (3, 2, 3, FIELDS[::2])]      # (micro, accum, stage, fields given)
TWO_RANKS = [(2, 2, 0, FIELDS), (3, 2, 3, FIELDS[1:])]
REFUSED_ON_TWO = [{"train_batch_size": 5}, {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 3},
                  {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1}]


@pytest.mark.slow
@pytest.mark.parametrize("world, fixed", [(1, ONE_RANK), (2, TWO_RANKS)], ids=["one-rank", "two-ranks"])
def test_a_config_alone_trains_as_deepspeed_splits_it_exactly_as_one_device(world, fixed, monkeypatch):
    """``poplar.initialize(model=, model_parameters=, training_data=, config=)`` and nothing else, DeepSpeed's loop:
    stages 0 and 3 and a seeded sample of (micro, accumulation, stage, fields given) on 1 and 2 gloo ranks; each
    trains DeepSpeed's split (the engine says so, and it is DeepSpeedConfig's), equal to one device to 1e-5; rank
    0 says the split and that a cluster plans it, once. On 2 ranks, configs DeepSpeed refuses are refused in one
    line, in well under 10 s."""
    cases = even_cases(world, fixed, n_sampled=3)
    got = spawn(ds_workers.config_alone, world, [(c, b) for c, b, _ in cases], N_STEPS,
                REFUSED_ON_TWO if world == 2 else (), timeout_s=240)
    for (config, batch, split), first, last in zip(cases, got[0]["runs"], got[-1]["runs"]):
        assert first["split"] == last["split"] == split == deepspeed_split(config, world, monkeypatch), config
        assert first["steps"] == N_STEPS and poplar.Plan.from_dict(first["plan"]).zero_stage == \
            config["zero_optimization"]["stage"]
        assert_same(first["state"], reference(batch), 1e-5)
        said = [line for line in first["printed"].splitlines() if "no plan and no cluster" in line]
        assert len(said) == 1 and f"{split[1]} samples x {split[2]} accumulation" in said[0], first["printed"]
        assert "give a cluster" in said[0] and "mixed GPUs" in said[0]
        assert last["printed"] == "" or world == 1
    for rank in got:
        for (message, seconds), config in zip(rank["refused"], REFUSED_ON_TWO):
            assert message is not None and "\n" not in message and seconds < 10, (config, message)
            assert deepspeed_split(config, 2, monkeypatch) is None
