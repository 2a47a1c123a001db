"""`poplar bench`: Poplar's plan measured against the baselines' splits (:mod:`poplar.compare.bench`)."""

from __future__ import annotations

from pathlib import Path

import typer

from poplar.cli.inputs import BAD_INPUT_ERRORS, check_writable, print_error, refused_early
from poplar.cli.output import CHECKPOINTING_HELP, Progress, say
from poplar.cli.output import console as _console


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
    from poplar.cli.tables import bench_table
    from poplar.compare.bench import bench_clusters, check_clusters
    from poplar.precision import precision as canonical_precision
    from poplar.models.workload import model_source

    console = _console()
    try:   # everything that can be refused is, before anything is profiled
        builtin = model in ("tiny", "small", "base")
        workload = model_source(model, seq_len=None if builtin else seq_len,
                                vocab_size=None if builtin else vocab_size,
                                activation_checkpointing=activation_checkpointing)
        precision = canonical_precision(mixed_precision)
        names = check_clusters(cluster, global_batch, precision)
        check_writable(json_out, "--json")
    except BAD_INPUT_ERRORS as e:
        print_error(console, e)
        raise typer.Exit(2) from None
    results, failed = bench_clusters(
        names, workload, global_batch, steps, use_cache=not no_cache, peers=not no_peers, json_out=json_out,
        precision=precision,
        progress=lambda c: Progress(console, f"{c}: profiling (cached after the first run), planning, measuring"))
    if results:
        table, notes = bench_table(results, f"{model}, global batch {global_batch}, {precision}: measured, {steps} "
                                              "steps per allocation")
        console.print(table)
        for note in notes:
            say(console, note)
    for line in failed:
        print_error(console, line)
    if json_out:
        say(console, f"wrote {json_out}")
    if failed:
        raise typer.Exit(1)
