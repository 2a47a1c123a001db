"""A user's own model and data: a Qwen2 directory the project has no preset of, a JSONL of prompt/completion pairs.

Profiled, planned and trained from its pretrained weights on an emulated cluster, then
exported; trained on plain ranks in every stage with an uneven plan (ZeRO-3 with uneven
shares too), each exactly as one device trains it on the same global batches.
"""

import json

import pytest
import torch

import poplar
from poplar.data.prepare import prepare
from poplar.data.records import DataFields
from poplar.models.loss import IGNORE
from poplar.train.config import load_config
from poplar.train.dataset import prepare_data, workload_of
from poplar.train.run import run_training
from tests.helpers.one_device import reference
from tests.helpers.pretrained import save_classifier, save_family, save_qwen2
from tests.helpers.user_data import WORDS, write_labelled, write_pairs

@pytest.fixture(autouse=True)
def caches(tmp_path, monkeypatch):
    monkeypatch.setenv("POPLAR_DATA_CACHE", str(tmp_path / "data-cache"))
    monkeypatch.setenv("POPLAR_CACHE_DIR", str(tmp_path / "profile-cache"))
    monkeypatch.setenv("POPLAR_DILATION", "3")


def test_only_the_completion_is_counted_and_weighted_by_tokens_over_the_global_batch(tmp_path):
    model = save_qwen2(tmp_path / "qwen")
    from poplar.models.pretrained import ModelDirectory

    source = ModelDirectory(directory=str(model), seq_len=24)
    rows = [{"prompt": "the cat", "completion": "sat on a mat"}, {"prompt": "a dog " * 30, "completion": "ran"},
            {"prompt": "birds " * 3, "completion": "sang over green hills " * 3}]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    prepared = prepare(str(tmp_path / "pairs.jsonl"), DataFields(), source, 24, 1024)
    tok = prepared.tokenizer
    assert tok.vocab_size == 300 and prepared.tokens.shape == (2, 25)   # the second's completion is past the end
    for row, (tokens, targets) in zip((rows[0], rows[2]), zip(prepared.tokens, prepared.targets)):
        prompt, completion = tok.encode([row["prompt"]])[0], tok.encode([row["completion"]], special=False)[0]
        whole = (prompt + completion + [tok.eos_id])[:25]
        assert tokens[:len(whole)].tolist() == whole and (tokens[len(whole):] == tok.pad_id).all()
        # the targets are the next tokens of the completion (and its end) alone: the prompt's and the padding's
        # are not counted
        n = len(whole) - len(prompt)
        assert targets[len(prompt) - 1:len(whole) - 1].tolist() == whole[len(prompt):]
        assert (targets[:len(prompt) - 1] == IGNORE).all() and (targets[len(whole) - 1:] == IGNORE).all() and n > 0
    # a second preparation reads the cache: the same tensors
    again = prepare(str(tmp_path / "pairs.jsonl"), DataFields(), source, 24, 1024)
    assert torch.equal(again.tokens, prepared.tokens) and torch.equal(again.targets, prepared.targets)


@pytest.mark.slow
@pytest.mark.parametrize("stage, local, accum, shares", [
    (0, [3, 5, 2], [1, 2, 1], None), (1, [4, 2, 6], [2, 1, 1], None), (2, [5, 3, 2], [1, 1, 1], None),
    (3, [2, 6, 4], [1, 1, 1], [1, 3, 0.5])])
def test_pairs_on_uneven_ranks_train_as_one_device_in_every_stage(tmp_path, stage, local, accum, shares):
    model = save_qwen2(tmp_path / "qwen")
    plan = poplar.Plan.from_local_batches(stage, local, accum, shard_shares=shares)
    plan.save(tmp_path / "plan.json")
    cfg = load_config(None, {"model": str(model), "data": str(write_pairs(tmp_path / "pairs.jsonl")),
                             "seq_len": 24, "global_batch": plan.global_batch_size, "steps": 3, "lr": 1e-2,
                             "cluster": "none", "plan": str(tmp_path / "plan.json"), "out": str(tmp_path / "run"),
                             "export": str(tmp_path / "exported") if stage == 3 else None})
    result = run_training(cfg, return_state=True, nproc=3)
    want, losses = reference(cfg, 3)
    assert result["losses"] == pytest.approx(losses, rel=1e-5)
    for name, value in want.items():
        torch.testing.assert_close(result["state"][name], value, rtol=1e-5, atol=1e-5, msg=name)
    if stage == 3:   # exported from ZeRO-3 with uneven shares: what from_pretrained loads is the trained model
        check_export(result["exported"], result["state"], workload_of(cfg.model_data))


def check_export(exported, state: dict, wl) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32, local_files_only=True)
    trained = wl.build()
    trained.load_state_dict(state)
    tokens = torch.randint(0, wl.vocab_size, (3, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=tokens).logits, trained(input_ids=tokens).logits,
                                   rtol=1e-5, atol=1e-5)
    assert len(AutoTokenizer.from_pretrained(exported, local_files_only=True)) == wl.vocab_size


