"""Evaluation while training: the loss of held-out samples, every rank computing its share: :class:`Evaluator`.

The evaluation samples (:attr:`poplar.train.dataset.RunData.eval_samples`, in a fixed order) are
cut into batches of the plan's global batch, the last one partial. Every rank takes its
share of each batch as in training (``plan.sample_range(rank)``; the last batch split by the
plan's shares, :func:`batch_shares`, where a rank may get none) and runs it in
micro-batches no larger than its training micro-batch, under ``torch.no_grad`` and in
eval mode. Each micro-batch's mean loss is weighted by what it counts (its counted target
tokens where some are not counted, as a prompt's; else its samples' tokens), and the sums
and counts are added over the ranks before the one division: the loss one device gets on
the same samples, however the plan splits them. In ZeRO-3 a forward gathers each unit's
parameters from every rank (:mod:`poplar.engine.unshard`), so a rank with fewer
micro-batches runs forwards of one sample, left out, until every rank has run as many.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from poplar.models.loss import IGNORE
from poplar.split import apportion, near_equal

if TYPE_CHECKING:
    from poplar.data.prepare import Prepared
    from poplar.train.config import TrainConfig
    from poplar.train.dataset import RunData

# what the rows of a table hold (poplar.data.records' kinds), in a user's words
KINDS = {"text": "documents (a 'text' field, or plain text)", "pairs": "prompt/completion pairs",
         "ids": "token ids (an 'input_ids' field)", "labelled": "texts with a label each", "chat": "conversations"}


def check_eval_data(cfg: TrainConfig, own) -> None:
    """Before anything is prepared, profiled or written: ``eval_data`` (a :class:`~poplar.train.config.TrainConfig`'s)
    exists and reads as the training data reads (the same kind of rows) by the model ``own``
    (:func:`~poplar.train.dataset.own_model`'s); one line where not."""
    source = cfg.eval_data
    if not isinstance(source, str):
        return
    if source not in ("embedded", "wikitext") and not Path(source).exists():
        raise FileNotFoundError(f"eval_data {source!r}: no such file or directory; give a file or table as data "
                                "takes (the same fields), or a fraction of the training samples to hold out (0.05)")
    task = getattr(own, "task", "causal-lm")
    trained, held = _kind(cfg.data, cfg.data_fields, task, "data"), _kind(source, cfg.data_fields, task, "eval_data")
    if trained != held:
        raise ValueError(f"eval_data {source!r} holds {KINDS.get(held, held)}, the training data {cfg.data!r} "
                         f"{KINDS.get(trained, trained)}: give evaluation data with the training data's fields, or a "
                         "fraction of the training samples to hold out (e.g. 0.05)")


def _kind(source: str, fields, task: str, option: str) -> str:
    """What ``source``'s rows hold as a model of ``task`` reads them (a language model reads labelled text as text)."""
    from poplar.data.records import is_table, read_records

    if not is_table(source):
        return "text"
    try:
        kind = read_records(source, fields).kind
    except (ValueError, FileNotFoundError) as e:
        raise type(e)(str(e).replace("--data ", f"{option} ", 1)) from None
    return "text" if kind == "labelled" and task != "sequence-classification" else kind


def say_evaluation(cfg: TrainConfig, data: RunData) -> None:
    """The launcher (or rank 0), once: what the run evaluates said in a line (``data``: the run's, prepared)."""
    line = evaluation_line(cfg, len(data.batches.sequences), data.eval_samples)
    if line:
        print(line, flush=True)


def evaluation_line(cfg: TrainConfig, trained: int, samples: Prepared | None) -> str | None:
    """What the run evaluates, said once at its start: ``samples`` (:attr:`~poplar.train.dataset.RunData.eval_samples`)
    beside the ``trained`` samples left to train on."""
    if samples is None:
        return None
    when = f"every {cfg.eval_every} steps and at the end" if cfg.eval_every else "at the end"
    n = len(samples.tokens)
    if isinstance(cfg.eval_data, float):
        return (f"poplar: evaluation on {n:,} of the {n + trained:,} training samples, held out (eval_data "
                f"{cfg.eval_data}, seed {cfg.seed}; they never train, {trained:,} do), {when}")
    return f"poplar: evaluation on {n:,} samples of {cfg.eval_data}, {when}"


def evaluator_for(samples: Prepared | None, every: int, engine, loss_fn, comm, last: int) -> Evaluator | None:
    """The run's :class:`Evaluator` of ``samples`` (as the launcher prepared them; None: no ``eval_data``, no
    evaluator), evaluated after every ``every`` steps and after step ``last``."""
    return None if samples is None else Evaluator(samples, every, last, engine, loss_fn, comm)


def batch_shares(n: int, plan) -> list[int]:
    """Each rank's samples of an evaluation batch of ``n`` (at most the global batch): the plan's split where
    whole, else ``n`` split in proportion to it (largest remainders; a rank may get none).

    >>> from poplar import Plan
    >>> batch_shares(5, Plan(0, [6, 2, 4]))
    [2, 1, 2]
    """
    local = plan.local_batch_sizes
    return list(local) if n == plan.global_batch_size else apportion(n, local)


def micro_batches(samples: int, plan, rank: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of each of ``rank``'s evaluation micro-batches over ``samples`` samples: its share of
    every batch, in near-equal micro-batches of at most its ``micro_batch_sizes[rank]``."""
    out, whole = [], plan.global_batch_size
    for first in range(0, samples, whole):
        shares = batch_shares(min(whole, samples - first), plan)
        start = first + sum(shares[:rank])
        mine = shares[rank]
        for size in near_equal(mine, -(-mine // plan.micro_batch_sizes[rank])) if mine else []:
            out.append((start, start + size))
            start += size
    return out


@dataclass(frozen=True)
class EvalResult:
    """One evaluation over every rank: the mean loss over what it counts (``tokens``), of ``samples`` samples."""

    loss: float
    tokens: int
    samples: int
    seconds: float

    @property
    def perplexity(self) -> float | None:
        return math.exp(self.loss) if math.isfinite(self.loss) and self.loss < 700 else None

    def record(self, step: int) -> dict:
        """Its ``log.jsonl`` record, after step ``step`` (from 0, as the steps' records)."""
        return {"step": step, "eval_loss": self.loss if math.isfinite(self.loss) else None,
                "eval_perplexity": self.perplexity, "eval_tokens": self.tokens, "eval_samples": self.samples,
                "eval_s": self.seconds}


class Evaluator:
    """Every rank's evaluation of ``samples`` with ``engine``'s model and plan (``loss_fn(model, micro_batch)``, the
    workload's; ``comm``: where the sums are added): after every ``every`` steps (0: none but the last) and after
    step ``last`` (counted from 1)."""

    def __init__(self, samples: Prepared, every: int, last: int, engine, loss_fn, comm):
        self.samples, self.every, self.last = samples, every, last
        self.engine, self.loss_fn, self.comm = engine, loss_fn, comm

    def due(self, step: int) -> bool:
        """Whether the run evaluates after step ``step`` (from 0)."""
        return step + 1 == self.last or (self.every > 0 and (step + 1) % self.every == 0)

    def evaluate(self) -> EvalResult:
        """Every rank at once: the loss over every evaluation sample, the same on every rank."""
        start = time.perf_counter()
        engine, n = self.engine, len(self.samples.tokens)
        plan, rank = engine.plan, engine.rank
        mine = micro_batches(n, plan, rank)
        # ZeRO-3's forwards gather from every rank: each runs as many (a one-sample forward, left out, to fill)
        runs = max(len(micro_batches(n, plan, r)) for r in range(plan.world_size))
        fill = runs - len(mine) if engine.stage.shards_parameters else 0
        # the summed loss (on the device: no wait for each micro-batch), what it counts, samples
        total = torch.zeros((), dtype=torch.float64, device=engine.device)
        counts = [0, 0]
        model = engine.model
        training = model.training
        model.eval()
        try:
            with torch.no_grad():
                for i, (lo, hi) in enumerate(mine + [(0, 1)] * fill):
                    batch, counted = self._micro_batch(lo, hi)
                    loss = self.loss_fn(model, batch)
                    if i < len(mine):
                        total += loss.detach().double().reshape(()) * counted
                        counts = [counts[0] + counted, counts[1] + hi - lo]
        finally:
            model.train(training)
        every = torch.stack([total, *torch.tensor(counts, dtype=torch.float64, device=engine.device)])
        self.comm.all_reduce(every)
        total, counted, samples = every.tolist()
        return EvalResult(total / counted if counted else math.nan, int(counted), int(samples),
                          time.perf_counter() - start)

    def _micro_batch(self, lo: int, hi: int) -> tuple[tuple, int]:
        """Samples ``[lo, hi)`` as the loss reads a micro-batch (on the engine's device), and what its mean loss
        is over: counted target tokens where some are not counted, else every input token."""
        s, device = self.samples, self.engine.device
        tokens = s.tokens[lo:hi].to(device)
        if s.labels is not None:     # a classifier's: a label a sample
            return (tokens, s.labels[lo:hi].to(device)), tokens.numel()
        if s.targets is None:        # packed text: every next token counted
            return (tokens[:, :-1], tokens[:, 1:]), tokens[:, 1:].numel()
        counted = int((s.targets[lo:hi] != IGNORE).sum())    # (counted on the host: no wait for the device)
        targets = s.targets[lo:hi].to(device)
        # the weight that makes the loss this micro-batch's mean over its counted tokens (poplar.models.loss)
        weight = torch.full((hi - lo,), (hi - lo) / max(counted, 1), dtype=torch.float32, device=device)
        return (tokens[:, :-1], targets, weight), counted
