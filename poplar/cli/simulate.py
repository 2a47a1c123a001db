"""`poplar simulate`: what Poplar would do for a model on a cluster, from a simulated profile (no device runs)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from poplar.cli.output import CHECKPOINTING_HELP

_SUFFIX = {"k": 2**10, "m": 2**20, "g": 2**30}


def parse_tokens(text: str) -> int:
    """A token count: ``2M`` (2 x 2^20, as batches of 2,048-token samples count), ``512k``, ``1048576``.

    >>> parse_tokens("2M"), parse_tokens("512k"), parse_tokens("4096")
    (2097152, 524288, 4096)
    """
    t = text.strip().lower()
    scale = _SUFFIX.get(t[-1:], 1)
    number = t[:-1] if scale > 1 else t
    try:
        value = float(number) * scale
    except ValueError:
        raise ValueError(f"--global-batch-tokens {text!r}: give a number of tokens, e.g. 2M or 524288") from None
    if value < 1 or value != int(value):
        raise ValueError(f"--global-batch-tokens {text!r}: give a positive whole number of tokens")
    return int(value)


def simulate(
    cluster: str = typer.Option(..., help="cluster YAML file, or a preset (e.g. two-node-10gbe)"),
    model: str = typer.Option(..., help="model preset (see `poplar profile --help`), e.g. llama-7b, or a Hugging "
                                                 "Face model directory or config.json (no weights needed)"),
    global_batch: int | None = typer.Option(None, min=1, help="samples per optimizer step, over all ranks"),
    global_batch_tokens: str | None = typer.Option(None, help="tokens per optimizer step instead (2M = 2^21): "
                                                   "that many samples of --seq-len, rounded down"),
    seq_len: int | None = typer.Option(None, help="tokens per sample (Hugging Face presets)"),
    stages: str = typer.Option("0,1,2,3", help="ZeRO stages to consider, comma-separated"),
    points: int = typer.Option(6, min=2, help="micro-batch sizes simulated per stage"),
    max_micro_batch: int = typer.Option(256, min=1, help="largest micro-batch the memory search tries"),
    mixed_precision: str = typer.Option("none", help="none (fp32), bf16 or fp16 (the engine's mixed precisions)"),
    activation_checkpointing: bool = typer.Option(False, "--activation-checkpointing", help=CHECKPOINTING_HELP),
    lora: str | None = typer.Option(None, help="LoRA adapters trained beside the frozen model: "
                                    "r=16,alpha=32,targets=q_proj,v_proj (or on for the defaults)"),
    alone: bool = typer.Option(True, help="also plan each kind's homogeneous cluster (the paper's baselines)"),
    workers: int | None = typer.Option(None, min=0, help="processes that simulate the kinds alone beside this one "
                                       "(default: the cores to spare; 0: all here)"),
    out: Path = typer.Option(Path("plan.json"), help="where to write the chosen plan (JSON)"),
    profile_out: Path | None = typer.Option(None, help="also write the simulated profile here (JSON)"),
    json_out: Path | None = typer.Option(None, "--json", help="write the figures (the tables') here as JSON"),
    plot: Path | None = typer.Option(None, help="draw the comparison here (PNG)"),
) -> None:
    r"""Plan a model on a cluster from a simulated profile, with no GPU and no weights.

    Each kind's steps are counted on meta tensors, not run; Poplar's plan beside the baselines and each kind alone.

    Examples:
      poplar simulate --cluster two-node-10gbe --model tiny --global-batch 256
      poplar simulate --cluster examples/clusters/memory-differs-4+4.yaml --model llama-7b \
        --seq-len 2048 --mixed-precision bf16 --global-batch 512
      poplar simulate --cluster compute-differs --model llama-tiny --global-batch 64 \
        --lora r=8,targets=q_proj,v_proj
    """
    from poplar.cli.inputs import BAD_INPUT_ERRORS, print_error
    from poplar.cli.output import console as _console

    console = _console()   # a preset's states are held to the cluster by arithmetic at once; with LoRA, as made
    stage_list, spec, tokens = _options(console, cluster, None if lora else model, mixed_precision, stages,
                                        global_batch, global_batch_tokens,
                                        [(out, "--out"), (profile_out, "--profile-out"), (json_out, "--json"),
                                         (plot, "--plot")])
    from poplar.compare.evaluate import evaluate
    from poplar.lazy import imported_for_good, no_last_collection
    from poplar.profile.options import ProfileOptions

    imported_for_good()     # this command's process: the simulator's collections scan only what it makes
    no_last_collection()    # (its files are written whole, each closed)
    try:   # what needs the model, before anything is simulated; then a PlanningError: no stage can run it
        options = ProfileOptions(stages=stage_list, n_points=points, max_micro_batch=max_micro_batch,
                                 precision=mixed_precision)
        workload = _workload(model, seq_len, activation_checkpointing, lora)
        batch = global_batch if tokens is None else _samples(global_batch_tokens, tokens, workload.seq_len)
        spec.check_global_batch(batch)
        comparison, result = evaluate(workload, spec, batch, options, alone=alone, workers=workers)
    except BAD_INPUT_ERRORS as e:
        print_error(console, e)
        raise typer.Exit(2) from None
    _report(console, comparison, result, [(out, "plan"), (profile_out, "profile"), (json_out, "json"), (plot, "plot")])


def _workload(model: str, seq_len: int | None, activation_checkpointing: bool, lora: str | None):
    """The model the options name, with LoRA adapters where ``--lora`` gives them (their targets checked against
    the model: one line, before anything is simulated)."""
    from pydantic import ValidationError

    from poplar.models.workload import model_source

    try:
        workload = model_source(model, seq_len=seq_len, activation_checkpointing=activation_checkpointing)
    except ValidationError as e:
        raise ValueError(f"--model/--seq-len: {e.errors()[0]['msg']}") from None
    if lora is None:
        return workload
    from poplar.cli.train import lora_option
    from poplar.models.lora import LoraSettings, LoraSource

    return LoraSource(workload, LoraSettings(**lora_option(lora)))


def _report(console, comparison, result, writes: list[tuple[Path | None, str]]) -> None:
    """The tables, the choice, and the files asked for (``writes``: (path, what); None paths are skipped)."""
    from poplar.cli.output import say
    from poplar.cli.tables import allocations_table, candidates_table, kinds_table, stage_table, summary_table

    tables = [stage_table(result, result.chosen), allocations_table(result), summary_table(comparison),
              kinds_table(comparison)]
    if len(result.candidates) > 1:
        tables.insert(2, candidates_table(result))
    for table in tables:
        console.print(table)
    say(console, f"chosen: {comparison.reason}")
    model = result.profile.model
    trained = f" ({model.trained_params:,} trained, the rest frozen)" if model.frozen_params else ""
    say(console, f"simulated {model.n_params:,} parameters{trained} on {comparison.world_size} ranks in "
                 f"{comparison.simulated_s:.1f} s, planned in {comparison.planned_s:.1f} s")
    write = {"plan": result.save, "profile": result.profile.save, "plot": lambda p: _plot(comparison, p),
             "json": lambda p: p.write_text(json.dumps(comparison.to_dict(), indent=1))}
    for path, what in writes:
        if path is not None:
            write[what](path)
            say(console, f"wrote {path}" + (f" ({result.plan.summary()})" if what == "plan" else ""))


def _options(console, cluster: str, model: str, precision: str, stages: str, samples: int | None,
             tokens: str | None, writes: list[tuple[Path | None, str]]):
    """What the options say without the model, refused in one line before torch is imported: the stages, the
    cluster, the global batch's tokens (None: given in samples, checked against the ranks), the files to write."""
    from poplar.cli.inputs import BAD_INPUT_ERRORS, check_writable, print_error, refused_early, stages_option
    from poplar.cluster.spec import load_cluster

    refused_early(console, [cluster], model, precision)   # what arithmetic refuses
    try:
        stage_list, spec = stages_option(stages), load_cluster(cluster)
        n_tokens = _global_batch(samples, tokens)
        if samples is not None:
            spec.check_global_batch(samples)
        for path, option in writes:
            check_writable(path, option)
    except BAD_INPUT_ERRORS as e:
        print_error(console, e)
        raise typer.Exit(2) from None
    return stage_list, spec, n_tokens


