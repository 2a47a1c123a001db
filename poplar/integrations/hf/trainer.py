"""Poplar inside the Hugging Face Trainer: :class:`PoplarTrainer`.

``PoplarTrainer`` is a ``transformers.Trainer`` that trains with a :class:`~poplar.Plan`:
every rank its own micro-batch size and accumulation count, and each optimizer step exactly
the single device's on the whole global batch. Users write ``TrainingArguments`` as usual;
the global batch is ``per_device_train_batch_size x world size x gradient_accumulation_steps``
and the plan decides how the ranks split it (with no plan and no cluster, every rank takes
``gradient_accumulation_steps`` micro-batches of ``per_device_train_batch_size``, as the Trainer
does with DDP; one line on rank 0 says so)::

    # torchrun --standalone --nproc-per-node 3 train.py
    plan = poplar.Plan(zero_stage=1, micro_batch_sizes=[4, 1, 2], accum_steps=[1, 4, 2])   # 12 samples
    args = TrainingArguments(output_dir="out", per_device_train_batch_size=4, max_steps=100)
    trainer = PoplarTrainer(model=model, args=args, train_dataset=dataset, plan=plan)
    trainer.train()

What changes from the plain Trainer, and why:

- data: the train loader gives each rank its plan slice of every global batch
  (:class:`~poplar.integrations.sampler.PlanBatchSampler`: the same global batches on any world
  size), and the Trainer runs one batch per optimizer step (the plan accumulates);
- the step: :meth:`PoplarTrainer.training_step` runs the whole optimizer step in the engine.
  A loss the model normalises by ``num_items_in_batch`` (a causal LM's mean over label
  tokens) is normalised by the global batch's count, all-reduced once per step, so the
  gradient is the single device's. The Trainer's own clipping and ``optimizer.step()`` do
  nothing (``max_grad_norm`` is the engine's exact global clip); its LR scheduler drives the
  engine's learning rate;
- accelerate does not wrap the model in DDP: the engine does the data parallelism;
- checkpoints: each ``checkpoint-N`` folder holds Poplar's sharded state under ``poplar/``
  beside the Trainer's own files, and ``resume_from_checkpoint`` continues exactly on any
  world size and plan;
- ``save_model()`` gathers the full weights from the shards: call it on every rank (as the
  Trainer asks in distributed runs anyway); the result loads with ``from_pretrained``;
- :attr:`PoplarTrainer.runtime` (after training starts, until :meth:`PoplarTrainer.close`): the
  :class:`~poplar.integrations.session.Session`, whose ``steps_s`` times every step on the rank's (possibly
  emulated) device.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import torch
from transformers import Trainer, TrainingArguments

from poplar.engine.batch import batch_size
from poplar.engine.config import EngineConfig
from poplar.integrations.batch_settings import HF, BatchSettings
from poplar.integrations.sampler import PlanBatchSampler
from poplar.integrations.hf.parts import EngineOptimizer, PlanLoader, global_batch_of, one_group_optimizer, poplar_args
from poplar.integrations.session import Session, resolve_planning
from poplar.runtime.plans import load_plan
from poplar.runtime.replan_settings import replan_config

__all__ = ["PoplarTrainer", "POPLAR_DIR"]

POPLAR_DIR = "poplar"            # where a Trainer checkpoint folder keeps Poplar's sharded state
SCHEDULER_FILE = "scheduler.pt"  # the Trainer's own name for its scheduler's state


class PoplarTrainer(Trainer):
    """A ``transformers.Trainer`` whose every optimizer step is Poplar's engine on the plan.

    ``plan``: a :class:`~poplar.Plan`, its dict or a ``plan.json``; or leave it out and give
    ``cluster`` (a cluster file or preset) to have one planned for the global batch (neither: the
    arguments' even split, in the lowest of ``stages``, as the Trainer splits it with DDP): the
    model given profiled on samples of ``train_dataset`` collated by the Trainer's collator
    (cached: a second run reads the profile), or the preset named by ``workload``
    (``stages``: the ZeRO stages to consider). ``cluster`` also
    gives each rank its emulated device, which paces and memory-checks its steps.
    ``engine_config``: further :class:`~poplar.engine.config.EngineConfig` options (clipping
    and precision come from ``TrainingArguments``: ``max_grad_norm``, ``bf16``). Everything
    else is the Trainer's.
    """

    def __init__(self, model=None, args: TrainingArguments | None = None, *trainer_args, plan=None, cluster=None,
                 workload=None, stages=(0, 1, 2, 3), engine_config: EngineConfig | dict | None = None,
                 replan=None, **trainer_kwargs):
        if "WORLD_SIZE" in os.environ:   # launched (torchrun): Poplar's group, with its timeout, before accelerate's
            from poplar.engine.dist import init_distributed

            init_distributed()
        args = args if args is not None else TrainingArguments(output_dir="tmp_trainer", report_to="none")
        global_batch = global_batch_of(args)
        yours = plan is None and cluster is not None and workload is None   # profile the model and data given
        if yours and trainer_kwargs.get("train_dataset") is None and len(trainer_args) < 2:
            raise ValueError("planning from a cluster profiles your model on samples of train_dataset: give "
                             "train_dataset (or a plan)")
        self.replan, self.basis = replan_config(replan), None
        if not yours:
            self.plan, self.basis = _plan_for(args, global_batch, plan, cluster, workload, stages, engine_config,
                                              model)
        self.cluster, self.engine_config = cluster, engine_config
        self._profiled = workload if plan is None else None   # planned from it: its step paces the ranks
        self.runtime: Session | None = None     # built with the optimizer, when training starts
        self._sampler: PlanBatchSampler | None = None    # the train loader's, which the runtime's re-plans reach
        super().__init__(model, poplar_args(args), *trainer_args, **trainer_kwargs)
        if yours:   # the Trainer's collator and column removal exist only now
            from poplar.integrations.module_source import ModuleSource, output_loss

            source = self._profiled = ModuleSource(self.model, output_loss, *self._train_samples())
            self.plan, self.basis = _plan_for(args, global_batch, None, cluster, source, stages, engine_config,
                                              self.model)

    # ------------------------------------------------------------------ data
    def get_train_dataloader(self) -> PlanLoader:
        """This rank's plan slice of every global batch, after the Trainer's column removal and collator."""
        dataset, collate = self._train_samples()
        sampler = PlanBatchSampler(len(dataset), self.plan, self.args.process_index, shuffle=self._shuffle,
                                   seed=self._data_seed)
        self._sampler = sampler
        if self.runtime is not None:
            self.runtime.follow(sampler)     # a re-plan reaches the batches cut from here on
        workers = self.args.dataloader_num_workers
        extra = (dict(persistent_workers=self.args.dataloader_persistent_workers,
                      prefetch_factor=self.args.dataloader_prefetch_factor) if workers > 0 else {})
        return PlanLoader(dataset, batch_sampler=sampler, collate_fn=collate, num_workers=workers,
                          pin_memory=self.args.dataloader_pin_memory and torch.cuda.is_available(), **extra)

    def _train_samples(self):
        """The training dataset after the Trainer's column removal, and its collator: what every batch is made of."""
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        dataset, collate = self.train_dataset, self.data_collator
        if _is_hf_dataset(dataset):
            dataset = self._remove_unused_columns(dataset, description="training")
        else:
            collate = self._get_collator_with_removed_columns(collate, description="training")
        if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__"):
            raise TypeError(f"{type(dataset).__name__} is not a map-style dataset (len and indexing): Poplar gives "
                            "each rank its samples by index; wrap an iterable dataset in a list or a Dataset")
        return dataset, collate

    def get_total_train_batch_size(self, args) -> int:
        return self.plan.global_batch_size

    @property
    def _shuffle(self) -> bool:
        strategy = self.args.train_sampling_strategy
        return str(getattr(strategy, "value", strategy)) != "sequential"

    @property
    def _data_seed(self) -> int:
        return self.args.data_seed if self.args.data_seed is not None else self.args.seed

    # ------------------------------------------------------------------ engine
    def create_optimizer(self, model=None) -> torch.optim.Optimizer:
        """Build the engine (and the rank's device) with the optimizer; the Trainer gets its stand-in.

        A user's optimizer (``optimizers=(opt, sched)``) is kept, rebound to the engine's flat
        parameters; otherwise ``TrainingArguments``' optimizer on one parameter group.
        """
        if self.runtime is not None and self.runtime.engine.model is not self.model:
            self.close()     # model_init made a new model (a hyperparameter trial): it gets its own engine
        if self.runtime is None:
            optimizer = self.optimizer if self.optimizer is not None else one_group_optimizer(self)
            self.model._is_accelerate_prepared = True    # accelerate must not wrap it: the engine is the DDP
            self.runtime = Session(self.model, optimizer, self.plan, self._engine_config(), cluster=self.cluster,
                                   basis=self.basis, replan=self.replan, workload=self._profiled,
                                   scratch=Path(self.args.output_dir) / "poplar-restage")
            if self._sampler is not None:
                self.runtime.follow(self._sampler)
            self.optimizer = EngineOptimizer(self.runtime.engine)
        return self.optimizer

    def _engine_config(self) -> EngineConfig:
        clip = self.args.max_grad_norm
        given = self.engine_config
        config = EngineConfig(**given) if isinstance(given, dict) else (given or EngineConfig())
        return config.model_copy(update={"clip_grad_norm": clip if clip and clip > 0 else None,
                                         "mixed_precision": "bf16" if self.args.bf16 else
                                         "fp16" if self.args.fp16 else config.mixed_precision})

    def training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        """One whole optimizer step of the engine on this rank's slice; the global batch's mean loss.

        ``num_items_in_batch`` (the Trainer's count of this rank's label tokens) is summed over
        the ranks, so every micro-batch's loss is its tokens' sum over the global batch's tokens.
        """
        runtime = self._require_runtime()
        engine = runtime.engine
        model.train()
        batch = dict(inputs) if isinstance(inputs, Mapping) else inputs
        skipped = engine.skipped_steps
        with runtime.step():
            tokens = self._global_count(num_items_in_batch)
            loss = engine.train_batch(batch, self._micro_loss(tokens))
        self.optimizer.step_was_skipped = engine.skipped_steps > skipped
        return torch.tensor(loss, device=self.args.device)

    def _global_count(self, local):
        """The global batch's label tokens (None where the loss takes no count): one all-reduce."""
        if local is None:
            return None
        engine = self.runtime.engine
        count = torch.as_tensor(local).detach().double().round().to(device=engine.device, dtype=torch.int64).reshape(())
        engine.comm.all_reduce(count)
        return count

    def _micro_loss(self, tokens):
        """The engine's ``loss_fn``: it weights each micro-batch's return by micro samples / global samples."""
        global_samples = self.plan.global_batch_size
        token_sum = tokens is not None and self._loss_takes_count()

        def loss_fn(model, micro):
            with self.compute_loss_context_manager():
                loss = self.compute_loss(model, micro, num_items_in_batch=tokens)
            # a token sum over the global count already carries its weight: undo the engine's
            return loss * (global_samples / batch_size(micro)) if token_sum else loss
        return loss_fn

    def _loss_takes_count(self) -> bool:
        """Whether ``compute_loss`` divides by ``num_items_in_batch`` (as the Trainer decides it, and
        ``loss_is_scaled_for_ga`` overrides) rather than returning each micro-batch's mean."""
        said = getattr(self, "loss_is_scaled_for_ga", None)
        return said if said is not None else bool(self.model_accepts_loss_kwargs or self.compute_loss_func)

    def _clip_grad_norm(self, model):
        """The engine clipped (exactly, globally) inside the step: the norm it measured."""
        return self._get_grad_norm(model)

    def _get_grad_norm(self, model, grad_norm=None):
        return self._require_runtime().engine.last_grad_norm

    def _require_runtime(self) -> Session:
        if self.runtime is None:
            raise RuntimeError("PoplarTrainer has no engine yet (it is built when train() starts) or it was closed")
        return self.runtime

    # ------------------------------------------------------------------ checkpoints
    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """The model's full weights (gathered from the shards on every rank), saved as the Trainer saves them."""
        if state_dict is None and self.runtime is not None:
            state_dict = self.runtime.engine.full_state_dict()
        super()._save(output_dir, state_dict=state_dict)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Every rank: Poplar's sharded state into ``output_dir/poplar``; the scheduler as the Trainer saves it."""
        self._require_runtime().save(Path(output_dir) / POPLAR_DIR, self._checkpoint_meta())
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_FILE))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """Only checked here: the weights come back with the optimizer, once the engine exists."""
        if not (Path(resume_from_checkpoint) / POPLAR_DIR).is_dir():
            raise ValueError(f"{resume_from_checkpoint} holds no Poplar state ({POPLAR_DIR}/ is missing): resume "
                             "from a checkpoint PoplarTrainer saved")

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """Every rank: weights and optimizer state from ``checkpoint/poplar`` (any world size, plan and stage)."""
        if checkpoint is None:
            return
        runtime = self._require_runtime()
        runtime.load(Path(checkpoint) / POPLAR_DIR, self._checkpoint_meta())
        runtime.schedule.skip = self._skipped_on_resume(checkpoint)
        scheduler = os.path.join(checkpoint, SCHEDULER_FILE)
        if os.path.isfile(scheduler):
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))

    def _skipped_on_resume(self, checkpoint: str) -> int:
        """The batches the Trainer cuts and drops unseen as it resumes mid-epoch (it skips by iterating the
        loader): none of them is trained, so none is queued for the runtime."""
        state = Path(checkpoint) / "trainer_state.json"
        if self.args.ignore_data_skip or self._sampler is None or not state.is_file():
            return 0
        import json

        return int(json.loads(state.read_text()).get("global_step", 0)) % self._sampler.steps_per_epoch

    def _checkpoint_meta(self) -> dict:
        """What a resumed run must share with the one that saved, for the same global batches."""
        return {"integration": "hf", "global_batch": self.plan.global_batch_size,
                "samples": len(self.train_dataset), "data_seed": self._data_seed, "shuffle": self._shuffle}

    # ------------------------------------------------------------------ the end
    def close(self) -> None:
        """Take the engine's hooks off the model (every rank); after it, no training or saving."""
        if self.runtime is not None:
            self.runtime.close()
            self.runtime = None

    def end(self):
        self.close()
        return super().end()


