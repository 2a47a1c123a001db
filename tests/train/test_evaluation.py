"""Evaluation while training (`eval_data`, `eval_every`): every rank's share of the evaluation batches, reduced
exactly, equals one device's loss on the same samples; a fraction held out never trains; the log and the plot
carry it; bad input is one line."""

from __future__ import annotations

import dataclasses
import json
import math
import random

import pytest
import torch

import poplar
from poplar.data.prepare import prepare
from poplar.data.records import DataFields
from poplar.models.loss import IGNORE
from poplar.train.config import load_config
from poplar.train.dataset import own_model, prepare_data, prepare_run_data
from poplar.train.eval_data import held_out
from poplar.train.evaluation import EvalResult, batch_shares, micro_batches
from poplar.train.report import eval_records, figure, read_log, step_records, summarize
from poplar.train.run import run_training
from tests.helpers.pretrained import save_qwen2
from tests.helpers.user_data import text_file, write_labelled, write_pairs


@pytest.fixture(autouse=True)
def caches(tmp_path, monkeypatch):
    monkeypatch.setenv("POPLAR_DATA_CACHE", str(tmp_path / "data-cache"))
    monkeypatch.setenv("POPLAR_CACHE_DIR", str(tmp_path / "profile-cache"))
    monkeypatch.setenv("POPLAR_DILATION", "3")


def random_plan(r: random.Random) -> poplar.Plan:
    stage, world = r.choice([0, 1, 2, 3]), r.randint(1, 4)
    local = [r.randint(1, 9) for _ in range(world)]
    accum = [r.randint(1, b) for b in local] if stage < 2 else [r.randint(1, min(local))] * world
    return poplar.Plan.from_local_batches(stage, local, accum)


def test_every_sample_is_evaluated_once_in_micro_batches_no_larger_than_training_s():
    """Seeded random plans (stages 0-3, 1-4 ranks, uneven) and evaluation sets of every remainder: the ranks'
    micro-batches cover each sample exactly once, each at most the rank's training micro-batch, and a whole batch
    is split as training splits it."""
    r = random.Random(0)
    for _ in range(300):
        plan = random_plan(r)
        g = plan.global_batch_size
        for n in sorted({1, g - 1, g, g + 1, 2 * g + r.randint(0, g - 1), r.randint(1, 5 * g)} - {0}):
            seen = []
            for rank in range(plan.world_size):
                for lo, hi in micro_batches(n, plan, rank):
                    assert 0 < hi - lo <= plan.micro_batch_sizes[rank], (plan, n, rank)
                    seen += range(lo, hi)
            assert sorted(seen) == list(range(n)), (plan, n)
        assert batch_shares(g, plan) == list(plan.local_batch_sizes)
        for rank in range(plan.world_size):      # a whole batch: the rank's training slice
            mine = [i for lo, hi in micro_batches(g, plan, rank) for i in range(lo, hi)]
            assert mine == list(range(*plan.sample_range(rank)))


def test_the_modules_examples_hold():
    import doctest

    import poplar.train.eval_data
    import poplar.train.evaluation

    for module in (poplar.train.evaluation, poplar.train.eval_data):
        result = doctest.testmod(module)
        assert result.attempted and not result.failed, module.__name__


def test_a_partial_batch_is_split_by_the_plan_s_shares_and_a_rank_may_get_none():
    plan = poplar.Plan.from_local_batches(3, [2, 6, 4], 1)
    assert batch_shares(1, plan) == [0, 1, 0] and batch_shares(6, plan) == [1, 3, 2]
    assert micro_batches(25, plan, 0) == [(0, 2), (12, 14)]       # nothing of the last batch (sample 24)
    assert micro_batches(25, plan, 1)[-1] == (24, 25)


