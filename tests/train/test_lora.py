"""LoRA (``--lora``, :mod:`poplar.models.lora`): adapters trained beside a model directory's frozen weights.

On uneven ranks in every ZeRO stage the adapters train exactly as plain PEFT with AdamW
trains them on one device over the same global batches, and the base weights stay bit
for bit what the directory holds; the export is the adapter PEFT loads (and the merged
model ``from_pretrained`` loads); the profiler measures more samples a micro-step beside
the frozen weights than beside a full fine-tune's states; bad input is one line.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import poplar
from poplar.cli.train import lora_option
from poplar.train.config import load_config
from poplar.train.dataset import workload_of
from poplar.train.run import run_training
from tests.helpers.caches import own_caches
from tests.helpers.refusals import refusal
from tests.helpers.user_data import write_pairs


@pytest.fixture(autouse=True)
def caches(tmp_path, monkeypatch):
    own_caches(monkeypatch, tmp_path / "caches")


def save_llama(directory: Path, seed: int = 7, hidden: int = 32, layers: int = 2) -> Path:
    """A small Llama causal LM with random (seeded) weights and a tokenizer, as save_pretrained writes them."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.helpers.pretrained import save_tokenizer

    directory = Path(directory)
    vocab = len(save_tokenizer(directory))
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def plain_peft(cfg, directory: Path, steps: int) -> tuple[torch.nn.Module, list[float]]:
    """One device, the whole global batch a step: the directory's model wrapped by PEFT itself (its adapters drawn
    after ``torch.manual_seed(seed)``), AdamW on what PEFT left trainable, the run's schedule and clipping."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from poplar.train.dataset import prepare_data

    base = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, local_files_only=True)
    torch.manual_seed(cfg.seed)
    model = get_peft_model(base, LoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha, target_modules=cfg.lora.targets,
                                            task_type="CAUSAL_LM"))
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=cfg.lr, weight_decay=cfg.weight_decay)
    _, batches = prepare_data(cfg.model_data)
    loss_of = workload_of(cfg.model_data).loss
    whole, losses = poplar.Plan(0, [cfg.global_batch], 1), []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = cfg.schedule.at(step)
        loss = loss_of(model, batches.local(step, whole, 0))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, cfg.engine.clip_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return model, losses


def base_name(name: str) -> str:
    """A PEFT model's parameter name as its base model names it."""
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")


@pytest.mark.slow
@pytest.mark.parametrize("stage, local, accum, shares", [
    (0, [3, 5, 2], [1, 2, 1], None), (1, [4, 2, 6], [2, 1, 1], None), (2, [5, 3, 2], [1, 1, 1], None),
    (3, [2, 6, 4], [1, 1, 1], [1, 3, 0.5])])
def test_adapters_on_uneven_ranks_train_as_plain_peft_on_one_device(tmp_path, stage, local, accum, shares):
    from transformers import AutoModelForCausalLM

    directory = save_llama(tmp_path / "llama")
    plan = poplar.Plan.from_local_batches(stage, local, accum, shard_shares=shares)
    plan.save(tmp_path / "plan.json")
    exported = tmp_path / "exported" if stage == 3 else None
    cfg = load_config(None, {"model": str(directory), "data": str(write_pairs(tmp_path / "pairs.jsonl")),
                             "seq_len": 24, "global_batch": plan.global_batch_size, "steps": 3, "lr": 1e-2,
                             "cluster": "none", "plan": str(tmp_path / "plan.json"), "out": str(tmp_path / "run"),
                             "lora": lora_option("r=4,alpha=8,targets=q_proj,v_proj,merge=true"),
                             "export": str(exported) if exported else None})
    result = run_training(cfg, return_state=True, nproc=3)
    want, losses = plain_peft(cfg, directory, 3)
    assert result["losses"] == pytest.approx(losses, rel=1e-5)
    state, adapters = result["state"], {k: v for k, v in want.state_dict().items() if "lora_" in k}
    assert len(adapters) == 2 * 2 * 2 and set(adapters) < set(state)    # A and B, on q and v, in 2 layers
    for name, value in adapters.items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-5, msg=name)
        assert state[name].abs().sum() > 0, name     # trained: B starts at zero
    start = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, local_files_only=True).state_dict()
    frozen = {k: v for k, v in state.items() if "lora_" not in k}
    assert {base_name(k) for k in frozen} == set(start)
    for name, value in frozen.items():    # bit for bit what the directory holds
        assert torch.equal(value, start[base_name(name)]), name
    if exported is not None:
        check_lora_export(result["exported"], state, workload_of(cfg.model_data), directory)


