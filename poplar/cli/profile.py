"""`poplar profile`: each device kind of a cluster measured in every ZeRO stage (:mod:`poplar.profile`)."""

from __future__ import annotations

import os
from pathlib import Path

import typer

from poplar.cli.inputs import print_error, refused_early
from poplar.cli.output import CHECKPOINTING_HELP, Progress, say
from poplar.cli.output import console as _console
from poplar.lazy import imported_for_good


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
    from poplar.cli.tables import profile_table
    from poplar.profile.report import cluster_line, comm_line, profile_rows
    from poplar.profile.run import run_profile

    imported_for_good()     # this command's process (under torchrun, a rank): the probe's collections scan less
    try:
        options = ProfileOptions(stages=stages, n_points=points, repeats=repeats, use_cache=not no_cache,
                                 max_micro_batch=max_micro_batch, precision=mixed_precision)
        workload, spec = _profile_inputs(model, seq_len, activation_checkpointing, cluster, options.precision)
    except (ValueError, FileNotFoundError) as e:
        print_error(console, e)
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
    console.print(profile_table(profile_rows(prof, summary), f"profile of {model} ({prof.model.n_params:,} parameters, "
                                               f"{options.precision}), {time.perf_counter() - start:.0f} s"))
    for line in (comm_line(prof), f"wrote {out}", plot and f"wrote {plot_profile(prof, plot)}"):
        if line:
            say(console, line)


def _profile_inputs(model: str, seq_len: int | None, activation_checkpointing: bool, cluster: str | None,
                    precision: str):
    """``poplar profile``'s workload and cluster, refused in one line (ValueError) where wrong."""
    from pydantic import ValidationError

    from poplar.profile.run import cluster_to_profile
    from poplar.models.workload import model_source

    try:
        workload = model_source(model, seq_len=seq_len, activation_checkpointing=activation_checkpointing)
    except ValidationError as e:
        raise ValueError(f"--model/--seq-len: {e.errors()[0]['msg']}") from None
    spec = cluster_to_profile(cluster)   # the real GPUs discovered: this joins their process group
    spec.check_precision(precision)
    return workload, spec