def _global_batch(samples: int | None, tokens: str | None) -> int | None:
    """The global batch's tokens where given so (None: given in samples), from exactly one of the two options."""
    if (samples is None) == (tokens is None):
        raise ValueError("give the global batch as --global-batch (samples) or --global-batch-tokens, one of them")
    return None if tokens is None else parse_tokens(tokens)


def _samples(text: str, tokens: int, seq_len: int) -> int:
    """The samples of ``seq_len`` in ``tokens`` (``--global-batch-tokens text``), rounded down."""
    if tokens < seq_len:
        raise ValueError(f"--global-batch-tokens {text}: fewer tokens than one sample of {seq_len}")
    return tokens // seq_len


def _plot(c, path: Path) -> None:
    """The comparison (:class:`~poplar.compare.comparison.Comparison`) as bars: Poplar's, the baselines', each kind
    alone's, the ideal bound."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [f"Poplar\n{c.label}", *(a.name for a in c.baselines), *(f"{a.kind}\nalone" for a in c.alone), "ideal"]
    values = [c.poplar.samples_per_s, *(a.samples_per_s or 0 for a in [*c.baselines, *c.alone]),
              c.ideal_samples_per_s]
    fig, ax = plt.subplots(figsize=(1.3 * len(names) + 2, 3.8))
    ax.bar(range(len(names)), values, color=["C0"] + ["C7"] * (len(names) - 2) + ["C2"])
    ax.set_xticks(range(len(names)), names, fontsize=8)
    ax.set_ylabel("samples/s (simulated)")
    ax.set_title(f"{c.model} on {c.world_size} GPUs, global batch {c.global_batch}", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
