"""`poplar train`: profile (or reuse the cache), plan, and train with the plan.

The launcher prepares the data once (the tokenizer is cached, so the ranks read it
back), obtains a plan (``--plan``, or profile + plan on the emulated cluster, or on the
real CUDA devices when there is no cluster file; the chosen stage's Poplar allocation
or a baseline), writes it to the run's directory and launches one process per device.
Each rank trains on its slice of every global batch
(:class:`poplar.data.text.GlobalBatches`), and rank 0 writes one JSON line per step:
loss, step time, samples/s, tokens/s, achieved TFLOP/s, and every rank's busy and idle
time. Checkpoints (``torch.distributed.checkpoint``) are sharded and atomic; ``resume``
continues from the newest one exactly where an uninterrupted run would be.

Model FLOPs per token, as counted here: ``6 * N + 12 * L * d * s`` for a training step
(forward and backward), with ``N`` the parameters outside the input embedding, ``L``
layers, ``d`` the hidden size and ``s`` the sequence length (the attention scores).
On real and emulated GPUs the log also holds the model FLOPs utilisation (MFU): that
rate over the sum of every GPU's peak dense TFLOP/s in the compute dtype (the
catalogue's, :mod:`poplar.cluster.catalogue`, a cluster file's declared figures, or
``peak_tflops`` in the config). Times are on the devices' clock: an emulated cluster's
are its declared seconds, and a step where an emulated device's real work ran past its
declared time says so (``overruns``).
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import threading
from pathlib import Path

import torch
import torch.distributed as dist

import poplar
from poplar.train import faults
from poplar.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from poplar.train.config import TrainConfig
from poplar.workload import Workload


def flops_per_token(model: torch.nn.Module, wl: Workload) -> float:
    n = sum(p.numel() for p in model.parameters())
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else getattr(model, "embed", None)
    if embed is not None:
        n -= embed.weight.numel()
    cfg = getattr(model, "config", None)
    layers = getattr(cfg, "num_hidden_layers", None) or len(getattr(model, "blocks", [])) or 1
    hidden = getattr(cfg, "hidden_size", None) or getattr(getattr(model, "embed", None), "embedding_dim", 0)
    return 6.0 * n + 12.0 * layers * hidden * wl.seq_len


def _peak_tflops(device, cfg: TrainConfig) -> float:
    """This rank's peak TFLOP/s for MFU (0: unknown, or the host's CPU)."""
    from poplar.cluster.catalogue import peak_tflops
    from poplar.devices.cuda import CudaDevice
    from poplar.emulate import EmulatedDevice
    from poplar.profile.profiler import compute_dtype

    dtype = compute_dtype(cfg.mixed_precision)
    if isinstance(device, EmulatedDevice):
        return device.kind.peak_tflops(dtype)
    if not isinstance(device, CudaDevice):
        return 0.0
    return cfg.peak_tflops or peak_tflops(device.properties.name, dtype) or 0.0


def learning_rate(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up, then cosine decay to a tenth over the run (a function of the step: resumable)."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def prepare_data(cfg: TrainConfig):
    from poplar.data.text import GlobalBatches, load_text, pack, train_tokenizer

    docs = load_text(cfg.data)
    tok = train_tokenizer(docs, cfg.vocab_size)
    seqs = pack(docs, tok, cfg.seq_len)
    return tok, GlobalBatches(seqs, cfg.global_batch, seed=cfg.seed)


def _train_rank(rank: int, world_size: int, cfg_dict: dict, plan_dict: dict, wl_dict: dict,
                return_state: bool = False) -> dict:
    from poplar.cluster.spec import load_cluster
    from poplar.devices import Device, rank_device
    from poplar.devices.cuda import CudaDevice

    cfg, wl = TrainConfig(**cfg_dict), Workload(**wl_dict)
    if cfg.cluster:
        device = rank_device(load_cluster(cfg.cluster), rank, wl)
    elif _on_cuda():   # a real GPU: its steps timed on the GPU, so busy and idle times mean what they say
        device = CudaDevice()
    else:
        device = Device()
    with device:
        return _train(device, rank, world_size, cfg, poplar.Plan.from_dict(plan_dict), wl, return_state)


class Preemption:
    """SIGTERM (what Slurm and Kubernetes send) asks for a checkpoint at the end of the step; a second stops now."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def __enter__(self) -> Preemption:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)

    def _on_sigterm(self, signum, frame) -> None:
        if self.requested:
            print("poplar: a second SIGTERM: stopping now, without a checkpoint", file=sys.stderr, flush=True)
            os._exit(128 + signal.SIGTERM)
        self.requested = True


