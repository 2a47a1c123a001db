"""The training data of :class:`~poplar.integrations.lightning.PoplarStrategy`: each rank's slice of every
global batch, as a ``DataLoader`` Lightning can save and resume mid-epoch.

Lightning hands the strategy the user's train ``DataLoader``; :func:`plan_train_loader` keeps its
dataset, ``collate_fn`` and worker settings and replaces its sampling with a
:class:`~poplar.integrations.data.PlanBatchSampler` (the user's ``batch_size``, ``shuffle`` and
sampler are not used: the plan's global batch and the strategy's ``shuffle``/``seed`` decide).
"""

from __future__ import annotations

from torch.utils.data import DataLoader, IterableDataset

from poplar.integrations.data import PlanBatchSampler
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


def module_source(trainer, module, loss_of) -> tuple:
    """``(source, batch_size)``: the user's module as a :class:`~poplar.integrations.module_source.ModuleSource`
    profiled on samples of its training data, collated as its loader collates them (``loss_of`` reads the loss
    from what ``training_step`` returns), and the loader's ``batch_size``.

    The profiled copy is detached from the trainer (its ``self.log`` calls do nothing).
    """
    import copy

    from torch.utils.data import default_collate

    from poplar.integrations.module_source import ModuleSource

    # Lightning keeps where the training data come from (fit's loader, the module's or the datamodule's
    # train_dataloader) in the fit loop's source, with no public accessor before the loop sets it up (2.6, pinned)
    loader = trainer.fit_loop._data_source.dataloader()
    if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
        raise TypeError("planning from a cluster alone profiles your module on its training data: give one torch "
                        f"DataLoader over a map-style dataset (got {type(loader).__name__}), or workload= or a plan")
    collate = loader.collate_fn if loader.batch_sampler is not None else default_collate
    detached = copy.deepcopy(module, memo={id(trainer): None})
    source = ModuleSource(detached, lambda m, batch: loss_of(m.training_step(batch, 0)), loader.dataset, collate,
                          name=type(module).__name__)
    return source, loader.batch_size
