"""What a command refuses: bad input is one line saying what to change (exit 2), not a failure of the run."""

from __future__ import annotations

from pathlib import Path


def _error(console, message) -> None:
    """One line on what went wrong; the message printed as it is (no markup read in it)."""
    from pydantic import ValidationError
    from rich.markup import escape

    if isinstance(message, ValidationError):   # each error, where it is (a field) and pydantic's words
        message = "; ".join(": ".join(filter(None, (".".join(map(str, e["loc"])),
                                                    e["msg"].removeprefix("Value error, "))))
                            for e in message.errors())
    line = " ".join(part.strip() for part in str(message).splitlines() if part.strip())
    console.print(f"[red]error:[/] {escape(line)}", soft_wrap=True)


# Bad input: what the user must change (one line, exit 2), not a failure of the run. Pydantic's ValidationError,
# CheckpointError and PlanningError are ValueErrors. Ranks refuse a wrong argument with a TypeError too.
BAD_INPUT_ERRORS: tuple[type[Exception], ...] = (ValueError, FileNotFoundError)
BAD_INPUT_IN_RANKS: tuple[type[Exception], ...] = (*BAD_INPUT_ERRORS, TypeError)


def is_bad_input_in_rank(error: str | None) -> bool:
    """Whether a rank's error, which reaches this process as its class's name, is bad input.

    It is where it names one of ``BAD_INPUT_IN_RANKS`` or a subclass of one (as ``except`` would match it here).
    """
    # the subclasses ranks raise, defined here so their names are known (both are ValueErrors)
    from poplar.planner import PlanningError  # noqa: F401
    from poplar.train.checkpoint import CheckpointError  # noqa: F401

    def names(cls: type) -> set[str]:
        return {cls.__name__}.union(*(names(sub) for sub in cls.__subclasses__()))

    return error is not None and any(error in names(cls) for cls in BAD_INPUT_IN_RANKS)


def stages_option(stages: str) -> list[int]:
    """``--stages 0,1,3``: the stages, or one line saying which exist (:func:`poplar.stages.parse_stages`)."""
    from poplar.stages import parse_stages

    try:
        return parse_stages(stages)
    except ValueError as e:
        raise ValueError(f"--stages: {e}") from None


def _check_writable(path: Path | None, option: str) -> None:
    """A file a command writes at its end: its directory is there, and it is no directory itself."""
    if path is not None and (path.is_dir() or not path.parent.is_dir()):
        raise ValueError(f"{option} {path}: " + ("is a directory: give a file name" if path.is_dir() else
                                                  f"no directory {path.parent}: create it or give another path"))
