"""Functions run inside spawned ranks for tests/integrations/test_replan.py: each front end trains a preset
planned on a cluster, re-planning or not, and returns what it ended with."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import poplar
from poplar.models.workload import Workload

WL = dict(model="llama-tiny", seq_len=128, vocab_size=512)
GLOBAL_BATCH, STEPS = 16, 7
EAGER = {"patience": 1, "every": 1}     # a re-plan as soon as one step measures off its prediction


def workload() -> Workload:
    return Workload(**WL)


def samples() -> tuple[torch.Tensor, torch.Tensor]:
    """One epoch of ``STEPS`` global batches."""
    return workload().random_batch(GLOBAL_BATCH * STEPS, seed=1)


def lm_loss(out, targets) -> torch.Tensor:
    return F.cross_entropy(out.logits.flatten(0, 1).float(), targets.flatten())


def _result(runtime) -> dict:
    state = runtime.engine.full_state_dict()    # every rank gathers
    return {"state": state if torch.distributed.get_rank() == 0 else None,
            "replans": [r.record() for r in runtime.replans], "plan": runtime.plan.to_dict(),
            "steps": runtime.engine.global_steps}


def _ds_engine(cluster: str, stage: int, replan):
    """``poplar.initialize`` as a DeepSpeed user calls it: the re-planning settings in the config's poplar section."""
    config = {"train_batch_size": GLOBAL_BATCH, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "poplar": {"replan": replan}}
    engine, _, loader, _ = poplar.initialize(model=workload().build(seed=0), config=config,
                                             training_data=TensorDataset(*samples()), cluster=cluster,
                                             workload=workload())
    return engine, loader


def _ds_steps(engine, batches, stop_at: int | None = None) -> None:
    """DeepSpeed's loop over ``batches`` (returning after optimizer step ``stop_at``)."""
    for tokens, targets in batches:
        engine.backward(lm_loss(engine(tokens), targets))
        engine.step()
        if engine.global_steps == stop_at:
            return


def deepspeed(rank, world_size, cluster: str, stage: int, replan, out: str) -> dict:
    """A run that saves after step 5 (after its re-plan, where it re-plans) and trains to its end; then, where it
    re-plans, a new run resumed from that checkpoint: its result and the plan it holds once it has loaded."""
    engine, loader = _ds_engine(cluster, stage, replan)
    batches = iter(loader)
    _ds_steps(engine, batches, stop_at=5)
    engine.save_checkpoint(out)
    _ds_steps(engine, batches)
    whole = _result(engine.runtime)
    engine.close()
    if replan == "off":
        return whole
    engine, loader = _ds_engine(cluster, stage, replan)
    engine.load_checkpoint(out)
    loaded = engine.runtime.plan.to_dict()
    _ds_steps(engine, loader)
    whole["resumed"], whole["loaded"] = _result(engine.runtime), loaded
    engine.close()
    return whole


def lightning(rank, world_size, cluster: str, stage: int, replan, out: str) -> dict:
    import lightning.pytorch as pl

    from poplar.integrations.lightning.strategy import PoplarStrategy

    class Lit(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = workload().build(seed=0)

        def training_step(self, batch, batch_idx):
            tokens, targets = batch
            return lm_loss(self.net(tokens), targets)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    strategy = PoplarStrategy(cluster=cluster, workload=workload(), global_batch=GLOBAL_BATCH, stages=(stage,),
                              shuffle=False, replan=replan)
    trainer = pl.Trainer(strategy=strategy, max_steps=STEPS, accelerator="cpu", logger=False, default_root_dir=out,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Lit(), DataLoader(TensorDataset(*samples()), batch_size=GLOBAL_BATCH // world_size))
    return _result(strategy.runtime)


def hf(rank, world_size, cluster: str, stage: int, replan, out: str) -> dict:
    from transformers import TrainingArguments

    from poplar.integrations.hf.trainer import PoplarTrainer

    tokens, _ = samples()
    data = [{"input_ids": row, "labels": row} for row in tokens]
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=GLOBAL_BATCH // world_size, max_steps=STEPS,
                             learning_rate=1e-3, max_grad_norm=0.0, report_to="none", disable_tqdm=True,
                             save_strategy="no", use_cpu=True, dataloader_pin_memory=False, log_level="error",
                             log_level_replica="error", train_sampling_strategy="sequential")
    trainer = PoplarTrainer(model=workload().build(seed=0), args=args, train_dataset=data, cluster=cluster,
                            workload=workload(), stages=(stage,), replan=replan)
    trainer.train()
    result = _result(trainer.runtime)
    trainer.close()
    return result


def both(rank, world_size, front: str, cluster: str, stage: int, out: str) -> list[dict]:
    """The front end re-planning eagerly, then with re-planning off: one spawn (the ranks import it once); each
    run's folder under ``out``."""
    fn = {"deepspeed": deepspeed, "lightning": lightning, "hf": hf}[front]
    return [fn(rank, world_size, cluster, stage, replan, f"{out}/{i}") for i, replan in enumerate((EAGER, "off"))]