def _agree(flag: bool) -> bool:
    """True on every rank when ``flag`` is on any (a signal may reach the ranks at different steps)."""
    from poplar.engine.dist import context

    t = torch.tensor([1.0 if flag else 0.0], device=context().device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)


def _resume_from(ckpt_root: Path, rank: int) -> Path | None:
    """The newest intact checkpoint, chosen by rank 0 (it reports damaged ones) and the same on every rank."""
    from poplar.engine.dist import context
    from poplar.train.checkpoint import CheckpointError, complete_checkpoints, find_resumable

    step = torch.tensor([-1], dtype=torch.int64, device=context().device)
    if rank == 0:
        path = find_resumable(ckpt_root, report=lambda line: print(f"poplar: {line}", file=sys.stderr, flush=True))
        if path is not None:
            step[0] = int(path.name.split("-")[1])
        elif complete_checkpoints(ckpt_root):
            step[0] = -2
    dist.broadcast(step, src=0)
    if int(step) == -2:
        raise CheckpointError(f"no intact checkpoint under {ckpt_root} (every one is damaged, see above): "
                              "start a new run with another --out")
    return None if int(step) < 0 else ckpt_root / f"step-{int(step):08d}"


def _keep_log_before(log_path: Path, start: int) -> None:
    """A resumed run repeats the steps after its checkpoint: their earlier records go (the rest stay)."""
    if not log_path.exists():
        return
    kept = [line for line in log_path.read_text().splitlines() if line.strip() and json.loads(line)["step"] < start]
    tmp = log_path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, log_path)


