"""Data preparation of a JSONL of prompt/completion pairs with a model directory's tokenizer: first run, then cached.

    python bench/bench_data.py                 # 100,000 pairs
    python bench/bench_data.py --pairs 20000 --seq-len 256

Writes the pairs (seeded, words drawn from the embedded text), a small Qwen2 directory
with a byte-level BPE tokenizer trained here (``--vocab`` ids), and times
:func:`poplar.data.prepare.prepare` twice in fresh caches (Poplar's and ``datasets``'):
the first run reads the JSONL, tokenises every pair (``tokenizers``, on every core) and
cuts the samples; the second, in a process of its own as a second run would be, reads
the prepared tensors back.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def write_pairs(path: Path, n: int, seed: int = 0) -> None:
    from poplar.data.text import embedded_text

    words = " ".join(embedded_text()).split()
    r = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            f.write(json.dumps({"prompt": " ".join(r.choices(words, k=r.randint(8, 60))),
                                "completion": " ".join(r.choices(words, k=r.randint(4, 40)))}) + "\n")


def timed_prepare(tmp: Path, args, attempt: str) -> None:
    """Prepare the pairs for the model directory under ``tmp``; print the seconds it took."""
    from poplar.data.prepare import prepare
    from poplar.data.records import DataFields
    from poplar.models.pretrained import ModelDirectory

    source = ModelDirectory(directory=str(tmp / "model"), seq_len=args.seq_len)
    start = time.perf_counter()
    prepared = prepare(str(tmp / "pairs.jsonl"), DataFields(), source, args.seq_len, args.vocab)
    seconds = time.perf_counter() - start
    counted = int((prepared.targets != -100).sum())
    print(f"{attempt}: {seconds:.2f} s, {len(prepared.tokens):,} samples of {args.seq_len + 1} tokens, "
          f"{counted:,} completion tokens counted", flush=True)


def write_model(tmp: Path, vocab: int) -> None:
    from tests.helpers.pretrained import save_qwen2, save_tokenizer

    save_qwen2(tmp / "model", tokenizer=False)
    save_tokenizer(tmp / "model", vocab)
    config = json.loads((tmp / "model" / "config.json").read_text())
    (tmp / "model" / "config.json").write_text(json.dumps({**config, "vocab_size": vocab,
                                                            "max_position_embeddings": 4096}))
    (tmp / "model" / "model.safetensors").unlink()    # its tokenizer is what is timed: a config is enough


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=100_000)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--again", type=Path, help=argparse.SUPPRESS)   # the second run's process
    args = ap.parse_args()
    if args.again:
        timed_prepare(args.again, args, "cached (a new process)")
        return
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        os.environ.update(POPLAR_DATA_CACHE=str(tmp / "poplar-data"), HF_DATASETS_CACHE=str(tmp / "hf-datasets"))
        write_model(tmp, args.vocab)
        start = time.perf_counter()
        write_pairs(tmp / "pairs.jsonl", args.pairs)
        size = (tmp / "pairs.jsonl").stat().st_size
        print(f"wrote {args.pairs:,} pairs ({size / 2**20:.1f} MiB) in {time.perf_counter() - start:.1f} s; "
              f"{os.cpu_count()} cores; tokenizer of {args.vocab:,} ids")
        timed_prepare(tmp, args, "first run")
        subprocess.run([sys.executable, __file__, "--again", str(tmp), "--seq-len", str(args.seq_len),
                        "--vocab", str(args.vocab)], check=True, timeout=600)


if __name__ == "__main__":
    main()
