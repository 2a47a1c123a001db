"""PoplarTrainer: the Hugging Face Trainer on a Poplar plan equals single-device training, resumes exactly.

A very small Llama on label-padded token rows (so the loss is a mean over a varying
number of tokens), trained on 3 emulated ranks with an uneven plan in every ZeRO stage,
one run after another in one spawn; the single-device reference is a plain torch loop
with the same AdamW and linear schedule over the same global batches. The stage-2 run
also checkpoints mid-epoch; a 2-rank run with another plan (ZeRO-1) resumes from it.
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import poplar
from poplar.integrations.sampler import PlanBatchSampler
from poplar.processes.spawn import spawn
from tests.integrations import assert_profiling_shown
from tests.integrations import hf_workers as W

ROOT = Path(__file__).resolve().parents[2]
CLUSTER3 = str(ROOT / "examples" / "cluster-3.yaml")      # an A100 beside two T4s, emulated
SAVE_AT = 3                                                 # mid-way through the second epoch


def plan(stage, micro, accum, local=None) -> dict:
    return {"zero_stage": stage, "micro_batch_sizes": micro, "accum_steps": accum, "local_batch_sizes": local}


# 12 samples a step on 3 ranks. Stages 0-1: unequal micro-batches and accumulation; 2-3: equal accumulation.
CASES = [
    (plan(0, [4, 1, 2], [1, 4, 2]), {}),
    (plan(1, [2, 3, 1], [3, 1, 3]), {"clip": 0.05, "weight_decay": 0.01}),   # clipping acts in every step
    (plan(2, [3, 2, 1], [2, 2, 2]), {"save_steps": SAVE_AT, "accum": 2}),  # 2 per device x 3 ranks x 2
    (plan(3, [4, 2, 1], [2, 2, 2], [7, 3, 2]), {}),                          # 7 = 4 + 3 near-equal
]
RESUME_PLAN = plan(1, [3, 3], [3, 1], [9, 3])                              # 2 ranks, another stage and split


@pytest.fixture(scope="module")
def env():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("POPLAR_DILATION", "3")     # the emulated devices' pace: fast, and no figure here depends on it
        yield


@pytest.fixture(scope="module")
def runs(starts_processes, env, tmp_path_factory):
    out = tmp_path_factory.mktemp("hf")
    return out, spawn(W.train_cases, 3, CASES, str(out), CLUSTER3, timeout_s=300)[0]


@functools.cache
def reference(clip: float, weight_decay: float):
    """Single device, whole global batches: the model's own mean loss over their label tokens."""
    from transformers import get_scheduler

    model = W.build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=W.HYPER["learning_rate"], eps=W.HYPER["adam_epsilon"],
                            weight_decay=weight_decay)
    schedule = get_scheduler("linear", opt, num_warmup_steps=0, num_training_steps=W.STEPS)
    samples = W.token_samples()
    # the global batches every PoplarTrainer run sees, whatever its plan: those of a one-rank plan
    sampler = PlanBatchSampler(len(samples), poplar.Plan(0, [W.GLOBAL_BATCH], [1]), 0, seed=W.HYPER["seed"])
    logs = []
    for epoch in range(W.STEPS):
        sampler.set_epoch(epoch)
        for idx in sampler:
            if len(logs) == W.STEPS:
                break
            loss = model(**{k: torch.stack([samples[i][k] for i in idx]) for k in samples[0]}).loss
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip or float("inf"))
            opt.step()
            schedule.step()
            opt.zero_grad()
            logs.append((loss.item(), norm.item()))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, logs


def assert_same_params(got: dict, want: dict, atol: float) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, atol=atol, rtol=0, msg=lambda m, key=key: f"{key}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(CASES)), ids=[f"stage{p['zero_stage']}" for p, _ in CASES])
def test_equals_single_device_training(runs, index):
    _, results = runs
    got = results[index]
    kw = CASES[index][1]
    state, logs = reference(kw.get("clip", 0.0), kw.get("weight_decay", 0.0))
    assert_same_params(got["state"], state, atol=1e-5)
    assert [loss for loss, _ in got["logs"]] == pytest.approx([loss for loss, _ in logs], abs=1e-5)
    assert [norm for _, norm in got["logs"]] == pytest.approx([norm for _, norm in logs], rel=1e-4)
    if kw.get("clip"):
        assert all(norm > kw["clip"] for _, norm in logs), "clipping must act in every step"
    assert len(got["steps_s"]) == W.STEPS and min(got["steps_s"]) > 0    # every step timed on its device


