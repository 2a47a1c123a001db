"""One rank's training, top to bottom: :func:`train_rank` (its device, its :class:`Trainer`, the loop).

``__init__`` builds the engine and the components the loop holds; ``train_step`` is one
optimizer step; ``train`` is the loop. Everything else is a component with one job:

- :class:`~poplar.train.checkpointer.Checkpointer`: resume, and save when due;
- :class:`~poplar.train.metrics.StepLog`: every step's figures, gathered, logged, printed (rank 0's records go to
  :class:`~poplar.train.reporters.Reporters`: ``log.jsonl``, TensorBoard, W&B);
- :class:`~poplar.train.evaluation.Evaluator`: the loss of the evaluation data, every rank its share, when due;
- :class:`~poplar.runtime.recovery.StepRecovery`: a rank out of memory mid-step, recovered;
- :class:`~poplar.runtime.replanner.Replanner`: the steps held to the plan's prediction, a better plan taken (one
  on other ranks: the run stops after this step's checkpoint, its launcher starts them, :mod:`poplar.train.relaunch`);
- :class:`~poplar.runtime.preemption.Preemption`: SIGTERM, a checkpoint and a clean exit;
- :class:`~poplar.runtime.watchdog.Watchdog`: a dead rank stops every rank, with one line;
- :class:`~poplar.train.faults.FaultInjector`: a fault armed by a test (``POPLAR_FAULT``).

Components that follow the steps (``on_step_start(step)``, ``on_step_end(step)``, steps
counted from 1) are in ``self.callbacks``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from poplar.engine.collectives import Comm
from poplar.models.source import build_for_rank
from poplar.train.checkpointer import Checkpointer
from poplar.train.description import Run
from poplar.train.evaluation import evaluator_for
from poplar.train.faults import FaultInjector
from poplar.train.metrics import StepLog, flops_per_token, peak_tflops
from poplar.runtime.preemption import Preemption
from poplar.runtime.rank import RankRuntime
from poplar.runtime.recovery import StepRecovery
from poplar.train.reporters import Reporters
from poplar.runtime.replanner import replanner_for
from poplar.train.run_dir import keep_log_before, write_plan
from poplar.runtime.watchdog import Watchdog, lost_peer, store_address


def train_rank(rank: int, world_size: int, run: Run, return_state: bool = False) -> dict:
    """One rank of ``run``: its device (the launch's), its :class:`Trainer`, the loop; rank 0's figures, its full
    parameters where asked (not where the run is to go on on other ranks: ``relaunch``), and the plan it ended with
    (re-planned, or lowered where a rank ran out of memory)."""
    with run.launch.device(rank, run.model, run.cluster, run.config.engine.mixed_precision) as device:
        trainer = Trainer(run, device, rank)
        out = trainer.train()
        state = trainer.engine.full_state_dict() if return_state and out["relaunch"] is None else None
        plan = trainer.engine.plan
        trainer.close()
    return {**out, "state": state if rank == 0 else None, "plan": plan}


class Trainer:
    """Trains ``run`` on this rank's ``device`` (the process group is joined already): its model with its plan on
    its data, planning again from its basis (None: the plan is kept) as the steps measure."""

    def __init__(self, run: Run, device, rank: int):
        cfg, plan, wl, world_size = run.config, run.plan, run.model, run.world_size
        self.cfg, self.wl, self.device, self.rank, self.world_size = cfg, wl, device, rank, world_size
        self.schedule = cfg.schedule     # the learning rate of each step
        self.batches = run.data.batches
        model, weights = build_for_rank(wl, cfg.seed, device.torch_device)   # read into the shards where it can
        optimizer = lambda params: torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)  # noqa: E731
        self.runtime = RankRuntime(device, model, optimizer, plan, cfg.engine, weights=weights)   # as integrations
        self.engine = self.runtime.engine
        self.comm = Comm()   # the loop's own small collectives (SIGTERM agreed, figures gathered): unpaced
        self.faults = FaultInjector.for_rank(run.device_rank(rank))
        self.callbacks = [self.faults.attach(model, device)] if self.faults else []
        self.checkpointer = Checkpointer(cfg.checkpointing, self.engine, wl, world_size,
                                         on_shard_written=self.faults.on_shard_written if self.faults else None)
        self.start = self.step = self.checkpointer.resume(rank)
        self.last = min(cfg.steps, cfg.stop_at or cfg.steps)
        self.recovery = StepRecovery(rank, self.engine, self._plan_lowered)
        self.preemption = Preemption(self.comm, self.engine.device)
        self.watchdog = (Watchdog(rank, world_size, dead_after_s=cfg.dead_rank_timeout_s,
                                  where=lambda: self.checkpointer.where(self.step))
                         if world_size > 1 and store_address() is not None else None)
        if rank == 0 and cfg.resume:
            keep_log_before(Path(cfg.out) / "log.jsonl", self.start)
        self.log = StepLog(cfg.logging, rank, device, self.comm, plan.global_batch_size,
                           flops_per_token(wl, cfg.engine),
                           peak_tflops(device, cfg.engine.mixed_precision, cfg.peak_tflops),
                           sink=Reporters(Path(cfg.out), cfg.report_to, run.record(), self.start)
                           if rank == 0 else None)
        self.evaluator = evaluator_for(run.data.eval_samples, cfg.eval_every, self.engine, wl.loss, self.comm,
                                       self.last)
        self.replanner = replanner_for(cfg.replan, run.basis, self.engine.plan, world_size, cfg.baseline,
                                       restage=True, who="relaunch" if run.whole is not None else "said")
        self.losses: list[float] = []
        self.preempted: int | None = None
        self.moving = None     # a re-plan onto other ranks: the run stops after this step for its launcher

    def train_step(self, step: int) -> float:
        """Optimizer step ``step`` (from 0) on this rank's slice of the global batch; the global mean loss."""
        for group in self.engine.optimizer.param_groups:
            group["lr"] = self.schedule.at(step)

        def attempt() -> float:
            local = self.batches.local(step, self.engine.plan, self.rank)
            return self.runtime.train_batch(local, self.wl.loss)   # waits for the other ranks included
        return self.recovery.run(step, attempt)

    def train(self) -> dict:
        """Steps from the checkpoint resumed (or 0) to the last; what rank 0's caller reports."""
        if self.watchdog is not None:
            self.watchdog.start()
        failed = True
        try:
            with self.preemption:
                self.comm.barrier()                     # the ranks start together
                for step in range(self.start, self.last):
                    if self._one_step(step):
                        break
            failed = False
        except BaseException as e:
            if self.watchdog is not None:
                self.watchdog.fail(str(e).splitlines()[0] if str(e) else type(e).__name__, lost_peer=lost_peer(e))
            raise
        finally:
            self.log.close(failed)
        return {"losses": self.losses, "start": self.start, "preempted": self.preempted, "relaunch": self._moving()}

    def _moving(self) -> dict | None:
        """Where the run goes on (a re-plan onto other ranks, not preempted): the ``step`` its checkpoint ends, the
        profile ``ranks``, the ``plan`` and the ranks' ``speeds``; None: it ends here."""
        if self.moving is None or self.preempted:
            return None
        return {"step": self.step + 1, "ranks": self.moving.ranks, "plan": self.moving.after,
                "speeds": self.moving.after_speeds}

    def _one_step(self, step: int) -> bool:
        """Step ``step`` with what surrounds it; True when the run stops here (preempted, or to go on on other
        ranks: its checkpoint written)."""
        self.step = step
        for c in self.callbacks:
            c.on_step_start(step + 1)
        skipped = self.engine.skipped_steps
        self.log.step_started()
        loss = self.train_step(step)
        self.losses.append(loss)
        self._figures(step, loss, self.engine.skipped_steps > skipped)
        for c in self.callbacks:
            c.on_step_end(step + 1)
        stop = self.preemption.agreed()
        self.checkpointer.step_done(step + 1, self.last, stopping=stop or self.moving is not None)
        if not stop and self.evaluator is not None and self.evaluator.due(step):
            self.log.write_eval(step, self.evaluator.evaluate())
        if stop:
            self.preempted = step + 1
            if self.rank == 0:
                print(f"poplar: preempted (SIGTERM) after step {step + 1}: checkpoint {self.checkpointer.root}/step-"
                      f"{step + 1:08d} written; continue with `poplar train --resume --out {self.cfg.out}`",
                      flush=True)
        return stop or self.moving is not None

    def _figures(self, step: int, loss: float, skipped: bool) -> None:
        """The step's figures gathered (where logged, or held to the plan's prediction), logged; a re-plan taken."""
        due = self.log.due(step, step == self.last - 1, skipped)
        if not due and self.replanner is None:
            return
        figures = self.log.gather(self.engine.last_grad_norm)
        change = (self.replanner.observe(step + 1, figures)
                  if self.replanner is not None and step + 1 < self.last else None)   # none after the last step
        said = None if self.replanner is None else (self.replanner.stopped or self.replanner.notice())
        if said and self.rank == 0:
            print(f"poplar: {said}", flush=True)
        if self.replanner is not None and self.replanner.stopped:
            self.replanner = None
        if due or change is not None:
            self.log.write(step, loss, figures, skipped, replan=None if change is None else change.record(),
                           loss_scale=self.engine.loss_scale if self.engine.config.mixed_precision == "fp16" else None)
        if change is None:
            return
        if change.ranks is not None:    # other ranks: this step's checkpoint, then the launcher starts them
            self.moving = change
        else:
            self.runtime.change_plan(change.after, Path(self.cfg.out) / "restage")   # another stage: a checkpoint
            self.checkpointer.plan_changed(change.after, step + 2)
        if self.rank == 0:
            print(change.line(), flush=True)
            write_plan(Path(self.cfg.out), change.after)

    def _plan_lowered(self, plan, notice: dict) -> None:
        """A rank ran out of memory: its micro-batch is lowered (every rank alike) and the step runs again; the
        profile's memory was wrong for it, so the plan is not searched again on it."""
        self.checkpointer.plan_changed(plan, notice["step"])
        self.replanner = None
        if self.rank == 0:
            print(f"poplar: rank {notice['rank']} ran out of memory in step {notice['step']} with micro-batches of "
                  f"{notice['micro_batch']} ({notice['error']}); its micro-batches are lowered to "
                  f"{plan.micro_batch_sizes[notice['rank']]}, the plan is now {plan}; the step runs again",
                  flush=True)
            write_plan(Path(self.cfg.out), plan)

    def close(self) -> None:
        """Remove the engine's and the components' hooks; tell the watch this rank is done."""
        if self.faults is not None:
            self.faults.close()
        self.runtime.close()
        if self.watchdog is not None:
            self.watchdog.finished()
