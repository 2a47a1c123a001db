"""Where a run's figures go: ``log.jsonl`` always, and TensorBoard or Weights & Biases (``report_to``).

:class:`Reporters` is the one sink :class:`~poplar.train.metrics.StepLog` writes each record
to (rank 0's, a step's or an evaluation's); it hands the record to each reporter:

- :class:`JsonLines`: the record as one line of ``<out>/log.jsonl``;
- :class:`TensorBoard`: every figure of the record as a scalar (``torch.utils.tensorboard``'s
  ``SummaryWriter``, into ``<out>/tensorboard``), a rank's busy and idle time as
  ``rank_<i>/busy_s`` and ``rank_<i>/idle_s``, a re-plan as ``replan`` (1) and its record as
  text;
- :class:`Wandb`: the same figures to a W&B run written under ``<out>/wandb``, offline unless
  ``WANDB_MODE`` or ``WANDB_API_KEY`` says otherwise (no server is needed; ``wandb sync``
  uploads it later).

Figures are logged at the optimizer steps done (a record's ``step`` + 1, as the printed
lines count). The names are the HF Trainer's ``report_to``; a name whose package is
missing is refused before anything runs (:func:`check_reporters`), naming the extra.
"""

from __future__ import annotations

import importlib
import json
import math
import os
from pathlib import Path

MODULES = {"tensorboard": "torch.utils.tensorboard", "wandb": "wandb"}   # what each name imports


def check_reporters(names) -> None:
    """Each ``report_to`` name's package imports; one line naming the extra where one does not."""
    for name in names:
        try:
            importlib.import_module(MODULES[name])
        except ImportError as e:
            raise ValueError(f"report_to: {name} needs the {name} package, which cannot be imported here "
                             f"({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}): "
                             f"pip install 'poplar-zero[{name}]', or leave {name} out of report_to") from None


def scalars(record: dict) -> dict[str, float]:
    """A record's figures as named scalars: numbers as they are, a rank's list as ``rank_<i>/<name>``, a re-plan
    or a skipped step as 1 (the step is the axis, not a figure)."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key == "step" or value is None:
            continue
        if isinstance(value, bool):
            out[key] = float(value)
        elif isinstance(value, (int, float)):
            if math.isfinite(value):
                out[key] = float(value)
        elif isinstance(value, list):
            out.update({f"rank_{i}/{key}": float(v) for i, v in enumerate(value) if isinstance(v, (int, float))})
        else:       # a re-plan's record, a skipped step's reason: that it happened
            out[key] = 1.0
    return out


def texts(record: dict) -> dict[str, str]:
    """A record's words: a re-plan's record, a skipped step's reason."""
    return {k: v if isinstance(v, str) else json.dumps(v) for k, v in record.items() if isinstance(v, (str, dict))}


class JsonLines:
    """``<out>/log.jsonl``: a record a line, flushed as written (a crash keeps every line before it)."""

    def __init__(self, out: Path):
        self._file = open(Path(out) / "log.jsonl", "a")

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self, failed: bool = False) -> None:
        self._file.close()


class TensorBoard:
    """``<out>/tensorboard``: TensorBoard's own event files. A resumed run (``start`` > 0) hides what an earlier
    run logged from its first step on, as ``log.jsonl`` drops those records."""

    def __init__(self, out: Path, start: int = 0):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(Path(out) / "tensorboard"), purge_step=start + 1 if start else None)

    def write(self, record: dict) -> None:
        step = record["step"] + 1
        for name, value in scalars(record).items():
            self.writer.add_scalar(name, value, step)
        for name, value in texts(record).items():
            self.writer.add_text(name, value, step)
        self.writer.flush()

    def close(self, failed: bool = False) -> None:
        self.writer.close()


class Wandb:
    """A W&B run under ``<out>/wandb``: offline unless ``WANDB_MODE`` or ``WANDB_API_KEY`` is set; ``config`` (the
    run's configuration) as its config."""

    def __init__(self, out: Path, config: dict | None = None):
        import wandb

        online = os.environ.get("WANDB_MODE") or os.environ.get("WANDB_API_KEY")
        self.run = wandb.init(dir=str(out), mode=None if online else "offline", name=Path(out).resolve().name,
                              project=os.environ.get("WANDB_PROJECT", "poplar"), config=config or {},
                              settings=wandb.Settings(silent=True, console="off"))

    def write(self, record: dict) -> None:
        self.run.log({**scalars(record), **texts(record)}, step=record["step"] + 1)

    def close(self, failed: bool = False) -> None:
        """The run ended, marked failed where training raised (W&B shows it crashed, not finished)."""
        self.run.finish(exit_code=1 if failed else 0)


class Reporters:
    """Rank 0's sink: each record to ``log.jsonl`` and to each of ``report_to``'s reporters (``config``: the run's,
    for W&B; ``start``: the step a resumed run starts from)."""

    def __init__(self, out: Path, report_to=(), config: dict | None = None, start: int = 0):
        self.reporters: list = [JsonLines(out)]
        try:
            for name in report_to:
                self.reporters.append(TensorBoard(out, start) if name == "tensorboard" else Wandb(out, config))
        except BaseException:
            self.close(failed=True)
            raise

    def write(self, record: dict) -> None:
        for r in self.reporters:
            r.write(record)

    def close(self, failed: bool = False) -> None:
        for r in self.reporters:
            r.close(failed)
        self.reporters = []
