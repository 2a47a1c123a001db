"""The pieces :class:`~poplar.integrations.hf.trainer.PoplarTrainer` hands the Hugging Face Trainer.

- :func:`poplar_args`: a copy of the user's ``TrainingArguments`` as Poplar runs them (the plan
  accumulates, so the Trainer runs one batch per optimizer step), refused in one line where
  Poplar cannot honour them;
- :class:`EngineOptimizer`: what the Trainer holds as its optimizer: the engine's parameter
  groups (so the Trainer's LR scheduler sets the engine's learning rate), with a ``step`` that
  does nothing, since the engine's update already ran inside the training step;
- :class:`PlanLoader`: a ``DataLoader`` of this rank's plan slices whose ``set_epoch`` reaches
  its :class:`~poplar.integrations.sampler.PlanBatchSampler`;
- :func:`one_group_optimizer`: the optimizer ``TrainingArguments`` name, on one parameter group.
"""

from __future__ import annotations

import copy
import warnings

import torch
from torch.utils.data import DataLoader

SAMPLING = ("random", "sequential")    # the orders PlanBatchSampler draws global batches in


def global_batch_of(args) -> int:
    """Samples per optimizer step as the user wrote ``TrainingArguments``: per device x ranks x accumulation."""
    return args.per_device_train_batch_size * args.world_size * args.gradient_accumulation_steps


def poplar_args(args):
    """A copy of ``args`` with the plan doing the accumulation; one-line errors for what Poplar cannot run."""
    refusals = [
        (args.fp16 and args.bf16, "fp16=True and bf16=True: give one of them"),
        (bool(args.deepspeed) or bool(args.fsdp),
         "deepspeed/fsdp: PoplarTrainer shards the model itself (the plan's ZeRO stage); leave them out"),
        (args.auto_find_batch_size, "auto_find_batch_size: the plan fixes every rank's micro-batch; leave it out"),
        (args.load_best_model_at_end, "load_best_model_at_end is not supported by PoplarTrainer: load the best "
                                      "checkpoint's model.safetensors yourself"),
        (str(getattr(args.train_sampling_strategy, "value", args.train_sampling_strategy)) not in SAMPLING,
         f"train_sampling_strategy={args.train_sampling_strategy!r}: PoplarTrainer draws whole global batches; "
         f"use one of {', '.join(SAMPLING)}"),
        (args.n_gpu > 1, f"{args.n_gpu} GPUs in one process: launch one process per GPU "
                         f"(torchrun --nproc-per-node {args.n_gpu})"),
    ]
    for refused, message in refusals:
        if refused:
            raise ValueError(message)
    args = copy.copy(args)
    args.gradient_accumulation_steps = 1       # one Trainer batch = this rank's whole plan slice
    # Poplar always counts the global batch's tokens itself; HF's DDP rescaling must not apply on top
    args.average_tokens_across_devices = False
    return args


def one_group_optimizer(trainer) -> torch.optim.Optimizer:
    """The optimizer of ``trainer.args.optim`` (or ``optimizer_cls_and_kwargs``) on one parameter group.

    Poplar flattens each unit's parameters together, so every parameter gets the same
    hyperparameters, weight decay included (HF leaves biases and norms out of it).
    """
    from transformers.trainer_optimizer import is_optimizer_factory

    args = trainer.args
    cls, kwargs = trainer.optimizer_cls_and_kwargs or trainer.get_optimizer_cls_and_kwargs(args, trainer.model)
    if is_optimizer_factory(cls) or {"params", "model", "optimizer_dict"} & set(kwargs):
        raise ValueError(f"optim={args.optim}: Poplar builds the optimizer on its own flat parameters, one group; "
                         "choose a torch optimizer such as adamw_torch")
    if args.weight_decay > 0:
        warnings.warn(f"PoplarTrainer: weight_decay={args.weight_decay} applies to every parameter, biases and norms "
                      "too (Poplar keeps one parameter group)", stacklevel=3)
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    return cls([{"params": params, "weight_decay": args.weight_decay}], **kwargs)


class EngineOptimizer(torch.optim.Optimizer):
    """The engine's optimizer as the Trainer sees it: the same parameter groups, a ``step`` that does nothing.

    The engine applies the update (clipped, over its flat shards) inside ``training_step``;
    the Trainer's own ``optimizer.step()`` and ``zero_grad()`` must not act again. Its
    groups are looked up on every access, since loading a checkpoint replaces them.
    Accelerate leaves it as it is (``_is_accelerate_prepared``).
    """

    _is_accelerate_prepared = True

    def __init__(self, engine):   # no Optimizer.__init__: it holds nothing of its own
        self.engine = engine
        self.step_was_skipped = False   # the last step was left out (EngineConfig(on_nonfinite="skip"))

    @property
    def inner(self) -> torch.optim.Optimizer:
        return self.engine.optimizer

    @property
    def param_groups(self):
        return self.inner.param_groups

    @param_groups.setter
    def param_groups(self, groups):
        self.inner.param_groups = groups

    @property
    def state(self):
        return self.inner.state

    @property
    def defaults(self):
        return self.inner.defaults

    def step(self, closure=None):
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None

    def state_dict(self) -> dict:
        """This rank's shard of the state only: checkpoints go through ``Session.save`` instead."""
        return self.inner.state_dict()

    def load_state_dict(self, state_dict) -> None:
        raise RuntimeError("PoplarTrainer restores the optimizer from its own checkpoints: pass "
                           "resume_from_checkpoint= to train()")

    def __repr__(self) -> str:
        return f"EngineOptimizer({self.inner!r})"


class PlanLoader(DataLoader):
    """This rank's plan slice of every global batch; ``set_epoch`` (the Trainer calls it) reshuffles."""

    def set_epoch(self, epoch: int) -> None:
        self.batch_sampler.set_epoch(epoch)
