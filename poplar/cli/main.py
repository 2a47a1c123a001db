"""The `poplar` command line."""

from __future__ import annotations

import os
from pathlib import Path

# On a GPU: segments that grow rather than new blocks beside old ones, so a step's memory is
# not lost to fragmentation (set before CUDA starts; a setting of the user's own is kept)
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import typer

app = typer.Typer(help="Poplar: ZeRO data parallelism for clusters of different GPUs.", no_args_is_help=True,
                  add_completion=False)


def _error(console, message) -> None:
    """One line on what went wrong; the message printed as it is (no markup read in it)."""
    from pydantic import ValidationError
    from rich.markup import escape

    if isinstance(message, ValidationError):
        message = "; ".join(f"{'.'.join(map(str, e['loc'])) or type(message).__name__}: {e['msg']}"
                            for e in message.errors())
    line = " ".join(part.strip() for part in str(message).splitlines() if part.strip())
    console.print(f"[red]error:[/] {escape(line)}", soft_wrap=True)


@app.callback()
def main() -> None:
    """Poplar: ZeRO data parallelism for clusters of different GPUs."""


@app.command()
def demo(
    steps: int = typer.Option(12, min=2, help="training steps per allocation (medians over all but the first)"),
    cluster: str = typer.Option("both-differ", help="emulated cluster: a preset or a YAML file"),
    out: Path = typer.Option(Path("runs/demo"), help="where the runs, the table and the plots go"),
    global_batch: int = typer.Option(96, min=1, help="samples per optimizer step, over all ranks"),
) -> None:
    """The main job: profile, plan and train a small Llama on real text with Poplar's plan and both baselines."""
    from poplar.demo import run_demo

    try:
        run_demo(steps=steps, cluster=cluster, out=out, global_batch=global_batch)
    except (ValueError, FileNotFoundError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None


@app.command()
def verify(steps: int = typer.Option(10, min=1, help="optimizer steps per ZeRO stage")) -> None:
    """Heterogeneous training on 3 local CPU ranks, every stage checked against one device."""
    from poplar.verify import run_verify

    rows = run_verify(steps)
    worst = max(r["max_param_error"] for r in rows)
    if worst > 1e-4:
        typer.echo(f"parameters differ from single-device training by {worst:.2e}", err=True)
        raise typer.Exit(1)


@app.command()
def profile(
    model: str = typer.Option("tiny", help="model preset: tiny, small, base (built-in), or llama-tiny, "
                                           "llama-small, llama-125m, llama-350m, bert-tiny, bert-small, bert-base"),
    seq_len: int | None = typer.Option(None, help="tokens per sample (Hugging Face presets; default 128)"),
    cluster: str | None = typer.Option(None, help="cluster YAML file, or a preset: memory-differs, compute-differs, "
                                                  "both-differ, uneven-quantity; none (or left out): the real CUDA "
                                                  "devices the ranks run on, discovered"),
    out: Path = typer.Option(Path("profile.json"), help="where to write the profile (JSON)"),
    plot: Path | None = typer.Option(None, help="also draw the fitted curves here (PNG)"),
    stages: str = typer.Option("0,1,2,3", help="ZeRO stages to profile, comma-separated"),
    points: int = typer.Option(6, min=2, help="micro-batch sizes timed per stage"),
    repeats: int | None = typer.Option(None, min=1, help="timed rounds after a warm-up round, the median counts "
                                       "(default: 3 on GPUs, 1 on an emulated cluster, whose time is deterministic)"),
    no_cache: bool = typer.Option(False, "--no-cache", help="measure again even where a cached profile exists"),
    max_micro_batch: int = typer.Option(256, min=1, help="largest micro-batch the memory search tries"),
    mixed_precision: str = typer.Option("none", help="the compute of the training to plan: none (fp32) or bf16 "
                                                     "(the engine's bf16 mixed precision)"),
) -> None:
    """Measure every device kind of a cluster (emulated, or the real CUDA devices) in every ZeRO stage."""
    import multiprocessing as mp
    import os
    import time

    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from poplar.cluster.spec import load_cluster
    from poplar.profile.plot import plot_profile
    from poplar.profile.profiler import compute_dtype, profile_cluster

    console = Console()
    under_torchrun = "WORLD_SIZE" in os.environ
    try:
        discover = cluster is None or cluster.strip().lower() in ("", "none")
        spec = None if discover else load_cluster(cluster)
        stage_list = sorted({int(s) for s in stages.split(",") if s.strip()})
        if not stage_list or any(s not in (0, 1, 2, 3) for s in stage_list):
            raise ValueError(f"--stages {stages!r}: give stages from 0, 1, 2, 3, e.g. 0,1,2,3")
        dtype = compute_dtype(mixed_precision)
        from pydantic import ValidationError

        from poplar.workload import Workload
        try:
            workload = Workload(model=model, seq_len=seq_len)
        except ValidationError as e:
            raise ValueError(f"--model/--seq-len: {e.errors()[0]['msg']}") from None
        if discover:
            spec = _discover_devices("profile")
    except (ValueError, FileNotFoundError) as e:
        _error(console, e)
        raise typer.Exit(2) from None
    if spec.is_real:
        console.print(f"profiling [bold]{model}[/] on {spec.world_size} CUDA ranks: "
                      + ", ".join(f"{d.count} x {d.kind}" for d in spec.devices))
    else:
        console.print(f"profiling [bold]{model}[/] on {spec.world_size} emulated ranks: "
                      + spec.describe())
    start = time.perf_counter()
    with Progress(console=console, transient=True, disable=under_torchrun and os.environ.get("RANK") != "0") as bar:
        task = bar.add_task("starting ranks", total=len(stage_list) * ((repeats or 3) + 3))

        class ToBar:   # progress events from rank 0 (in this process under torchrun)
            def put(self, event):
                bar.update(task, advance=1, description=f"stage {event[0]}: {event[1]}")

        if under_torchrun or spec.is_real:   # this process is a rank (torchrun's, or the one GPU's here)
            from poplar.engine.dist import init_distributed, shutdown

            ctx = init_distributed()
            spec.check_world_size(ctx.world_size)
            prof, summary = profile_cluster(workload, spec.model_dump(), stage_list, n_points=points, repeats=repeats,
                                            use_cache=not no_cache, progress=ToBar(), distributed=True,
                                            max_micro_batch=max_micro_batch, dtype=dtype)
            shutdown()
            if ctx.rank != 0:
                return
        else:
            queue = mp.get_context("spawn").Queue()

            def on_poll():
                while not queue.empty():
                    ToBar().put(queue.get())

            prof, summary = profile_cluster(workload, spec.model_dump(), stage_list, n_points=points, repeats=repeats,
                                            use_cache=not no_cache, progress=queue, on_poll=on_poll,
                                            max_micro_batch=max_micro_batch, dtype=dtype)
    prof.save(out)
    table = Table(title=f"profile of {model} ({prof.model.n_params:,} parameters, {dtype}), "
                        f"{time.perf_counter() - start:.0f} s")
    for col in ("device", "stage", "max mbs", "state MiB", "ms@1", "ms@max", "samples/s", "source"):
        table.add_column(col, justify="right", no_wrap=True)
    for kind, dev in prof.devices.items():
        for stage, sp in sorted(dev.stages.items()):
            source = "cache" if (kind, stage) in summary["from_cache"] else "measured"
            if sp.points:
                top = sp.max_micro_batch
                table.add_row(kind, str(stage), str(top), f"{sp.state_bytes / 2**20:.2f}", f"{1000 * sp.time(1):.1f}",
                              f"{1000 * sp.time(top):.1f}", f"{sp.throughput(top):.1f}", source)
            else:
                table.add_row(kind, str(stage), str(sp.max_micro_batch), f"{sp.state_bytes / 2**20:.2f}", "-", "-",
                              "-", sp.note or source)
    console.print(table)
    if prof.comm:
        c = prof.comm
        console.print(f"collectives at {c.numel:,} fp32 elements: all-reduce {1000 * c.all_reduce_s:.1f} ms, "
                      f"reduce-scatter {1000 * c.reduce_scatter_s:.1f} ms, all-gather {1000 * c.all_gather_s:.1f} ms")
    console.print(f"wrote {out}")
    if plot:
        console.print(f"wrote {plot_profile(prof, plot)}")


def _discover_devices(command: str):
    """The real CUDA devices the ranks run on; joins the process group (torchrun's, or one rank here)."""
    import os

    from poplar.engine.dist import init_distributed
    from poplar.profile.discover import cuda_devices_here, discover_cluster, no_devices_message

    n = cuda_devices_here()
    if n == 0:
        raise ValueError(no_devices_message())
    if "WORLD_SIZE" not in os.environ and n > 1:
        raise ValueError(f"{n} CUDA devices here: launch one rank per device, `torchrun --standalone "
                         f"--nproc-per-node {n} -m poplar.cli.main {command} ...` (or CUDA_VISIBLE_DEVICES=0 for one)")
    init_distributed()
    return discover_cluster()


@app.command()
def plan(
    profile: Path = typer.Option(..., help="a profile written by `poplar profile`"),
    global_batch: int = typer.Option(..., help="samples per optimizer step, over all ranks"),
    stages: str = typer.Option("0,1,2,3", help="ZeRO stages to consider, comma-separated"),
    out: Path = typer.Option(Path("plan.json"), help="where to write the chosen plan (JSON)"),
    all_stages: bool = typer.Option(False, "--all-stages", help="print every stage's per-rank table, "
                                                                  "not only the chosen one's"),
) -> None:
    """Choose the ZeRO stage and every rank's micro-batch and accumulation for the most throughput."""
    from rich.console import Console

    from poplar.planner import PlanningError, make_plan
    from poplar.planner.report import comparison_table, stage_table
    from poplar.profile.profile import Profile

    console = Console()
    try:
        stage_list = sorted({int(s) for s in stages.split(",") if s.strip()})
    except ValueError:
        stage_list = []
    try:
        if not stage_list or any(s not in (0, 1, 2, 3) for s in stage_list):
            raise ValueError(f"--stages {stages!r}: give stages from 0, 1, 2, 3, e.g. 0,1,2,3")
        if not profile.exists():
            raise ValueError(f"--profile {profile}: no such file; write one with `poplar profile`")
        try:
            prof = Profile.load(profile)
        except Exception as e:   # pydantic or JSON: say which file and what is wrong in it
            from pydantic import ValidationError

            what = ("; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors()[:3])
                    if isinstance(e, ValidationError) else str(e).splitlines()[0])
            raise ValueError(f"--profile {profile}: not a Poplar profile ({what}); write one with "
                             "`poplar profile`") from None
        result = make_plan(prof, global_batch, stage_list)
    except (ValueError, PlanningError) as e:
        _error(console, e)
        raise typer.Exit(2) from None
    for s, sp in result.stages.items():
        if not sp.excluded and (all_stages or s == result.stage):
            console.print(stage_table(result, sp))
    console.print(comparison_table(result))
    console.print(f"[bold]chosen:[/] {result.reason}")
    result.save(out)
    console.print(f"wrote {out} ({result.plan})")


BAD_INPUT_ERRORS = ("ValueError", "FileNotFoundError", "CheckpointError", "ValidationError", "TypeError")


def _where_run_stands(cfg) -> str:
    from poplar.train.checkpoint import latest_checkpoint

    if cfg is None:
        return ""
    last = latest_checkpoint(Path(cfg.out) / "checkpoints")
    return (f"; last complete checkpoint: {last} (continue with `poplar train --resume --out {cfg.out}`)"
            if last else "; no checkpoint was written")


@app.command()
def train(
    config: Path | None = typer.Option(None, help="a YAML file of training fields (see poplar/train/config.py)"),
    model: str | None = typer.Option(None, help="model preset, e.g. llama-tiny, bert-tiny, llama-125m"),
    cluster: str | None = typer.Option(None, help="emulated cluster: a preset or a YAML file; none: the real CUDA "
                                                  "devices (discovered), or plain ranks with --plan"),
    global_batch: int | None = typer.Option(None, help="samples per optimizer step"),
    steps: int | None = typer.Option(None, help="optimizer steps"),
    plan: str | None = typer.Option(None, help="train with this plan.json (no profiling or planning)"),
    baseline: str | None = typer.Option(None, help="poplar (default), uniform, proportional or measured-peak"),
    out: str | None = typer.Option(None, help="run directory: log, plan, checkpoints"),
    resume: bool = typer.Option(False, "--resume", help="continue from the newest checkpoint in --out"),
    nproc: int | None = typer.Option(None, min=1, help="without --cluster: this many plain CPU ranks (with --plan)"),
    set_: list[str] = typer.Option([], "--set", help="any other field: --set lr=3e-4 (repeatable)"),
) -> None:
    """Profile (or reuse the cache), plan, and train on an emulated heterogeneous cluster or the real CUDA devices.

    Under torchrun every process is one rank; with restarts the group resumes by itself from the newest intact
    checkpoint: torchrun --standalone --nproc-per-node 4 --max-restarts 3 -m poplar.cli.main train --out runs/x ...

    Under Slurm, one torchrun agent per node: srun --nodes 2 --ntasks-per-node 1 torchrun --nnodes 2
    --nproc-per-node 8 --max-restarts 3 --rdzv-backend c10d --rdzv-endpoint HOST:29500 -m poplar.cli.main train ...

    SIGTERM (preemption) finishes the step, writes a checkpoint and exits 0; a second SIGTERM stops at once. A dead
    rank stops every rank with one line naming it and the last checkpoint. --resume continues on this cluster or
    another (other devices, another world size: planned anew). See docs/reliability.md.
    """
    from rich.console import Console

    from poplar.launch import RankFailed
    from poplar.train.config import load_config
    from poplar.train.run import run_training

    console = Console()
    cfg = None
    overrides = {"model": model, "cluster": cluster, "global_batch": global_batch, "steps": steps, "plan": plan,
                 "baseline": baseline, "out": out, "resume": resume or None}
    try:
        for item in set_:
            key, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"--set {item!r}: write field=value")
            import yaml

            overrides[key.strip()] = yaml.safe_load(value)
        cfg = load_config(config, overrides)
        result = run_training(cfg, nproc=nproc)
    except (ValueError, FileNotFoundError) as e:
        _error(console, e)
        raise typer.Exit(2) from None
    except RankFailed as e:
        _error(console, f"{e.line}{_where_run_stands(cfg)}")
        raise typer.Exit(2 if e.error in BAD_INPUT_ERRORS else 1) from None
    except (TimeoutError, RuntimeError, FloatingPointError) as e:   # this process is a rank (torchrun's)
        line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        _error(console, f"{line}{_where_run_stands(cfg)}")
        raise typer.Exit(1) from None
    if result.get("preempted"):
        console.print(f"preempted: stopped after step {result['preempted']} with a checkpoint; continue with "
                      f"`poplar train --resume --out {cfg.out}`", soft_wrap=True)
        return
    losses = result["losses"]
    if losses and "summary" in result:      # rank 0 (or the launcher)
        s = result["summary"]
        console.print(f"trained steps {result['start'] + 1}-{cfg.steps} with {result['plan']}: "
                      f"loss {losses[0]:.3f} -> {losses[-1]:.3f}; steady steps (median): "
                      f"{s['samples_per_s']:.1f} samples/s, {s['tokens_per_s']:,.0f} tokens/s, "
                      f"{s['tflops']:.2f} TFLOP/s" + (f", MFU {100 * s['mfu']:.1f}%" if "mfu" in s else "")
                      + f"; log {cfg.out}/log.jsonl, report {result['report']}")


