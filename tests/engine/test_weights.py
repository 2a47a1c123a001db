"""Weights read straight into each rank's shards (poplar.engine.weights, poplar.models.weights).

A saved Qwen2 (sharded safetensors, fp32 or bf16, tied head or not) is built with its
parameters on the meta device and read into engines of every stage, flat, with uneven
shares and hybrid (node groups of 2 and 1), computing in fp32 and bf16, on 3 real
ranks over gloo: every engine's full parameters equal ``from_pretrained``'s, and its
first step's loss equals the loaded model's loss on that batch.
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch

import poplar
from poplar.processes.spawn import RankFailed, spawn
from tests.helpers.pretrained import save_qwen2

WORLD = 3
LAYOUTS = {"flat": {}, "shares": {"shard_shares": [0.5, 0.2, 0.3]},
           "hybrid": {"shard_groups": [[0, 1], [2]], "shard_shares": [0.7, 0.3, 1.0]}}


def _expected(directory: str):
    from poplar.models.pretrained import ModelDirectory

    model = ModelDirectory(directory=directory).build()
    return model, {k: v.float() for k, v in model.state_dict().items()}


def _batch(vocab: int, n: int = WORLD * 2, seq: int = 16):
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, vocab, (n, seq + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def _loss(model, batch):
    inputs, targets = batch
    logits = model(input_ids=inputs).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class Counting:
    """A reader that counts the elements it was asked for."""

    def __init__(self, reader):
        self.reader, self.elements = reader, 0

    def read(self, names, start, stop):
        self.elements += stop - start
        return self.reader.read(names, start, stop)


def load_cases(rank, world_size, directory: str, cases: list) -> list:
    """Each case (stage, layout, precision) in turn: an engine read from the directory's weights; what it holds."""
    from poplar.models.pretrained import ModelDirectory

    reference, expected = _expected(directory)
    batch = _batch(reference.config.vocab_size)
    with torch.no_grad():
        want_loss = _loss(reference, batch).item()
    out = []
    for zero_stage, layout, precision in cases:
        kw = {k: v for k, v in LAYOUTS[layout].items() if zero_stage > 0 or k == "shard_groups"}
        plan = poplar.Plan(zero_stage, [2] * WORLD, 1, **kw)
        model, weights = ModelDirectory(directory=directory).build_empty()
        weights = Counting(weights)
        engine = poplar.initialize(model, functools.partial(torch.optim.SGD, lr=0.0), plan, weights=weights,
                                   mixed_precision=precision)
        state = engine.full_state_dict()
        err = max((state[k].float() - v).abs().max().item() for k, v in expected.items())
        lo, hi = plan.sample_range(rank)
        loss = engine.train_batch((batch[0][lo:hi], batch[1][lo:hi]), _loss)
        held = sum(min(u.numel, u.shard_start + u.shard_numel) - min(u.numel, u.shard_start) if u.shard_optim
                   else u.numel for u in engine.units)
        out.append({"err": err, "loss": loss, "want_loss": want_loss, "keys": sorted(state) == sorted(expected),
                    "read": weights.elements, "held": held, "total": sum(u.numel for u in engine.units)})
        engine.close()
    return out


CASES = [(s, layout, p) for s, layout, p in itertools.product(range(4), LAYOUTS, ("fp32", "bf16"))
         if not (s == 0 and layout == "shares")]


@pytest.mark.slow
def test_weights_read_into_every_stage_and_layout_equal_from_pretrained(tmp_path):
    """Two sharded checkpoints, fp32 (untied) and bf16 (tied head), each in every case, in one group of ranks."""
    saved = [save_qwen2(tmp_path / "fp32", max_shard_size="30KB"),
             save_qwen2(tmp_path / "bf16-tied", tie=True, dtype=torch.bfloat16, max_shard_size="30KB")]
    assert all((d / "model.safetensors.index.json").is_file() for d in saved)    # sharded checkpoints
    results = spawn(load_directories, WORLD, [str(d) for d in saved], CASES, timeout_s=240)
    for rank, rank_results in enumerate(results):
        for case, r in zip([c for _ in saved for c in CASES], rank_results):
            alone = case[1] == "hybrid" and rank == 2    # a node of one rank holds its copy whole
            assert r["keys"], case
            assert r["err"] == 0.0, (case, r["err"])
            # each rank read what its master holds and nothing more: its shard alone where the stage shards
            assert r["read"] == r["held"] and (case[0] == 0 or alone or r["read"] < r["total"] * 0.75), (case, r)
            tol = 1e-5 if case[2] == "fp32" else 3e-2
            assert abs(r["loss"] - r["want_loss"]) <= tol * max(1.0, abs(r["want_loss"])), (case, r)


def load_directories(rank, world_size, directories: list[str], cases: list) -> list:
    return [r for d in directories for r in load_cases(rank, world_size, d, cases)]


@pytest.mark.slow
def test_a_meta_model_without_weights_is_refused_in_one_line():
    with pytest.raises(RankFailed, match="meta device: give initialize weights="):
        spawn(_init_meta, 1, timeout_s=60)


def _init_meta(rank, world_size):
    with torch.device("meta"):
        model = torch.nn.Linear(4, 4)
    poplar.initialize(model, functools.partial(torch.optim.SGD, lr=0.1), poplar.Plan(0, [1], 1))


def test_a_rank_reads_the_shards_where_the_directory_has_weights_and_builds_whole_otherwise(tmp_path):
    from poplar.models.pretrained import ModelDirectory
    from poplar.models.source import build_for_rank

    directory = str(save_qwen2(tmp_path / "qwen", tokenizer=False))
    model, weights = build_for_rank(ModelDirectory(directory=directory), 0)
    assert weights is not None and all(p.is_meta for p in model.parameters())
    assert all(not b.is_meta for b in model.buffers())
    model, weights = build_for_rank(ModelDirectory(directory=directory, pretrained=False), 0)
    assert weights is None and not any(p.is_meta for p in model.parameters())