def _train(device, rank: int, world_size: int, cfg: TrainConfig, plan, wl: Workload, return_state: bool) -> dict:
    from poplar.train.recovery import StepRecovery
    from poplar.train.watchdog import Watchdog, lost_peer, store_address

    _, batches = prepare_data(cfg)
    model = wl.build(seed=cfg.seed)
    fpt = flops_per_token(model, wl)
    peak = _peak_tflops(device, cfg)
    optimizer = lambda params: torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)  # noqa: E731
    engine = poplar.initialize(model, optimizer, plan, clip_grad_norm=cfg.clip_grad_norm,
                               mixed_precision=None if cfg.mixed_precision == "none" else cfg.mixed_precision,
                               on_nonfinite="skip" if cfg.on_nonfinite == "skip" else "raise")
    out_dir = Path(cfg.out)
    ckpt_root = out_dir / "checkpoints"
    expect = _expect(cfg, wl, plan.global_batch_size)
    meta = {**expect, "world_size": world_size, "zero_stage": plan.zero_stage, "plan": plan.to_dict()}
    start = 0
    if cfg.resume:
        path = _resume_from(ckpt_root, rank)
        if path is not None:
            start = load_checkpoint(engine, path, expect)["step"]
            if rank == 0:
                print(f"resuming after step {start} from {path}", flush=True)
    where = {"step": start}
    fault_hooks = faults.install(engine.model, rank, lambda: where["step"] + 1)
    watchdog = None
    if world_size > 1 and store_address() is not None:
        watchdog = Watchdog(rank, world_size, dead_after_s=cfg.dead_rank_timeout_s, where=lambda: (
            f"during step {where['step'] + 1}; last complete checkpoint: {latest_checkpoint(ckpt_root) or 'none'}"
            f" (continue with `poplar train --resume --out {cfg.out}`)")).start()
    if rank == 0 and cfg.resume:
        _keep_log_before(out_dir / "log.jsonl", start)
    log = open(out_dir / "log.jsonl", "a") if rank == 0 else None

    def replanned(new_plan, notice: dict) -> None:
        meta["plan"], meta["plan_changed_at_step"] = new_plan.to_dict(), notice["step"]
        if rank == 0:
            print(f"poplar: rank {notice['rank']} ran out of memory in step {notice['step']} with micro-batches of "
                  f"{notice['micro_batch']} ({notice['error']}); its micro-batches are lowered to "
                  f"{new_plan.micro_batch_sizes[notice['rank']]}, the plan is now {new_plan}; the step runs again",
                  flush=True)
            _keep_aside(out_dir / "plan.json")
            new_plan.save(out_dir / "plan.json")
    recovery = StepRecovery(rank, engine, replanned)
    tokens = plan.global_batch_size * wl.seq_len
    losses = []
    last = min(cfg.steps, cfg.stop_at or cfg.steps)
    preempted = None
    try:
        with Preemption() as preemption:
            dist.barrier()                       # the ranks start together
            for step in range(start, last):
                where["step"] = step
                for group in engine.optimizer.param_groups:
                    group["lr"] = learning_rate(cfg, step)
                overruns, skipped = device.overruns, engine.skipped_steps
                faults.shrink(device, rank, step + 1)

                def attempt():
                    local = batches.local(step, engine.plan, rank)
                    with device.step(engine.held_state):   # waits for the other ranks included
                        return engine.train_batch(local, wl.loss)
                loss = recovery.run(step, attempt)
                losses.append(loss)
                logging = step % cfg.log_every == 0 or step == last - 1 or engine.skipped_steps > skipped
                if logging:                              # every rank: the figures are gathered
                    record = _gather_figures(device, engine, world_size, overruns, peak)
                if logging and log is not None:
                    _log_step(log, record, cfg, plan, step, loss, tokens, fpt, engine.skipped_steps > skipped)
                done = step + 1
                faults.point("collective", rank, done)
                stop = _agree(preemption.requested)
                if (cfg.checkpoint_every and done % cfg.checkpoint_every == 0) or done == last or stop:
                    save_checkpoint(engine, ckpt_root, done, meta, keep=cfg.keep_checkpoints)
                if stop:
                    preempted = done
                    if rank == 0:
                        print(f"poplar: preempted (SIGTERM) after step {done}: checkpoint {ckpt_root}/step-"
                              f"{done:08d} written; continue with `poplar train --resume --out {cfg.out}`",
                              flush=True)
                    break
    except BaseException as e:
        if watchdog is not None:
            watchdog.fail(str(e).splitlines()[0] if str(e) else type(e).__name__, lost_peer=lost_peer(e))
        raise
    finally:
        if log is not None:
            log.close()
    state = engine.full_state_dict() if return_state else None
    for h in fault_hooks:
        h.remove()
    engine.close()
    if watchdog is not None:
        watchdog.finished()
    return {"losses": losses, "start": start, "state": state if rank == 0 else None, "preempted": preempted}


def _expect(cfg: TrainConfig, wl: Workload, global_batch: int) -> dict:
    """What a checkpoint must share with the run that resumes it; world, plan and stage may change."""
    return {"workload": wl.model_dump(), "global_batch": global_batch, "seed": cfg.seed, "data": cfg.data}


def _check_resume(cfg: TrainConfig, wl: Workload, plan) -> None:
    """Before anything is written: a resume that would fail (damaged checkpoints, another run's) fails now."""
    from poplar.train.checkpoint import check_resumable

    if cfg.resume:
        check_resumable(Path(cfg.out) / "checkpoints", _expect(cfg, wl, plan.global_batch_size))


def _gather_figures(device, engine, world_size: int, overruns: int, peak: float) -> dict:
    from poplar.engine.dist import context

    figures = torch.tensor([device.step_s, device.compute_s, device.overruns - overruns, peak],
                           dtype=torch.float64, device=context().device)   # NCCL: on the GPU
    every = [torch.zeros_like(figures) for _ in range(world_size)]
    dist.all_gather(every, figures)
    return {"step_s": max(float(f[0]) for f in every), "busy": [float(f[1]) for f in every],
            "overran": int(sum(float(f[2]) for f in every)), "peaks": [float(f[3]) for f in every],
            "grad_norm": engine.last_grad_norm}


