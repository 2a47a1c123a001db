"""What each spawned rank runs in the DeepSpeed-style tests: DeepSpeed's loop, on poplar.initialize."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import poplar
from tests.helpers.models import lm_loss, make_batches, make_model


def dataset(n_steps: int, global_batch: int) -> TensorDataset:
    batches = make_batches(n_steps, global_batch)
    return TensorDataset(torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches]))


def run(engine, batches, stop_at: int | None = None, overflow_from: float = float("inf"), scales=None) -> None:
    """DeepSpeed's loop, as its users write it (returning after optimizer step ``stop_at``). fp16: a micro-batch
    run at a loss scale of ``overflow_from`` or more is made to overflow; ``scales`` collects each one's scale."""
    for tokens, targets in batches:
        logits = engine(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        if scales is not None:
            scales.append(engine.cur_scale)
        engine.backward(loss * (float("inf") if engine.cur_scale >= overflow_from else 1.0))
        before = engine.global_steps
        engine.step()
        if engine.global_steps != before and engine.global_steps == stop_at:
            return


def train(rank, world_size, cases, cluster, n_steps, save_at=None, load=None, out=None, overflow_from=float("inf")):
    """Each (plan, config) case in turn; with ``save_at``/``load``, a checkpoint written or resumed under ``out``."""
    from tests.integrations import printed

    results = []
    for plan, config in cases:   # no plan: planned from the cluster, the model profiled with lm_loss on its data
        plan = poplar.Plan.from_dict(plan) if plan is not None else None
        model = make_model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        with printed(rank) as shown:
            engine, _, loader, _ = poplar.initialize(model=model, optimizer=opt, config=config, plan=plan,
                                                     training_data=dataset(n_steps, config["train_batch_size"]),
                                                     cluster=cluster, loss=lm_loss if plan is None else None)
        client = engine.load_checkpoint(load)[1] if load is not None else None
        batches = iter(loader)      # one pass over the data, however it is cut by a checkpoint
        scales = []
        if save_at is not None:
            run(engine, batches, stop_at=save_at, overflow_from=overflow_from, scales=scales)
            engine.save_checkpoint(out, client_state={"saved_at": save_at})
        run(engine, batches, overflow_from=overflow_from, scales=scales)
        state = engine.runtime.engine.full_state_dict()
        with torch.no_grad():    # evaluation: a forward outside any step (ZeRO-3 gathers as it goes)
            logits = engine(dataset(1, 2).tensors[0])
        results.append({"state": state if rank == 0 else None, "steps": engine.global_steps,
                        "plan": engine.runtime.plan.to_dict(), "cache": _cache_files(),
                        "loss": engine.last_loss, "client": client, "logits": logits, "scales": scales,
                        "skipped": engine.skipped_steps, "printed": shown.getvalue()})
        engine.close()
    return results


def planned_here(rank, world_size, cache: str, config: dict):
    """No plan given: the config's poplar section names the cluster and the workload, and the ranks plan."""
    import os

    from poplar.models.workload import Workload

    os.environ["POPLAR_CACHE_DIR"] = cache
    wl = Workload(model="tiny")
    model = wl.build(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, _, loader, _ = poplar.initialize(model, opt, config=config, training_data=TensorDataset(*wl.random_batch(32)))
    run(engine, iter(loader))
    out = {"plan": engine.runtime.plan.to_dict(), "steps": engine.global_steps}
    engine.close()
    return out


def _cache_files() -> dict:
    """The profile cache's files and their modification times (a profile measured again rewrites its file)."""
    import os
    from pathlib import Path

    root = Path(os.environ.get("POPLAR_CACHE_DIR", "/nonexistent"))
    return {str(p): p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()}


def config_alone(rank, world_size, cases, n_steps, refused=()):
    """DeepSpeed's call with a config and nothing else (no plan, no cluster, no optimizer: the config's), as
    DeepSpeed's users write it, for each ``(config, global batch)`` in turn; before them, each config of
    ``refused``: its one-line refusal (None if it was taken) and the seconds it took."""
    import time

    from tests.integrations import printed

    out = {"refused": [], "runs": []}
    for config in refused:
        start, model = time.monotonic(), make_model()
        try:
            poplar.initialize(model=model, model_parameters=model.parameters(), training_data=dataset(n_steps, 6),
                              config=config)
            out["refused"].append((None, time.monotonic() - start))
        except ValueError as e:
            out["refused"].append((str(e), time.monotonic() - start))
    for config, global_batch in cases:
        model = make_model()
        with printed(rank) as shown:
            engine, _, loader, _ = poplar.initialize(model=model, model_parameters=model.parameters(),
                                                     training_data=dataset(n_steps, global_batch), config=config)
        run(engine, iter(loader))
        split = (engine.train_batch_size(), engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps())
        state = engine.runtime.engine.full_state_dict()
        out["runs"].append({"state": state if rank == 0 else None, "steps": engine.global_steps, "split": split,
                            "plan": engine.runtime.plan.to_dict(), "printed": shown.getvalue()})
        engine.close()
    return out
