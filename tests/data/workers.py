"""Ranks for tests/data: Hugging Face models trained on packed text through the engine."""

from __future__ import annotations

import functools

import torch

import poplar
from poplar.data.text import MASK, GlobalBatches, embedded_text, pack, train_tokenizer
from poplar.models.hf import build_hf_model, causal_lm_loss, family, masked_lm_loss_fn

OPTIMIZER = functools.partial(torch.optim.AdamW, lr=1e-3, eps=1e-6)
NO_DROPOUT = {"bert": dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0), "llama": {}}


def setup(name: str, seq_len: int = 32):
    docs = embedded_text()
    tok = train_tokenizer(docs, 512)
    seqs = pack(docs[:20], tok, seq_len)
    model = build_hf_model(name, tok.get_vocab_size(), **NO_DROPOUT[family(name)])
    loss = causal_lm_loss if family(name) == "llama" else masked_lm_loss_fn(tok.token_to_id(MASK))
    return model, loss, seqs


def train_hf(rank, world_size, name: str, plans: list[dict], steps: int):
    """Each plan in turn from the same initial weights; rank 0 returns full parameters and losses."""
    out = []
    for p in plans:
        plan = poplar.Plan.from_dict(p)
        model, loss_fn, seqs = setup(name)
        engine = poplar.initialize(model, OPTIMIZER, plan)
        batches = GlobalBatches(seqs, plan.global_batch_size, seed=3)
        losses = [engine.train_batch(batches.local(k, plan, rank), loss_fn) for k in range(steps)]
        state = engine.full_state_dict()
        engine.close()
        out.append({"losses": losses, "state": state if rank == 0 else None})
    return out


def reference(name: str, global_batch: int, steps: int):
    """One process, the whole global batch, the plain optimizer."""
    model, loss_fn, seqs = setup(name)
    opt = OPTIMIZER(model.parameters())
    batches = GlobalBatches(seqs, global_batch, seed=3)
    whole = poplar.Plan(0, [global_batch], 1)
    losses = []
    for k in range(steps):
        opt.zero_grad()
        loss = loss_fn(model, batches.local(k, whole, 0))
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return model.state_dict(), losses