@pytest.mark.slow
def test_a_lora_run_stopped_and_resumed_ends_as_one_that_was_not(tmp_path):
    """The checkpoint holds the adapters (the frozen weights are the directory's, read again): a run stopped after
    a step and resumed on another stage's uneven plan trains on to plain PEFT's adapters on one device."""
    directory = save_llama(tmp_path / "llama")
    first, then = (poplar.Plan.from_local_batches(1, [4, 2, 6], [2, 1, 1]),
                   poplar.Plan.from_local_batches(3, [2, 6, 4], [1, 1, 1], shard_shares=[1, 3, 0.5]))
    first.save(tmp_path / "first.json")
    then.save(tmp_path / "then.json")
    fields = {"model": str(directory), "data": str(write_pairs(tmp_path / "pairs.jsonl")), "seq_len": 24,
              "global_batch": 12, "steps": 3, "lr": 1e-2, "cluster": "none", "out": str(tmp_path / "run"),
              "lora": lora_option("r=4,alpha=8,targets=q_proj,v_proj")}
    run_training(load_config(None, {**fields, "plan": str(tmp_path / "first.json"), "stop_at": 1}), nproc=3)
    cfg = load_config(None, {**fields, "plan": str(tmp_path / "then.json"), "resume": True})
    result = run_training(cfg, return_state=True, nproc=3)
    want, losses = plain_peft(cfg, directory, 3)
    assert result["start"] == 1 and result["losses"] == pytest.approx(losses[1:], rel=1e-5)
    for name, value in want.state_dict().items():
        if "lora_" in name:
            torch.testing.assert_close(result["state"][name], value, rtol=1e-5, atol=1e-5, msg=name)


def check_lora_export(exported: Path, state: dict, wl, directory: Path) -> None:
    """The adapter PEFT loads onto the directory's model, and the merged model, give the trained model's logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    exported = Path(exported)
    assert (exported / "adapter_config.json").is_file() and (exported / "adapter_model.safetensors").is_file()
    base = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, local_files_only=True)
    loaded = PeftModel.from_pretrained(base, exported)
    merged = AutoModelForCausalLM.from_pretrained(exported / "merged", dtype=torch.float32, local_files_only=True)
    trained = wl.build()
    trained.load_state_dict(state)
    tokens = torch.randint(0, wl.vocab_size, (3, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = trained(input_ids=tokens).logits
        torch.testing.assert_close(loaded(input_ids=tokens).logits, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(merged(input_ids=tokens).logits, want, rtol=1e-5, atol=1e-5)
        untouched = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, local_files_only=True)
        assert not torch.allclose(untouched(input_ids=tokens).logits, want, atol=1e-4)   # the adapters count


def _stages_in_turn(rank: int, world_size: int, directory: str, plans: list[dict], scratch: str) -> dict:
    """A LoRA model trained a step a plan, another ZeRO stage each (``RankRuntime.change_plan``: the engine rebuilt
    through a checkpoint, as a re-plan does), on this host's CPU; rank 0's full state."""
    import functools

    from poplar.devices import rank_device_of
    from poplar.models.lora import LoraSettings, LoraSource
    from poplar.models.pretrained import ModelDirectory
    from poplar.runtime.rank import RankRuntime

    wl = LoraSource(ModelDirectory(directory=directory, seq_len=16),
                    LoraSettings(r=4, alpha=8, targets=["q_proj", "v_proj"]))
    plans = [poplar.Plan.from_dict(p) for p in plans]
    with rank_device_of(None, rank) as device:
        runtime = RankRuntime(device, wl.build(seed=0), functools.partial(torch.optim.AdamW, lr=1e-2), plans[0],
                              poplar.EngineConfig())
        for step, plan in enumerate(plans):
            runtime.change_plan(plan, scratch)
            inputs, targets = wl.random_batch(plan.global_batch_size, seed=step)
            lo, hi = plan.sample_range(rank)
            runtime.train_batch((inputs[lo:hi], targets[lo:hi]), wl.loss)
        state = runtime.engine.full_state_dict()
        runtime.close()
    return {"state": state if rank == 0 else None, "stage": runtime.engine.zero_stage}


@pytest.mark.slow
def test_a_change_of_stage_keeps_the_frozen_weights(tmp_path):
    """A re-plan to another stage rebuilds the engine through a checkpoint, which holds the adapters alone: the
    frozen weights are kept as they are, and the adapters train on as plain PEFT's on one device."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from poplar.processes.spawn import spawn
    from poplar.models.hf import causal_lm_loss
    from poplar.models.pretrained import ModelDirectory

    directory = save_llama(tmp_path / "llama")
    plans = [poplar.Plan.from_local_batches(stage, local, accum, shard_shares=shares) for stage, local, accum, shares
             in ((0, [4, 2], [2, 1], None), (3, [2, 4], [1, 1], [1, 2]), (1, [5, 1], [1, 1], [2, 1]),
                 (2, [3, 3], [1, 1], None))]
    ranks = spawn(_stages_in_turn, 2, str(directory), [p.to_dict() for p in plans], str(tmp_path / "scratch"),
                  timeout_s=300)
    assert ranks[0]["stage"] == 2
    base = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, local_files_only=True)
    start = {k: v.clone() for k, v in base.state_dict().items()}
    torch.manual_seed(0)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                            task_type="CAUSAL_LM"))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    batch = ModelDirectory(directory=str(directory), seq_len=16).random_batch     # the ranks' batches
    for step, plan in enumerate(plans):
        causal_lm_loss(model, batch(plan.global_batch_size, seed=step)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    state = ranks[0]["state"]
    for name, value in model.state_dict().items():
        if "lora_" in name:
            torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-5, msg=name)
        else:
            assert torch.equal(state[name], start[base_name(name)]), name


