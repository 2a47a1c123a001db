#!/usr/bin/env python
"""Step-time benchmark: Poplar's ZeRO stages against their peers, on CPU with gloo.

Every system trains the same model (a :class:`poplar.models.workload.Workload` preset, same
seed, so identical initial weights) on the same batches with the same optimizer
(``torch.optim.AdamW``, lr 1e-3, fp32). Each (round, system) pair runs in its own
launch of ``--world-size`` ranks (:func:`poplar.processes.spawn.spawn`: gloo, one torch thread
per rank). Systems run round-robin ``--rounds`` times; a system's number is the median
over its rounds of the wall time of its timed steps between two barriers, per step
(the JSON also keeps every step's slowest-rank time).

Groups (what each one shards), the peers from :mod:`poplar.compare.peers`:

    stage 0 / replicas            torch DDP, Poplar stage 0
    stage 1 / optimizer states    ZeroRedundancyOptimizer + DDP, DeepSpeed ZeRO-1, Poplar stage 1
    stage 2 / + gradients         DeepSpeed ZeRO-2, FSDP2 (reshard_after_forward=False), Poplar stage 2
    stage 3 / + parameters        DeepSpeed ZeRO-3, FSDP2 (reshard_after_forward=True), Poplar stage 3

Run ``python bench/bench_engine.py --help`` for the flags; see bench/README.md.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path

from pydantic import ValidationError

# Before anything imports deepspeed (the spawned ranks inherit it).
os.environ.setdefault("DS_ACCELERATOR", "cpu")

# Benchmark the poplar of this checkout, whether or not it is installed.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import poplar  # noqa: E402
from poplar.processes.spawn import RankFailed, spawn  # noqa: E402
from poplar.compare.peers import deepspeed  # noqa: E402
from poplar.compare.peers.torch_peers import NAMES as TORCH_NAMES  # noqa: E402
from poplar.compare.peers.torch_peers import TorchSetup  # noqa: E402
from poplar.models.workload import Workload  # noqa: E402

GROUP_NAMES = {0: "stage 0 / replicas", 1: "stage 1 / optimizer states", 2: "stage 2 / + gradients",
               3: "stage 3 / + parameters"}


@dataclass(frozen=True)
class System:
    key: str
    stage: int      # the ZeRO stage whose group it is compared in
    kind: str       # "torch", "deepspeed" or "poplar"

    @property
    def label(self) -> str:
        return {"torch": TORCH_NAMES[self.stage], "deepspeed": f"DeepSpeed ZeRO-{self.stage}",
                "poplar": f"Poplar stage {self.stage}"}[self.kind]


SYSTEMS = [System("ddp", 0, "torch"), System("poplar0", 0, "poplar"),
           System("zero_redundancy", 1, "torch"), System("ds1", 1, "deepspeed"), System("poplar1", 1, "poplar"),
           System("ds2", 2, "deepspeed"), System("fsdp2_grad_op", 2, "torch"), System("poplar2", 2, "poplar"),
           System("ds3", 3, "deepspeed"), System("fsdp2_full", 3, "torch"), System("poplar3", 3, "poplar")]
SYSTEM_BY_KEY = {s.key: s for s in SYSTEMS}


@dataclass(frozen=True)
class Settings:
    """What every system is run with (crosses into the ranks)."""

    workload: Workload
    world_size: int
    micro_batch: int
    accum: int
    steps: int
    warmup: int
    seed: int
    poplar_config: dict = field(default_factory=dict)
    lr: float = 1e-3
    n_batches: int = 4      # distinct global batches, cycled


# ----------------------------------------------------------------------------- in every rank


def local_batches(s: Settings, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's slice of each of a few fixed global batches (the same for every system)."""
    n = s.micro_batch * s.accum
    out = []
    for j in range(s.n_batches):
        x, y = s.workload.random_batch(n * s.world_size, seed=s.seed + 1000 + j)
        out.append((x[rank * n:(rank + 1) * n].contiguous(), y[rank * n:(rank + 1) * n].contiguous()))
    return out


