"""The `poplar` command line."""

from __future__ import annotations

import os
from pathlib import Path

# On a GPU: segments that grow rather than new blocks beside old ones, so a step's memory is
# not lost to fragmentation (set before CUDA starts; a setting of the user's own is kept)
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import typer

from poplar.cli.inputs import (BAD_INPUT_ERRORS, BAD_INPUT_IN_RANKS, _check_writable, _error,  # noqa: F401
                               is_bad_input_in_rank, stages_option)
from poplar.cli.output import CHECKPOINTING_HELP, Progress, say
from poplar.cli.output import console as _console
from poplar.cli.demo import demo
from poplar.lazy import imported_for_good

app = typer.Typer(help="Poplar: ZeRO data parallelism for clusters of different GPUs.", no_args_is_help=True,
                  add_completion=False)


@app.callback()
def main() -> None:
    """Poplar: ZeRO data parallelism for clusters of different GPUs."""


app.command()(demo)     # the main job, first in the help (its command, defined beside this file)


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
                                           "llama-small, llama-125m, llama-350m, bert-tiny, bert-small, bert-base; "
                                           "or a Hugging Face model directory (./my-model) or its config.json"),
    seq_len: int | None = typer.Option(None, help="tokens per sample (Hugging Face presets; default 128)"),
    activation_checkpointing: bool = typer.Option(False, "--activation-checkpointing", help=CHECKPOINTING_HELP),
    cluster: str | None = typer.Option(None, help="cluster YAML file, or a preset (e.g. both-differ, two-node-10gbe; "
                                                  "a wrong name lists them all); none (or left out): the real CUDA "
                                                  "devices the ranks run on, discovered"),
    out: Path = typer.Option(Path("profile.json"), help="where to write the profile (JSON)"),
    plot: Path | None = typer.Option(None, help="also draw the fitted curves here (PNG)"),
    stages: str = typer.Option("0,1,2,3", help="ZeRO stages to profile, comma-separated"),
    points: int = typer.Option(6, min=2, help="micro-batch sizes timed per stage"),
    repeats: int | None = typer.Option(None, min=1, help="timed rounds after a warm-up round, the median counts "
                                       "(default: 3 on GPUs, 1 on an emulated cluster, whose time is deterministic)"),
    no_cache: bool = typer.Option(False, "--no-cache", help="measure again even where a cached profile exists"),
    max_micro_batch: int = typer.Option(256, min=1, help="largest micro-batch the memory search tries"),
    mixed_precision: str = typer.Option("none", help="the compute of the training to plan: none (fp32), bf16 or "
                                                     "fp16 (the engine's mixed precisions)"),
) -> None:
    """Measure every device kind of a cluster (emulated, or the real CUDA devices) in every ZeRO stage."""
    import contextlib
    import time

    from poplar.cli.inputs import refused_early

    console = _console()
    refused_early(console, [cluster], model, mixed_precision)   # what arithmetic refuses, before torch is imported
    from poplar.profile.options import ProfileOptions
    from poplar.profile.plot import plot_profile
    from poplar.profile.report import cluster_line, comm_line, profile_table
    from poplar.profile.run import run_profile

    imported_for_good()     # this command's process (under torchrun, a rank): the probe's collections scan less
    try:
        options = ProfileOptions(stages=stages, n_points=points, repeats=repeats, use_cache=not no_cache,
                                 max_micro_batch=max_micro_batch, precision=mixed_precision)
        workload, spec = _profile_inputs(model, seq_len, activation_checkpointing, cluster, options.precision)
    except (ValueError, FileNotFoundError) as e:
        _error(console, e)
        raise typer.Exit(2) from None
    start = time.perf_counter()
    shown = os.environ.get("RANK", "0") == "0"   # under torchrun, rank 0 reports
    with (Progress(console, f"profile of {model}: {cluster_line(spec)}", steps=(repeats or 3) + 3) if shown
          else contextlib.nullcontext()) as progress:
        result = run_profile(workload, spec, options, progress=progress)
    if result is None:
        return
    prof, summary = result
    prof.save(out)
    console.print(profile_table(prof, summary, f"profile of {model} ({prof.model.n_params:,} parameters, "
                                               f"{options.precision}), {time.perf_counter() - start:.0f} s"))
    for line in (comm_line(prof), f"wrote {out}", plot and f"wrote {plot_profile(prof, plot)}"):
        if line:
            say(console, line)


