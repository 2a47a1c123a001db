"""A small module of the user's own making planned from an emulated two-card cluster alone, by each front end
(for tests/integrations/test_pace.py and bench/bench_integration_planning.py; importable by spawned ranks).

The model is a 6-17-9-2 MLP classifying random features, the cluster an A800-80GB beside a V100S-32GB (the
paper's both-differ pair) at memory scale 0.01, the global batch 48; nothing fixes the emulated pace.
"""

from __future__ import annotations

import functools
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import poplar
from tests.integrations import one_device_batches

PAIR = str(Path(__file__).resolve().parents[2] / "bench" / "clusters" / "both-differ-0.01.yaml")
GLOBAL_BATCH, N_STEPS, SEED = 48, 3, 3
N_SAMPLES = 2 * GLOBAL_BATCH + 5          # two steps an epoch (five left out): the run crosses an epoch
# eps=1e-6 as in tests/engine/test_equivalence.py: summation-order rounding stays below the tolerance
OPTIMIZER = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.01, eps=1e-6)


def make_mlp(seed: int = 0) -> torch.nn.Sequential:
    """6 features in, 2 classes out, hidden layers of 17 and 9."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 17), torch.nn.Tanh(), torch.nn.Linear(17, 9), torch.nn.Tanh(),
                               torch.nn.Linear(9, 2))


def features(n: int = N_SAMPLES, seed: int = 1) -> TensorDataset:
    """Random features, labelled by the sign of their sum."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return TensorDataset(x, (x.sum(dim=1) > 0).long())


def mlp_loss(model, batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def global_batches(n_steps: int = N_STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global batches every front end trains on, in order: the plan's sampler over the dataset (``SEED``)."""
    return one_device_batches(features().tensors, N_SAMPLES, GLOBAL_BATCH, SEED, n_steps)


def reference(n_steps: int = N_STEPS) -> dict[str, torch.Tensor]:
    """One device, the whole global batches: the parameters every front end must reach."""
    model = make_mlp()
    opt = OPTIMIZER(model.parameters())
    for batch in global_batches(n_steps):
        mlp_loss(model, batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def probes_seen() -> list[dict]:
    """Every emulated device's pace probe in this rank from now on, in the order the devices start: its model's
    class and its largest micro-batch (None, None: a device paced by the host's own probes alone), and the
    dilation this rank chose with it (the cluster takes the largest of its ranks')."""
    import poplar.emulate.dilation as dilation

    seen, choose = [], dilation.choose_dilation

    def recording(device, probe=None):
        d = choose(device, probe)
        seen.append({"model": None if probe is None else type(probe.model).__name__,
                     "most": getattr(probe, "most", None), "dilation": d})
        return d
    dilation.choose_dilation = recording
    return seen


def _result(rank: int, start: float, state, plan, dilation: float, printed: str, probes: list) -> dict:
    return {"state": state if rank == 0 else None, "plan": plan.to_dict(), "wall_s": time.monotonic() - start,
            "dilation": dilation, "printed": printed, "probes": probes}


def lightning_fit(rank: int, world_size: int, cluster: str = PAIR) -> dict:
    """``PoplarStrategy(cluster=..., global_batch=48)`` on a LightningModule: profiled, planned, trained."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from poplar.integrations.lightning.strategy import PoplarStrategy
    from tests.integrations import printed

    class LitMLP(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = make_mlp()

        def training_step(self, batch, batch_idx):
            return mlp_loss(self.net, batch)

        def configure_optimizers(self):
            return OPTIMIZER(self.parameters())

    warnings.filterwarnings("ignore")
    probes, start, lit = probes_seen(), time.monotonic(), LitMLP()
    strategy = PoplarStrategy(cluster=cluster, global_batch=GLOBAL_BATCH, seed=SEED)
    trainer = pl.Trainer(strategy=strategy, max_steps=N_STEPS, accelerator="cpu", logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0)
    with printed(rank) as out:
        trainer.fit(lit, DataLoader(features(), batch_size=8, shuffle=True))
    state = {k.removeprefix("net."): v.clone() for k, v in lit.state_dict().items()}
    return _result(rank, start, state, strategy.plan, strategy.runtime.device.dilation, out.getvalue(), probes)


class _Sample(torch.utils.data.Dataset):
    """The features as the Hugging Face Trainer takes them: one dict a sample (``x``, ``labels``)."""

    def __init__(self):
        self.x, self.y = features().tensors

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


class _MLPWithLoss(torch.nn.Module):
    """The MLP as a Hugging Face model is called: keywords in, its loss in the output."""

    def __init__(self):
        super().__init__()
        self.net = make_mlp()

    def forward(self, x, labels):
        return {"loss": F.cross_entropy(self.net(x), labels)}


def hf_fit(rank: int, world_size: int, out: str, cluster: str = PAIR) -> dict:
    """``PoplarTrainer(cluster=...)``: the model given profiled on its dataset, planned, trained."""
    from transformers import TrainingArguments

    from poplar.integrations.hf.trainer import PoplarTrainer
    from tests.integrations import printed

    warnings.filterwarnings("ignore")
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=GLOBAL_BATCH // world_size,
                             max_steps=N_STEPS, optim="adamw_torch", learning_rate=1e-2, weight_decay=0.01,
                             adam_epsilon=1e-6, lr_scheduler_type="constant", max_grad_norm=0.0, report_to="none",
                             disable_tqdm=True, save_strategy="no", use_cpu=True, dataloader_pin_memory=False,
                             log_level="error", log_level_replica="error", seed=SEED)
    probes, start = probes_seen(), time.monotonic()
    with printed(rank) as shown:
        trainer = PoplarTrainer(model=_MLPWithLoss(), args=args, train_dataset=_Sample(), cluster=cluster)
        trainer.train()
    state = {k.removeprefix("net."): v for k, v in trainer.runtime.engine.full_state_dict().items()}
    dilation = trainer.runtime.device.dilation
    trainer.close()
    return _result(rank, start, state, trainer.plan, dilation, shown.getvalue(), probes)


def deepspeed_fit(rank: int, world_size: int, cluster: str = PAIR) -> dict:
    """``poplar.initialize(model, optimizer, config, training_data, loss=...)`` with a cluster: planned, trained."""
    from tests.integrations import printed

    warnings.filterwarnings("ignore")
    probes, start, model = probes_seen(), time.monotonic(), make_mlp()
    config = {"train_batch_size": GLOBAL_BATCH, "poplar": {"cluster": cluster, "seed": SEED}}
    with printed(rank) as shown:
        engine, _, loader, _ = poplar.initialize(model, OPTIMIZER(model.parameters()), config=config,
                                                 training_data=features(), loss=mlp_loss)
        epoch = 0
        while engine.global_steps < N_STEPS:      # DeepSpeed's loop, an epoch at a time
            loader.batch_sampler.set_epoch(epoch)
            for x, y in loader:
                engine.backward(F.cross_entropy(engine(x), y))
                engine.step()
                if engine.global_steps == N_STEPS:
                    break
            epoch += 1
    state = engine.runtime.engine.full_state_dict()
    dilation = engine.runtime.device.dilation
    plan = engine.runtime.plan
    engine.close()
    return _result(rank, start, state, plan, dilation, shown.getvalue(), probes)