@pytest.mark.slow
def test_fp16_true_trains_the_engines_fp16_and_nothing_of_hfs_own_on_top(env, tmp_path):
    """``fp16=True`` is the engine's fp16 (its loss scale, fp32 masters): the very parameters of a run that asks the
    engine for fp16 directly. Hugging Face's own autocast or GradScaler taking part would make them differ."""
    plan = {"zero_stage": 1, "micro_batch_sizes": [4, 2, 1], "accum_steps": [1, 2, 4]}
    cases = [(plan, {"fp16": True, "steps": 2}), (plan, {"engine_config": {"mixed_precision": "fp16"}, "steps": 2})]
    spelled, direct = spawn(W.train_cases, 3, cases, str(tmp_path), CLUSTER3, timeout_s=300)[0]
    assert spelled["precision"] == direct["precision"] == ("fp16", 2.0 ** 16)
    assert [loss for loss, _ in spelled["logs"]] == [loss for loss, _ in direct["logs"]]
    for key, value in direct["state"].items():
        assert torch.equal(spelled["state"][key], value), key
        assert torch.isfinite(value).all(), key


@pytest.mark.slow
def test_resumes_exactly_on_another_world_size_and_plan(runs, tmp_path):
    out, results = runs
    checkpoint = out / "case-2" / f"checkpoint-{SAVE_AT}"
    for what in ("poplar", "model.safetensors", "scheduler.pt", "trainer_state.json"):   # Poplar's and the Trainer's
        assert (checkpoint / what).exists(), what
    moved = spawn(W.train, 2, RESUME_PLAN, str(tmp_path / "moved"), "both-differ", resume=str(checkpoint),
                  timeout_s=300)[0]
    whole = results[2]
    assert len(moved["logs"]) == W.STEPS      # the checkpoint's log history, and the steps after it
    assert [x for log in moved["logs"][SAVE_AT:] for x in log] == pytest.approx(
        [x for log in whole["logs"][SAVE_AT:] for x in log], abs=1e-6)
    assert_same_params(moved["state"], whole["state"], atol=1e-6)


def args(**kw):
    from transformers import TrainingArguments

    fields = dict(output_dir="unused", per_device_train_batch_size=4, report_to="none", use_cpu=True)
    return TrainingArguments(**{**fields, **kw})


@pytest.mark.parametrize("given, message", [
    (dict(plan=poplar.Plan(1, [2, 2], [1, 1])), "the plan is for 2 ranks"),
    (dict(plan={"zero_stage": 2, "micro_batch_sizes": [2, 1], "accum_steps": [1, 2]}),
     "same number of accumulation steps"),
    (dict(plan=poplar.Plan(0, [3], [1])), "the plan splits 3 samples per step, the TrainingArguments give 4"),
    (dict(workload="tiny"), "Poplar needs a plan"),
    (dict(cluster="both-differ"), "give train_dataset"),
    (dict(plan=poplar.Plan(0, [4], [1]), train_sampling_strategy="group_by_length"), "train_sampling_strategy"),
], ids=["world-size", "stage2-unequal-accum", "global-batch", "workload-without-cluster", "cluster-without-data",
        "sampling"])
def test_bad_input_is_one_line_before_any_process_group(given, message):
    from poplar.integrations.hf.trainer import PoplarTrainer

    strategy = given.pop("train_sampling_strategy", "random")
    with pytest.raises(ValueError, match=message) as e:
        PoplarTrainer(model=torch.nn.Linear(2, 2), args=args(train_sampling_strategy=strategy), **given)
    assert "\n" not in str(e.value)
    assert not torch.distributed.is_initialized()


