#!/usr/bin/env python
"""Step-time benchmark: Poplar's ZeRO stages against their peers, on CPU with gloo.

Every system trains the same small decoder-only transformer (same seed, so identical
initial weights) on the same batches with the same optimizer (``torch.optim.AdamW``,
lr 1e-3, fp32). Each (round, system) pair runs in its own freshly spawned group of
``--world-size`` processes (``torch.multiprocessing``, gloo, one torch thread per
rank). Systems are run round-robin ``--rounds`` times; a system's number is the median
of all its timed per-step times over all rounds, where one step's time is the slowest
rank's wall time for that step.

Groups (what each one shards):

    stage 0 / replicas            torch DDP, Poplar stage 0
    stage 1 / optimizer states    ZeroRedundancyOptimizer + DDP, DeepSpeed ZeRO-1, Poplar stage 1
    stage 2 / + gradients         DeepSpeed ZeRO-2, FSDP2 (reshard_after_forward=False), Poplar stage 2
    stage 3 / + parameters        DeepSpeed ZeRO-3, FSDP2 (reshard_after_forward=True), Poplar stage 3

Run ``python bench/bench_engine.py --help`` for the flags; see bench/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import platform
import shutil
import socket
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from importlib import metadata
from pathlib import Path

# Must be in the environment before anything imports deepspeed (children inherit it).
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

# Benchmark the poplar of this checkout, whether or not it is installed.
_REPO_ROOT = str(Path(__file__).resolve().parent.parent)
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402


# ----------------------------------------------------------------------------- systems


@dataclass(frozen=True)
class System:
    key: str
    group: int  # the ZeRO stage whose peers it is compared with
    label: str
    poplar: bool = False


GROUP_NAMES = {
    0: "stage 0 / replicas",
    1: "stage 1 / optimizer states",
    2: "stage 2 / + gradients",
    3: "stage 3 / + parameters",
}

SYSTEMS = [
    System("ddp", 0, "torch DDP"),
    System("poplar0", 0, "Poplar stage 0", poplar=True),
    System("zero_redundancy", 1, "torch ZeroRedundancyOptimizer + DDP"),
    System("ds1", 1, "DeepSpeed ZeRO-1"),
    System("poplar1", 1, "Poplar stage 1", poplar=True),
    System("ds2", 2, "DeepSpeed ZeRO-2"),
    System("fsdp2_grad_op", 2, "FSDP2 reshard_after_forward=False"),
    System("poplar2", 2, "Poplar stage 2", poplar=True),
    System("ds3", 3, "DeepSpeed ZeRO-3"),
    System("fsdp2_full", 3, "FSDP2 reshard_after_forward=True"),
    System("poplar3", 3, "Poplar stage 3", poplar=True),
]
SYSTEM_BY_KEY = {s.key: s for s in SYSTEMS}


# ----------------------------------------------------------------------------- model


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a GELU MLP."""

    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model {d_model} is not divisible by n_heads {n_heads}")
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, 4 * d_model)
        self.fc2 = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, t, 3, self.n_heads, c // self.n_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each (b, heads, t, head_dim)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, c))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, seq_len: int, d_model: int, n_layers: int, n_heads: int):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        h = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln_f(h))


def build_model(cfg: dict) -> TinyGPT:
    torch.manual_seed(cfg["seed"])
    return TinyGPT(cfg["vocab"], cfg["seq_len"], cfg["d_model"], cfg["layers"], cfg["heads"])


