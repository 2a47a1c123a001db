"""`poplar export`: a run's newest intact checkpoint as a Hugging Face model directory."""

from __future__ import annotations

from pathlib import Path

import typer

from poplar.cli.inputs import BAD_INPUT_ERRORS, print_error
from poplar.cli.output import say
from poplar.cli.output import console as _console


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
    from poplar.processes.spawn import RankFailed
    from poplar.train.export import export_run

    console = _console()
    try:
        if not (run / "checkpoints").is_dir():
            raise ValueError(f"{run}: no checkpoints: give the --out of a `poplar train` run")
        written = export_run(run, out)
    except BAD_INPUT_ERRORS as e:
        print_error(console, e)
        raise typer.Exit(2) from None
    except RankFailed as e:
        print_error(console, e.line)
        raise typer.Exit(1) from None
    if (written / "adapter_config.json").is_file():    # a LoRA run's adapters (and, merged, the model beside them)
        merged = f"; the merged model in {written / 'merged'}" if (written / "merged").is_dir() else ""
        say(console, f"exported {run}'s adapter to {written} (peft.PeftModel.from_pretrained loads it onto the base "
                     f"model){merged}")
        return
    say(console, f"exported {run} to {written} (from_pretrained loads it)")