def _log_step(log, fig: dict, cfg: TrainConfig, plan, step: int, loss: float, tokens: int, fpt: float,
              skipped: bool) -> None:
    step_s, busy, overran = fig["step_s"], fig["busy"], fig["overran"]
    grad_norm = fig["grad_norm"] if fig["grad_norm"] is None or math.isfinite(fig["grad_norm"]) else None
    record = {"step": step, "loss": loss if math.isfinite(loss) else None, "lr": learning_rate(cfg, step),
              "step_s": step_s, "samples_per_s": plan.global_batch_size / step_s, "tokens_per_s": tokens / step_s,
              "tflops": fpt * tokens / step_s / 1e12, "busy_s": busy,
              "idle_s": [max(0.0, step_s - b) for b in busy], "grad_norm": grad_norm, "overruns": overran}
    if skipped:
        record["skipped"] = "non-finite loss or gradient: the update was left out"
    if all(p > 0 for p in fig["peaks"]):
        record["mfu"] = record["tflops"] / sum(fig["peaks"])
    log.write(json.dumps(record) + "\n")
    log.flush()
    print(f"step {step + 1}/{cfg.steps}  loss {loss:.4f}  {record['samples_per_s']:,.0f} samples/s  "
          f"{record['tflops']:.1f} TFLOP/s" + (f" (MFU {100 * record['mfu']:.1f}%)" if "mfu" in record else "")
          + f"  most idle {100 * max(record['idle_s']) / step_s:.0f}%"
          + (f"  {overran} overruns" if overran else "") + ("  SKIPPED (non-finite)" if skipped else ""),
          flush=True)


def get_plan(cfg: TrainConfig, wl: Workload, world_size: int, distributed: bool = False):
    """The plan to train with, and the planner's result (None with --plan or when resuming)."""
    if cfg.plan:
        plan = _load_plan_for(cfg, wl)
        plan.check_world_size(world_size)
        return plan, None
    previous = Path(cfg.out) / "plan.json"
    if cfg.resume and previous.exists() and _same_cluster(cfg, world_size):   # the run's own plan, as it was
        return poplar.Plan.load(previous), None
    from poplar.cluster.spec import load_cluster
    from poplar.planner import make_plan
    from poplar.profile.discover import discover_cluster
    from poplar.profile.profiler import compute_dtype, profile_cluster

    if cfg.cluster:
        spec = load_cluster(cfg.cluster)
    elif distributed and _on_cuda():   # no cluster file: the ranks' own GPUs
        spec = discover_cluster()
    else:
        raise ValueError("without a cluster file only real CUDA ranks are profiled (torchrun's on GPUs, or the one "
                         "GPU here), and these are plain CPU ranks: give --plan, or --cluster FILE|PRESET for an "
                         "emulated cluster")
    spec.check_world_size(world_size)
    profile, _ = profile_cluster(wl, spec.model_dump(), stages=tuple(cfg.stages), use_cache=cfg.profile_cache,
                                 max_micro_batch=min(256, cfg.global_batch), distributed=distributed,
                                 dtype=compute_dtype(cfg.mixed_precision))
    result = make_plan(profile, cfg.global_batch, cfg.stages)
    if cfg.baseline == "poplar":
        return result.plan, result
    alloc = result.stages[result.stage].allocations[cfg.baseline]
    if alloc.plan is None:
        raise ValueError(f"the {cfg.baseline} baseline cannot run stage {result.stage}: {alloc.why_not}")
    return alloc.plan, result


