"""`poplar --help` and every command's `--help` say in one line what it does and show an example that parses.

The help is rendered in this process (typer's CliRunner, at 100 columns, no process started); each example's
command line is read from the rendering, checked against the CLI's own click objects (tests/helpers/poplar_commands.py,
as the docs' commands are), parsed by its command (types, ranges, required options) and put to the checks the
command makes before importing torch (the cluster exists, holds the model, has the precision). An example that
names a renamed command, a dropped option or a preset that is gone fails here.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from poplar.cli.inputs import refuse_early
from poplar.cli.main import app, unwrapped
from tests.helpers.poplar_commands import cli_problems, command_lines

ROOT = Path(__file__).resolve().parents[2]

COLUMNS = 100
PURPOSE_CHARS = 85   # one line of `poplar --help`'s command list at 100 columns
COMMANDS = sorted(typer.main.get_command(app).commands)
PANEL = ("│", "╭", "╰")


def rendered(*args: str) -> str:
    result = CliRunner().invoke(app, [*args, "--help"], env={"COLUMNS": str(COLUMNS)}, prog_name="poplar")
    assert result.exit_code == 0, result.output
    return result.output


def text_lines(help_text: str) -> list[str]:
    """The rendered help's own text (the usage, the description, the epilog), not its panels; rich indents
    it by one column."""
    return [line[1:].rstrip() for line in help_text.splitlines() if not line.lstrip().startswith(PANEL)]


def example_commands(help_text: str) -> list[list[str]]:
    """The ``poplar`` commands a rendered help shows: its indented lines (each example's, a backslash joining
    one to the next) and a command on an ``Example:`` line itself."""
    shell = [line.removeprefix("Example:") for line in text_lines(help_text)
             if line.startswith(("  ", "Example: "))]
    return command_lines("\n".join(shell))


def refusal(args: list[str]) -> str | None:
    """What ``poplar ARGS`` would be refused for before it ran: its options as the command parses them (types,
    ranges, required ones), then its clusters, model and precision as it checks them before importing torch."""
    command = typer.main.get_command(app).commands[args[0]]
    try:
        params = command.make_context(args[0], list(args[1:])).params
        for cluster in str(params.get("cluster") or "").split(","):
            if cluster.strip() not in ("", "all"):
                refuse_early(cluster.strip(), params.get("model"), params.get("mixed_precision"))
    except Exception as e:   # click's usage errors, the early refusals (ValueError), a missing file: each is one
        return f"poplar {' '.join(args)}: {e}"
    return None


def purpose(command: str) -> str:
    return typer.main.get_command(app).commands[command].help.split("\n\n")[0]


def test_poplar_help_says_what_it_is_lists_the_commands_and_shows_the_flow():
    help_text = rendered()
    first = next(line for line in text_lines(help_text) if line and not line.startswith("Usage:"))
    assert first.startswith("Poplar: ZeRO data parallelism"), help_text
    rows = [line.strip("│ ").split(None, 1) for line in help_text.splitlines() if line.startswith("│")]
    for command in COMMANDS:
        assert [command, purpose(command)] in rows, f"{command}: its purpose is not one line in\n{help_text}"
    flow = example_commands(help_text)
    assert [c[0] for c in flow] == ["demo", "profile", "plan", "train"], help_text
    assert cli_problems(flow) == []
    assert [refusal(c) for c in flow] == [None] * len(flow)
    profile_out, plan_in = flow[1][flow[1].index("--out") + 1], flow[2][flow[2].index("--profile") + 1]
    assert profile_out == plan_in, "the flow's plan reads the profile its profile writes"


@pytest.mark.parametrize("command", COMMANDS)
def test_each_command_says_what_it_does_and_shows_an_example_that_parses(command, monkeypatch):
    monkeypatch.chdir(ROOT)   # an example's files (a cluster under examples/) are the repository's
    help_text = rendered(command)
    first = purpose(command)
    assert "\n" not in first and first.endswith(".") and len(first) <= PURPOSE_CHARS, \
        f"poplar {command}: the docstring's first paragraph is its line in `poplar --help`: one sentence of at " \
        f"most {PURPOSE_CHARS} characters on one line, not {first!r}"
    lines = text_lines(help_text)
    assert first in lines, help_text
    assert "Example" in help_text, f"poplar {command} --help shows no example"
    examples = example_commands(help_text)
    assert examples and all(c[0] == command for c in examples), f"poplar {command}'s examples: {examples}"
    assert cli_problems(examples) == []
    assert [refusal(c) for c in examples] == [None] * len(examples)
    written = [line.strip() for line in typer.main.get_command(app).commands[command].help.splitlines()
               if line.startswith("  ")]
    assert {line.strip() for line in lines} >= set(written), \
        f"poplar {command}: an example line wraps at {COLUMNS} columns; shorten it or continue it with a backslash"


def test_a_stale_example_is_found():
    help_text = (" Usage: poplar plan [OPTIONS]\n\n Choose the stage.\n\n Examples:\n"
                 "   poplar plan --profile p.json --colour red\n"
                 "   torchrun --nproc-per-node 2 -m poplar.cli.main trian \\\n     --steps 2\n\n"
                 "╭─ Options ─╮\n│ --profile  <path>  a profile │\n")
    examples = example_commands(help_text)
    assert examples == [["plan", "--profile", "p.json", "--colour", "red"], ["trian", "--steps", "2"]]
    problems = cli_problems(examples)
    assert len(problems) == 2 and "--colour" in problems[0] and "'trian'" in problems[1], problems


@pytest.mark.parametrize("args, says", [
    (["plan", "--profile", "p.json"], "global_batch"),
    (["profile", "--points", "1"], "--points"),
    (["simulate", "--cluster", "no-such-cluster", "--model", "tiny", "--global-batch", "8"], "no-such-cluster"),
    (["simulate", "--cluster", "both-differ", "--model", "llama-7b", "--global-batch", "8"],
     "llama-7b has 6.74B parameters"),
])
def test_an_example_that_would_be_refused_is_found(args, says):
    assert says in (refusal(args) or ""), refusal(args)


def test_a_wrapped_paragraph_reads_as_one_line_and_an_example_keeps_its_own():
    doc = """Train it.

    Writes the plan
    and the log.

    Example:
      poplar train --out runs/a \\
        --steps 2
    """
    assert unwrapped(doc).split("\n\n") == ["Train it.", "Writes the plan and the log.",
                                            "Example:\n  poplar train --out runs/a \\\n    --steps 2"]
