"""`poplar demo`: the main job, on an emulated heterogeneous cluster (:mod:`poplar.compare.demo`)."""

from __future__ import annotations

from pathlib import Path

import typer

from poplar.cli.inputs import BAD_INPUT_ERRORS, print_error
from poplar.cli.output import console as _console
from poplar.cli.output import say
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
    from poplar.compare.demo import check_demo

    imported_for_good()     # this command's process: the simulator's collections scan only what it makes
    console = _console()
    real_model = None if real_model.strip().lower() == "none" else real_model
    try:
        check_demo(cluster, out, global_batch, real_model)
        show_demo(console, steps, cluster, out, global_batch, real_model,
                  progress=lambda title, **kw: Progress(console, title, **kw))
    except BAD_INPUT_ERRORS as e:
        print_error(console, e)
        raise typer.Exit(2) from None


LEGEND = ("samples/s in the emulated GPUs' declared time; Poplar's speedup: its samples/s over the row's; ideal: the "
          "batch shared so that every device finishes together, only the communication no plan hides; predicted: the "
          "planner's figure against the measured one")


def show_demo(console, steps: int, cluster: str, out: Path, global_batch: int, real_model: str | None,
              progress=None) -> None:
    """The demo (:func:`poplar.compare.demo.run_demo`), its table and where its files are; then ``real_model`` at
    full memory on the same GPUs, simulated (:func:`show_real_size`; None: not)."""
    from poplar.cli.tables import demo_table
    from poplar.compare.demo import run_demo, write_record

    comparison, plot = run_demo(steps, cluster, out, global_batch, console, progress)
    console.print(demo_table(comparison, f"{comparison.model} on {cluster}: ZeRO-{comparison.zero_stage}"
                             f"{'' if comparison.shape == 'flat' else ' ' + comparison.shape}, global batch "
                             f"{global_batch}, medians of steps 2-{steps}"))
    console.print(LEGEND, highlight=False)
    for line in (f"planner's choice: {comparison.reason}",
                 f"plots: {plot} (every row), {out}/<row>/report.png; logs: {out}/<row>/log.jsonl; "
                 f"the table: {out}/demo.json"):
        say(console, line)
    real = show_real_size(console, progress, cluster, real_model) if real_model is not None else None
    if real is not None:
        write_record(out, comparison, real)


def show_real_size(console, progress, cluster: str, real_model: str):
    """The closing table: ``real_model`` on ``cluster``'s GPUs at full memory, simulated; where these GPUs cannot
    hold it in any stage, a line saying so (the demo's own table stands). The comparison, or None."""
    import contextlib

    from poplar.cli.tables import real_size_table
    from poplar.compare.demo import real_size

    with (progress(f"simulating {real_model} on the same GPUs at full memory") if progress
          else contextlib.nullcontext()):
        try:
            real = real_size(cluster, real_model)
        except ValueError as e:   # the planner's (PlanningError) or the arithmetic's: no stage holds the model
            real, why = None, str(e)
    if real is None:
        say(console, f"{real_model} at full memory on these GPUs: no plan ({why}); the closing table is left out: "
                     "give --real-model a smaller preset, or none")
        return None
    console.print(real_size_table(real))
    say(console, f"the planner's choice there: {real.reason}")
    return real