@pytest.mark.slow
def test_the_profiler_measures_more_samples_beside_frozen_weights_than_beside_a_full_fine_tune(tmp_path):
    """The paper's V100-16GB + T4-16GB pair, emulated (its memory scaled to 98 MB a card, where it binds): the
    profiler builds the LoRA model on each rank and measures its states (the frozen weights alone, 4 bytes a
    parameter in fp32, beside the adapters' weight, gradient and AdamW moments) and the samples that fit beside
    them; the simulator counts the same."""
    from poplar.cluster.spec import load_cluster
    from poplar.models.lora import LoraSettings, LoraSource
    from poplar.models.pretrained import ModelDirectory
    from poplar.profile.options import ProfileOptions
    from poplar.profile.profiler import profile_cluster
    from poplar.simulate import simulate_stages

    base = ModelDirectory(directory=str(save_llama(tmp_path / "llama", hidden=256, layers=4)), seq_len=64)
    adapted = LoraSource(base, LoraSettings(r=8, targets=["q_proj", "v_proj"]))
    cluster, options = load_cluster("compute-differs").model_dump(), ProfileOptions(stages=(0,), n_points=2)
    full, lora = (profile_cluster(wl, cluster, options)[0] for wl in (base, adapted))
    simulated = simulate_stages(adapted, cluster, options)
    for kind in ("v100-16gb", "t4-16gb"):
        f, a = full.stage(kind, 0), lora.stage(kind, 0)
        assert f.state_bytes == 16 * base.n_params()      # weight, gradient and two AdamW moments, in fp32
        assert a.state_bytes == 4 * adapted.frozen_params() + 16 * adapted.trained_params()
        assert 0 < f.max_micro_batch < a.max_micro_batch, (kind, f.max_micro_batch, a.max_micro_batch)
        assert (simulated[(kind, 0)].max_micro_batch, simulated[(kind, 0)].state_bytes) == (a.max_micro_batch,
                                                                                            a.state_bytes)


# -- bad input: one line, exit 2, nothing written, in under 10 s ---------------------------------------------------
def _refused(tmp: Path, args: list[str]) -> str:
    """The one line ``poplar`` refuses ``args`` with (exit 2), having written nothing, within 10 s."""
    output = refusal(args, tmp)
    assert not (tmp / "run").exists() and not (tmp / "exported").exists()
    return output


@pytest.fixture
def llama_dir(tmp_path):
    directory = save_llama(tmp_path / "llama")
    write_pairs(tmp_path / "pairs.jsonl")
    return directory


def _train(tmp: Path, lora: str) -> list[str]:
    return ["train", "--cluster", "both-differ", "--model", str(tmp / "llama"), "--data", str(tmp / "pairs.jsonl"),
            "--set", "seq_len=24", "--steps", "2", "--lora", lora, "--export", str(tmp / "exported"),
            "--out", str(tmp / "run")]


def test_targets_that_match_no_module_are_refused_naming_the_layers_there_are(tmp_path, llama_dir):
    line = _refused(tmp_path, _train(tmp_path, "r=8,targets=qkv,out_proj"))
    assert "targets=qkv,out_proj match no module of llama" in line
    assert "k_proj, lm_head, o_proj, q_proj, up_proj, v_proj" in line and "targets=q_proj,v_proj" in line
    line = _refused(tmp_path, ["simulate", "--cluster", "both-differ", "--model", "llama-tiny", "--global-batch", "8",
                               "--lora", "targets=qkv", "--out", str(tmp_path / "plan.json")])
    assert "targets=qkv match no module of llama-tiny" in line


def test_peft_missing_is_one_line_naming_the_extra(tmp_path, llama_dir, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "peft", None)      # `import peft` raises ImportError, as where it is not installed
    line = _refused(tmp_path, _train(tmp_path, "on"))
    assert "--lora needs PEFT, which is not installed: pip install 'poplar-zero[lora]'" in line