def _plan_for(args, global_batch: int, plan, cluster, workload, stages, engine_config, model=None):
    """The plan, checked against the launched world and the arguments' global batch (one line each); with no plan
    and no cluster, ``per_device_train_batch_size`` in ``gradient_accumulation_steps`` micro-batches on every rank."""
    world = args.world_size
    if plan is not None:
        plan = load_plan(plan)
        plan.check_world_size(world)
        if plan.global_batch_size != global_batch:
            raise ValueError(
                f"the plan splits {plan.global_batch_size} samples per step, the TrainingArguments give "
                f"{global_batch} (per_device_train_batch_size {args.per_device_train_batch_size} x {world} ranks x "
                f"gradient_accumulation_steps {args.gradient_accumulation_steps}): make them agree")
    elif cluster is not None and workload is not None:
        from poplar.engine.dist import init_distributed

        init_distributed()      # profiling the cluster is collective
    config = EngineConfig(**engine_config) if isinstance(engine_config, dict) else engine_config
    even = BatchSettings(None, args.per_device_train_batch_size, args.gradient_accumulation_steps, HF)
    return resolve_planning(world, plan, cluster=cluster, workload=workload, global_batch=global_batch,
                            stages=stages, config=config, model=model if isinstance(model, torch.nn.Module) else None,
                            batch=even)


def _is_hf_dataset(dataset) -> bool:
    try:
        import datasets
    except ImportError:
        return False
    return isinstance(dataset, datasets.Dataset)
