"""The `poplar` command line."""

from __future__ import annotations

import typer

app = typer.Typer(help="Poplar: ZeRO data parallelism for clusters of different GPUs.", no_args_is_help=True,
                  add_completion=False)


@app.callback()
def main() -> None:
    """Poplar: ZeRO data parallelism for clusters of different GPUs."""


@app.command()
def demo(steps: int = typer.Option(10, min=1, help="optimizer steps per ZeRO stage")) -> None:
    """Heterogeneous training on 3 local CPU ranks, every stage checked against one device."""
    from poplar.demo import run_demo

    rows = run_demo(steps)
    worst = max(r["max_param_error"] for r in rows)
    if worst > 1e-4:
        typer.echo(f"parameters differ from single-device training by {worst:.2e}", err=True)
        raise typer.Exit(1)


if __name__ == "__main__":
    app()
