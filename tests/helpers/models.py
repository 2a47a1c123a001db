"""Small models and a single-process reference trainer shared by the tests."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.utils.checkpoint
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int, hidden: int | None = None):
        super().__init__()
        hidden = hidden or 3 * d
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    """Embedding, a ModuleList of blocks (one unit each), a head tied to the embedding.

    ``hidden``: the blocks' inner width (default ``3 * d``); with it the units' sizes can be chosen.
    """

    def __init__(self, vocab: int = 37, d: int = 16, layers: int = 3, tied: bool = True, unused: bool = False,
                 checkpoint: str | None = None, hidden: int | None = None):
        super().__init__()
        self.checkpoint = checkpoint
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, hidden) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.head.weight = self.embed.weight
        self.unused = nn.Linear(d, d) if unused else None

    def forward(self, tokens):
        x = self.embed(tokens)
        for b in self.blocks:
            x = self._checkpointed(b, x) if self.checkpoint else b(x)
        return self.head(self.norm(x))

    def _checkpointed(self, block, x):
        """Activation checkpointing: 'early_stop' (torch's default), 'full' recompute, or 'reentrant'."""
        if self.checkpoint == "reentrant":
            return torch.utils.checkpoint.checkpoint(block, x, use_reentrant=True)
        with torch.utils.checkpoint.set_checkpoint_early_stop(self.checkpoint == "early_stop"):
            return torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)


def lm_loss(model, batch):
    tokens, targets = batch
    logits = model(tokens)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def make_model(seed: int = 0, **kw) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(**kw)


def make_batches(n_steps: int, global_batch: int, seq: int = 6, vocab: int = 37, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, (global_batch, seq), generator=g),
             torch.randint(0, vocab, (global_batch, seq), generator=g)) for _ in range(n_steps)]


OPTIMIZER = functools.partial(torch.optim.AdamW, lr=1e-3, weight_decay=0.01)
# eps=1e-6 rather than 1e-8, where ranks' updates are held to one device's: an element whose true gradient is ~1e-8
# would otherwise turn summation-order rounding (~1e-10, unavoidable when ranks sum in another order) into an
# lr-sized Adam step. That is Adam's conditioning, not a difference of the engine.
ORDER_TOLERANT_OPTIMIZER = functools.partial(torch.optim.AdamW, lr=1e-3, weight_decay=0.01, eps=1e-6)


def reference_train(batches, clip: float | None = None, optimizer=OPTIMIZER, model_kw=None, schedule=None,
                    after_step=None):
    """Plain single-process training on whole global batches: what the engine must reproduce.

    ``schedule``: a LambdaLR factor of the step, stepped after each update; ``after_step(step, model)``: called
    after each (steps from 1)."""
    model = make_model(**(model_kw or {}))
    opt = optimizer(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule) if schedule is not None else None
    losses = []
    for step, batch in enumerate(batches, 1):
        loss = lm_loss(model, batch)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if sched is not None:
            sched.step()
        losses.append(loss.item())
        if after_step is not None:
            after_step(step, model)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def _regression_loss(model: nn.Module, batch) -> torch.Tensor:
    features, target = batch
    return F.mse_loss(model(features), target)


@dataclass(frozen=True)
class RegressionSource:
    """A model source that is no preset (:class:`poplar.models.workload.ModelSource`): an MLP regressing the sum of 8
    features, two blocks wide enough to be units of their own."""

    width: int = 384
    seq_len: int = 1

    @property
    def name(self) -> str:
        return f"regression-{self.width}"

    def build(self, seed: int = 0) -> nn.Module:
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(8, self.width), Block(self.width, 4 * self.width), Block(self.width, 4 * self.width),
                             nn.Linear(self.width, 1))

    @property
    def loss(self):
        return _regression_loss

    def random_batch(self, n: int, seed: int = 0):
        features = torch.randn(n, 8, generator=torch.Generator().manual_seed(seed))
        return features, features.sum(dim=1, keepdim=True)

    def n_params(self) -> int:
        return sum(p.numel() for p in self.build().parameters())

    def cache_dict(self) -> dict:
        return {"source": "regression", "width": self.width}

    def identity(self) -> dict:
        return self.cache_dict()


def reference_train_fp16(batches, clip: float | None = None, optimizer=OPTIMIZER, scaler_kw=None,
                         overflow_from: float = float("inf"), micro_batches: list[list[int]] | None = None,
                         device: str = "cpu"):
    """One process, fp16 with ``torch.amp.GradScaler``: the model computes in float16 (every tensor, as the
    engine's does), its fp32 master copy is what the optimizer steps on.

    ``micro_batches``: the global batch's samples in micro-batches of these sizes, in order, each one's
    backward apart, its fp16 gradient added in fp32 to its group's, the groups' sums then added in order (a
    plan's micro-batches, rank by rank); None: the whole batch in one backward. ``overflow_from``: a step
    whose loss scale is at least this overflows (its loss made infinite), to exercise the skip and the
    back-off. Returns (state, losses, the scale each step ran at). One thread, as a spawned rank's: CPU
    kernels sum fp16 reductions (a LayerNorm's weight gradient) in an order that depends on the threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train_fp16(batches, clip, optimizer, scaler_kw, overflow_from, micro_batches, torch.device(device))
    finally:
        torch.set_num_threads(threads)


def _train_fp16(batches, clip, optimizer, scaler_kw, overflow_from, micro_batches, device):
    master = make_model().to(device)
    half = make_model().half().to(device)
    pairs = list(zip(master.parameters(), half.parameters()))
    opt = optimizer(master.parameters())
    scaler = torch.amp.GradScaler(device.type, **(scaler_kw or {}))
    losses, scales = [], []
    for tokens, targets in batches:
        tokens, targets = tokens.to(device), targets.to(device)
        with torch.no_grad():
            for p, h in pairs:
                h.copy_(p)
        scale = scaler.get_scale()
        scales.append(scale)
        total, start, sums = 0.0, 0, [None] * len(pairs)
        for group in micro_batches or [[len(tokens)]]:
            part = [None] * len(pairs)
            for n in group:
                weight = n / len(tokens)
                loss = lm_loss(half, (tokens[start:start + n], targets[start:start + n]))
                loss = loss * (float("inf") if scale >= overflow_from else 1.0)
                scaler.scale(loss * weight).backward()
                part = [h.grad.float() if g is None else g + h.grad.float() for g, (_, h) in zip(part, pairs)]
                half.zero_grad(set_to_none=True)
                total, start = total + loss.item() * weight, start + n
            sums = [g if s is None else s + g for s, g in zip(sums, part)]
        for (p, _), g in zip(pairs, sums):
            p.grad = g
        if clip is not None:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(master.parameters(), clip)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    return {k: v.detach().clone() for k, v in master.state_dict().items()}, losses, scales
