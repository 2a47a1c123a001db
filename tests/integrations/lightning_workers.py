"""Functions run inside spawned ranks for the Lightning tests (importable by the child processes)."""

from __future__ import annotations

import functools
import os
import warnings
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import poplar
from poplar.integrations.lightning.strategy import PoplarStrategy
from tests.integrations import one_device_batches
from tests.helpers.models import lm_loss, make_model

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = str(ROOT / "examples" / "cluster-3.yaml")
N_SAMPLES, GLOBAL_BATCH, N_STEPS, SEED = 23, 10, 4, 3   # two steps an epoch (3 samples left out), two epochs
# eps=1e-6 as in tests/engine/test_equivalence.py: summation-order rounding stays below the tolerance
OPTIMIZER = functools.partial(torch.optim.AdamW, lr=1e-3, weight_decay=0.01, eps=1e-6)
QUIET = dict(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
             enable_model_summary=False, num_sanity_val_steps=0)


def schedule(step: int) -> float:
    return 1.0 / (1.0 + step)


class LitTiny(pl.LightningModule):
    """TinyLM whose training_step returns the mean LM loss of whatever batch it is given; a stepped scheduler."""

    def __init__(self, groups: bool = False):
        super().__init__()
        self.net = make_model()
        self.groups = groups

    def training_step(self, batch, batch_idx):
        return lm_loss(self.net, batch)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", lm_loss(self.net, batch), sync_dist=True)

    def configure_optimizers(self):
        if self.groups:   # two groups with different weight decay: refused
            params = list(self.parameters())
            return torch.optim.AdamW([{"params": params[:1], "weight_decay": 0.0}, {"params": params[1:]}], lr=1e-3)
        opt = OPTIMIZER(self.parameters())
        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def dataset(n: int = N_SAMPLES, seed: int = 1) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randint(0, 37, (n, 6), generator=g), torch.randint(0, 37, (n, 6), generator=g))


def val_set() -> TensorDataset:
    """Six samples in batches of 2: the epoch's mean of batch means is the mean over all six."""
    return dataset(6, seed=2)


def global_batches(n_steps: int = N_STEPS, global_batch: int = GLOBAL_BATCH) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global batches every run must train on, in order (one rank taking them whole)."""
    return one_device_batches(dataset().tensors, N_SAMPLES, global_batch, SEED, n_steps)


# the checkpoints a saving run writes: after epoch 0's last step, at its end, and in the middle of epoch 1
LAST_STEP, EPOCH_END, MID_EPOCH = "last-step=2.ckpt", "epoch=0-step=2.ckpt", "epoch=1-step=3.ckpt"


class Record(pl.Callback):
    """Each step's loss as Lightning saw it, each validation's (step, loss); with ``save_to``, checkpoints there
    after epoch 0's last step, at its end (where ModelCheckpoint saves without validation) and after step 3."""

    def __init__(self, save_to: str | None = None):
        self.losses, self.val, self.save_to = [], [], save_to

    def on_validation_end(self, trainer, pl_module):
        self.val.append((trainer.global_step, float(trainer.callback_metrics["val_loss"])))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))
        if self.save_to and trainer.global_step in (2, 3):
            trainer.save_checkpoint(os.path.join(self.save_to, LAST_STEP if trainer.global_step == 2 else MID_EPOCH))

    def on_train_epoch_end(self, trainer, pl_module):
        if self.save_to and trainer.current_epoch == 0:
            trainer.save_checkpoint(os.path.join(self.save_to, EPOCH_END))


def fit(plan: poplar.Plan, cluster: str, clip=None, save_to=None, ckpt=None, validate=False) -> dict:
    """``N_STEPS`` steps (from ``ckpt``, when given); the model's final state (rank 0), the losses, the steps."""
    lit, record = LitTiny(), Record(save_to)
    strategy = PoplarStrategy(plan=plan, cluster=cluster, seed=SEED)
    trainer = pl.Trainer(strategy=strategy, max_steps=N_STEPS, gradient_clip_val=clip, callbacks=[record], **QUIET)
    val = DataLoader(val_set(), batch_size=2) if validate else None
    trainer.fit(lit, DataLoader(dataset(), batch_size=4, shuffle=True), val, ckpt_path=ckpt)
    rank = torch.distributed.get_rank()
    samplers = [type(dl.batch_sampler).__name__ for dl in trainer.fit_loop._combined_loader.flattened]
    return {"state": {k: v.clone() for k, v in lit.state_dict().items()} if rank == 0 else None,
            "losses": record.losses, "val": record.val, "steps": trainer.global_step,
            "timed_steps": len(strategy.runtime.steps_s), "samplers": samplers}


