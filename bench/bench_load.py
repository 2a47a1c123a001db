"""Peak host memory of each rank while a sharded pretrained checkpoint loads into ZeRO-3: read into the shards vs whole.

    python bench/bench_load.py                  # a 82M-parameter Qwen2, 3 ranks
    python bench/bench_load.py --layers 4 --ranks 2

Saves a Qwen2 causal LM (random weights, tied embeddings) as ``save_pretrained`` writes a
large one: safetensors in several files under an index. Then, on ``--ranks`` processes,
twice, one after the other: the engine built in ZeRO-3 with the parameters read straight
into each rank's shard (:mod:`poplar.engine.weights`, what ``poplar train`` does with a
model directory), and built from ``from_pretrained``'s whole model (what every rank would
do otherwise). Each rank's peak resident memory during the load (``VmHWM``, reset before
it through ``/proc/self/clear_refs``) is printed above what it held before, beside its
bound: its share of the states the engine holds from the start (the fp32 parameter and
gradient shards; the optimizer's states come with the first step) plus the largest
unit's fp32 bytes.
"""

from __future__ import annotations

import argparse
import functools
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MB = 2 ** 20


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def load_rank(rank: int, world_size: int, directory: str, sharded: bool) -> dict:
    """One rank: the engine built in ZeRO-3 from the directory; its peak memory above what it held before."""
    import torch

    import poplar
    from poplar.models.pretrained import ModelDirectory

    source = ModelDirectory(directory=directory)
    _warm_up(world_size)
    shell = source.build_empty() if sharded else None   # (the shell is a few buffers: nothing of the weights)
    torch.distributed.barrier()
    Path("/proc/self/clear_refs").write_text("5")       # the peak from here on
    before = _status("VmRSS")
    model, weights = shell if sharded else (source.build(), None)
    engine = poplar.initialize(model, functools.partial(torch.optim.AdamW, lr=1e-4),
                               poplar.Plan(3, [1] * world_size, 1), weights=weights)
    peak = _status("VmHWM") - before
    master = sum(u.master.numel() + u.grad_shard.numel() for u in engine.units) * 4
    largest = max(u.padded_numel for u in engine.units) * 4
    params = sum(u.numel for u in engine.units)
    engine.close()
    return {"peak": peak, "master": master, "unit": largest, "params": params}


class _Zeros:
    def read(self, names, start, stop):
        import torch

        return torch.zeros(stop - start)


def _warm_up(world_size: int) -> None:
    """An engine of a small model read into its shards, and a step: what the first engine imports and allocates
    once (modules, the collectives' buffers) is not counted as the load's."""
    import torch

    import poplar

    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    engine = poplar.initialize(model, functools.partial(torch.optim.AdamW, lr=1e-4),
                               poplar.Plan(3, [1] * world_size, 1), weights=_Zeros())
    engine.close()


def save_model(directory: Path, layers: int, hidden: int, vocab: int) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 8 // 3,
                         num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=4,
                         max_position_embeddings=512, tie_word_embeddings=True)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(directory, max_shard_size="100MB")


def main() -> None:
    from poplar.processes.spawn import spawn

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=8000)
    ap.add_argument("--ranks", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="poplar-load-") as tmp:
        directory = Path(tmp) / "qwen2"
        save_model(directory, args.layers, args.hidden, args.vocab)
        files = sorted(p.name for p in directory.glob("*.safetensors"))
        print(f"checkpoint: {len(files)} safetensors files under an index, "
              f"{sum((directory / f).stat().st_size for f in files) / MB:.0f} MB")
        rows = {}
        for sharded in (True, False):
            rows[sharded] = spawn(load_rank, args.ranks, str(directory), sharded, timeout_s=600)
    r0 = rows[True][0]
    print(f"model: {r0['params'] / 1e6:.1f} M parameters ({r0['params'] * 4 / MB:.0f} MB in fp32), ZeRO-3 on "
          f"{args.ranks} ranks; largest unit {r0['unit'] / MB:.1f} MB")
    print(f"{'rank':>4} {'states+unit MB':>14} {'read into shards MB':>20} {'/bound':>7} {'whole model MB':>15} "
          f"{'/bound':>7}")
    for rank in range(args.ranks):
        s, w = rows[True][rank], rows[False][rank]
        bound = s["master"] + s["unit"]
        print(f"{rank:>4} {bound / MB:>14.1f} {s['peak'] / MB:>20.1f} {s['peak'] / bound:>7.2f} "
              f"{w['peak'] / MB:>15.1f} {w['peak'] / bound:>7.2f}")


if __name__ == "__main__":
    main()
