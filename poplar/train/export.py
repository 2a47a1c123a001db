"""A model out of a run: its newest checkpoint as a directory ``from_pretrained`` loads (``poplar export``).

The checkpoint is read as training reads one (:func:`poplar.train.checkpoint.load_checkpoint`:
any world size, plan and stage) into one rank's engine of the run's own units, whose
full parameters go into the model and out through ``save_pretrained`` (config,
safetensors); beside them the tokenizer the run trained with: the model directory's own,
or the one trained on the run's text, saved as a fast tokenizer. Nothing is overwritten:
the output directory must be new or empty.
"""

from __future__ import annotations

from pathlib import Path

from poplar.train.checkpoint import CheckpointError, find_resumable, read_meta
from poplar.train.config import TrainConfig


def check_export_dir(out: str | Path) -> Path:
    """The directory an export writes: new, or empty (one line otherwise, before anything runs)."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--export {out}: " + ("is a file" if not out.is_dir() else "already holds files") +
                         ": give a new or empty directory (nothing is overwritten)")
    if not out.parent.is_dir():
        raise ValueError(f"--export {out}: no directory {out.parent}: create it or give another path")
    return out


def check_exportable(model_source) -> None:
    """Only a Hugging Face model can be written as one: a model directory or a Hugging Face preset (the built-in
    presets and a factory's modules are the user's or Poplar's own)."""
    from poplar.models.pretrained import ModelDirectory
    from poplar.workload import Workload

    hf = isinstance(model_source, ModelDirectory) or (isinstance(model_source, Workload) and
                                                       model_source.family != "tiny")
    if not hf:
        raise ValueError(f"--export: {model_source.name} is not a Hugging Face model: export a model directory "
                         "or a Hugging Face preset (its checkpoints hold the weights of any model)")


def export_run(run_dir: str | Path, out: str | Path, timeout_s: float = 600) -> Path:
    """Write the run's newest intact checkpoint to ``out`` as a Hugging Face model directory; returns ``out``."""
    import yaml

    from poplar.launch import spawn
    from poplar.workload import as_workload

    run_dir, out = Path(run_dir), check_export_dir(out)
    checkpoint = find_resumable(run_dir / "checkpoints", report=lambda line: None)
    if checkpoint is None:
        raise CheckpointError(f"{run_dir}: no intact checkpoint to export (a run writes one at its end): check "
                              "the run directory")
    cfg_path = run_dir / "config.yaml"
    if not cfg_path.is_file():
        raise ValueError(f"{run_dir}: no config.yaml: not a run directory of `poplar train`")
    cfg = TrainConfig(**yaml.safe_load(cfg_path.read_text()))
    meta = read_meta(checkpoint)
    wl = as_workload(meta["workload"])
    check_exportable(wl)
    state = spawn(_full_state, 1, cfg, wl, checkpoint, meta, timeout_s=timeout_s)[0]
    model = wl.build(seed=cfg.seed)
    model.load_state_dict(state)
    out.mkdir(exist_ok=True)
    model.save_pretrained(out)
    _save_tokenizer(cfg, wl, out)
    return out


def _full_state(rank: int, world_size: int, cfg: TrainConfig, wl, checkpoint: Path, meta: dict) -> dict:
    """One rank: the run's units in an engine of its own, the checkpoint loaded, the full parameters returned."""
    import torch

    import poplar
    from poplar.engine import initialize
    from poplar.train.checkpoint import load_checkpoint
    from poplar.train.checkpointer import EXPECTED_KEYS

    plan = poplar.Plan(0, [meta["global_batch"]], 1)
    engine = initialize(wl.build(seed=cfg.seed), lambda p: torch.optim.AdamW(p, lr=cfg.lr), plan, cfg.engine)
    load_checkpoint(engine, checkpoint, {k: meta[k] for k in EXPECTED_KEYS})
    state = engine.full_state_dict()
    engine.close()
    return state


def _save_tokenizer(cfg: TrainConfig, wl, out: Path) -> None:
    """The tokenizer the run read its text with, saved beside the model (none where the data was ids alone)."""
    from transformers import PreTrainedTokenizerFast

    from poplar.data.text import EOT, MASK
    from poplar.train.dataset import prepare_data

    directory = getattr(wl, "directory", None)
    if directory is not None and wl.has_tokenizer():
        from poplar.models.pretrained import auto_tokenizer

        auto_tokenizer(directory).save_pretrained(out)
        return
    tok, _ = prepare_data(cfg)
    if tok is not None:
        PreTrainedTokenizerFast(tokenizer_object=tok.backend, eos_token=EOT, pad_token=EOT,
                                mask_token=MASK).save_pretrained(out)
