"""A LightningModule trained by Poplar on an emulated cluster of unlike GPUs: ``PoplarStrategy``.

    POPLAR_DILATION=3 python examples/integrations/lightning_train.py

Lightning's script launcher starts one process per device of ``examples/cluster-3.yaml`` (an
A100-80GB beside two T4-16GB, emulated on this CPU); each rank takes its own share of every
global batch of 17 samples, as the plan says (10, 4 and 3 samples; the A100 in two
micro-batches), and the update equals one device's on the whole batch. ``training_step`` is
plain Lightning. Under torchrun (``torchrun --standalone --nproc-per-node 3
examples/integrations/lightning_train.py``) the ranks join torchrun's group instead. ``--plan plan.json``
(from ``poplar plan``) trains with another plan; ``POPLAR_DILATION`` fixes the emulated
devices' pace (left out, each device measures this host first).

The same with ``Trainer(strategy="poplar")``: ``POPLAR_PLAN=plan.json
POPLAR_CLUSTER=examples/cluster-3.yaml`` in the environment.
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.utils.data import DataLoader, TensorDataset

import poplar
from poplar.data.synthetic import bigram_batches
from poplar.integrations.lightning import PoplarStrategy
from poplar.models.workload import Workload

CLUSTER = Path(__file__).resolve().parents[1] / "cluster-3.yaml"
PLAN = poplar.Plan.from_local_batches(1, [10, 4, 3], [2, 1, 1])   # ZeRO-1: 17 samples, the A100 the most


class TinyLM(pl.LightningModule):
    """Poplar's tiny causal LM (two blocks) as a LightningModule; nothing in it knows of Poplar."""

    def __init__(self, lr: float = 3e-3):
        super().__init__()
        self.workload = Workload(model="tiny")
        self.model = self.workload.build(seed=0)
        self.lr = lr

    def training_step(self, batch, batch_idx):
        loss = self.workload.loss(self.model, batch)
        self.log("micro_loss", loss)   # each micro-batch's; Lightning's "loss" is the global batch's
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 5))   # warm-up
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class PrintLoss(pl.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step % 5 == 0 or trainer.global_step == trainer.max_steps:
            rank_zero_info(f"step {trainer.global_step:3d}  loss {float(outputs['loss']):.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--plan", help="a plan.json (default: a ZeRO-1 plan of 17 samples for cluster-3.yaml)")
    ap.add_argument("--cluster", default=str(CLUSTER), help="a cluster file or preset")
    args = ap.parse_args()
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    torch.set_num_threads(1)

    plan = poplar.Plan.load(args.plan) if args.plan else PLAN
    wl = Workload(model="tiny")
    batches = bigram_batches(args.steps, plan.global_batch_size, seq_len=wl.seq_len, vocab_size=wl.vocab_size)
    data = TensorDataset(torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches]))

    strategy = PoplarStrategy(plan=plan, cluster=args.cluster, shuffle=True, seed=0)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", max_steps=args.steps, callbacks=[PrintLoss()],
                         logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.fit(TinyLM(), DataLoader(data, batch_size=8))   # batch_size is the plan's business: not used

    steps = strategy.runtime.steps_s[1:] or strategy.runtime.steps_s
    rank_zero_info(f"plan: {strategy.plan}")
    rank_zero_info(f"{trainer.global_step} steps; a step took {sum(steps) / len(steps):.3f} s on the emulated "
                   f"devices' clock (first step left out)")


if __name__ == "__main__":
    main()
