"""`poplar verify`: every ZeRO stage against single-device training (:mod:`poplar.compare.verify`)."""

from __future__ import annotations

import typer


def verify(steps: int = typer.Option(10, min=1, help="optimizer steps per ZeRO stage")) -> None:
    """Check every ZeRO stage on 3 uneven CPU ranks against training on one device.

    Each rank takes its own micro-batch (and, in stages 0-1, its own accumulation steps); the parameters
    after every stage must match single-process training on the same batches (exit 1 where they do not).

    Example:
      poplar verify --steps 5
    """
    from rich.console import Console

    from poplar.cli.tables import verify_table
    from poplar.compare.verify import run_verify

    console = Console()
    rows = run_verify(steps, console)
    console.print(verify_table(rows))
    worst = max(r["max_param_error"] for r in rows)
    if worst > 1e-4:
        typer.echo(f"parameters differ from single-device training by {worst:.2e}", err=True)
        raise typer.Exit(1)