def smaller_world(keep: int) -> bool:
    """The first ``keep`` ranks become a new default process group (a job resumed on fewer machines: a fresh
    group, devices and strategy; the checkpoint read from disk); the others leave. Whether this rank stays.

    One spawn for both worlds: each spawn's ranks import Lightning, which takes longer than their training.
    """
    rank = dist.get_rank()
    dist.barrier()
    dist.destroy_process_group()
    if rank >= keep:
        return False
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=120))   # the launcher's store, which outlives the ranks
    dist.init_process_group("gloo", store=dist.PrefixStore(f"world-of-{keep}", store), rank=rank, world_size=keep,
                            timeout=timedelta(seconds=120))
    os.environ["WORLD_SIZE"] = os.environ["LOCAL_WORLD_SIZE"] = str(keep)
    return True


def refused_optimizer(plan: poplar.Plan, cluster: str) -> str | None:
    """Two parameter groups with different hyperparameters: the one-line refusal (None if it trained)."""
    trainer = pl.Trainer(strategy=PoplarStrategy(plan=plan, cluster=cluster), max_steps=1, **QUIET)
    try:
        trainer.fit(LitTiny(groups=True), DataLoader(dataset()))
    except ValueError as e:
        return str(e)
    return None


def lightning_runs(rank, world_size, cases, ckpt_dir, two_ranks, two_ranks_clip):
    """Every (plan dict, clip, save, validate) case one after another on 3 emulated ranks (cluster-3.yaml); then
    the saving case's checkpoints resumed on 2 ranks of another cluster (both-differ) with the plan ``two_ranks``."""
    warnings.filterwarnings("ignore")
    runs = [fit(poplar.Plan.from_dict(plan), CLUSTER, clip, ckpt_dir if save else None, validate=validate)
            for plan, clip, save, validate in cases]
    if not smaller_world(2):
        return {"runs": runs, "resumed": None}
    plan = poplar.Plan.from_dict(two_ranks)
    resumed = {"refused": refused_optimizer(plan, "both-differ")}
    for name in (LAST_STEP, EPOCH_END, MID_EPOCH):
        resumed[name] = fit(plan, "both-differ", two_ranks_clip, ckpt=os.path.join(ckpt_dir, name))
    return {"runs": runs, "resumed": resumed}


def fit_twice_from_cluster(rank, world_size, cluster: str) -> list[dict]:
    """Two fits planned from the cluster alone (LitTiny itself profiled on its loader's samples), one after the
    other: each one's final state (rank 0), losses, plan, and whether it profiled (the cache's files changed)."""
    from tests.integrations import printed
    from tests.integrations import profile_cache_files as cache_files

    warnings.filterwarnings("ignore")
    runs = []
    for _ in range(2):
        before = cache_files()
        lit, record = LitTiny(), Record()
        strategy = PoplarStrategy(cluster=cluster, global_batch=GLOBAL_BATCH, stages=(1,), seed=SEED)
        trainer = pl.Trainer(strategy=strategy, max_steps=N_STEPS, callbacks=[record], **QUIET)
        with printed(rank) as out:
            trainer.fit(lit, DataLoader(dataset(), batch_size=4, shuffle=True))
        runs.append({"state": {k: v.clone() for k, v in lit.state_dict().items()} if rank == 0 else None,
                     "losses": record.losses, "plan": strategy.plan.to_dict(), "profiled": cache_files() != before,
                     "printed": out.getvalue()})
    return runs


def fit_even(rank: int, stages, batch_size: int, accumulate: int) -> dict:
    """``PoplarStrategy(stages=...)`` with no plan and no cluster: the loader's ``batch_size`` and
    ``accumulate_grad_batches`` on every rank; the final state (rank 0), losses, plan, what rank 0 printed, and the
    Trainer's ``accumulate_grad_batches`` after fit (the user's own, given back)."""
    from tests.integrations import printed

    lit, record = LitTiny(), Record()
    strategy = PoplarStrategy(stages=stages, seed=SEED)
    trainer = pl.Trainer(strategy=strategy, max_steps=N_STEPS, accumulate_grad_batches=accumulate, callbacks=[record],
                         **QUIET)
    with printed(rank) as out:
        trainer.fit(lit, DataLoader(dataset(), batch_size=batch_size, shuffle=True))
    return {"state": {k: v.clone() for k, v in lit.state_dict().items()} if rank == 0 else None,
            "losses": record.losses, "plan": strategy.plan.to_dict(), "steps": trainer.global_step,
            "accumulate": trainer.accumulate_grad_batches, "printed": out.getvalue()}


def even_runs(rank, world_size, two: list, one: list) -> dict:
    """The ``two`` cases ``(stages, batch_size, accumulate_grad_batches)`` on 2 ranks, then ``one`` on rank 0 alone
    (a group of one: ``smaller_world``), each with no plan and no cluster."""
    warnings.filterwarnings("ignore")
    runs = {"two": [fit_even(rank, *case) for case in two]}
    if smaller_world(1):
        runs["one"] = [fit_even(rank, *case) for case in one]
    return runs