def _profile_inputs(model: str, seq_len: int | None, activation_checkpointing: bool, cluster: str | None,
                    precision: str):
    """``poplar profile``'s workload and cluster, refused in one line (ValueError) where wrong."""
    from pydantic import ValidationError

    from poplar.profile.run import cluster_to_profile
    from poplar.workload import model_source

    try:
        workload = model_source(model, seq_len=seq_len, activation_checkpointing=activation_checkpointing)
    except ValidationError as e:
        raise ValueError(f"--model/--seq-len: {e.errors()[0]['msg']}") from None
    spec = cluster_to_profile(cluster)   # the real GPUs discovered: this joins their process group
    spec.check_precision(precision)
    return workload, spec


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
    from poplar.planner import make_plan
    from poplar.planner.report import comparison_table, stage_table
    from poplar.profile.profile import Profile

    console = _console()
    try:
        stage_list = stages_option(stages)
        _check_writable(out, "--out")
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
    except BAD_INPUT_ERRORS as e:   # PlanningError is one
        _error(console, e)
        raise typer.Exit(2) from None
    for sp in [*result.stages.values(), *result.shaped.values()]:
        if not sp.excluded and (all_stages or sp is result.chosen):
            console.print(stage_table(result, sp))
    console.print(comparison_table(result))
    say(console, f"chosen: {result.reason}")
    result.save(out)
    say(console, f"wrote {out} ({result.plan.summary()})")


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
    model: str | None = typer.Option(None, help="model preset, e.g. llama-tiny, bert-tiny, llama-125m, or a "
                                                "Hugging Face model directory (./my-model)"),
    cluster: str | None = typer.Option(None, help="emulated cluster: a preset or a YAML file; none: the real CUDA "
                                                  "devices (discovered), or plain ranks with --plan"),
    global_batch: int | None = typer.Option(None, help="samples per optimizer step"),
    steps: int | None = typer.Option(None, help="optimizer steps"),
    plan: str | None = typer.Option(None, help="train with this plan.json (no profiling or planning)"),
    baseline: str | None = typer.Option(None, help="poplar (default), uniform, proportional or measured-peak"),
    out: str | None = typer.Option(None, help="run directory: log, plan, checkpoints"),
    resume: bool = typer.Option(False, "--resume", help="continue from the newest checkpoint in --out"),
    nproc: int | None = typer.Option(None, min=1, help="without --cluster: this many plain CPU ranks (with --plan)"),
    data: str | None = typer.Option(None, help="'embedded', a .txt file, or a table: .jsonl/.csv/.parquet/.arrow "
                                               "(fields text; prompt + completion; input_ids), a saved dataset"),
    export: str | None = typer.Option(None, help="at the end, write the model here as a directory from_pretrained "
                                                 "loads (new or empty)"),
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
    from poplar.cli.inputs import refused_early

    console = _console()
    # a cluster file's fields and figures, and a precision it lacks, before torch is imported
    refused_early(console, [cluster], precision=_set_precision(set_))
    from poplar.launch import RankFailed
    from poplar.train.config import load_config
    from poplar.train.run import run_training

    imported_for_good()     # this command's process (under torchrun, a rank): the probe's collections scan less
    cfg = None
    overrides = {"model": model, "cluster": cluster, "global_batch": global_batch, "steps": steps, "plan": plan,
                 "baseline": baseline, "out": out, "resume": resume or None, "data": data, "export": export}
    try:
        cfg = load_config(config, {**overrides, **_set_options(set_)})
        shown = os.environ.get("RANK", "0") == "0"   # under torchrun, rank 0 reports the profiling
        shows = (lambda title, **kw: Progress(console, title, **kw)) if shown else None
        result = run_training(cfg, nproc=nproc, progress=shows)
    except BAD_INPUT_ERRORS as e:
        _error(console, e)
        raise typer.Exit(2) from None
    except RankFailed as e:
        _error(console, f"{e.line}{_where_run_stands(cfg)}")
        raise typer.Exit(2 if is_bad_input_in_rank(e.error) else 1) from None
    except (TimeoutError, RuntimeError, FloatingPointError) as e:   # this process is a rank (torchrun's)
        line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        _error(console, f"{line}{_where_run_stands(cfg)}")
        raise typer.Exit(1) from None
    _say_trained(console, cfg, result)


def _set_precision(items: list[str]) -> str | None:
    """``--set mixed_precision=...`` where given and read (None otherwise: the config's, checked later)."""
    try:
        value = _set_options(items).get("mixed_precision")
    except ValueError:
        return None
    return value if isinstance(value, str) else None