@pytest.mark.slow
def test_a_model_directory_is_profiled_planned_trained_from_its_weights_and_exported(tmp_path):
    model = save_qwen2(tmp_path / "qwen", layers=3)
    cfg = load_config(None, {"model": str(model), "data": str(write_pairs(tmp_path / "pairs.jsonl", n=96)),
                             "seq_len": 24, "global_batch": 12, "steps": 2, "cluster": "both-differ",
                             "stages": [1], "out": str(tmp_path / "run"), "export": str(tmp_path / "exported")})
    result = run_training(cfg, return_state=True)
    assert result["planning"] is not None and result["plan"].zero_stage == 1
    # the first step's loss is the pretrained model's on that batch (not a fresh initialisation's)
    _, losses = reference(cfg, 1)
    assert result["losses"][0] == pytest.approx(losses[0], rel=1e-5)
    fresh = cfg.model_copy(update={"pretrained": False})
    assert abs(reference(fresh, 1)[1][0] - losses[0]) > 1e-3
    check_export(result["exported"], result["state"], workload_of(cfg.model_data))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt2", "mistral", "gpt-neox", "bert", "qwen2-tied"])
def test_each_family_trains_on_its_own_tokenizer_s_text_as_one_device(tmp_path, family):
    """Another architecture each (tied heads, a masked LM): ZeRO-3 with uneven shares on 2 ranks, plain text."""
    model = (save_qwen2(tmp_path / "m", tie=True) if family == "qwen2-tied" else save_family(tmp_path / "m", family))
    (tmp_path / "text.txt").write_text("\n\n".join(" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))) * 6)
    plan = poplar.Plan.from_local_batches(3, [5, 3], 1, shard_shares=[1, 2])
    plan.save(tmp_path / "plan.json")
    cfg = load_config(None, {"model": str(model), "data": str(tmp_path / "text.txt"), "seq_len": 16,
                             "global_batch": 8, "steps": 2, "lr": 1e-2, "cluster": "none",
                             "plan": str(tmp_path / "plan.json"), "out": str(tmp_path / "run")})
    result = run_training(cfg, return_state=True, nproc=2)
    want, losses = reference(cfg, 2)
    assert result["losses"] == pytest.approx(losses, rel=1e-5)
    for name, value in want.items():
        torch.testing.assert_close(result["state"][name], value, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("family, labels, stage, local, shares", [
    ("qwen2", 3, 3, [2, 6, 4], [1, 3, 0.5]), ("bert", 2, 1, [5, 3, 4], None), ("qwen2", 1, 2, [4, 4, 4], None)],
    ids=["qwen2-3-classes-zero3", "bert-2-classes-zero1", "qwen2-regression-zero2"])
def test_a_sequence_classifier_trains_on_labelled_text_as_one_device(tmp_path, family, labels, stage, local, shares):
    """Texts padded to the sequence and a label each, the head's loss (cross-entropy, or squared error where
    there is one label): uneven ranks train exactly as one device on the same global batches."""
    model = save_classifier(tmp_path / "cls", family, num_labels=labels)
    plan = poplar.Plan.from_local_batches(stage, local, 1, shard_shares=shares)
    plan.save(tmp_path / "plan.json")
    cfg = load_config(None, {"model": str(model), "data": str(write_labelled(tmp_path / "rows.jsonl", labels=labels)),
                             "seq_len": 24, "global_batch": plan.global_batch_size, "steps": 2, "lr": 1e-2,
                             "cluster": "none", "plan": str(tmp_path / "plan.json"), "out": str(tmp_path / "run")})
    _, batches = prepare_data(cfg.model_data)
    inputs, targets = batches.local(0, plan, 0)
    assert inputs.shape[1] == 24 and targets.shape == (inputs.shape[0],)    # a label a sample
    result = run_training(cfg, return_state=True, nproc=3)
    want, losses = reference(cfg, 2)
    assert result["losses"] == pytest.approx(losses, rel=1e-5)
    for name, value in want.items():
        torch.testing.assert_close(result["state"][name], value, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.slow
def test_a_factory_s_module_is_trained_on_the_text_as_one_device(tmp_path):
    """``--model package.module:factory``: the module the factory returns (ids to logits), on uneven ranks."""
    (tmp_path / "text.txt").write_text("\n\n".join(" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))) * 6)
    plan = poplar.Plan.from_local_batches(1, [5, 3], [2, 1])
    plan.save(tmp_path / "plan.json")
    cfg = load_config(None, {"model": "tests.helpers.pretrained:factory_lm", "data": str(tmp_path / "text.txt"),
                             "seq_len": 16, "global_batch": 8, "steps": 2, "lr": 1e-2, "cluster": "none",
                             "plan": str(tmp_path / "plan.json"), "out": str(tmp_path / "run")})
    result = run_training(cfg, return_state=True, nproc=2)
    want, losses = reference(cfg, 2)
    assert workload_of(cfg.model_data).vocab_size == 320 and result["losses"] == pytest.approx(losses, rel=1e-5)
    for name, value in want.items():
        torch.testing.assert_close(result["state"][name], value, rtol=1e-5, atol=1e-5, msg=name)