def start(system: System, s: Settings):
    """``(step, close)``: one optimizer step of ``system`` on a local batch, and its release."""
    wl, w = s.workload, s.world_size
    if system.kind == "poplar":
        plan = poplar.Plan(zero_stage=system.stage, micro_batch_sizes=[s.micro_batch] * w, accum_steps=[s.accum] * w)
        engine = poplar.initialize(wl.build(seed=s.seed), functools.partial(torch.optim.AdamW, lr=s.lr), plan,
                                   s.poplar_config)
        return (lambda batch: engine.train_batch(batch, wl.loss)), engine.close
    # DeepSpeed with its own bucket sizes (hidden_size=None), as its users get it.
    make = TorchSetup if system.kind == "torch" else functools.partial(deepspeed.DeepSpeedSetup, hidden_size=None)
    peer = make(zero_stage=system.stage, micro_batch_size=s.micro_batch, accum_steps=s.accum, world_size=w,
                lr=s.lr, seed=s.seed).start(wl)
    return peer.train_batch, peer.close


def run_rank(rank: int, world_size: int, key: str, s: Settings, run_dir: str) -> dict:
    """One system on this rank: warm-up, timed steps between barriers; the figures all-reduced over ranks."""
    log = open(os.path.join(run_dir, f"rank{rank}.log"), "w", buffering=1)   # DeepSpeed is loud
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    data = local_batches(s, rank)
    t0 = time.perf_counter()
    step, close = start(SYSTEM_BY_KEY[key], s)
    torch.set_num_threads(1)   # in case a system changed it
    setup_s = time.perf_counter() - t0
    losses = [step(data[i % len(data)]) for i in range(s.warmup)]
    dist.barrier()
    dist.barrier()   # the first barrier's exits are staggered; the second starts everyone together
    times, t_loop = [], time.perf_counter()
    for i in range(s.warmup, s.warmup + s.steps):
        t0 = time.perf_counter()
        losses.append(step(data[i % len(data)]))
        times.append(time.perf_counter() - t0)
    dist.barrier()
    wall_step_s = (time.perf_counter() - t_loop) / s.steps
    step_s = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(step_s, op=dist.ReduceOp.MAX)   # a step takes as long as its slowest rank
    loss = torch.tensor([float(v) for v in losses], dtype=torch.float64)
    dist.all_reduce(loss)
    close()
    t = os.times()   # this rank's CPU: its launcher does not reap it (the ranks are forked from a server)
    return {"step_s": step_s.tolist(), "wall_step_s": wall_step_s, "losses": (loss / world_size).tolist(),
            "setup_s": setup_s, "num_threads": torch.get_num_threads(), "cpu_s": t.user + t.system}


# ----------------------------------------------------------------------------- the parent


def run_system(key: str, s: Settings, run_dir: str, timeout_s: float, pg_timeout_s: float) -> dict:
    """Launch ``world_size`` ranks for one system; its result, or ``{"error": one line, "traceback": ...}``."""
    os.makedirs(run_dir, exist_ok=True)
    try:
        ranks = spawn(run_rank, s.world_size, key, s, run_dir, timeout_s=timeout_s,
                      collective_timeout_s=pg_timeout_s)
        return {**ranks[0], "cpu_s": sum(r["cpu_s"] for r in ranks)}
    except RankFailed as e:
        return {"error": e.line, "traceback": str(e)}
    except TimeoutError as e:
        return {"error": f"timeout: {e}"}