@app.command()
def bench(
    cluster: str = typer.Option("all", help="a preset, a YAML file, several comma-separated, or 'all' (every preset)"),
    model: str = typer.Option("llama-tiny", help="model preset"),
    seq_len: int | None = typer.Option(64, help="tokens per sample (Hugging Face presets)"),
    vocab_size: int | None = typer.Option(1024, help="vocabulary (Hugging Face presets; as `poplar train`)"),
    global_batch: int = typer.Option(256, min=1, help="samples per optimizer step (large beside every device's "
                                                        "micro-batch, as in training at scale)"),
    steps: int = typer.Option(12, min=3, help="measured steps per allocation"),
    json_out: Path | None = typer.Option(None, "--json", help="also write the figures here"),
    no_cache: bool = typer.Option(False, "--no-cache", help="profile again"),
    no_peers: bool = typer.Option(False, "--no-peers", help="leave DeepSpeed out (measured where it is installed)"),
) -> None:
    """Measure Poplar's plan against the uniform, proportional and measured-peak splits, DeepSpeed, the ideal bound."""
    import json

    from rich.console import Console
    from rich.table import Table

    from poplar.bench import bench_cluster, clusters
    from poplar.workload import Workload

    console = Console()
    try:
        builtin = model in ("tiny", "small", "base")
        workload = Workload(model=model, seq_len=None if builtin else seq_len,
                            vocab_size=None if builtin else vocab_size)
        results = []
        for c in clusters(cluster):
            console.print(f"[bold]{c}[/]: profiling (cached after the first run), planning, measuring")
            results.append(bench_cluster(c, workload, global_batch, steps, use_cache=not no_cache,
                                         peers=not no_peers))
    except (ValueError, FileNotFoundError) as e:
        _error(console, e)
        raise typer.Exit(2) from None
    table = Table(title=f"{model}, global batch {global_batch}: measured, {steps} steps per allocation")
    for col in ("cluster", "stage", "allocation", "samples/s", "vs uniform", "vs proportional",
                "vs measured-peak", "vs deepspeed", "of ideal", "predicted", "overruns"):
        table.add_column(col, justify="right")
    notes = []
    for r in results:
        rows = dict(r["allocations"])
        for name, peer in r["peers"].items():
            if isinstance(peer, dict):
                rows[name] = peer
            else:
                notes.append(f"{r['cluster']}: {name}: {peer}")

        def vs(a: dict, name: str) -> str:
            return f"{a['samples_per_s'] / rows[name]['samples_per_s']:.2f}x" if name in rows else "-"

        for name, a in rows.items():
            label = f"{name} (= {a['same_plan_as']})" if a.get("same_plan_as") else name
            error = f"{100 * a['prediction_error']:+.1f}%" if "prediction_error" in a else "-"
            table.add_row(r["cluster"], str(r["zero_stage"]), label, f"{a['samples_per_s']:.1f}",
                          vs(a, "uniform"), vs(a, "proportional"), vs(a, "measured-peak"), vs(a, "deepspeed"),
                          f"{100 * a['samples_per_s'] / r['ideal_samples_per_s']:.0f}%", error,
                          str(a.get("overruns", "-")))
        table.add_row(r["cluster"], str(r["zero_stage"]), "ideal", f"{r['ideal_samples_per_s']:.1f}",
                      "-", "-", "-", "-", "100%", "-", "-")
    console.print(table)
    console.print("samples/s: on an emulated cluster, in its devices' declared time; predicted: the plan's "
                  "predicted step time against the measured one; overruns: spans whose real work ran past "
                  "their declared time (0: the figures are the declared devices')", highlight=False)
    if any(a.get("same_plan_as") for r in results for a in r["allocations"].values()):
        console.print("(= name): the same plan as that allocation's, measured once", highlight=False)
    for note in notes:
        console.print(note, highlight=False)
    if json_out:
        json_out.write_text(json.dumps(results, indent=2) + "\n")
        console.print(f"wrote {json_out}")


if __name__ == "__main__":
    app()
