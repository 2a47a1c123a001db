"""`poplar train`: profile (or reuse the cache), plan and train, with checkpoints, resume and export
(:mod:`poplar.train`)."""

from __future__ import annotations

import os
from pathlib import Path

import typer

from poplar.cli.inputs import BAD_INPUT_ERRORS, print_error, is_bad_input_in_rank, refused_early
from poplar.cli.output import Progress, say
from poplar.cli.output import console as _console
from poplar.lazy import imported_for_good

TRAIN_OUT_DEFAULT = "runs/poplar"   # TrainConfig.out's default (read here before the config is imported)


def _where_run_stands(cfg) -> str:
    from poplar.runtime.checkpoint import latest_checkpoint

    if cfg is None:
        return ""
    last = latest_checkpoint(Path(cfg.out) / "checkpoints")
    return (f"; last complete checkpoint: {last} (continue with `poplar train --resume --out {cfg.out}`)"
            if last else "; no checkpoint was written")


def train(
    config: Path | None = typer.Option(None, help="a YAML file of training fields (see poplar/train/config.py)"),
    model: str | None = typer.Option(None, help="model preset, e.g. llama-tiny, bert-tiny, llama-125m, or a "
                                                "Hugging Face model directory (./my-model)"),
    cluster: str | None = typer.Option(None, help="emulated cluster: a preset or a YAML file; none: the real CUDA "
                                                  "devices (discovered), or plain ranks with --plan"),
    global_batch: int | None = typer.Option(None, help="samples per optimizer step"),
    steps: int | None = typer.Option(None, help="optimizer steps"),
    plan: str | None = typer.Option(None, help="train with this plan.json (no profiling or planning)"),
    baseline: str | None = typer.Option(None, help="poplar (default), uniform, proportional or measured-peak"),
    out: str | None = typer.Option(None, help="run directory: log, plan, checkpoints"),
    resume: bool = typer.Option(False, "--resume", help="continue from the newest checkpoint in --out"),
    nproc: int | None = typer.Option(None, min=1, help="without --cluster: this many plain CPU ranks (with --plan)"),
    data: str | None = typer.Option(None, help="'embedded', a .txt file, or a table: .jsonl/.csv/.parquet/.arrow "
                                               "(text; prompt + completion; messages; alpaca; ShareGPT "
                                               "conversations; input_ids), a saved dataset"),
    export: str | None = typer.Option(None, help="at the end, write the model here as a directory from_pretrained "
                                                 "loads (new or empty)"),
    eval_data: str | None = typer.Option(None, help="held-out data (a file or table as --data), or a fraction of "
                                                    "the training samples held out, e.g. 0.05"),
    eval_every: int | None = typer.Option(None, min=0, help="steps between evaluations (default: at the end only)"),
    lora: str | None = typer.Option(None, help="train LoRA adapters: r=16,alpha=32,targets=q_proj,v_proj (or on "
                                               "for the defaults)"),
    report_to: str | None = typer.Option(None, help="also log to tensorboard and/or wandb (comma-separated; "
                                                    "default none)"),
    set_: list[str] = typer.Option([], "--set", help="any other field: --set lr=3e-4 (repeatable)"),
) -> None:
    r"""Profile (or reuse the cache), plan and train on an emulated cluster or real GPUs.

    Writes the plan, a step log, checkpoints and a report into --out; --resume continues a run, on this
    or another cluster. Under torchrun every process is one rank (with --max-restarts the group resumes
    from its newest checkpoint); SIGTERM checkpoints and exits 0. Slurm, failures: docs/reliability.md.

    Examples:
      poplar train --cluster both-differ --model llama-tiny --global-batch 64 --out runs/mine
      poplar train --resume --steps 100 --out runs/mine
      torchrun --standalone --nproc-per-node 4 --max-restarts 3 -m poplar.cli.main train \
        --cluster none --model llama-125m --global-batch 256 --out runs/gpus
    """
    console = _console()
    # a cluster file's fields and figures, and a precision it lacks, before torch is imported
    refused_early(console, [cluster], precision=_set_precision(set_))
    given = {"model": model, "cluster": cluster, "global_batch": global_batch, "steps": steps, "plan": plan,
             "baseline": baseline, "out": out, "resume": resume or None, "data": data, "export": export,
             "eval_data": eval_data, "eval_every": eval_every, "lora": lora, "report_to": report_to}
    _train(console, config, given, set_, nproc)