def test_the_held_out_split_is_seeded_disjoint_and_refuses_what_leaves_nothing():
    train, held = held_out(1000, 0.05, 3, 32)
    assert len(held) == 50 and len(train) == 950 and not set(train.tolist()) & set(held.tolist())
    again, held_again = held_out(1000, 0.05, 3, 32)
    assert torch.equal(held, held_again) and torch.equal(train, again)
    assert not torch.equal(held_out(1000, 0.05, 4, 32)[1], held)       # the run's seed chooses it
    with pytest.raises(ValueError, match="holds out none of the 10 samples"):
        held_out(10, 0.01, 0, 2)
    with pytest.raises(ValueError, match="leaves 1 to train on, fewer than a global batch of 4"):
        held_out(10, 0.9, 0, 4)


def test_an_evaluation_s_record_and_the_plot_s_series():
    result = EvalResult(loss=2.0, tokens=100, samples=4, seconds=0.5)
    assert result.perplexity == pytest.approx(math.exp(2.0))
    assert result.record(3) == {"step": 3, "eval_loss": 2.0, "eval_perplexity": math.exp(2.0), "eval_tokens": 100,
                                "eval_samples": 4, "eval_s": 0.5}
    steps = [{"step": i, "loss": 5.0 - i, "step_s": 1.0, "samples_per_s": 8.0, "tokens_per_s": 256.0, "tflops": 1.0,
              "busy_s": [1.0, 0.5], "idle_s": [0.0, 0.5], "overruns": 0} for i in range(4)]
    evals = [EvalResult(4.5 - i, 100, 4, 0.1).record(i) for i in (1, 3)]
    records = steps[:2] + evals[:1] + steps[2:] + evals[1:]
    assert step_records(records) == steps and eval_records(records) == evals
    assert summarize(records)["eval_loss"] == 1.5 and summarize(records)["steps"] == 4
    check_plot(records, "poplar")


def check_plot(records: list[dict], name: str) -> None:
    """The report's loss plot draws each evaluation at its step (the steps done), as ``<name> eval``."""
    import matplotlib.pyplot as plt

    fig = figure({name: records})
    drawn = {line.get_label(): line for line in fig.axes[0].get_lines()}
    plt.close(fig)
    evals = eval_records(records)
    assert list(drawn[f"{name} eval"].get_xdata()) == [r["step"] + 1 for r in evals]
    assert list(drawn[f"{name} eval"].get_ydata()) == pytest.approx([r["eval_loss"] for r in evals], rel=1e-12)
    assert list(drawn[name].get_ydata()) == pytest.approx([r["loss"] for r in step_records(records)])


def run_data(cfg):
    """The run's model and data as its launcher prepares them."""
    return prepare_run_data(cfg.model_data, own_model(cfg.model_data))


def one_device_loss(cfg, state: dict) -> tuple[float, int]:
    """One device, every evaluation sample at once: the mean loss over what is counted, and that count."""
    prepared = run_data(cfg)
    samples = prepared.eval_samples
    model = prepared.model.build(seed=cfg.seed)
    model.load_state_dict(state)
    model.eval()
    with torch.no_grad():
        if samples.targets is None:
            logits = model(samples.tokens[:, :-1])
            logits = getattr(logits, "logits", logits)
            targets = samples.tokens[:, 1:]
        else:
            logits = model(input_ids=samples.tokens[:, :-1]).logits
            targets = samples.targets
        flat = logits.reshape(-1, logits.size(-1)).double()
        total = torch.nn.functional.cross_entropy(flat, targets.reshape(-1), ignore_index=IGNORE, reduction="sum")
    counted = int((targets != IGNORE).sum())
    return float(total) / counted, counted


@pytest.mark.slow
@pytest.mark.parametrize("stage, local, accum, shares, data", [
    (0, [6, 3, 1], [2, 1, 1], None, "text"), (1, [6, 3, 1], [3, 1, 1], [1, 2, 1], "text"),
    (2, [6, 4, 2], [2, 2, 2], None, "pairs"), (3, [2, 6, 4], [1, 1, 1], [1, 3, 0.5], "pairs")])
