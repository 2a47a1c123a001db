"""The training data of :class:`~poplar.integrations.lightning.strategy.PoplarStrategy`: each rank's slice of every
global batch, as a ``DataLoader`` Lightning can save and resume mid-epoch; the train loader's ``batch_size``
where it is each rank's (:func:`even_settings`: no plan and no cluster).

Lightning hands the strategy the user's train ``DataLoader``; :func:`plan_train_loader` keeps its
dataset, ``collate_fn`` and worker settings and replaces its sampling with a
:class:`~poplar.integrations.sampler.PlanBatchSampler` (the user's ``shuffle`` and sampler are not
used: the plan's global batch and the strategy's ``shuffle``/``seed`` decide; its ``batch_size`` is
each rank's micro-batch only in the even split).
"""

from __future__ import annotations

from torch.utils.data import DataLoader, IterableDataset

from poplar.integrations.batch_settings import LIGHTNING, BatchSettings
from poplar.integrations.sampler import PlanBatchSampler
from poplar.plan import Plan


class EpochBatchSampler(PlanBatchSampler):
    """A :class:`PlanBatchSampler` as Lightning's loops drive it.

    Its length is always a whole epoch's steps, as Lightning counts a resumed epoch's
    batches on from where it stopped; ``set_epoch`` is reachable as ``.sampler`` (where
    Lightning looks for it); ``consumed`` is the optimizer steps of the epoch taken, which
    the strategy sets after each step (the loader reads ahead, so counting here would
    overcount).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.consumed = 0

    @property
    def sampler(self) -> "EpochBatchSampler":
        return self

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.consumed = 0
        super().set_epoch(epoch)

    def __len__(self) -> int:
        return self.steps_per_epoch


class PlanDataLoader(DataLoader):
    """A ``DataLoader`` over an :class:`EpochBatchSampler` whose state (epoch, steps taken) Lightning keeps
    in its checkpoints, so a run resumed mid-epoch, on any world size, skips the steps already taken."""

    def state_dict(self) -> dict:
        s = self.batch_sampler
        return {"epoch": s.epoch, "consumed": s.consumed, "global_batch": s.plan.global_batch_size}

    def load_state_dict(self, state: dict) -> None:
        s = self.batch_sampler
        if state.get("global_batch") != s.plan.global_batch_size:
            raise ValueError(f"the checkpoint's data were cut into global batches of {state.get('global_batch')} "
                             f"samples, this plan's are {s.plan.global_batch_size}: resume with the same global batch")
        epoch, consumed = int(state["epoch"]), int(state["consumed"])
        if consumed >= s.steps_per_epoch:   # saved at the epoch's end: the next one, from its start
            epoch, consumed = epoch + 1, 0
        s.epoch, s.consumed, s.skip_steps = epoch, consumed, consumed


def plan_train_loader(dataloader, plan: Plan, rank: int, *, shuffle: bool, seed: int) -> PlanDataLoader:
    """``dataloader``'s dataset and settings, batched as ``rank``'s slice of every global batch of ``plan``."""
    if not isinstance(dataloader, DataLoader):
        raise TypeError(f"PoplarStrategy takes the training data from a torch DataLoader over a map-style dataset, "
                        f"got {type(dataloader).__name__}: return a DataLoader from train_dataloader()")
    dataset = dataloader.dataset
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
        raise TypeError(f"{type(dataset).__name__} is not a map-style dataset (len and indexing): Poplar gives each "
                        "rank its samples by index; wrap an iterable dataset in a list or a Dataset")
    sampler = EpochBatchSampler(len(dataset), plan, rank, shuffle=shuffle, seed=seed)
    options = {"num_workers": dataloader.num_workers, "pin_memory": dataloader.pin_memory,
               "timeout": dataloader.timeout, "worker_init_fn": dataloader.worker_init_fn,
               "multiprocessing_context": dataloader.multiprocessing_context, "generator": dataloader.generator,
               "persistent_workers": dataloader.persistent_workers}
    if dataloader.num_workers > 0:
        options["prefetch_factor"] = dataloader.prefetch_factor
    # a loader without automatic batching has a per-sample collate_fn: batches take the default one
    collate_fn = dataloader.collate_fn if dataloader.batch_sampler is not None else None
    return PlanDataLoader(dataset, batch_sampler=sampler, collate_fn=collate_fn, **options)


def train_loader(trainer, why: str) -> DataLoader:
    """The train ``DataLoader`` fit was given (its own, the module's or the datamodule's ``train_dataloader``), before
    the fit loop sets it up; refused in one line unless one torch DataLoader over a map-style dataset (``why``: what
    it is read for, and what to give instead)."""
    # Lightning keeps where the training data come from in the fit loop's source, with no public accessor before
    # the loop sets it up (2.6, pinned)
    loader = trainer.fit_loop._data_source.dataloader()
    if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
        raise TypeError(f"{why}: give one torch DataLoader over a map-style dataset (got {type(loader).__name__})")
    return loader


def loader_batch_size(trainer) -> int:
    """The train loader's ``batch_size`` (or its batch sampler's): each rank's micro-batch in the even split."""
    loader = train_loader(trainer, "with no plan and no cluster each rank takes the train loader's batch_size")
    size = loader.batch_size if loader.batch_size is not None else getattr(loader.batch_sampler, "batch_size", None)
    if not isinstance(size, int) or size < 1:
        raise ValueError("the train DataLoader has no batch_size (a batch_sampler without one): give it batch_size=, "
                         "or a plan or a cluster")
    return size


def even_settings(trainer, global_batch: int | None, accumulation: int,
                  before_setup: bool = False) -> BatchSettings | None:
    """The even split's settings: the train loader's ``batch_size`` on every rank, ``accumulation`` (the Trainer's
    ``accumulate_grad_batches`` as given) and ``global_batch`` where given. ``before_setup``: None unless the loader
    was handed to ``fit`` itself (a module's or datamodule's ``train_dataloader`` waits for their set-up)."""
    if before_setup and trainer.fit_loop._data_source.is_module():
        return None
    return BatchSettings(global_batch, loader_batch_size(trainer), accumulation, LIGHTNING)


def module_source(trainer, module, loss_of) -> tuple:
    """``(source, batch_size)``: the user's module as a :class:`~poplar.integrations.module_source.ModuleSource`
    profiled on samples of its training data, collated as its loader collates them (``loss_of`` reads the loss
    from what ``training_step`` returns), and the loader's ``batch_size``.

    The profiled copy is detached from the trainer (its ``self.log`` calls do nothing).
    """
    import copy

    from torch.utils.data import default_collate

    from poplar.integrations.module_source import ModuleSource

    loader = train_loader(trainer, "planning from a cluster alone profiles your module on its training data (or "
                          "give workload= or a plan)")
    collate = loader.collate_fn if loader.batch_sampler is not None else default_collate
    detached = copy.deepcopy(module, memo={id(trainer): None})
    source = ModuleSource(detached, lambda m, batch: loss_of(m.training_step(batch, 0)), loader.dataset, collate,
                          name=type(module).__name__)
    return source, loader.batch_size
