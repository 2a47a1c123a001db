"""The `poplar` command line."""

from __future__ import annotations

import inspect
import os
from pathlib import Path

# On a GPU: segments that grow rather than new blocks beside old ones, so a step's memory is
# not lost to fragmentation (set before CUDA starts; a setting of the user's own is kept)
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import typer

from poplar.cli.inputs import (BAD_INPUT_ERRORS, BAD_INPUT_IN_RANKS, _check_writable, _error,  # noqa: F401
                               is_bad_input_in_rank, refused_early, stages_option)
from poplar.cli.output import CHECKPOINTING_HELP, Progress, say
from poplar.cli.output import console as _console
from poplar.cli.demo import demo
from poplar.cli.train import train
from poplar.lazy import imported_for_good

# After the commands in `poplar --help`: the usual flow, one command a line
FLOW = """Start with the demo; then your model, step by step (here on an emulated preset; on real
GPUs, one process per GPU under torchrun with --cluster none):

  poplar demo
  poplar profile --cluster both-differ --model llama-tiny --seq-len 64 --out profile.json
  poplar plan --profile profile.json --global-batch 128 --out plan.json
  poplar train --cluster both-differ --model llama-tiny --plan plan.json --out runs/mine

Each command's --help has an example."""


def unwrapped(text: str) -> str:
    """``text`` as typer's help should show it: each paragraph of prose on one line, which the terminal wraps
    (typer keeps a docstring's line breaks, so a sentence would break where the source wraps), and each
    indented line (an example's command) on a line of its own.

    >>> print(unwrapped('''Plan a model.
    ...
    ...     Prints the plan
    ...     and writes it.
    ...
    ...     Example:
    ...       poplar plan --profile profile.json
    ...         --out plan.json'''))
    Plan a model.
    <BLANKLINE>
    Prints the plan and writes it.
    <BLANKLINE>
    Example:
      poplar plan --profile profile.json
        --out plan.json
    """
    lines: list[str] = []
    for line in inspect.cleandoc(text).splitlines():
        if lines and lines[-1] and line and not line.startswith(" ") and not lines[-1].startswith(" "):
            lines[-1] += " " + line
        else:
            lines.append(line)
    return "\n".join(lines)


app = typer.Typer(no_args_is_help=True, add_completion=False, epilog=unwrapped(FLOW))


@app.callback()
def main() -> None:
    """Poplar: ZeRO data parallelism that gives each GPU of a mixed cluster its own share of the batch."""


app.command()(demo)     # the main job, first in the help (its command, defined beside this file)


@app.command()
def verify(steps: int = typer.Option(10, min=1, help="optimizer steps per ZeRO stage")) -> None:
    """Check every ZeRO stage on 3 uneven CPU ranks against training on one device.

    Each rank takes its own micro-batch (and, in stages 0-1, its own accumulation steps); the parameters
    after every stage must match single-process training on the same batches (exit 1 where they do not).

    Example:
      poplar verify --steps 5
    """
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
    """Measure each device kind of a cluster in every ZeRO stage and write the profile.

    The cluster: a preset, a YAML file, or (left out) the real GPUs under torchrun. The profile is cached.

    Example:
      poplar profile --cluster both-differ --model llama-tiny --seq-len 64 --out profile.json
    """
    import contextlib
    import time

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
    """Choose the ZeRO stage and each rank's micro-batch and accumulation from a profile.

    Plans every stage asked for, prints each rank's share and Poplar's allocation beside the uniform,
    proportional and measured-peak ones, says why it chose the stage, and writes the plan, which
    poplar train --plan trains.

    Example:
      poplar plan --profile profile.json --global-batch 128 --out plan.json
    """
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


app.command()(train)   # defined beside this file, with what it reports


@app.command()
def export(
    run: Path = typer.Argument(..., help="a run directory of `poplar train` (its --out)"),
    out: Path = typer.Option(..., help="the directory to write (new or empty): config, safetensors, tokenizer"),
) -> None:
    """Write a run's newest intact checkpoint as a Hugging Face model directory.

    The run trained a Hugging Face model (a model directory or a preset such as llama-tiny); the
    directory written holds its config, weights (safetensors) and tokenizer, and from_pretrained loads it.
    A LoRA run's is its adapter, as PEFT saves one (with lora.merge, the merged model in merged/).

    Example:
      poplar export runs/mine --out mine-model
    """
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
    if (written / "adapter_config.json").is_file():    # a LoRA run's adapters (and, merged, the model beside them)
        merged = f"; the merged model in {written / 'merged'}" if (written / "merged").is_dir() else ""
        say(console, f"exported {run}'s adapter to {written} (peft.PeftModel.from_pretrained loads it onto the base "
                     f"model){merged}")
        return
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
    """Measure Poplar's plan against the baselines' splits on emulated clusters.

    On each cluster: profile (cached after the first run), plan, and train a few steps with Poplar's
    allocation and with the uniform, proportional and measured-peak ones (and DeepSpeed where it is
    installed), beside the ideal bound. Minutes a cluster.

    Example:
      poplar bench --cluster both-differ,compute-differs --steps 6 --no-peers
    """
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

for _command in app.registered_commands:   # each command's --help from its docstring, as it reads
    _command.help = _command.help or unwrapped(_command.callback.__doc__ or "")

if __name__ == "__main__":
    app()