def _load_plan_for(cfg: TrainConfig, wl: Workload):
    """``cfg.plan``, refused where it was planned for another model or sequence length, or is not a plan."""
    path = Path(cfg.plan)
    if not path.is_file():
        raise ValueError(f"--plan {path}: no such file; give a plan.json written by `poplar plan` or by hand")
    try:
        data = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"--plan {path}: not valid JSON ({e}); write it again with `poplar plan`") from None
    planned = (data.get("meta") or {}).get("model") if isinstance(data, dict) else None
    if planned and (planned.get("name"), planned.get("seq_len")) != (wl.model, wl.seq_len):
        raise ValueError(f"--plan {path} was planned for {planned.get('name')} at {planned.get('seq_len')} tokens "
                         f"per sample, this run trains {wl.model} at {wl.seq_len}: plan for this model "
                         "(`poplar profile` then `poplar plan`), or leave --plan out")
    try:
        plan = poplar.Plan.from_dict(data)
    except (ValueError, TypeError) as e:
        raise ValueError(f"--plan {path}: {e}") from None
    if plan.global_batch_size != cfg.global_batch and "global_batch" in cfg.model_fields_set:
        raise ValueError(f"--plan {path} splits a global batch of {plan.global_batch_size} samples, and "
                         f"--global-batch is {cfg.global_batch}: give one of them (the plan's is used without it)")
    return plan


def _cluster_record(cfg: TrainConfig, world_size: int) -> dict:
    """What the run's cluster was, to tell on resume whether it changed (a changed one is planned anew)."""
    from poplar.cluster.spec import load_cluster

    if cfg.cluster:
        return {"world_size": world_size, "cluster": load_cluster(cfg.cluster).model_dump(mode="json")}
    return {"world_size": world_size, "cluster": None}


def _same_cluster(cfg: TrainConfig, world_size: int) -> bool:
    recorded = Path(cfg.out) / "cluster.json"
    try:
        return json.loads(recorded.read_text()) == _cluster_record(cfg, world_size)
    except (OSError, ValueError):
        return False


def _check_out(cfg: TrainConfig, restarted: bool = False) -> Path:
    """Refuse to clobber an earlier run, or to resume one that is not there."""
    out_dir = Path(cfg.out)
    held = out_dir.exists() and ((out_dir / "log.jsonl").exists() or (out_dir / "checkpoints").exists())
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"--out {out_dir} is a file: give a directory for the run")
    if held and not cfg.resume:
        raise ValueError(f"{out_dir} already holds a run: pass --resume to continue it, or choose another --out "
                         "(nothing is overwritten)")
    if cfg.resume and not held and not restarted:
        raise ValueError(f"--resume: {out_dir} holds no run to continue (no log, no checkpoints): check --out, "
                         "or leave --resume out to start one")
    return out_dir


def _write_run_files(cfg: TrainConfig, out_dir: Path, plan, result) -> None:
    import yaml

    if result is not None:   # the plan trained on top (what --resume reads), the planner's figures beside it
        d = result.to_dict()
        if plan != result.plan:   # a baseline's allocation: its plan and its prediction
            d.update(plan.to_dict(), predicted=result.stages[result.stage].allocations[cfg.baseline].predicted.to_dict())
        d["meta"]["allocation"] = cfg.baseline
        _keep_aside(out_dir / "plan.json")
        (out_dir / "plan.json").write_text(json.dumps(d, indent=2) + "\n")
    elif not (out_dir / "plan.json").exists() or poplar.Plan.load(out_dir / "plan.json") != plan:
        _keep_aside(out_dir / "plan.json")
        plan.save(out_dir / "plan.json")
    _keep_aside(out_dir / "config.yaml")
    (out_dir / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(), sort_keys=False))
    (out_dir / "cluster.json").write_text(json.dumps(_cluster_record(cfg, plan.world_size), indent=2) + "\n")


def _keep_aside(path: Path) -> None:
    """A resumed run's earlier plan or config is kept beside the new one (``plan.1.json``, ...), not overwritten."""
    if not path.exists():
        return
    n = 1
    while path.with_name(f"{path.stem}.{n}{path.suffix}").exists():
        n += 1
    path.rename(path.with_name(f"{path.stem}.{n}{path.suffix}"))


def _finish(cfg: TrainConfig, out_dir: Path, plan, result, mine: dict) -> dict:
    from poplar.train.report import plot_runs, read_log, summarize

    records = read_log(out_dir / "log.jsonl")
    report = plot_runs({cfg.baseline: records}, out_dir / "report.png", title=f"{cfg.model}, {plan}")
    return {"plan": plan, "planning": result, "summary": summarize(records), "report": report, **mine}


