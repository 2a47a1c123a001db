"""A run's figures per step: gathered from every rank, one JSON line each in ``log.jsonl``, one printed line.

Model FLOPs per token: a training step's (the profile's and the simulator's count,
:func:`poplar.profile.units.step_flops_per_sample`: three times the forward's, counted
operator by operator), over the sequence length.
On real and emulated GPUs the log also holds the model FLOPs utilisation (MFU): that
rate over the sum of every GPU's peak dense TFLOP/s in the compute dtype (the
catalogue's, :mod:`poplar.cluster.catalogue`, a cluster file's declared figures, or
``peak_tflops`` in the config). Times are on the devices' clock: an emulated cluster's
are its declared seconds, and a step where an emulated device's real work ran past its
declared time says so (``overruns``). The figures are gathered from every rank as
:class:`~poplar.runtime.step_figures.StepFigures` (every front end's, and the re-planner's).

An evaluation (:mod:`poplar.train.evaluation`) is a record of its own, beside its step's:
``{"step", "eval_loss", "eval_perplexity", "eval_tokens", "eval_samples", "eval_s"}``. Rank 0
hands every record to one sink (:class:`~poplar.train.reporters.Reporters`: ``log.jsonl``,
and TensorBoard or W&B where ``report_to`` names them).
"""

from __future__ import annotations

import math

from poplar.engine.config import EngineConfig
from poplar.models.workload import ModelSource
from poplar.runtime.step_figures import StepFigures
from poplar.train.config import LogSettings


def flops_per_token(wl: ModelSource, config: EngineConfig | None = None) -> float:
    """Model FLOPs of a token in a training step."""
    from poplar.profile.units import step_flops_per_sample

    return step_flops_per_sample(wl, config) / wl.seq_len


def peak_tflops(device, mixed_precision: str, given: float | None = None) -> float:
    """This rank's peak TFLOP/s for MFU in the engine's ``mixed_precision`` (0: unknown, or the host's CPU);
    ``given``: the config's ``peak_tflops``, for a real GPU the catalogue does not rate."""
    from poplar.cluster.catalogue import peak_tflops as catalogue_peak
    from poplar.devices.cuda import CudaDevice
    from poplar.precision import precision

    dtype = precision(mixed_precision)
    declared = getattr(device, "kind", None)   # an emulated device's declared GPU
    if declared is not None:
        return declared.peak_tflops(dtype)
    if not isinstance(device, CudaDevice):
        return 0.0
    return given or catalogue_peak(device.properties.name, dtype) or 0.0


class StepLog:
    """Rank 0's record (``log.jsonl``, ``report_to``'s) and printed line per logged step and per evaluation; every
    rank gathers the figures."""

    def __init__(self, settings: LogSettings, rank: int, device, comm, global_batch: int, flops_per_token: float,
                 peak: float, sink=None):
        """``settings``: the config's :class:`~poplar.train.config.LogSettings`; ``peak``: this rank's peak TFLOP/s
        for MFU (:func:`peak_tflops`); ``sink``: where rank 0's records go (default: ``log.jsonl`` and
        ``settings.report_to``'s reporters, :class:`~poplar.train.reporters.Reporters`)."""
        from poplar.train.reporters import Reporters

        self.settings, self.device, self.comm = settings, device, comm
        self.global_batch, self.fpt = global_batch, flops_per_token
        self.tokens = global_batch * settings.seq_len
        self.peak = peak
        self._sink = (sink or Reporters(settings.out, settings.report_to)) if rank == 0 else None
        self._late = device.lateness()

    def step_started(self) -> None:
        self._late = self.device.lateness()

    def due(self, step: int, last: bool, skipped: bool) -> bool:
        """Whether step ``step`` (from 0) is logged."""
        return step % self.settings.every == 0 or last or skipped

    def gather(self, grad_norm: float | None) -> StepFigures:
        """Every rank's figures of the step just done (every rank calls this)."""
        return StepFigures.gather(self.device, self.comm, self._late, self.peak, grad_norm)

    def write(self, step: int, loss: float, figures: StepFigures, skipped: bool, loss_scale: float | None = None,
              replan: dict | None = None) -> None:
        """Rank 0: the step's record and line. ``loss_scale``: fp16's, after the step (None in bf16 and fp32);
        ``replan``: the plan changed after this step (:class:`poplar.runtime.replanner.Replan`'s record)."""
        if self._sink is None:
            return
        record = self.record(step, loss, figures, skipped)
        if loss_scale is not None:
            record["loss_scale"] = loss_scale
        if replan is not None:
            record["replan"] = replan
        self._sink.write(record)
        print(self.line(record, loss), flush=True)

    def write_eval(self, step: int, result) -> None:
        """Rank 0: an evaluation's record and line (``result``: :class:`~poplar.train.evaluation.EvalResult`)
        after step ``step`` (from 0)."""
        if self._sink is None:
            return
        self._sink.write(result.record(step))
        ppl = result.perplexity
        print(f"eval after step {step + 1}/{self.settings.steps}  loss {result.loss:.4f}  perplexity "
              + (f"{ppl:,.2f}" if ppl is not None else "-") + f"  ({result.tokens:,} tokens of {result.samples:,} "
              f"samples, {result.seconds:.1f} s)", flush=True)

    def record(self, step: int, loss: float, fig: StepFigures, skipped: bool) -> dict:
        record = {"step": step, "loss": loss if math.isfinite(loss) else None, "lr": self.settings.schedule.at(step),
                  "step_s": fig.step_s, "samples_per_s": self.global_batch / fig.step_s,
                  "tokens_per_s": self.tokens / fig.step_s, "tflops": self.fpt * self.tokens / fig.step_s / 1e12,
                  "busy_s": fig.busy_s, "idle_s": [max(0.0, fig.step_s - b) for b in fig.busy_s],
                  "grad_norm": fig.grad_norm, "overruns": fig.overruns}
        if skipped:
            record["skipped"] = "non-finite loss or gradient: the update was left out"
        if all(p > 0 for p in fig.peaks):
            record["mfu"] = record["tflops"] / sum(fig.peaks)
        return record

    def line(self, r: dict, loss: float) -> str:
        return (f"step {r['step'] + 1}/{self.settings.steps}  loss {loss:.4f}  {r['samples_per_s']:,.0f} samples/s  "
                f"{r['tflops']:.1f} TFLOP/s" + (f" (MFU {100 * r['mfu']:.1f}%)" if "mfu" in r else "")
                + f"  most idle {100 * max(r['idle_s']) / r['step_s']:.0f}%"
                + (f"  {r['overruns']} overruns" if r["overruns"] else "")
                + (f"  loss scale {r['loss_scale']:g}" if "loss_scale" in r else "")
                + ("  SKIPPED (non-finite)" if "skipped" in r else ""))

    def close(self, failed: bool = False) -> None:
        """``failed``: the run raised (a reporter that records how a run ended says so)."""
        if self._sink is not None:
            self._sink.close(failed)
            self._sink = None
