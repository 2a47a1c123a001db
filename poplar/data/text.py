"""Real text, tokenised and packed into fixed-length sequences, served as global batches.

Sources (``load_text``):

- ``"embedded"``: the Python Language Reference's topics that ship with every Python
  installation (``pydoc_data.topics``, about 465,000 characters of English prose and
  grammar). No network, no download: the default.
- a path (a ``.txt`` file, or a directory of them): read through Hugging Face
  ``datasets``' ``text`` builder.
- ``"wikitext"``: ``wikitext-2-raw-v1`` from the Hugging Face hub, where a hub is
  reachable (a clear error where it is not).

Tokenisation: a byte-level BPE tokenizer trained here with Hugging Face ``tokenizers``
on the text itself (cached on disk, keyed by the text and the vocabulary size), so
nothing needs a hub. The token stream (documents joined by an end-of-text token) is cut
into sequences of ``seq_len + 1`` tokens: inputs are the first ``seq_len``, targets the
last ``seq_len``.

Batches: :class:`GlobalBatches` orders the sequences by a seeded permutation per epoch
(:func:`poplar.data.order.epoch_order`, the integrations' samplers' too), so global batch
``k`` is a pure function of ``(seed, k)``: resuming at step ``k`` gives
exactly the batches an uninterrupted run would have seen, and every rank cuts its own
slice (``plan.sample_range(rank)``) from the same global batch.
"""

from __future__ import annotations

import codecs
import hashlib
import os
from pathlib import Path

import torch

from poplar.data.order import epoch_order
from poplar.models.loss import IGNORE

EOT = "<|endoftext|>"
MASK = "<|mask|>"      # for masked-LM training


def data_cache_dir() -> Path:
    return Path(os.environ.get("POPLAR_DATA_CACHE", Path.home() / ".cache" / "poplar" / "data"))


def embedded_text() -> list[str]:
    """The Python Language Reference topics: real text that every Python installation has."""
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)]


def load_text(source: str = "embedded") -> list[str]:
    """Documents (strings) from ``source``; see the module's docstring."""
    if source == "embedded":
        return embedded_text()
    if source == "wikitext":
        try:
            from datasets import load_dataset

            ds = load_dataset("wikitext", "wikitext-2-raw-v1", split="train")
        except Exception as e:   # offline, hub unreachable, rate-limited...
            raise RuntimeError(f"wikitext could not be loaded from the Hugging Face hub ({type(e).__name__}: "
                               f"{str(e)[:200]}); use --data embedded or a local text file") from None
        return [t for t in ds["text"] if t.strip()]
    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(f"--data {source!r}: no such file or directory; give 'embedded', 'wikitext', "
                                "a .txt file or a directory of .txt files")
    files = sorted(str(p) for p in path.rglob("*.txt")) if path.is_dir() else [str(path)]
    if not files:
        raise ValueError(f"--data {source!r}: the directory holds no .txt file")
    if not any([_holds_text(f, source) for f in files]):   # every file checked: a bad one is named
        raise ValueError(f"--data {source!r}: the text is empty")
    import datasets
    from datasets import load_dataset

    datasets.disable_progress_bars()   # a run's output is its own lines
    try:
        ds = load_dataset("text", data_files=files, split="train", sample_by="paragraph")
    except Exception as e:   # what the checks above did not foresee: one line, not the library's traceback
        line = next((x for x in str(e).splitlines() if x.strip()), "")
        raise ValueError(f"--data {source!r}: Hugging Face datasets could not read it ({type(e).__name__}: "
                         f"{line[:200]}); give UTF-8 text files (.txt)") from None
    docs = [t for t in ds["text"] if t.strip()]
    if not docs:
        raise ValueError(f"--data {source!r}: the text is empty")
    return docs


def _holds_text(path: str, source: str) -> bool:
    """Whether ``path`` holds any text (False: empty or blank); a file that is not UTF-8 text is refused, named.

    Read in chunks, so a large file is checked without holding it whole.
    """
    decoder = codecs.getincrementaldecoder("utf-8")()
    blank, offset = True, 0
    where = f"--data {source!r}" + ("" if path == source else f": {path}")
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            if b"\0" in chunk:   # valid UTF-8, but no text has NUL bytes: an archive, an image, a tensor file
                raise ValueError(f"{where} is a binary file, not text (byte "
                                 f"{offset + chunk.index(0)} is NUL): give UTF-8 text files (.txt)")
            try:
                blank = not decoder.decode(chunk).strip() and blank
                offset += len(chunk)
            except UnicodeDecodeError as e:
                raise ValueError(f"{where} is not UTF-8 text (byte {offset + e.start} is "
                                 f"{chunk[e.start]:#04x}): convert it to UTF-8 (e.g. iconv -t UTF-8) or give "
                                 "another file") from None
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            raise ValueError(f"{where} is not UTF-8 text (it ends inside a character): convert "
                             "it to UTF-8 or give another file") from None
    return not blank