def loss_fn(model: nn.Module, micro_batch: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of one micro-batch of (samples, seq_len + 1) tokens."""
    x, y = micro_batch[:, :-1], micro_batch[:, 1:]
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def local_batches(cfg: dict, rank: int) -> list[torch.Tensor]:
    """This rank's slice of each of a few fixed global batches (identical for every system)."""
    per_rank = cfg["micro_batch"] * cfg["accum"]
    out = []
    for j in range(cfg["n_batches"]):
        g = torch.Generator().manual_seed(cfg["seed"] + 1000 + j)
        global_batch = torch.randint(0, cfg["vocab"], (per_rank * cfg["world_size"], cfg["seq_len"] + 1), generator=g)
        out.append(global_batch[rank * per_rank : (rank + 1) * per_rank].contiguous())
    return out


# ----------------------------------------------------------------------------- one step per system
# Every builder returns step(local_batch) -> mean loss over this rank's micro-batches,
# doing exactly one optimizer step.


def _adamw_factory(cfg: dict):
    return functools.partial(torch.optim.AdamW, lr=cfg["lr"])


def _accumulating_step(model_call: nn.Module, optimizer, cfg: dict, no_sync=None):
    accum, mbs = cfg["accum"], cfg["micro_batch"]

    def step(local: torch.Tensor):
        total = None
        for i, mb in enumerate(local.split(mbs)):
            ctx = no_sync() if (no_sync is not None and i < accum - 1) else contextlib.nullcontext()
            with ctx:
                loss = loss_fn(model_call, mb) / accum
                loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return total

    return step


def build_ddp(model, cfg, zero_redundancy: bool):
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(model)
    if zero_redundancy:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=cfg["lr"])
    else:
        opt = _adamw_factory(cfg)(ddp.parameters())
    return _accumulating_step(ddp, opt, cfg, no_sync=ddp.no_sync)


def build_fsdp2(model, cfg, reshard_after_forward: bool):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (cfg["world_size"],))
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    opt = _adamw_factory(cfg)(model.parameters())
    # Gradients are reduce-scattered on every micro-step (ZeRO-2/3 semantics), as in
    # DeepSpeed ZeRO-2/3 and Poplar stages 2/3; no set_requires_gradient_sync(False).
    return _accumulating_step(model, opt, cfg)


def build_deepspeed(model, cfg, stage: int):
    import logging

    import deepspeed

    deepspeed.utils.logger.setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo")  # reuses the initialised default group
    torch.set_num_threads(1)  # in case anything above changed it
    ds_config = {
        "train_batch_size": cfg["micro_batch"] * cfg["accum"] * cfg["world_size"],
        "train_micro_batch_size_per_gpu": cfg["micro_batch"],
        "gradient_accumulation_steps": cfg["accum"],
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,  # a client torch.optim.AdamW
        "fp16": {"enabled": False},
        "bf16": {"enabled": False},
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    optimizer = _adamw_factory(cfg)(model.parameters())
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    torch.set_num_threads(1)
    accum, mbs = cfg["accum"], cfg["micro_batch"]

    def step(local: torch.Tensor):
        total = None
        for mb in local.split(mbs):
            loss = loss_fn(engine, mb)
            engine.backward(loss)  # DeepSpeed divides by gradient_accumulation_steps itself
            engine.step()  # steps the optimizer only at the accumulation boundary
            total = loss.detach() if total is None else total + loss.detach()
        return total / accum

    return step


def build_poplar(model, cfg, stage: int):
    import poplar

    world = cfg["world_size"]
    plan = poplar.Plan(
        zero_stage=stage, micro_batch_sizes=[cfg["micro_batch"]] * world, accum_steps=[cfg["accum"]] * world
    )
    engine = poplar.initialize(model, _adamw_factory(cfg), plan, cfg.get("poplar_config") or {})

    def step(local: torch.Tensor):
        return engine.train_batch(local, loss_fn)

    return step


def build_system(key: str, model, cfg: dict):
    if key == "ddp":
        return build_ddp(model, cfg, zero_redundancy=False)
    if key == "zero_redundancy":
        return build_ddp(model, cfg, zero_redundancy=True)
    if key in ("ds1", "ds2", "ds3"):
        return build_deepspeed(model, cfg, stage=int(key[-1]))
    if key == "fsdp2_grad_op":
        return build_fsdp2(model, cfg, reshard_after_forward=False)
    if key == "fsdp2_full":
        return build_fsdp2(model, cfg, reshard_after_forward=True)
    if key.startswith("poplar"):
        return build_poplar(model, cfg, stage=int(key[-1]))
    raise ValueError(f"unknown system {key!r}")


# ----------------------------------------------------------------------------- child process


def _to_float(loss) -> float:
    if isinstance(loss, torch.Tensor):
        return float(loss.detach().float().mean())
    return float(loss)


def _run_one(rank: int, key: str, cfg: dict) -> dict:
    import torch.distributed as dist

    world = cfg["world_size"]
    data = local_batches(cfg, rank)
    model = build_model(cfg)
    t0 = time.perf_counter()
    step = build_system(key, model, cfg)
    torch.set_num_threads(1)
    setup_s = time.perf_counter() - t0

    losses = []
    t0 = time.perf_counter()
    for i in range(cfg["warmup"]):
        losses.append(step(data[i % len(data)]))
    warmup_s = time.perf_counter() - t0
    dist.barrier()

    # Throughput: wall time of all timed steps between two barriers, divided by the steps.
    # (Per-step times of one rank depend on where a system puts its synchronisation
    # inside the step; the wall time over many steps does not.)
    dist.barrier()
    t_loop = time.perf_counter()
    times = []
    for i in range(cfg["warmup"], cfg["warmup"] + cfg["steps"]):
        batch = data[i % len(data)]
        t0 = time.perf_counter()
        loss = step(batch)
        times.append(time.perf_counter() - t0)
        losses.append(loss)

    dist.barrier()
    wall_step_s = (time.perf_counter() - t_loop) / cfg["steps"]
    # One step's time is the slowest rank's; the loss is the mean over ranks.
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    lt = torch.tensor([_to_float(x) for x in losses], dtype=torch.float64)
    dist.all_reduce(lt, op=dist.ReduceOp.SUM)
    lt /= world
    return {
        "step_s": t.tolist(),
        "wall_step_s": wall_step_s,
        "losses": lt.tolist(),
        "setup_s": setup_s,
        "warmup_s": warmup_s,
        "num_threads": torch.get_num_threads(),
    }


def _worker(rank: int, key: str, cfg: dict, port: int, run_dir: str) -> None:
    # Keep this rank's chatter (DeepSpeed is loud) out of the report; it goes to a log.
    log = open(os.path.join(run_dir, f"rank{rank}.log"), "w", buffering=1)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    world = cfg["world_size"]
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    import torch.distributed as dist

    torch.set_num_threads(1)
    ok = False
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world, timeout=timedelta(seconds=cfg["pg_timeout"])
        )
        result = _run_one(rank, key, cfg)
        if rank == 0:
            tmp = os.path.join(run_dir, "result.json.tmp")
            with open(tmp, "w") as f:
                json.dump(result, f)
            os.replace(tmp, os.path.join(run_dir, "result.json"))
        ok = True
    except BaseException as e:  # report, then leave the group as cleanly as we can
        with open(os.path.join(run_dir, f"error{rank}.txt"), "w") as f:
            f.write(f"{type(e).__name__}: {e}\n\n{traceback.format_exc()}")
        traceback.print_exc()
    finally:
        if dist.is_available() and dist.is_initialized():
            try:
                dist.barrier()
                dist.destroy_process_group()
            except BaseException:
                traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(0 if ok else 1)