def test_the_evaluation_loss_is_one_device_s_on_uneven_ranks(tmp_path, stage, local, accum, shares, data):
    """Every stage, uneven plans: a preset on text (its tokenizer trained on the training text, the evaluation
    text cut with it), and a model directory's prompt/completion pairs (token-weighted; ZeRO-3 with uneven
    shares): the loss after the last step equals one device's on the same samples to 1e-5; every `eval_every`
    steps a record, and the plot draws them."""
    plan = poplar.Plan.from_local_batches(stage, local, accum, shard_shares=shares)
    plan.save(tmp_path / "plan.json")
    if data == "text":
        fields = {"model": "llama-tiny", "seq_len": 16, "vocab_size": 300,
                  "data": str(text_file(tmp_path / "train.txt", 60, 0)),
                  "eval_data": str(text_file(tmp_path / "eval.txt", 11, 1))}
    else:
        fields = {"model": str(save_qwen2(tmp_path / "qwen")), "seq_len": 24,
                  "data": str(write_pairs(tmp_path / "pairs.jsonl")),
                  "eval_data": str(write_pairs(tmp_path / "eval.jsonl", n=55, seed=5))}
    cfg = load_config(None, {**fields, "global_batch": plan.global_batch_size, "steps": 3, "lr": 1e-2,
                             "eval_every": 2, "cluster": "none", "plan": str(tmp_path / "plan.json"),
                             "out": str(tmp_path / "run")})
    prepared = run_data(cfg)
    tok, samples = prepared.tokenizer, prepared.eval_samples
    n, g = len(samples.tokens), plan.global_batch_size
    # the last evaluation batch is partial and some rank has none of it
    assert n % g and 0 in batch_shares(n % g, plan), (n, g)
    check_read_as_data(cfg, tok, samples, data)
    result = run_training(cfg, return_state=True, nproc=3)
    records = read_log(tmp_path / "run" / "log.jsonl")
    evals = eval_records(records)
    assert [r["step"] for r in evals] == [1, 2] and [r["step"] for r in step_records(records)] == [0, 1, 2]
    want, counted = one_device_loss(cfg, result["state"])
    assert evals[-1]["eval_loss"] == pytest.approx(want, rel=1e-5, abs=0)
    assert evals[-1]["eval_perplexity"] == pytest.approx(math.exp(want), rel=1e-5)
    assert evals[-1]["eval_tokens"] == counted and evals[-1]["eval_samples"] == n
    assert evals[0]["eval_loss"] != evals[1]["eval_loss"]          # evaluated after step 2, then after it learnt
    assert result["summary"]["eval_loss"] == evals[-1]["eval_loss"]
    check_plot(records, cfg.baseline)


def check_read_as_data(cfg, tok, samples, data: str) -> None:
    """The evaluation file is read as `data` is: the same call, the training's tokenizer."""
    from poplar.data.text import load_text, pack
    from poplar.train.dataset import own_model

    if data == "text":     # a preset's tokenizer is trained on the training text alone: the evaluation text is cut by it
        want = pack(load_text(cfg.eval_data), tok.backend, cfg.seq_len, eos_id=tok.eos_id)
        assert torch.equal(samples.tokens, want) and samples.targets is None
    else:
        want = prepare(cfg.eval_data, DataFields(), own_model(cfg.model_data), cfg.seq_len, cfg.vocab_size)
        assert torch.equal(samples.tokens, want.tokens) and torch.equal(samples.targets, want.targets)


