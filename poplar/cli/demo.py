"""`poplar demo`: the main job, on an emulated heterogeneous cluster (:mod:`poplar.compare.demo`)."""

from __future__ import annotations

from pathlib import Path

import typer

from poplar.cli.inputs import BAD_INPUT_ERRORS, print_error
from poplar.cli.output import console as _console
from poplar.lazy import imported_for_good

# The demo's cluster: two cards whose memory sets their micro-batches (the 80 GB card holds twice the 40 GB
# card's), so Poplar gives each its own and both work; a batch and steps measured in a few minutes on a
# laptop's CPU.
DEMO_CLUSTER, DEMO_BATCH, DEMO_STEPS = "memory-differs-small", 24, 6


def demo(
    steps: int = typer.Option(DEMO_STEPS, min=2, help="training steps per allocation (medians over all but the first)"),
    cluster: str = typer.Option(DEMO_CLUSTER, help="emulated cluster: a preset or a YAML file"),
    out: Path = typer.Option(Path("runs/demo"), help="where the runs, the table and the plots go"),
    global_batch: int = typer.Option(DEMO_BATCH, min=1, help="samples per optimizer step, over all ranks"),
    real_model: str = typer.Option("llama-1b", help="the model the closing table simulates on the same GPUs at "
                                   "full memory (a preset: llama-1b, llama-7b, ...; Hugging Face presets at "
                                   "2,048-token samples), or none"),
) -> None:
    """Profile, plan and train a small Llama on two emulated GPUs, beside the baselines.

    Poplar's plan, the uniform and proportional splits and each card alone, each trained a few steps on real
    text (about 1.5 minutes on 2 CPU cores; the profile is cached after).

    Example: poplar demo --out runs/demo
    """
    from poplar.cli.output import Progress
    from poplar.compare.demo import run_demo

    imported_for_good()     # this command's process: the simulator's collections scan only what it makes
    console = _console()
    try:
        run_demo(steps=steps, cluster=cluster, out=out, global_batch=global_batch, console=console,
                 progress=lambda title, **kw: Progress(console, title, **kw),
                 real_model=None if real_model.strip().lower() == "none" else real_model)
    except BAD_INPUT_ERRORS as e:
        print_error(console, e)
        raise typer.Exit(2) from None