def train_tokenizer(docs: list[str], vocab_size: int = 2048):
    """A byte-level BPE tokenizer trained on ``docs`` (cached on disk by content and size)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    digest = hashlib.sha256()
    for d in docs:
        digest.update(d.encode())
    path = data_cache_dir() / f"tokenizer-{digest.hexdigest()[:16]}-{vocab_size}.json"
    if path.exists():
        try:
            return Tokenizer.from_file(str(path))
        except Exception:   # a damaged cache file (a full disk, a crash): it is only a cache, train again
            path.unlink(missing_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT, MASK], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs, trainer=trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tok.save(str(tmp))
    tmp.replace(path)
    return tok


def pack(docs: list[str], tokenizer, seq_len: int, eos_id: int | None = None) -> torch.Tensor:
    """Token ids of ``docs`` (a ``tokenizers.Tokenizer``'s) joined by end-of-text (``eos_id``, else the trained
    tokenizer's), cut into ``[n, seq_len + 1]`` (the tail dropped)."""
    eot = tokenizer.token_to_id(EOT) if eos_id is None else eos_id
    ids: list[int] = []
    for enc in tokenizer.encode_batch(docs):
        ids.extend(enc.ids)
        ids.append(eot)
    n = len(ids) // (seq_len + 1)
    if n == 0:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than one sequence of {seq_len + 1}: "
                         "use more text or a shorter sequence")
    return torch.tensor(ids[: n * (seq_len + 1)], dtype=torch.long).view(n, seq_len + 1)


class GlobalBatches:
    """Global batch ``k`` of ``global_batch`` sequences, the same on every rank and in every run.

    Epoch ``e`` visits the sequences in :func:`~poplar.data.order.epoch_order`'s order for
    ``(seed, e)``; batch ``k`` takes the next ``global_batch`` of that order (the last
    partial batch of an epoch is dropped, so every batch is whole).
    """

    def __init__(self, sequences: torch.Tensor, global_batch: int, seed: int = 0, targets: torch.Tensor | None = None,
                 labels: torch.Tensor | None = None):
        if global_batch > len(sequences):
            raise ValueError(f"global batch {global_batch} is larger than the {len(sequences)} sequences of the "
                             "data: use more text, shorter sequences or a smaller batch")
        self.sequences, self.global_batch, self.seed, self.targets = sequences, global_batch, seed, targets
        self.labels = labels    # a classifier's: the sequences are its inputs, a label each
        # each sample's counted targets, once: a step's weight sums the global batch's (every rank, every step)
        self.counted = None if targets is None else (targets != IGNORE).sum(1)
        self.per_epoch = len(sequences) // global_batch

    def _indices(self, step: int) -> torch.Tensor:
        epoch, k = divmod(step, self.per_epoch)
        return epoch_order(len(self.sequences), self.seed, epoch)[k * self.global_batch:(k + 1) * self.global_batch]

    def batch(self, step: int) -> torch.Tensor:
        """The ``[global_batch, seq_len + 1]`` token ids of step ``step`` (0-based)."""
        return self.sequences[self._indices(step)]

    def local(self, step: int, plan, rank: int) -> tuple[torch.Tensor, ...]:
        """This rank's ``(inputs, targets)`` of step ``step``, by the plan's slice (a classifier's: ``(inputs,
        labels)``); where some targets are not counted, ``(inputs, targets, weight)`` (:mod:`poplar.models.loss`:
        the global batch's samples over its counted tokens, for each sample)."""
        lo, hi = plan.sample_range(rank)
        idx = self._indices(step)
        tokens = self.sequences[idx[lo:hi]]
        if self.labels is not None:
            return tokens, self.labels[idx[lo:hi]]
        if self.targets is None:
            return tokens[:, :-1], tokens[:, 1:]
        counted = int(self.counted[idx].sum())
        weight = torch.full((hi - lo,), self.global_batch / max(counted, 1), dtype=torch.float32)
        return tokens[:, :-1], self.targets[idx[lo:hi]], weight
