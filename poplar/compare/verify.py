"""`poplar verify`: heterogeneous ZeRO training on local CPU processes, checked against one device.

Three ranks stand in for three different GPUs: each gets its own micro-batch size and,
in stages 0-1, its own number of accumulation steps. For every ZeRO stage the demo
trains a small causal LM on a learnable token stream and compares the parameters with
single-process training on the same global batches.
"""

from __future__ import annotations

import contextlib
import functools
import time

import torch

import poplar
from poplar.data.synthetic import bigram_batches
from poplar.engine import initialize
from poplar.processes.spawn import spawn
from poplar.models import TinyCausalLM, causal_lm_loss

MODEL = dict(vocab_size=128, d_model=64, n_layers=2, n_heads=4, max_seq_len=32)
OPTIMIZER = functools.partial(torch.optim.AdamW, lr=3e-3, weight_decay=0.01)
# One plan per stage for 3 ranks; every global batch is 12 sequences of 32 tokens.
DEMO_PLANS = [
    poplar.Plan(0, [4, 2, 1], [1, 2, 4]),
    poplar.Plan(1, [6, 3, 1], [1, 1, 3]),
    poplar.Plan(2, [6, 4, 2], [1, 1, 1]),
    poplar.Plan(3, [6, 4, 2], [1, 1, 1]),
]


def make_model(seed: int = 0) -> TinyCausalLM:
    torch.manual_seed(seed)
    return TinyCausalLM(**MODEL)


def train_rank(rank: int, world_size: int, plan: poplar.Plan, steps: int) -> dict:
    """What every rank runs: the engine on this rank's slice of each global batch."""
    engine = initialize(make_model(), OPTIMIZER, plan)
    lo, hi = plan.sample_range(rank)
    batches = bigram_batches(steps, plan.global_batch_size, seq_len=MODEL["max_seq_len"],
                             vocab_size=MODEL["vocab_size"])
    losses, times = [], []
    for inputs, targets in batches:
        start = time.perf_counter()
        losses.append(engine.train_batch((inputs[lo:hi], targets[lo:hi]), causal_lm_loss))
        times.append(time.perf_counter() - start)
    state = engine.full_state_dict()
    memory = engine.memory_report()
    engine.close()
    return {"losses": losses, "step_s": sorted(times)[len(times) // 2], "memory": memory,
            "state": state if rank == 0 else None}


def train_reference(plan: poplar.Plan, steps: int) -> dict[str, torch.Tensor]:
    model = make_model()
    opt = OPTIMIZER(model.parameters())
    for batch in bigram_batches(steps, plan.global_batch_size, seq_len=MODEL["max_seq_len"],
                                vocab_size=MODEL["vocab_size"]):
        causal_lm_loss(model, batch).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def _demo_all(rank: int, world_size: int, plans: list[poplar.Plan], steps: int) -> list[dict]:
    return [train_rank(rank, world_size, plan, steps) for plan in plans]


def run_verify(steps: int = 10, console=None) -> list[dict]:
    """Every stage's plan trained on 3 ranks and on one device: a row a stage (its plan, rank 0's losses and
    median step time, the largest difference from one device's parameters, the most state bytes a rank holds).
    ``console`` (a rich console): where it says what it trains, and shows the wait."""
    if console is not None:
        console.print(f"[bold]Poplar demo[/]: {DEMO_PLANS[0].world_size} CPU ranks over gloo, a "
                      f"{sum(p.numel() for p in make_model().parameters()):,}-parameter causal LM, "
                      f"{steps} AdamW steps per ZeRO stage, global batch {DEMO_PLANS[0].global_batch_size}")
    with console.status("training on 3 processes ...") if console is not None else contextlib.nullcontext():
        ranks = spawn(_demo_all, DEMO_PLANS[0].world_size, DEMO_PLANS, steps, timeout_s=600)
    rows = []
    for i, plan in enumerate(DEMO_PLANS):
        res = ranks[0][i]
        ref = train_reference(plan, steps)
        err = max((res["state"][k] - v).abs().max().item() for k, v in ref.items())
        mem = max(r[i]["memory"]["total"] for r in ranks)
        rows.append({"plan": plan.to_dict(), "losses": res["losses"], "max_param_error": err, "state_bytes": mem,
                     "step_s": res["step_s"]})
    return rows