def test_the_trainers_optimizer_steps_nothing_and_its_scheduler_sets_the_engines_lr():
    from transformers import get_scheduler

    from poplar.integrations.hf.parts import EngineOptimizer

    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.ones(3)
    inner = torch.optim.AdamW([param], lr=1.0)
    proxy = EngineOptimizer(SimpleNamespace(optimizer=inner))
    schedule = get_scheduler("linear", proxy, num_warmup_steps=0, num_training_steps=4)
    proxy.step()
    proxy.zero_grad()
    schedule.step()
    assert torch.equal(param.detach(), torch.ones(3)) and param.grad is not None
    assert inner.param_groups[0]["lr"] == 0.75 and schedule.get_last_lr() == [0.75]


@pytest.mark.slow
def test_the_users_model_is_profiled_on_its_data_planned_and_trained_as_one_device_and_cached(env, tmp_path,
                                                                                            monkeypatch):
    """No plan and no preset: a cluster alone. The model given is profiled on samples of the dataset as the
    Trainer collates them, planned, trained exactly as one device; a second run reads the profile from the cache."""
    monkeypatch.setenv("POPLAR_CACHE_DIR", str(tmp_path / "profiles"))
    first, second = spawn(W.train_twice, 3, str(tmp_path), CLUSTER3, timeout_s=600)[0]
    want, logs = reference(0.0, 0.0)
    for run in (first, second):
        assert poplar.Plan.from_dict(run["plan"]).global_batch_size == W.GLOBAL_BATCH
        assert_same_params(run["state"], want, atol=1e-5)
        assert [loss for loss, _ in run["logs"]] == pytest.approx([loss for loss, _ in logs], abs=1e-5)
    assert first["profiled"] and not second["profiled"]      # measured once, then read from the cache
    assert_profiling_shown(first["printed"], second["printed"], CLUSTER3, "LlamaForCausalLM", 1)


# ---------------------------------------------------------------------- no plan and no cluster: the Trainer's split
EVEN = {1: [(None, {"accum": 3, "stages": (3,)}), (None, {"accum": 1})],                 # 4 x 3 and 12 x 1
        2: [(None, {"accum": 2}), (None, {"accum": 1, "stages": (2, 3)})]}               # 3 x 2 and 6 x 1 a rank


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2], ids=["one-rank", "two-ranks"])
def test_no_plan_and_no_cluster_trains_the_arguments_evenly_exactly_as_one_device(env, tmp_path, world):
    """``PoplarTrainer(model, args, train_dataset)`` alone on 1 and 2 gloo ranks: every rank
    ``gradient_accumulation_steps`` micro-batches of ``per_device_train_batch_size`` (the Trainer's split with DDP) in
    the lowest stage given, equal to one device to 1e-5; rank 0 says the split and that a cluster plans it, once."""
    got = spawn(W.train_cases, world, EVEN[world], str(tmp_path), None, timeout_s=300)[0]
    want, logs = reference(0.0, 0.0)
    for (_, kw), run in zip(EVEN[world], got):
        per_device = W.GLOBAL_BATCH // (world * kw["accum"])
        assert run["plan"] == poplar.Plan(min(kw.get("stages", (0,))), [per_device] * world, kw["accum"]).to_dict()
        assert_same_params(run["state"], want, atol=1e-5)
        assert [loss for loss, _ in run["logs"]] == pytest.approx([loss for loss, _ in logs], abs=1e-5)
        said = [line for line in run["printed"].splitlines() if "no plan and no cluster" in line]
        assert len(said) == 1 and f"takes {per_device} samples x {kw['accum']} accumulation" in said[0], said
        assert "mixed GPUs" in said[0]


def test_no_plan_and_no_cluster_is_the_arguments_even_split_before_any_process_group(capsys):
    from poplar.integrations.hf.trainer import PoplarTrainer

    trainer = PoplarTrainer(model=torch.nn.Linear(2, 2), args=args(gradient_accumulation_steps=3), stages=(2, 3))
    assert trainer.plan == poplar.Plan(2, [4], 3) and not torch.distributed.is_initialized()
    said = [line for line in capsys.readouterr().out.splitlines() if "no plan and no cluster" in line]
    assert said == ["poplar: no plan and no cluster: the one rank takes 4 samples x 3 accumulation steps (12 a step, "
                    "ZeRO stage 2), as DDP splits it; give a cluster (cluster= or POPLAR_CLUSTER) or a plan to have "
                    "Poplar plan the split for mixed GPUs"]