def _set_options(items: list[str]) -> dict:
    """``--set field=value`` options: each value read as YAML (numbers, lists, booleans)."""
    import yaml

    fields = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r}: write field=value")
        try:
            fields[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError as e:
            raise ValueError(f"--set {item!r}: the value is not YAML ({getattr(e, 'problem', None) or e}); quote "
                             "it or write it as YAML, e.g. --set stages=[0,1]") from None
    return fields


def _replanned(replans: list[dict]) -> str:
    """Each re-plan: when, and its step time predicted and then measured."""
    if not replans:
        return ""
    each = "; ".join(f"after step {r['after_step']}: {1e3 * r['predicted_step_s']:.3g} ms a step predicted"
                     + (f", {1e3 * r['measured_after_s']:.3g} measured" if r.get("measured_after_s") else "")
                     for r in replans)
    return f"; re-planned {len(replans)} time{'s' if len(replans) > 1 else ''} ({each}: the log says why)"


def _say_trained(console, cfg, result: dict) -> None:
    if result.get("preempted"):
        say(console, f"preempted: stopped after step {result['preempted']} with a checkpoint; continue with "
                     f"`poplar train --resume --out {cfg.out}`")
        return
    losses = result["losses"]
    if losses and "summary" in result:      # rank 0 (or the launcher)
        s = result["summary"]
        say(console, f"trained steps {result['start'] + 1}-{cfg.steps} with {result['plan']}: "
                     f"loss {losses[0]:.3f} -> {losses[-1]:.3f}; steady steps (median): "
                     f"{s['samples_per_s']:.1f} samples/s, {s['tokens_per_s']:,.0f} tokens/s, "
                     f"{s['tflops']:.2f} TFLOP/s" + (f", MFU {100 * s['mfu']:.1f}%" if "mfu" in s else "")
                     + _replanned(s.get("replans", []))
                     + f"; log {cfg.out}/log.jsonl, report {result['report']}")
    if result.get("exported"):
        say(console, f"exported the model to {result['exported']} (from_pretrained loads it)")


@app.command()
def export(
    run: Path = typer.Argument(..., help="a run directory of `poplar train` (its --out)"),
    out: Path = typer.Option(..., help="the directory to write (new or empty): config, safetensors, tokenizer"),
) -> None:
    """Write a run's newest intact checkpoint as a Hugging Face model directory (from_pretrained loads it)."""
    from poplar.launch import RankFailed
    from poplar.train.export import export_run

    console = _console()
    try:
        if not (run / "checkpoints").is_dir():
            raise ValueError(f"{run}: no checkpoints: give the --out of a `poplar train` run")
        written = export_run(run, out)
    except BAD_INPUT_ERRORS as e:
        _error(console, e)
        raise typer.Exit(2) from None
    except RankFailed as e:
        _error(console, e.line)
        raise typer.Exit(1) from None
    say(console, f"exported {run} to {written} (from_pretrained loads it)")


@app.command()
def bench(
    cluster: str = typer.Option("all", help="a preset, a YAML file, several comma-separated, or 'all' (every preset)"),
    model: str = typer.Option("llama-tiny", help="model preset, or a Hugging Face model directory (./my-model)"),
    seq_len: int | None = typer.Option(64, help="tokens per sample (Hugging Face presets)"),
    vocab_size: int | None = typer.Option(1024, help="vocabulary (Hugging Face presets; as `poplar train`)"),
    activation_checkpointing: bool = typer.Option(False, "--activation-checkpointing", help=CHECKPOINTING_HELP),
    global_batch: int = typer.Option(256, min=1, help="samples per optimizer step (large beside every device's "
                                                        "micro-batch, as in training at scale)"),
    steps: int = typer.Option(12, min=3, help="measured steps per allocation"),
    json_out: Path | None = typer.Option(None, "--json", help="also write the figures here"),
    no_cache: bool = typer.Option(False, "--no-cache", help="profile again"),
    no_peers: bool = typer.Option(False, "--no-peers", help="leave DeepSpeed out (measured where it is installed)"),
    mixed_precision: str = typer.Option("none", help="what the engine computes in: none (fp32), bf16 or fp16 "
                                                     "(DeepSpeed is measured in fp32 alone)"),
) -> None:
    """Measure Poplar's plan against the uniform, proportional and measured-peak splits, DeepSpeed, the ideal bound."""
    from poplar.cli.inputs import refused_early

    # each cluster file's fields and figures, before torch is imported
    refused_early(_console(), [] if cluster.strip() == "all" else [c.strip() for c in cluster.split(",")])
    from poplar.bench import bench_clusters, check_clusters, results_table
    from poplar.precision import precision as canonical_precision
    from poplar.workload import model_source

    console = _console()
    try:   # everything that can be refused is, before anything is profiled
        builtin = model in ("tiny", "small", "base")
        workload = model_source(model, seq_len=None if builtin else seq_len,
                                vocab_size=None if builtin else vocab_size,
                                activation_checkpointing=activation_checkpointing)
        precision = canonical_precision(mixed_precision)
        names = check_clusters(cluster, global_batch, precision)
        _check_writable(json_out, "--json")
    except BAD_INPUT_ERRORS as e:
        _error(console, e)
        raise typer.Exit(2) from None
    results, failed = bench_clusters(
        names, workload, global_batch, steps, use_cache=not no_cache, peers=not no_peers, json_out=json_out,
        precision=precision,
        progress=lambda c: Progress(console, f"{c}: profiling (cached after the first run), planning, measuring"))
    if results:
        table, notes = results_table(results, f"{model}, global batch {global_batch}, {precision}: measured, {steps} "
                                              "steps per allocation")
        console.print(table)
        for note in notes:
            say(console, note)
    for line in failed:
        _error(console, line)
    if json_out:
        say(console, f"wrote {json_out}")
    if failed:
        raise typer.Exit(1)


from poplar.cli.simulate import simulate  # noqa: E402  (its command, defined beside this file)

app.command()(simulate)

if __name__ == "__main__":
    app()
