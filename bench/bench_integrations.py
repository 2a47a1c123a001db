#!/usr/bin/env python
"""Throughput through each integration against `poplar train`, on one plan and one emulated cluster.

Every system trains the same model (a :class:`poplar.models.workload.Workload` preset, same
seed) with the same plan on the same emulated cluster, at one fixed time dilation:

    poplar-train   `poplar train --plan` (poplar.train.run.run_training), the reference
    deepspeed      DeepSpeed's loop on poplar.initialize(config=ds_config)
    lightning      Trainer(strategy=PoplarStrategy(...)).fit
    hf             PoplarTrainer(...).train()

A system's figure is the one `poplar train` logs: the global batch over the median step
time on the device clock (each step as long as its slowest rank), warm-up steps left
out. Beside it, what the framework costs this host between steps (its loop, its hooks,
its data loader: wall time outside the engine's steps, per step, the slowest rank) and
the overruns (spans whose real work ran past the declared time). The integrations are
launched one after another, never side by side.

    python bench/bench_integrations.py                      # both-differ, llama-tiny, 12 steps
    python bench/bench_integrations.py --cluster examples/cluster-3.yaml --systems poplar-train,lightning
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import poplar  # noqa: E402
from poplar.processes.spawn import spawn  # noqa: E402
from poplar.models.workload import Workload  # noqa: E402

LR = 1e-3


def _dataset(wl: Workload, n: int):
    from torch.utils.data import TensorDataset

    return TensorDataset(*wl.random_batch(n, seed=1))


def _figures(runtime, overruns_before: int = 0) -> dict:
    walls = runtime.step_walls
    between = [b[0] - a[1] for a, b in zip(walls, walls[1:])]
    return {"steps_s": list(runtime.steps_s), "between_s": between,
            "overruns": runtime.device.overruns - overruns_before}


def deepspeed_rank(rank, world_size, wl_dict, plan_dict, cluster, steps) -> dict:
    wl, plan = Workload(**wl_dict), poplar.Plan.from_dict(plan_dict)
    model = wl.build(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    config = {"train_batch_size": plan.global_batch_size, "gradient_clipping": 1.0,
              "zero_optimization": {"stage": plan.zero_stage}}
    engine, _, loader, _ = poplar.initialize(model=model, optimizer=opt, config=config, plan=plan, cluster=cluster,
                                             training_data=_dataset(wl, steps * plan.global_batch_size))
    for batch in loader:
        engine.backward(wl.loss(engine, batch))
        engine.step()
    out = _figures(engine.runtime)
    engine.close()
    return out


def lightning_rank(rank, world_size, wl_dict, plan_dict, cluster, steps) -> dict:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from poplar.integrations.lightning.strategy import PoplarStrategy

    wl, plan = Workload(**wl_dict), poplar.Plan.from_dict(plan_dict)

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = wl.build(seed=0)

        def training_step(self, batch, batch_idx):
            return wl.loss(self.model, batch)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.01)

    strategy = PoplarStrategy(plan=plan, cluster=cluster)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", max_steps=steps, gradient_clip_val=1.0, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Module(), DataLoader(_dataset(wl, steps * plan.global_batch_size)))
    return _figures(strategy.runtime)


def hf_rank(rank, world_size, wl_dict, plan_dict, cluster, steps) -> dict:
    from transformers import TrainingArguments

    from poplar.integrations.hf.trainer import PoplarTrainer

    wl, plan = Workload(**wl_dict), poplar.Plan.from_dict(plan_dict)
    if plan.global_batch_size % world_size:
        raise ValueError(f"the Trainer's arguments write a global batch as a multiple of the {world_size} ranks; "
                         f"plan {plan.global_batch_size} samples is not one")
    tokens, _ = wl.random_batch(steps * plan.global_batch_size, seed=1)
    data = [{"input_ids": row, "labels": row} for row in tokens]     # the model shifts the labels itself
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=plan.global_batch_size // world_size,
                             max_steps=steps, learning_rate=LR, weight_decay=0.01, max_grad_norm=1.0,
                             optim="adamw_torch",     # torch's AdamW as the others step (its default: the fused one)
                             lr_scheduler_type="constant", save_strategy="no", logging_steps=steps, report_to="none",
                             disable_tqdm=True, use_cpu=True, dataloader_pin_memory=False)
    trainer = PoplarTrainer(model=wl.build(seed=0), args=args, train_dataset=data, plan=plan, cluster=cluster)
    trainer.train()
    out = _figures(trainer.runtime)
    trainer.end()
    return out


SYSTEMS = {"deepspeed": deepspeed_rank, "lightning": lightning_rank, "hf": hf_rank}


def poplar_train(wl: Workload, plan_path: Path, cluster: str, steps: int, out: Path) -> dict:
    from poplar.train.config import load_config
    from poplar.train.report import read_log
    from poplar.train.run import run_training

    cfg = load_config(None, {"model": wl.model, "seq_len": wl.seq_len, "vocab_size": wl.vocab_size,
                             "global_batch": poplar.Plan.load(plan_path).global_batch_size, "steps": steps,
                             "lr": LR, "cluster": cluster, "plan": str(plan_path), "out": str(out)})
    run_training(cfg)
    records = read_log(out / "log.jsonl")
    return {"steps_s": [r["step_s"] for r in records], "overruns": sum(r["overruns"] for r in records)}


def summarise(name: str, ranks: list[dict], global_batch: int, warmup: int) -> dict:
    """Each step as long as its slowest rank; the median over the steps after the warm-up."""
    steps = [max(r["steps_s"][i] for r in ranks) for i in range(len(ranks[0]["steps_s"]))][warmup:]
    step_s = statistics.median(steps)
    between = [statistics.median(r["between_s"][warmup:]) for r in ranks if r.get("between_s")]
    return {"system": name, "steps": len(steps), "step_s": step_s, "samples_per_s": global_batch / step_s,
            "between_ms": 1000 * max(between) if between else None,
            "overruns": sum(r["overruns"] for r in ranks)}


def make_plan(wl: Workload, cluster: str, global_batch: int, out: Path) -> Path:
    """Poplar's plan of ``global_batch`` on ``cluster`` (profiled, or read from the profile cache)."""
    from poplar.cluster.spec import load_cluster
    from poplar.train.config import load_config
    from poplar.train.planning import plan_on

    cfg = load_config(None, {"model": wl.model, "seq_len": wl.seq_len, "vocab_size": wl.vocab_size,
                             "global_batch": global_batch, "cluster": cluster})
    plan, _ = plan_on(cfg, wl, load_cluster(cluster), distributed=False)
    plan.save(out)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cluster", default="both-differ", help="a cluster preset or YAML file (emulated)")
    p.add_argument("--model", default="llama-tiny")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--vocab-size", type=int, default=1024, help="as `poplar train` tokenizes its text")
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--plan", help="a plan.json to train with (default: Poplar's plan, profiled or cached)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the median")
    p.add_argument("--dilation", type=float, default=10.0, help="wall seconds per device second, every system")
    p.add_argument("--systems", default="poplar-train," + ",".join(SYSTEMS))
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args()
    os.environ["POPLAR_DILATION"] = str(args.dilation)
    wl = Workload(model=args.model, seq_len=args.seq_len, vocab_size=args.vocab_size)
    work = Path(tempfile.mkdtemp(prefix="bench-integrations-"))
    plan_path = Path(args.plan) if args.plan else make_plan(wl, args.cluster, args.global_batch, work / "plan.json")
    plan = poplar.Plan.load(plan_path)
    print(f"{args.cluster}, {wl.model} (seq {wl.seq_len}), {plan}, dilation {args.dilation}", flush=True)
    rows = []
    for name in args.systems.split(","):
        if name == "poplar-train":
            ranks = [poplar_train(wl, plan_path, args.cluster, args.steps, work / "train")]
        else:
            ranks = spawn(SYSTEMS[name], plan.world_size, wl.model_dump(), plan.to_dict(), args.cluster, args.steps,
                          timeout_s=1800)
        rows.append(summarise(name, ranks, plan.global_batch_size, args.warmup))
        print(json.dumps(rows[-1]), flush=True)
    report(rows)
    if args.json:
        Path(args.json).write_text(json.dumps({"plan": plan.to_dict(), "cluster": args.cluster, "rows": rows}, indent=2))


def report(rows: list[dict]) -> None:
    base = next((r for r in rows if r["system"] == "poplar-train"), None)
    print(f"\n{'system':<14}{'samples/s':>11}{'vs poplar train':>17}{'host ms between steps':>23}{'overruns':>10}")
    for r in rows:
        ratio = f"{r['samples_per_s'] / base['samples_per_s']:.3f}" if base else "-"
        between = f"{r['between_ms']:.1f}" if r["between_ms"] is not None else "-"
        print(f"{r['system']:<14}{r['samples_per_s']:>11,.1f}{ratio:>17}{between:>23}{r['overruns']:>10}")


if __name__ == "__main__":
    main()