def _train(console, config: Path | None, given: dict, set_: list[str], nproc: int | None) -> None:
    """The command's work: the config (the file, or a resumed run's own, then ``given`` and ``--set``), the run, its
    end said in one line (or its failure)."""
    from poplar.processes.spawn import RankFailed
    from poplar.train.config import load_config
    from poplar.train.run import run_training

    imported_for_good()     # this command's process (under torchrun, a rank): the probe's collections scan less
    cfg = None
    try:
        overrides = {**given, "lora": lora_option(given["lora"]), **_set_options(set_)}
        cfg = load_config(_run_config(config, bool(given["resume"]), given["out"]), overrides)
        shown = os.environ.get("RANK", "0") == "0"   # under torchrun, rank 0 reports the profiling
        shows = (lambda title, **kw: Progress(console, title, **kw)) if shown else None
        result = run_training(cfg, nproc=nproc, progress=shows)
    except BAD_INPUT_ERRORS as e:
        print_error(console, e)
        raise typer.Exit(2) from None
    except RankFailed as e:
        print_error(console, f"{e.line}{_where_run_stands(cfg)}")
        raise typer.Exit(2 if is_bad_input_in_rank(e.error) else 1) from None
    except (TimeoutError, RuntimeError, FloatingPointError) as e:   # this process is a rank (torchrun's)
        line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print_error(console, f"{line}{_where_run_stands(cfg)}")
        raise typer.Exit(1) from None
    _say_trained(console, cfg, result)


def _run_config(config: Path | None, resume: bool, out: str | None) -> Path | None:
    """The config a run starts from: ``--config``, or, resuming with none, the run's own (its ``config.yaml``), so
    that the options not given again are the run's, not the defaults."""
    if config is not None or not resume:
        return config
    own = Path(out or TRAIN_OUT_DEFAULT) / "config.yaml"
    return own if own.is_file() else None


def lora_option(text: str | None) -> dict | None:
    """``--lora r=16,alpha=32,targets=q_proj,v_proj``: fields by name, a name with no ``=`` continuing the list
    before it; ``on`` for the defaults."""
    import yaml

    if text is None:
        return None
    if text.strip().lower() in ("on", "true", "yes", "default"):
        return {}
    fields: dict = {}
    key = None
    for part in (p.strip() for p in text.split(",")):
        name, sep, value = part.partition("=")
        if sep:
            key = name.strip()
            fields[key] = value.strip() if key == "targets" else yaml.safe_load(value)
        elif key == "targets" and part:
            fields[key] = [*([fields[key]] if isinstance(fields[key], str) else fields[key]), part]
        else:
            raise ValueError(f"--lora {text!r}: write field=value pairs, e.g. r=16,alpha=32,targets=q_proj,v_proj")
    if isinstance(fields.get("targets"), str) and fields["targets"] != "all-linear":
        fields["targets"] = [fields["targets"]]
    return fields


def _set_precision(items: list[str]) -> str | None:
    """``--set mixed_precision=...`` where given and read (None otherwise: the config's, checked later)."""
    try:
        value = _set_options(items).get("mixed_precision")
    except ValueError:
        return None
    return value if isinstance(value, str) else None


def _set_options(items: list[str]) -> dict:
    """``--set field=value`` options: each value read as YAML (numbers, lists, booleans)."""
    import yaml

    fields = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r}: write field=value")
        try:
            fields[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError as e:
            raise ValueError(f"--set {item!r}: the value is not YAML ({getattr(e, 'problem', None) or e}); quote "
                             "it or write it as YAML, e.g. --set stages=[0,1]") from None
    return fields


def _replanned(replans: list[dict]) -> str:
    """Each re-plan: when, and its step time predicted and then measured."""
    if not replans:
        return ""
    each = "; ".join(f"after step {r['after_step']}: {1e3 * r['predicted_step_s']:.3g} ms a step predicted"
                     + (f", {1e3 * r['measured_after_s']:.3g} measured" if r.get("measured_after_s") else "")
                     for r in replans)
    return f"; re-planned {len(replans)} time{'s' if len(replans) > 1 else ''} ({each}: the log says why)"


def _say_trained(console, cfg, result: dict) -> None:
    if result.get("preempted"):
        say(console, f"preempted: stopped after step {result['preempted']} with a checkpoint; continue with "
                     f"`poplar train --resume --out {cfg.out}`")
        return
    losses = result["losses"]
    if losses and "summary" in result:      # rank 0 (or the launcher)
        s = result["summary"]
        say(console, f"trained steps {result['start'] + 1}-{cfg.steps} with {result['plan']}: "
                     f"loss {losses[0]:.3f} -> {losses[-1]:.3f}; steady steps (median): "
                     f"{s['samples_per_s']:.1f} samples/s, {s['tokens_per_s']:,.0f} tokens/s, "
                     f"{s['tflops']:.2f} TFLOP/s" + (f", MFU {100 * s['mfu']:.1f}%" if "mfu" in s else "")
                     + (f"; evaluation loss {s['eval_loss']:.4f} (perplexity {s['eval_perplexity']:,.2f})"
                        if s.get("eval_loss") is not None else "")
                     + _replanned(s.get("replans", []))
                     + f"; log {cfg.out}/log.jsonl, report {result['report']}")
    if result.get("exported") and cfg.lora is not None:
        merged = f", the merged model to {result['exported']}/merged (from_pretrained loads it)" if cfg.lora.merge else ""
        say(console, f"exported the adapter to {result['exported']} (peft.PeftModel.from_pretrained loads it onto "
                     f"the base model){merged}")
    elif result.get("exported"):
        say(console, f"exported the model to {result['exported']} (from_pretrained loads it)")