# ----------------------------------------------------------------------------- parent


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_seconds() -> tuple[float, float] | None:
    """(CPU-seconds busy on the whole machine, CPU-seconds used by this process and its
    reaped children), or None off Linux. Their difference over a run is other people's load."""
    try:
        with open("/proc/stat") as f:
            vals = [int(v) for v in f.readline().split()[1:9]]
        busy = (sum(vals) - vals[3] - vals[4]) / os.sysconf("SC_CLK_TCK")
        t = os.times()
        return busy, t.user + t.system + t.children_user + t.children_system
    except (OSError, ValueError, IndexError):
        return None


def _first_error_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else "unknown error"


# First-line fragments of errors that a rank raises because another rank failed first.
_SECONDARY_ERRORS = ("Connection closed by peer", "Timed out waiting", "Connection reset by peer", "timed out", "Broken pipe")


def _kill(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()  # only the processes this script spawned, by their handle
    for p in procs:
        p.join(timeout=5)


def run_system(key: str, cfg: dict, run_dir: str, timeout_s: float, grace_s: float = 10.0) -> dict:
    """Spawn world_size ranks for one system; return its result or its error. Never hangs."""
    os.makedirs(run_dir, exist_ok=True)
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, key, cfg, port, run_dir), daemon=True)
        for r in range(cfg["world_size"])
    ]
    for p in procs:
        p.start()
    start = time.monotonic()
    failed_at = None
    reason = None
    try:
        while True:
            if all(not p.is_alive() for p in procs):
                break
            now = time.monotonic()
            errs = [f for f in os.listdir(run_dir) if f.startswith("error")]
            if failed_at is None and (errs or any(p.exitcode not in (None, 0) for p in procs)):
                failed_at = now
            if failed_at is not None and now - failed_at > grace_s:
                reason = "killed: other ranks did not exit after a rank failed"
                break
            if now - start > timeout_s:
                reason = f"timeout: no result within {timeout_s:.0f} s"
                break
            time.sleep(0.05)
    finally:
        _kill(procs)

    errors = [Path(run_dir, f) for f in os.listdir(run_dir) if f.startswith("error")]
    if errors:
        # Report the root cause: a rank's own error before its peers' lost-connection or
        # timed-out errors, and the earliest one among those.
        def rank_key(path: Path):
            text = path.read_text()
            secondary = any(m in text.split("\n", 1)[0] for m in _SECONDARY_ERRORS)
            return (secondary, path.stat().st_mtime)

        text = min(errors, key=rank_key).read_text()
        return {"error": _first_error_line(text), "traceback": text, "log_dir": run_dir}
    result_file = Path(run_dir, "result.json")
    if result_file.exists() and all(p.exitcode == 0 for p in procs):
        return json.loads(result_file.read_text())
    if reason is None:
        codes = [p.exitcode for p in procs]
        reason = f"ranks exited with codes {codes} and no result"
    return {"error": reason, "log_dir": run_dir}