@pytest.mark.slow
def test_a_held_out_fraction_never_trains_and_is_the_same_split_every_run(tmp_path, capfd):
    plan = poplar.Plan.from_local_batches(1, [5, 3], [1, 2])
    plan.save(tmp_path / "plan.json")
    cfg = load_config(None, {"model": "llama-tiny", "seq_len": 16, "vocab_size": 300, "eval_data": 0.25,
                             "data": str(text_file(tmp_path / "train.txt", 60, 0)), "global_batch": 8,
                             "steps": 2, "cluster": "none", "plan": str(tmp_path / "plan.json"),
                             "out": str(tmp_path / "run")})
    whole = prepare_data(dataclasses.replace(cfg.model_data, eval_data=None))[1].sequences
    data = run_data(cfg)
    batches, held = data.batches, data.eval_samples.tokens
    assert len(held) == round(0.25 * len(whole)) and len(batches.sequences) + len(held) == len(whole)
    rows = lambda t: {tuple(x) for x in t.tolist()}   # noqa: E731
    assert not rows(held) & rows(batches.sequences) and rows(held) | rows(batches.sequences) == rows(whole)
    # every step of two epochs draws only from the samples that train
    trained = set().union(*(rows(batches.batch(k)) for k in range(2 * batches.per_epoch)))
    assert trained == rows(batches.sequences)
    run_training(cfg, nproc=2)
    out = capfd.readouterr().out.splitlines()
    said = (f"poplar: evaluation on {len(held)} of the {len(whole)} training samples, held out (eval_data 0.25, "
            f"seed 0; they never train, {len(batches.sequences)} do), at the end")
    assert said in out, out       # the launcher's, before the ranks start
    evals = eval_records(read_log(tmp_path / "run" / "log.jsonl"))
    assert [(r["step"], r["eval_samples"]) for r in evals] == [(1, len(held))]
    # another run (a process of its own) holds out the same samples
    import subprocess
    import sys

    code = ("import sys; from poplar.train.eval_data import held_out; "
            f"print(held_out({len(whole)}, 0.25, 0, 8)[1].tolist())")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(other.stdout) == held_out(len(whole), 0.25, 0, 8)[1].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("family, stage, local", [("classifier", 1, [5, 2, 3]), ("bert", 3, [2, 5, 3])])
def test_a_classifier_s_and_a_masked_lm_s_evaluation_is_one_device_s(tmp_path, family, stage, local):
    """A sequence classifier on labelled rows and a masked LM on text: one micro-batch of every evaluation sample
    through the model's own loss, on one device, gives the loss the ranks report (to 1e-5)."""
    from tests.helpers.pretrained import save_classifier, save_family

    plan = poplar.Plan.from_local_batches(stage, local, 1, shard_shares=[2, 1, 1] if stage == 3 else None)
    plan.save(tmp_path / "plan.json")
    if family == "classifier":
        fields = {"model": str(save_classifier(tmp_path / "m", num_labels=3)),
                  "data": str(write_labelled(tmp_path / "rows.jsonl")),
                  "eval_data": str(write_labelled(tmp_path / "eval.jsonl", n=21, seed=4))}
    else:
        fields = {"model": str(save_family(tmp_path / "m", "bert")), "data": str(text_file(tmp_path / "t.txt", 60, 0)),
                  "eval_data": str(text_file(tmp_path / "eval.txt", 11, 1))}
    cfg = load_config(None, {**fields, "seq_len": 16, "global_batch": 10, "steps": 2, "lr": 1e-2, "cluster": "none",
                             "plan": str(tmp_path / "plan.json"), "out": str(tmp_path / "run")})
    result = run_training(cfg, return_state=True, nproc=3)
    data = run_data(cfg)
    samples = data.eval_samples
    assert len(samples.tokens) % 10        # a partial last batch
    model = data.model.build(seed=cfg.seed)
    model.load_state_dict(result["state"])
    model.eval()
    whole = ((samples.tokens, samples.labels) if family == "classifier" else
             (samples.tokens[:, :-1], samples.tokens[:, 1:]))
    with torch.no_grad():
        want = float(data.model.loss(model, whole))
    evals = eval_records(read_log(tmp_path / "run" / "log.jsonl"))
    assert [r["step"] for r in evals] == [1] and evals[0]["eval_samples"] == len(samples.tokens)
    assert evals[0]["eval_loss"] == pytest.approx(want, rel=1e-5, abs=0)
