"""A small decoder-only transformer in plain torch, for demos, tests and benchmarks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from poplar.models.checkpointing import checkpointed
from poplar.models.loss import next_token_loss


class Attention(nn.Module):
    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.out = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.attn_norm = nn.LayerNorm(d_model)
        self.attn = Attention(d_model, n_heads)
        self.mlp_norm = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TinyCausalLM(nn.Module):
    """Token + position embeddings, ``n_layers`` pre-norm blocks, a head tied to the embedding.

    >>> model = TinyCausalLM(vocab_size=50, d_model=32, n_layers=2, n_heads=2, max_seq_len=16)
    >>> model(torch.zeros(3, 16, dtype=torch.long)).shape
    torch.Size([3, 16, 50])
    """

    def __init__(self, vocab_size: int = 256, d_model: int = 64, n_layers: int = 2, n_heads: int = 4,
                 max_seq_len: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(max_seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.head.weight = self.embed.weight
        self.checkpointing = False    # poplar.models.checkpointing
        for name, p in self.named_parameters():   # GPT-2 style: small embeddings keep first logits sane
            if name.endswith("weight") and p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = checkpointed(block, x) if self.checkpointing and self.training else block(x)
        return self.head(self.norm(x))


def causal_lm_loss(model: nn.Module, batch) -> torch.Tensor:
    """Next-token cross-entropy of a ``(inputs, targets)`` micro-batch (:func:`poplar.models.loss.next_token_loss`)."""
    return next_token_loss(model(batch[0]), batch)


def build_model(name: str, seed: int = 0) -> TinyCausalLM:
    """Built-in preset ``name`` (:data:`poplar.models.presets.MODEL_PRESETS`), seeded."""
    from poplar.models.presets import MODEL_PRESETS

    if name not in MODEL_PRESETS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODEL_PRESETS)}")
    torch.manual_seed(seed)
    return TinyCausalLM(**MODEL_PRESETS[name])


def random_token_batch(name: str, batch: int, seed: int = 0):
    """Random ``(inputs, targets)`` of the preset's shape: enough to time and size a step."""
    from poplar.models.presets import MODEL_PRESETS

    cfg = MODEL_PRESETS[name]
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, cfg["vocab_size"], (batch, cfg["max_seq_len"] + 1), generator=g)
    return x[:, :-1], x[:, 1:]