def _versions() -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__}
    for dist_name in ("deepspeed", "numpy"):
        try:
            out[dist_name] = metadata.version(dist_name)
        except metadata.PackageNotFoundError:
            out[dist_name] = "not installed"
    return out


def _poplar_precheck() -> str | None:
    """None if `import poplar` works and has the API this script calls, else the error."""
    try:
        import poplar

        for name in ("Plan", "initialize"):
            if not hasattr(poplar, name):
                return f"poplar has no attribute {name!r} (engine not written yet?)"
        return None
    except BaseException as e:
        return f"import poplar failed: {type(e).__name__}: {e}"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=20, help="timed optimizer steps per system per round")
    p.add_argument("--warmup", type=int, default=3, help="untimed optimizer steps first")
    p.add_argument("--rounds", type=int, default=3, help="round-robin passes over all systems")
    p.add_argument(
        "--systems",
        default="all",
        help="comma list of: " + ",".join(s.key for s in SYSTEMS) + " (or 'all', 'peers', 'poplar')",
    )
    p.add_argument("--json", default=None, metavar="PATH", help="write the results here")
    p.add_argument("--accum", type=int, default=1, help="micro-steps per optimizer step")
    p.add_argument("--micro-batch", type=int, default=4, help="samples per micro-batch per rank")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--vocab", type=int, default=2000)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--pg-timeout", type=float, default=120.0, help="process-group timeout in every rank (s)")
    p.add_argument("--run-timeout", type=float, default=300.0, help="hard limit for one system in one round (s)")
    p.add_argument("--timeout", type=float, default=1200.0, help="hard limit for the whole benchmark (s)")
    p.add_argument("--poplar-config", default="{}", metavar="JSON",
                   help='poplar.EngineConfig fields for the Poplar systems, e.g. \'{"unit_numel": 2000000}\'')
    p.add_argument("--log-dir", default=None, help="keep every rank's log here (default: a temp dir, removed)")
    args = p.parse_args(argv)
    for name in ("world_size", "steps", "rounds", "accum", "micro_batch", "d_model", "layers", "heads", "seq_len", "vocab"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    if args.systems in ("all", ""):
        keys = [s.key for s in SYSTEMS]
    elif args.systems == "peers":
        keys = [s.key for s in SYSTEMS if not s.poplar]
    elif args.systems == "poplar":
        keys = [s.key for s in SYSTEMS if s.poplar]
    else:
        keys = [k.strip() for k in args.systems.split(",") if k.strip()]
        bad = [k for k in keys if k not in SYSTEM_BY_KEY]
        if bad:
            p.error(f"unknown system(s) {bad}; choose from {[s.key for s in SYSTEMS]}")
    args.system_keys = [s.key for s in SYSTEMS if s.key in keys]  # canonical order
    return args


def _short(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def report(results: dict, keys: list[str]) -> list[str]:
    """The table (and the Poplar verdict lines) as text lines; also fills in ratios."""
    fastest_peer = {}
    for g in GROUP_NAMES:
        peers = [
            (results[k]["median_ms"], SYSTEM_BY_KEY[k].label)
            for k in keys
            if SYSTEM_BY_KEY[k].group == g and not SYSTEM_BY_KEY[k].poplar and results[k].get("median_ms") is not None
        ]
        if peers:
            fastest_peer[g] = min(peers)
    headers = ["group", "system", "ms/step", "vs fastest peer", "each round (ms/step)", "loss first -> last"]
    rows = []
    for k in keys:
        s, r = SYSTEM_BY_KEY[k], results[k]
        if r.get("median_ms") is None:
            rows.append([GROUP_NAMES[s.group], s.label, "-", "-", None, _short(f"unavailable: {r.get('error', '?')}")])
            continue
        fp = fastest_peer.get(s.group)
        ratio = r["median_ms"] / fp[0] if fp else None
        r["ratio_to_fastest_peer"] = ratio
        r["fastest_peer"] = fp[1] if fp else None
        rounds = " ".join(f"{m:.1f}" for m in r["round_wall_ms"])
        losses = f"{r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}"
        rows.append(
            [GROUP_NAMES[s.group], s.label, f"{r['median_ms']:.1f}", "-" if ratio is None else f"{ratio:.3f}x", rounds, losses]
        )
    # An unavailable row (None in column 4) prints its reason after the columns, unpadded.
    widths = [
        max([len(h)] + [len(row[i]) for row in rows if i < 4 or row[4] is not None]) for i, h in enumerate(headers)
    ]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)), "  ".join("-" * w for w in widths)]
    prev_group = None
    for row in rows:
        if prev_group is not None and row[0] != prev_group:
            lines.append("")
        shown = list(row)
        if shown[0] == prev_group:
            shown[0] = ""
        prev_group = row[0]
        if shown[4] is None:
            lines.append("  ".join(c.ljust(w) for c, w in zip(shown[:4], widths)) + "  " + shown[5])
        else:
            lines.append("  ".join(c.ljust(w) for c, w in zip(shown, widths)).rstrip())
    lines.append("")
    for k in keys:
        s, r = SYSTEM_BY_KEY[k], results[k]
        if not s.poplar:
            continue
        stage = s.group
        if r.get("median_ms") is None:
            lines.append(_short(f"poplar stage {stage}: unavailable: {r.get('error', '?')}"))
        elif stage not in fastest_peer:
            lines.append(f"poplar stage {stage}: {r['median_ms']:.1f} ms/step (no peer ran in this group)")
        else:
            lines.append(f"poplar stage {stage}: {r['ratio_to_fastest_peer']:.2f}x the fastest peer ({fastest_peer[stage][1]})")
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.monotonic()
    deadline = t_start + args.timeout
    cfg = {
        "world_size": args.world_size,
        "steps": args.steps,
        "warmup": args.warmup,
        "accum": args.accum,
        "micro_batch": args.micro_batch,
        "d_model": args.d_model,
        "layers": args.layers,
        "heads": args.heads,
        "seq_len": args.seq_len,
        "vocab": args.vocab,
        "seed": args.seed,
        "lr": 1e-3,
        "n_batches": 4,
        "pg_timeout": args.pg_timeout,
        "poplar_config": json.loads(args.poplar_config),
    }
    n_params = sum(p.numel() for p in build_model(cfg).parameters())
    versions = _versions()
    print("versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    print(
        f"config: world {args.world_size} ranks (gloo, CPU, 1 thread each), model d_model {args.d_model}, "
        f"{args.layers} layers, {args.heads} heads, seq {args.seq_len}, vocab {args.vocab}, "
        f"{n_params / 1e6:.2f}M params; micro-batch {args.micro_batch}/rank x accum {args.accum} "
        f"= global batch {args.micro_batch * args.accum * args.world_size}; AdamW lr 1e-3 fp32; "
        f"{args.warmup} warm-up + {args.steps} timed steps x {args.rounds} rounds"
    )
    print(f"systems: {', '.join(args.system_keys)}")

    poplar_error = None
    if any(SYSTEM_BY_KEY[k].poplar for k in args.system_keys):
        poplar_error = _poplar_precheck()
        if poplar_error:
            print(f"poplar: {poplar_error} -- running the peers only")

    log_root = args.log_dir or tempfile.mkdtemp(prefix="poplar_bench_")
    keep_logs = args.log_dir is not None
    results = {k: {"step_s": [], "round_medians_ms": [], "round_wall_ms": [], "losses": None, "error": None}
               for k in args.system_keys}
    if poplar_error:
        for k in args.system_keys:
            if SYSTEM_BY_KEY[k].poplar:
                results[k]["error"] = poplar_error
    interrupted = False
    max_other = 0.0
    try:
        for rnd in range(args.rounds):
            # Alternate the order each round, so that whatever running first or second
            # in a round does to a system (caches, clocks) falls on every system alike.
            order = args.system_keys if rnd % 2 == 0 else list(reversed(args.system_keys))
            for k in order:
                if results[k]["error"]:
                    continue  # failures are deterministic; do not retry them every round
                left = deadline - time.monotonic()
                if left <= 5:
                    results[k]["error"] = f"skipped: overall --timeout {args.timeout:.0f} s reached"
                    continue
                run_dir = os.path.join(log_root, f"round{rnd}_{k}")
                t0, cpu0 = time.monotonic(), _cpu_seconds()
                r = run_system(k, cfg, run_dir, timeout_s=min(args.run_timeout, left))
                wall, cpu1 = time.monotonic() - t0, _cpu_seconds()
                # CPU cores kept busy by processes that are not this benchmark, on average.
                other = max(0.0, ((cpu1[0] - cpu0[0]) - (cpu1[1] - cpu0[1])) / wall) if cpu0 and cpu1 else None
                if other is not None:
                    results[k].setdefault("other_load_cores", []).append(other)
                    max_other = max(max_other, other)
                if "error" in r:
                    results[k]["error"] = r["error"]
                    results[k]["traceback"] = r.get("traceback")
                    print(f"[round {rnd + 1}/{args.rounds}] {k:16s} FAILED ({wall:.0f} s): {r['error']}", flush=True)
                    if r.get("traceback"):
                        tb = r["traceback"].strip().splitlines()
                        print("    " + "\n    ".join(tb[-6:]), flush=True)
                    continue
                med = r["wall_step_s"] * 1e3
                results[k]["step_s"].extend(r["step_s"])
                results[k]["round_wall_ms"].append(med)
                results[k]["round_medians_ms"].append(statistics.median(r["step_s"]) * 1e3)
                results[k]["losses"] = r["losses"]
                results[k]["setup_s"] = r["setup_s"]
                print(
                    f"[round {rnd + 1}/{args.rounds}] {k:16s} {med:8.1f} ms/step  "
                    f"(setup {r['setup_s']:.1f} s, run {wall:.0f} s, threads {r['num_threads']}"
                    + ("" if other is None else f", other load {other:.2f} cores")
                    + ")",
                    flush=True,
                )
    except KeyboardInterrupt:
        interrupted = True
        print("interrupted; reporting what finished", flush=True)
    finally:
        if not keep_logs and not interrupted:
            shutil.rmtree(log_root, ignore_errors=True)

    for k in args.system_keys:
        r = results[k]
        if r["step_s"] and not r["error"]:
            r["median_ms"] = statistics.median(r["round_wall_ms"])
            r["per_step_max_ms"] = statistics.median(r["step_s"]) * 1e3
        else:
            r["median_ms"] = None
            if r["error"] is None:
                r["error"] = "no result"
    print()
    lines = report(results, args.system_keys)
    print("\n".join(lines))
    print(f"\ntotal wall time {time.monotonic() - t_start:.0f} s; ms/step = median over rounds of (wall time of the timed "
          "steps between two barriers) / steps")
    ran = [k for k in args.system_keys if results[k]["median_ms"] is not None]
    if len(ran) > 1:
        ref = ran[0]
        diffs = {k: abs(results[k]["losses"][-1] - results[ref]["losses"][-1]) for k in ran[1:]}
        worst = max(diffs, key=diffs.get)
        print(
            f"loss check: final loss {results[ref]['losses'][-1]:.5f} ({ref}); largest difference from it "
            f"{diffs[worst]:.2e} ({worst})"
        )
    if max_other > 0.25:
        print(
            f"warning: other processes kept up to {max_other:.2f} of {os.cpu_count()} CPU cores busy during some "
            "runs; step times on this machine are then inflated and noisy (see 'each round')"
        )

    if args.json:
        out = {
            "versions": versions,
            "config": {**cfg, "rounds": args.rounds, "n_params": n_params},
            "systems": {
                k: {
                    "group": GROUP_NAMES[SYSTEM_BY_KEY[k].group],
                    "label": SYSTEM_BY_KEY[k].label,
                    "poplar": SYSTEM_BY_KEY[k].poplar,
                    **{f: v for f, v in results[k].items()},
                }
                for k in args.system_keys
            },
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
