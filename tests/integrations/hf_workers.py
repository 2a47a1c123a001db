"""Functions for tests/integrations/test_hf.py, importable by spawned ranks, and the data and model they share
with the single-device reference."""

from __future__ import annotations

import torch

SEQ_LEN, VOCAB = 16, 128
GLOBAL_BATCH = 12
SAMPLES = 2 * GLOBAL_BATCH + 3          # two steps an epoch (three left over): runs cross an epoch
STEPS = 4
HYPER = dict(learning_rate=2e-3, adam_epsilon=1e-6, seed=0)


def build_model(seed: int = 0):
    """A very small Llama (hidden 32, two layers), the same on every rank and in the reference."""
    from poplar.models.hf import build_hf_model

    return build_hf_model("llama-tiny", VOCAB, seed=seed, hidden_size=32, intermediate_size=64)


def token_samples(n: int = SAMPLES, seed: int = 1) -> list[dict]:
    """Random token rows whose labels end in padding (-100) of random length: the token count differs by sample."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n, SEQ_LEN), generator=g)
    keep = torch.randint(SEQ_LEN // 3, SEQ_LEN + 1, (n,), generator=g)
    labels = ids.masked_fill(torch.arange(SEQ_LEN)[None, :] >= keep[:, None], -100)
    return [{"input_ids": ids[i], "labels": labels[i]} for i in range(n)]


def training_args(out: str, world_size: int, *, steps: int = STEPS, clip: float = 0.0, weight_decay: float = 0.0,
                  save_steps: int | None = None, accum: int = 1, fp16: bool = False):
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=out, per_device_train_batch_size=GLOBAL_BATCH // (world_size * accum),
        gradient_accumulation_steps=accum, max_steps=steps, optim="adamw_torch", lr_scheduler_type="linear",
        max_grad_norm=clip, weight_decay=weight_decay, logging_steps=1, report_to="none", disable_tqdm=True,
        save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500, use_cpu=True,
        dataloader_pin_memory=False, log_level="error", log_level_replica="error", fp16=fp16, **HYPER)


def train(rank: int, world_size: int, plan: dict | None, out: str, cluster: str | None, resume: str | None = None,
          engine_config: dict | None = None, stages=(0, 1, 2, 3), **kw) -> dict:
    """One PoplarTrainer run; rank 0 returns the final full weights, the logged (loss, grad_norm), step times, the
    engine's precision and loss scale, the plan and what it printed as the Trainer was made."""
    from poplar.integrations.hf.trainer import PoplarTrainer
    from tests.integrations import printed

    with printed(rank) as shown:
        trainer = PoplarTrainer(model=build_model(), args=training_args(out, world_size, **kw),
                                train_dataset=token_samples(), plan=plan, cluster=cluster, engine_config=engine_config,
                                stages=stages)
    trainer.train(resume_from_checkpoint=resume)
    state = trainer.runtime.engine.full_state_dict()
    logs = [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "grad_norm" in h]
    steps_s = list(trainer.runtime.steps_s)
    engine = trainer.runtime.engine
    precision = (engine.config.mixed_precision, engine.loss_scale)
    trainer.close()
    return {"state": state, "logs": logs, "steps_s": steps_s, "precision": precision, "plan": trainer.plan.to_dict(),
            "printed": shown.getvalue()} if rank == 0 else {}


def train_cases(rank: int, world_size: int, cases: list[tuple[dict, dict]], out: str, cluster: str) -> list[dict]:
    """Several runs one after another in the same ranks (one spawn): ``(plan, training keywords)`` each."""
    return [train(rank, world_size, plan, f"{out}/case-{i}", cluster, **kw) for i, (plan, kw) in enumerate(cases)]


def train_twice(rank: int, world_size: int, out: str, cluster: str) -> list[dict]:
    """Two runs planned from the cluster alone (the model and data profiled), one after the other: each one's
    result, whether it profiled (the cache's files changed) and its plan."""
    from tests.integrations import printed
    from tests.integrations import profile_cache_files as cache_files

    runs = []
    for i in range(2):
        before = cache_files()
        from poplar.integrations.hf.trainer import PoplarTrainer

        with printed(rank) as shown:    # the Trainer plans as it is made
            trainer = PoplarTrainer(model=build_model(), args=training_args(f"{out}/run-{i}", world_size),
                                    train_dataset=token_samples(), cluster=cluster, stages=(1,))
        plan = trainer.plan.to_dict()
        trainer.train()
        state = trainer.runtime.engine.full_state_dict()
        logs = [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "grad_norm" in h]
        trainer.close()
        runs.append({"state": state, "logs": logs, "plan": plan, "profiled": cache_files() != before,
                     "printed": shown.getvalue()})
    return runs if rank == 0 else []
