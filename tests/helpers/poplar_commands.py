"""``poplar`` command lines found in text (a page's shell blocks, a command's ``--help`` examples), and what
each names that the CLI has not, checked against the CLI's own click objects (``typer.main.get_command``) in
this process: a command or an option that goes stale fails the tests that show it (tests/test_docs.py,
tests/cli/test_help.py)."""

from __future__ import annotations

import shlex
from pathlib import Path

import typer


def command_lines(text: str) -> list[list[str]]:
    """Every ``poplar`` command in shell ``text``, as its tokens after ``poplar``.

    A line continued with a backslash is joined; comments are dropped; ``&&``, ``||``, ``;`` and ``|``
    separate commands; the command is found after ``poplar`` (any wrapper or environment before it) or
    after ``-m poplar.cli.main`` / ``-m poplar`` (under ``torchrun`` or ``python``).

    >>> command_lines("pip install -e . && poplar plan --profile p.json --global-batch 8  # a plan")
    [['plan', '--profile', 'p.json', '--global-batch', '8']]
    """
    commands = []
    for line in text.replace("\\\n", " ").splitlines():
        try:
            tokens = shlex.split(line, comments=True)
        except ValueError:   # an unbalanced quote in a comment or an ellipsis: fall back on blanks
            tokens = line.split(" #")[0].split()
        command: list[str] = []
        for token in [*tokens, ";"]:
            if token in {"&&", "||", ";", "|"}:
                args = _after_poplar(command)
                if args is not None:
                    commands.append(args)
                command = []
            else:
                command.append(token)
    return commands


def _after_poplar(tokens: list[str]) -> list[str] | None:
    for i, token in enumerate(tokens):
        if Path(token).name == "poplar":
            return tokens[i + 1:]
        if token == "-m" and i + 1 < len(tokens) and tokens[i + 1] in {"poplar.cli.main", "poplar"}:
            return tokens[i + 2:]
    return None


def cli_problems(commands: list[list[str]]) -> list[str]:
    """What each command names that the CLI has not: an unknown subcommand, an option it does not take."""
    import poplar.cli.main

    group = typer.main.get_command(poplar.cli.main.app)
    problems = []
    for args in commands:
        line = "poplar " + " ".join(args)
        if not args or args[0].startswith("-"):
            unknown = [a.split("=")[0] for a in args if a.startswith("--") and a.split("=")[0] != "--help"]
            if unknown:
                problems.append(f"{line}: poplar takes no option {unknown[0]}")
            continue
        sub = group.commands.get(args[0])
        if sub is None:
            problems.append(f"{line}: no command {args[0]!r} (poplar has {', '.join(sorted(group.commands))})")
            continue
        options = {o for p in sub.params for o in (*p.opts, *p.secondary_opts)} | {"--help"}
        for arg in args[1:]:
            if arg.startswith("--") and arg.split("=")[0] not in options:
                problems.append(f"{line}: `poplar {args[0]}` has no option {arg.split('=')[0]}")
    return problems
