"""What a command refuses: bad input is one line saying what to change (exit 2), not a failure of the run."""

from __future__ import annotations

from pathlib import Path


def print_error(console, message) -> None:
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
    from poplar.runtime.checkpoint import CheckpointError  # noqa: F401

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


def check_writable(path: Path | None, option: str) -> None:
    """A file a command writes at its end: its directory is there, and it is no directory itself."""
    if path is not None and (path.is_dir() or not path.parent.is_dir()):
        raise ValueError(f"{option} {path}: " + ("is a directory: give a file name" if path.is_dir() else
                                                  f"no directory {path.parent}: create it or give another path"))


def refuse_early(cluster: str | None, model: str | None = None, precision: str | None = None,
                 vocab_size: int | None = None) -> None:
    """What arithmetic refuses before torch is imported (seconds) or anything is profiled: a cluster file's fields
    and figures, a precision its devices have no hardware for, a model preset whose states the whole cluster
    cannot hold. The real GPUs (no cluster file) and a model that is no preset are checked as they are found."""
    from poplar.cluster.spec import load_cluster
    from poplar.models.presets import HF_PRESETS, MODEL_PRESETS, default_vocab, param_count
    from poplar.precision import precision as canonical

    if cluster is None or str(cluster).strip().lower() in ("", "none", "null"):
        return
    spec = load_cluster(cluster)
    try:
        dtype = canonical(precision)
    except ValueError:
        return     # refused with the command's other options, as it parses them
    spec.check_precision(dtype)
    if model in MODEL_PRESETS or model in HF_PRESETS:
        vocab = vocab_size if vocab_size and model in HF_PRESETS else default_vocab(model)
        spec.check_holds_states(model, param_count(model, vocab), dtype)


def refused_early(console, clusters: list[str | None], model: str | None = None, precision: str | None = None) -> None:
    """:func:`refuse_early` for each of ``clusters``, said in one line with exit 2."""
    import typer

    try:
        for cluster in clusters:
            refuse_early(cluster, model, precision)
    except BAD_INPUT_ERRORS as e:
        print_error(console, e)
        raise typer.Exit(2) from None