def _cpu_seconds() -> tuple[float, float] | None:
    """(CPU-seconds the whole machine was busy, CPU-seconds of this process and its reaped children); None off
    Linux. Their difference over a run, less the ranks' own CPU, is other people's load."""
    try:
        with open("/proc/stat") as f:
            vals = [int(v) for v in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    t = os.times()
    return (sum(vals) - vals[3] - vals[4]) / os.sysconf("SC_CLK_TCK"), t.user + t.system + t.children_user + \
        t.children_system


def _timed_run(key: str, s: Settings, run_dir: str, timeout_s: float,
               pg_timeout_s: float) -> tuple[dict, float, float | None]:
    """``run_system`` with its wall time and the CPU cores other processes kept busy meanwhile."""
    t0, cpu0 = time.monotonic(), _cpu_seconds()
    r = run_system(key, s, run_dir, timeout_s, pg_timeout_s)
    wall, cpu1 = time.monotonic() - t0, _cpu_seconds()
    ranks = r.get("cpu_s", 0.0)
    other = max(0.0, ((cpu1[0] - cpu0[0]) - (cpu1[1] - cpu0[1]) - ranks) / wall) if cpu0 and cpu1 else None
    return r, wall, other


def _run_once(k: str, rnd: int, args, s: Settings, log_root: str, res: dict) -> None:
    """One round of system ``k``: its figures (or its error) go into ``res``, and a progress line is printed."""
    left = args.deadline - time.monotonic()
    if left <= 5:
        res["error"] = f"skipped: overall --timeout {args.timeout:.0f} s reached"
        return
    r, wall, other = _timed_run(k, s, os.path.join(log_root, f"round{rnd}_{k}"), min(args.run_timeout, left),
                                args.pg_timeout)
    tag = f"[round {rnd + 1}/{args.rounds}] {k:16s}"
    if other is not None:
        res["other_load_cores"].append(other)
    if "error" in r:
        res.update(error=r["error"], traceback=r.get("traceback"))
        tail = (r.get("traceback") or "").strip().splitlines()[-6:]
        print(f"{tag} FAILED ({wall:.0f} s): {r['error']}" + "".join(f"\n    {t}" for t in tail), flush=True)
        return
    res["round_wall_ms"].append(r["wall_step_s"] * 1e3)
    res["step_s"] += r["step_s"]
    res.update(losses=r["losses"], setup_s=r["setup_s"])
    load = "" if other is None else f", other load {other:.2f} cores"
    print(f"{tag} {r['wall_step_s'] * 1e3:8.1f} ms/step  (setup {r['setup_s']:.1f} s, run {wall:.0f} s, "
          f"threads {r['num_threads']}{load})", flush=True)


def run_rounds(args, s: Settings, log_root: str) -> tuple[dict, bool]:
    """Every system, round-robin, each in its own launch: per system its figures or its error; and whether
    the run was interrupted (Ctrl-C: what finished is still reported)."""
    results = {k: {"round_wall_ms": [], "step_s": [], "losses": None, "error": None, "other_load_cores": []}
               for k in args.system_keys}
    missing = deepspeed.unavailable()
    for k in args.system_keys:
        if missing and SYSTEM_BY_KEY[k].kind == "deepspeed":
            results[k]["error"] = missing
    args.deadline = time.monotonic() + args.timeout
    interrupted = False
    try:
        for rnd in range(args.rounds):
            # Reverse the order every other round: what running first or last does falls on every system alike.
            for k in args.system_keys if rnd % 2 == 0 else reversed(args.system_keys):
                if not results[k]["error"]:   # failures are deterministic: not retried every round
                    _run_once(k, rnd, args, s, log_root, results[k])
    except KeyboardInterrupt:
        interrupted = True
        print("interrupted; reporting what finished", flush=True)
    for res in results.values():
        ran = bool(res["round_wall_ms"]) and not res["error"]
        res["median_ms"] = statistics.median(res["round_wall_ms"]) if ran else None
        res["per_step_max_ms"] = statistics.median(res["step_s"]) * 1e3 if ran else None
        res["error"] = res["error"] or (None if ran else "no result")
    return results, interrupted


def _short(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _fastest_peers(results: dict, keys: list[str]) -> dict[int, tuple[float, str]]:
    """Per stage, the fastest non-Poplar system that ran: (ms/step, label)."""
    out: dict[int, tuple[float, str]] = {}
    for k in keys:
        s, ms = SYSTEM_BY_KEY[k], results[k]["median_ms"]
        if s.kind != "poplar" and ms is not None:
            out[s.stage] = min(out.get(s.stage, (ms, s.label)), (ms, s.label))
    return out


def report(results: dict, keys: list[str]) -> list[str]:
    """The table, per group, and a verdict line per Poplar stage; fills in each row's ratio to the fastest peer."""
    fastest = _fastest_peers(results, keys)
    headers = ["group", "system", "ms/step", "vs fastest peer", "each round (ms/step)", "loss first -> last"]
    rows = []
    for k in keys:
        s, r = SYSTEM_BY_KEY[k], results[k]
        if r["median_ms"] is None:   # its reason follows the first four columns, unpadded
            rows.append(([GROUP_NAMES[s.stage], s.label, "-", "-"], _short(f"unavailable: {r['error']}")))
            continue
        fp = fastest.get(s.stage)
        r["ratio_to_fastest_peer"], r["fastest_peer"] = (r["median_ms"] / fp[0], fp[1]) if fp else (None, None)
        ratio = "-" if fp is None else f"{r['ratio_to_fastest_peer']:.3f}x"
        rows.append(([GROUP_NAMES[s.stage], s.label, f"{r['median_ms']:.1f}", ratio,
                      " ".join(f"{m:.1f}" for m in r["round_wall_ms"]),
                      f"{r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}"], None))
    widths = [max([len(h)] + [len(cells[i]) for cells, _ in rows if i < len(cells)]) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)), "  ".join("-" * w for w in widths)]
    previous = None
    for cells, reason in rows:
        group = cells[0]
        if previous is not None and group != previous:
            lines.append("")
        cells = ["" if group == previous else group, *cells[1:]]
        previous = group
        line = "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()
        lines.append(line if reason is None else f"{line}  {reason}")
    lines.append("")
    for k in keys:
        s, r = SYSTEM_BY_KEY[k], results[k]
        if s.kind != "poplar":
            continue
        if r["median_ms"] is None:
            lines.append(_short(f"poplar stage {s.stage}: unavailable: {r['error']}"))
        elif s.stage not in fastest:
            lines.append(f"poplar stage {s.stage}: {r['median_ms']:.1f} ms/step (no peer ran in this group)")
        else:
            lines.append(f"poplar stage {s.stage}: {r['ratio_to_fastest_peer']:.2f}x the fastest peer "
                         f"({fastest[s.stage][1]})")
    return lines


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=20, help="timed optimizer steps per system per round")
    p.add_argument("--warmup", type=int, default=3, help="untimed optimizer steps first")
    p.add_argument("--rounds", type=int, default=3, help="round-robin passes over all systems")
    p.add_argument("--systems", default="all",
                   help="comma list of: " + ",".join(SYSTEM_BY_KEY) + " (or 'all', 'peers', 'poplar')")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results here")
    p.add_argument("--accum", type=int, default=1, help="micro-steps per optimizer step")
    p.add_argument("--micro-batch", type=int, default=2, help="samples per micro-batch per rank")
    p.add_argument("--model", default="small", help="a poplar.models.workload.Workload model preset (default: small)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sample (Hugging Face presets only)")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary (Hugging Face presets only)")
    p.add_argument("--seed", type=int, default=1234, help="initial weights and batches")
    p.add_argument("--pg-timeout", type=float, default=120.0, help="collective timeout in every rank (s)")
    p.add_argument("--run-timeout", type=float, default=300.0, help="hard limit for one system in one round (s)")
    p.add_argument("--timeout", type=float, default=1200.0, help="hard limit for the whole benchmark (s)")
    p.add_argument("--poplar-config", default="{}", metavar="JSON",
                   help='poplar.EngineConfig fields for the Poplar systems, e.g. \'{"unit_numel": 2000000}\'')
    p.add_argument("--log-dir", default=None, help="keep every rank's log here (default: a temp dir, removed)")
    args = p.parse_args(argv)
    for name in ("world_size", "steps", "rounds", "accum", "micro_batch"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    try:
        args.workload = Workload(model=args.model, seq_len=args.seq_len, vocab_size=args.vocab)
    except ValidationError as e:
        p.error(f"--model/--seq-len/--vocab: {e.errors()[0]['msg'].removeprefix('Value error, ')}")
    try:
        fields = json.loads(args.poplar_config)
        args.poplar_config = poplar.EngineConfig(**fields).model_dump(exclude_unset=True)
    except ValidationError as e:
        p.error(f"--poplar-config: {'.'.join(map(str, e.errors()[0]['loc']))}: {e.errors()[0]['msg']}")
    except (ValueError, TypeError):
        p.error(f"--poplar-config: write a JSON object of poplar.EngineConfig fields; got {args.poplar_config!r}")
    groups = {"all": list(SYSTEM_BY_KEY), "": list(SYSTEM_BY_KEY),
              "peers": [s.key for s in SYSTEMS if s.kind != "poplar"],
              "poplar": [s.key for s in SYSTEMS if s.kind == "poplar"]}
    keys = groups.get(args.systems) or [k.strip() for k in args.systems.split(",") if k.strip()]
    bad = [k for k in keys if k not in SYSTEM_BY_KEY]
    if bad:
        p.error(f"unknown system(s) {bad}; choose from {list(SYSTEM_BY_KEY)}")
    args.system_keys = [k for k in SYSTEM_BY_KEY if k in keys]   # canonical order
    return args


def _versions() -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("deepspeed", "numpy"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def _summary(results: dict, keys: list[str], max_other: float) -> list[str]:
    """The loss check (every system should end on the same loss) and a warning about a busy machine."""
    lines = []
    ran = [k for k in keys if results[k]["median_ms"] is not None]
    if len(ran) > 1:
        last = {k: results[k]["losses"][-1] for k in ran}
        worst = max(ran[1:], key=lambda k: abs(last[k] - last[ran[0]]))
        lines.append(f"loss check: final loss {last[ran[0]]:.5f} ({ran[0]}); largest difference from it "
                     f"{abs(last[worst] - last[ran[0]]):.2e} ({worst})")
    if max_other > 0.25:
        lines.append(f"warning: other processes kept up to {max_other:.2f} of {os.cpu_count()} CPU cores busy during "
                     "some runs; step times on this machine are then inflated and noisy (see 'each round')")
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    wl, t_start = args.workload, time.monotonic()
    s = Settings(workload=wl, world_size=args.world_size, micro_batch=args.micro_batch, accum=args.accum,
                 steps=args.steps, warmup=args.warmup, seed=args.seed, poplar_config=args.poplar_config)
    versions = _versions()
    print("versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    print(f"config: world {s.world_size} ranks (gloo, CPU, 1 thread each), model {wl.model} "
          f"({wl.n_params() / 1e6:.2f}M params, seq {wl.seq_len}, vocab {wl.vocab_size}); micro-batch "
          f"{s.micro_batch}/rank x accum {s.accum} = global batch {s.micro_batch * s.accum * s.world_size}; "
          f"AdamW lr {s.lr:g} fp32; {s.warmup} warm-up + {s.steps} timed steps x {args.rounds} rounds")
    print(f"systems: {', '.join(args.system_keys)}", flush=True)
    log_root = args.log_dir or tempfile.mkdtemp(prefix="poplar_bench_")
    results, interrupted = run_rounds(args, s, log_root)
    if args.log_dir is None and not interrupted:
        shutil.rmtree(log_root, ignore_errors=True)
    elif interrupted:
        print(f"every rank's log: {log_root}")
    max_other = max((x for k in args.system_keys for x in results[k]["other_load_cores"]), default=0.0)
    print("\n" + "\n".join(report(results, args.system_keys)))
    print(f"\ntotal wall time {time.monotonic() - t_start:.0f} s; ms/step = median over rounds of (wall time of the "
          "timed steps between two barriers) / steps")
    for line in _summary(results, args.system_keys, max_other):
        print(line)
    if args.json:
        config = {**asdict(s), "workload": wl.model_dump(), "rounds": args.rounds, "n_params": wl.n_params()}
        systems = {k: {"group": GROUP_NAMES[SYSTEM_BY_KEY[k].stage], "label": SYSTEM_BY_KEY[k].label,
                       "poplar": SYSTEM_BY_KEY[k].kind == "poplar", **results[k]} for k in args.system_keys}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"versions": versions, "config": config, "systems": systems}, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
