"""Heterogeneous ZeRO training under torchrun: every rank its own micro-batch.

    torchrun --standalone --nproc-per-node 3 examples/hetero_train.py --zero-stage 1

Rank r gets micro-batch r+1; in stages 0-1 the ranks also run different numbers of
accumulation steps. Rank 0 checks the result against single-device training.
"""

import argparse
import functools

import torch

import poplar
from poplar.data.synthetic import bigram_batches
from poplar.engine.dist import init_distributed, shutdown
from poplar.models import TinyCausalLM, causal_lm_loss


def make_model():
    torch.manual_seed(0)
    return TinyCausalLM(vocab_size=64, d_model=32, n_layers=2, n_heads=2, max_seq_len=16)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--zero-stage", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    ctx = init_distributed(timeout_s=120)
    world = ctx.world_size
    micro = [r + 1 for r in range(world)]
    accum = [world - r for r in range(world)] if args.zero_stage <= 1 else [2] * world
    plan = poplar.Plan(args.zero_stage, micro, accum)
    optimizer = functools.partial(torch.optim.AdamW, lr=1e-3, eps=1e-6)
    engine = poplar.initialize(make_model(), optimizer, plan)
    lo, hi = plan.sample_range(ctx.rank)
    batches = bigram_batches(args.steps, plan.global_batch_size, seq_len=16, vocab_size=64)
    for step, (inputs, targets) in enumerate(batches):
        loss = engine.train_batch((inputs[lo:hi], targets[lo:hi]), causal_lm_loss)
        if ctx.rank == 0:
            print(f"step {step}: loss {loss:.4f}  ({plan})", flush=True)
    state = engine.full_state_dict()
    if ctx.rank == 0:
        model = make_model()
        opt = optimizer(model.parameters())
        for batch in batches:
            causal_lm_loss(model, batch).backward()
            opt.step()
            opt.zero_grad()
        err = max((state[k] - v).abs().max().item() for k, v in model.state_dict().items())
        verdict = "matches" if err < 1e-5 else "DIFFERS FROM"
        print(f"{verdict} single-device training: max |param difference| = {err:.2e}")
    shutdown()


if __name__ == "__main__":
    main()
