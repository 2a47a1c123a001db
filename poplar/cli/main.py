"""The `poplar` command line."""

from __future__ import annotations

import inspect
import os

# On a GPU: segments that grow rather than new blocks beside old ones, so a step's memory is
# not lost to fragmentation (set before CUDA starts; a setting of the user's own is kept)
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import typer  # noqa: E402

from poplar.cli.bench import bench  # noqa: E402
from poplar.cli.demo import demo  # noqa: E402
from poplar.cli.export import export  # noqa: E402
from poplar.cli.plan import plan  # noqa: E402
from poplar.cli.profile import profile  # noqa: E402
from poplar.cli.simulate import simulate  # noqa: E402
from poplar.cli.train import train  # noqa: E402
from poplar.cli.verify import verify  # noqa: E402

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


# one file per command, beside this one; the main job first in the help
for _callback in (demo, verify, profile, plan, train, export, bench, simulate):
    app.command()(_callback)

for _command in app.registered_commands:   # each command's --help from its docstring, as it reads
    _command.help = _command.help or unwrapped(_command.callback.__doc__ or "")

if __name__ == "__main__":
    app()
