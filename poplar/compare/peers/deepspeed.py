"""DeepSpeed ZeRO as a measured peer: the uniform plan, trained by DeepSpeed under the same emulated device.

What the issue asks of ``poplar bench``: beside Poplar's plan and the baselines it
computes, the real DeepSpeed, as its users run it on a cluster of different devices:
every rank the same micro-batch (the largest the smallest device holds: the planner's
``uniform`` plan) and the same accumulation, in the ZeRO stage Poplar chose.

How it is run (:class:`DeepSpeedSetup` is the value the parent builds; every rank then
calls ``setup.start(workload, device.comm)`` and steps the :class:`DeepSpeedPeer`):

- ``deepspeed.initialize`` on the rank's already joined gloo group, with a config dict:
  ``zero_optimization.stage`` (all of 0-3 run on CPU over gloo in DeepSpeed 0.19.8),
  ``train_micro_batch_size_per_gpu`` and ``gradient_accumulation_steps`` from the
  uniform plan, fp32 (no fp16/bf16, no clipping), the workload's model with Poplar's
  seed, and a client ``torch.optim.AdamW(lr=1e-4)`` as Poplar's measurement uses
  (``zero_allow_untested_optimizer``). Bucket sizes follow the Hugging Face Trainer's
  ``auto`` values (``hidden_size**2`` elements; ZeRO-3: prefetch ``0.9 * hidden**2``,
  persistence threshold ``10 * hidden``): DeepSpeed's defaults (5e8 elements, a 2 GB
  fp32 bucket) are sized for 80 GB cards and would not fit an emulated device scaled
  to a small model (``hidden_size=None`` keeps DeepSpeed's own: the engine benchmark,
  on the real clock, runs it as its users get it). DeepSpeed's CPU accelerator is
  required (``DS_ACCELERATOR=cpu``);
  its shared-memory all-reduce extension, which serves only inference, is not built
  (that would JIT-compile C++ for a minute on the first start and hold a file lock).
- Time: the caller steps it inside its device's ``step(held)`` as it does Poplar's
  engine, and for as long as the step runs every ``torch.distributed`` collective, and
  the references DeepSpeed's backend caches to all-gather and reduce-scatter, go
  through the rank's ``device.comm`` (:func:`poplar.compare.peers.seams.seam_collectives`):
  on an emulated device DeepSpeed's operators take the modelled GPU's time and its
  collectives the declared network's, exactly as Poplar's.
- Memory: :meth:`DeepSpeedPeer.held_state` gives the device the bytes of every tensor
  DeepSpeed holds for this rank (module parameters and gradients, ZeRO-3's parameter
  shards, and every tensor reachable from its optimizer: flat fp32 partitions, gradient
  buckets and partitions, Adam moments), each storage counted once, at the highest
  level seen so far (gradients and moments exist only after the first step, which is a
  warm-up in ``poplar bench``); the device adds the activations autograd saves.

In ``poplar bench`` DeepSpeed runs in the same launch as Poplar's plans, in the same
alternating rounds (:func:`poplar.compare.measure.measure_plans`), so a drift of the shared host
falls on all of them alike. It is started, and warmed up, before Poplar's engines: a
DeepSpeed that cannot run (an error at start-up, out of memory on a small device) fails
the launch within seconds (:class:`poplar.compare.peers.PeerFailed`). Out of memory, the
benchmark gives it the next smaller micro-batch (:meth:`DeepSpeedSetup.smaller`);
otherwise it measures Poplar's plans again without it, saying why in one line.

>>> setup = DeepSpeedSetup(zero_stage=1, micro_batch_size=12, accum_steps=4, world_size=2, hidden_size=64)
>>> setup.config()["train_batch_size"]
96
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import warnings
from dataclasses import asdict, dataclass, replace

import torch

from poplar.engine.collectives import Comm
from poplar.compare.peers.seams import seam_collectives
from poplar.compare.peers.uniform import UniformSetup
from poplar.plan import Plan
from poplar.models.workload import Workload

INSTALL_HINT = "not installed: pip install 'poplar-zero[bench]'"
LR = 1e-4   # as poplar.compare.measure trains Poplar's plans


def unavailable() -> str | None:
    """Why DeepSpeed cannot be measured here, in one line; None when it can (nothing is imported)."""
    if importlib.util.find_spec("deepspeed") is None:
        return INSTALL_HINT
    return None


@dataclass(frozen=True)
class DeepSpeedSetup(UniformSetup):
    """How DeepSpeed trains: its stage, every rank's micro-batch and accumulation (a picklable value)."""

    hidden_size: int | None   # sizes the communication buckets (the HF Trainer's ``auto``); None: DeepSpeed's own
    lr: float = LR
    seed: int = 0             # the model's initial weights (Workload.build)

    name = "deepspeed"

    @classmethod
    def from_plan(cls, plan: Plan, workload: Workload) -> DeepSpeedSetup:
        """DeepSpeed's version of a uniform ``plan``: its largest micro-batch and its accumulation on every rank.

        Where the plan's ranks differ by a sample (``B mod N`` is not 0), DeepSpeed, which
        cannot, trains ``micro_batch_size * accum_steps`` samples on every rank.
        """
        if len(set(plan.accum_steps)) != 1:
            raise ValueError(f"DeepSpeed runs the same accumulation on every rank; this plan has {plan.accum_steps}")
        config = workload.cache_dict()["config"]
        return cls(zero_stage=plan.zero_stage, micro_batch_size=max(plan.micro_batch_sizes),
                   accum_steps=plan.accum_steps[0], world_size=plan.world_size,
                   hidden_size=int(config.get("hidden_size") or config["d_model"]))

    def config(self) -> dict:
        """The DeepSpeed config dict handed to ``deepspeed.initialize``."""
        h = self.hidden_size
        zero = {"stage": self.zero_stage}
        if h is not None:
            zero.update(reduce_bucket_size=h * h, allgather_bucket_size=h * h)
        if h is not None and self.zero_stage == 3:
            zero.update(stage3_prefetch_bucket_size=int(0.9 * h * h), stage3_param_persistence_threshold=10 * h)
        return {
            "train_batch_size": self.global_batch_size,
            "train_micro_batch_size_per_gpu": self.micro_batch_size,
            "gradient_accumulation_steps": self.accum_steps,
            "zero_optimization": zero,
            "zero_allow_untested_optimizer": True,    # the client torch.optim.AdamW
            "fp16": {"enabled": False},
            "bf16": {"enabled": False},
            "gradient_clipping": 0.0,
            "steps_per_print": 2**31 - 1,
            "wall_clock_breakdown": False,
        }

    def smaller(self) -> DeepSpeedSetup | None:
        """The same samples per rank in the next smaller micro-batch (more accumulation); None below 1."""
        samples = self.micro_batch_size * self.accum_steps
        m = next((m for m in range(self.micro_batch_size - 1, 0, -1) if samples % m == 0), None)
        return None if m is None else replace(self, micro_batch_size=m, accum_steps=samples // m)

    def to_dict(self) -> dict:
        return {**asdict(self), "config": self.config()}

    def start(self, workload: Workload, comm: Comm | None = None) -> DeepSpeedPeer:
        """DeepSpeed on this rank; its collectives go through ``comm`` (give ``device.comm`` to time them)."""
        return DeepSpeedPeer(self, workload, comm)


def _deepspeed():
    """Import DeepSpeed on its CPU accelerator (the emulated devices are CPU ranks)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    name = get_accelerator().device_name()
    if name != "cpu":
        raise RuntimeError(f"DeepSpeed's accelerator here is {name!r}; the emulated devices run on the CPU: "
                           "set DS_ACCELERATOR=cpu before anything imports deepspeed")
    deepspeed.utils.logger.setLevel(logging.WARNING)
    # Its shared-memory all-reduce serves only inference; training goes through torch.distributed.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return deepspeed


class DeepSpeedPeer:
    """DeepSpeed training this rank's share of every global batch."""

    def __init__(self, setup: DeepSpeedSetup, workload: Workload, comm: Comm | None = None):
        deepspeed = _deepspeed()
        self.setup, self.workload = setup, workload
        self.comm = comm if comm is not None else Comm()
        threads = torch.get_num_threads()
        with _quiet():
            deepspeed.init_distributed(dist_backend="gloo")   # adopts the group the rank has joined
            model = workload.build(seed=setup.seed)
            optimizer = torch.optim.AdamW(model.parameters(), lr=setup.lr)
            self.engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=setup.config())
        torch.set_num_threads(threads)   # one torch thread per rank, as the device's clock needs
        from deepspeed.comm import comm as ds_comm

        backend = ds_comm.cdb   # keeps its own references to these two collectives
        self._cached = ((backend, "all_gather_function"), (backend, "reduce_scatter_function"))
        self.state_bytes = 0

    # -- memory -------------------------------------------------------------------------
    def held_tensors(self) -> list[torch.Tensor]:
        """Every tensor DeepSpeed holds for this rank: the module's, and all its optimizer reaches."""
        out: list[torch.Tensor] = []
        for p in self.engine.module.parameters():
            out += [t for t in (p, p.grad, getattr(p, "ds_tensor", None)) if t is not None]
        out += list(self.engine.module.buffers())
        seen: set[int] = set()
        todo = [self.engine.optimizer]
        while todo:
            obj = todo.pop()
            if obj is None or id(obj) in seen:
                continue
            seen.add(id(obj))
            if isinstance(obj, torch.Tensor):
                out.append(obj)
            elif isinstance(obj, dict):
                todo += [*obj.keys(), *obj.values()]
            elif isinstance(obj, (list, tuple, set, frozenset)):
                todo += list(obj)
            elif isinstance(obj, torch.nn.Module):
                continue   # the module's tensors are counted above
            elif isinstance(obj, torch.optim.Optimizer):
                todo += [obj.state, obj.param_groups]
            elif type(obj).__module__.startswith("deepspeed.") and hasattr(obj, "__dict__"):
                todo += list(vars(obj).values())
        return out

    def held_state(self) -> tuple[int, set[int]]:
        """Bytes of the tensors DeepSpeed holds (each storage once, at their highest so far) and their storages."""
        storages: dict[int, int] = {}
        for t in self.held_tensors():
            st = t.untyped_storage()
            if st.nbytes() > 0 and t.device.type != "meta":
                storages[st._cdata] = st.nbytes()
        self.state_bytes = max(self.state_bytes, sum(storages.values()))
        return self.state_bytes, set(storages)

    # -- training -----------------------------------------------------------------------
    def train_batch(self, local_batch: tuple[torch.Tensor, torch.Tensor]) -> float:
        """One optimizer step on this rank's ``(inputs, targets)``; returns this rank's mean loss."""
        micro_batches = self.setup.micro_batches(local_batch)
        a = len(micro_batches)
        total = torch.zeros(())
        with _quiet(), seam_collectives(self.comm, self._cached):
            for i, micro_batch in enumerate(micro_batches):
                loss = self.workload.loss(self.engine, micro_batch)
                self.engine.backward(loss)   # DeepSpeed divides by its accumulation steps itself
                if i < a - 1:
                    self.engine.step()   # bookkeeping only: not at the accumulation boundary
                total += loss.detach()
            self.engine.step()   # the optimizer step
        return float(total) / a

    def close(self) -> None:
        self.engine.destroy()


@contextlib.contextmanager
def _quiet():
    """torch 2.13 deprecates the ``*_tensor`` collectives DeepSpeed calls: a warning per rank and name otherwise."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
        yield
