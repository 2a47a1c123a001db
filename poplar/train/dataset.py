"""A run's data: the tokenizer trained on its text, and the global batches the text packs into."""

from __future__ import annotations

from poplar.train.config import TrainConfig
from poplar.workload import Workload


def prepare_data(cfg: TrainConfig):
    """The tokenizer (cached: the ranks read back the launcher's) and the run's :class:`GlobalBatches`."""
    from poplar.data.text import GlobalBatches, load_text, pack, train_tokenizer

    docs = load_text(cfg.data)
    tok = train_tokenizer(docs, cfg.vocab_size)
    seqs = pack(docs, tok, cfg.seq_len)
    return tok, GlobalBatches(seqs, cfg.global_batch, seed=cfg.seed)


def workload_of(cfg: TrainConfig) -> Workload:
    """The model and shapes the run trains (the vocabulary is the tokenizer's)."""
    tok, _ = prepare_data(cfg)
    return Workload(model=cfg.model, seq_len=cfg.seq_len, vocab_size=tok.get_vocab_size(),
                    activation_checkpointing=cfg.activation_checkpointing)