def run_training(cfg: TrainConfig, return_state: bool = False, timeout_s: float = 3600,
                 nproc: int | None = None) -> dict:
    """Train; returns rank 0's losses (and full parameters if asked).

    Under ``torchrun`` this process is one rank (every rank calls this). Otherwise it
    launches the ranks itself: one per device of ``cfg.cluster``, or ``nproc`` plain
    CPU ranks with ``cfg.plan``.
    """
    from poplar.profile.discover import cuda_devices_here

    if "WORLD_SIZE" in os.environ:
        return _run_under_torchrun(cfg, return_state)
    gpus = cuda_devices_here()
    if not cfg.cluster and nproc is None and gpus == 1:   # the one GPU here: this process is its rank
        return _run_under_torchrun(cfg, return_state)
    from poplar.cluster.spec import load_cluster
    from poplar.launch import spawn

    out_dir = _check_out(cfg)
    if cfg.cluster:
        world = load_cluster(cfg.cluster).world_size
        if nproc is not None and nproc != world:
            raise ValueError(f"--nproc {nproc}, but the cluster file describes {world} devices: give one of them")
    elif nproc:
        world = nproc
    elif gpus > 1:
        raise ValueError(f"{gpus} CUDA devices here: launch one rank per device, `torchrun --standalone "
                         f"--nproc-per-node {gpus} -m poplar.cli.main train ...`; or give --cluster FILE|PRESET "
                         "(an emulated cluster), or --nproc with --plan (plain CPU ranks)")
    else:
        raise ValueError("no cluster file and no CUDA device to discover here: give --cluster FILE|PRESET (an "
                         "emulated cluster), or --nproc with --plan (plain CPU ranks), or launch under torchrun")
    tok, _ = prepare_data(cfg)
    wl = Workload(model=cfg.model, seq_len=cfg.seq_len, vocab_size=tok.get_vocab_size())
    plan, result = get_plan(cfg, wl, world)
    _check_resume(cfg, wl, plan)
    out_dir.mkdir(parents=True, exist_ok=True)     # only now: a run refused writes nothing
    _write_run_files(cfg, out_dir, plan, result)
    ranks = spawn(_train_rank, world, cfg.model_dump(), plan.to_dict(), wl.model_dump(), return_state,
                  timeout_s=timeout_s)
    plan = poplar.Plan.load(out_dir / "plan.json")    # the ranks lower it when one runs out of memory
    return _finish(cfg, out_dir, plan, result, ranks[0])


def _on_cuda() -> bool:
    """This rank computes on its own GPU (the process group runs over NCCL)."""
    from poplar.engine.dist import context

    return dist.is_initialized() and context().device.type == "cuda"


def _run_under_torchrun(cfg: TrainConfig, return_state: bool) -> dict:
    """This process is one rank: torchrun's, or a group of one here (``init_distributed`` makes it)."""
    from poplar.engine.dist import init_distributed, shutdown

    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    if restarted:     # torchrun restarted the group after a failure: continue from the newest checkpoint
        cfg = cfg.model_copy(update={"resume": True})
    out_dir = _check_out(cfg, restarted)    # every rank sees the same directory: all refuse alike
    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        if rank == 0:
            out_dir.mkdir(parents=True, exist_ok=True)
            prepare_data(cfg)                   # trains and caches the tokenizer once
        dist.barrier()
        tok, _ = prepare_data(cfg)
        wl = Workload(model=cfg.model, seq_len=cfg.seq_len, vocab_size=tok.get_vocab_size())
        plan, result = get_plan(cfg, wl, world, distributed=True)
        _check_resume(cfg, wl, plan)
        if rank == 0:
            _write_run_files(cfg, out_dir, plan, result)
        dist.barrier()
        mine = _train_rank(rank, world, cfg.model_dump(), plan.to_dict(), wl.model_dump(), return_state)
        return _finish(cfg, out_dir, plan, result, mine) if rank == 0 else {"plan": plan, **mine}
    finally:
        shutdown()
