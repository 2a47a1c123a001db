"""A model out of a run: its newest checkpoint as a directory ``from_pretrained`` loads (``poplar export``).

The checkpoint holds each unit's fp32 master whole (whatever world size, plan and stage
wrote it); the export reads one unit at a time, cuts it into the unit's parameters by
the model's own layout (built on the meta device) and writes it as a safetensors file of
its own under an index, as ``save_pretrained`` writes a sharded model, with the config;
beside them the tokenizer the run trained with: the model directory's own, or the one
trained on the run's text, saved as a fast tokenizer. No process holds the whole model.
Nothing is overwritten: the output directory must be new or empty.

A LoRA run (:mod:`poplar.models.lora`) is written as PEFT writes an adapter
(``adapter_config.json``, ``adapter_model.safetensors``: what
``peft.PeftModel.from_pretrained(base, directory)`` loads), its values read from the
checkpoint as above, with the tokenizer; with ``lora.merge`` also the merged model
(the adapters folded into the base's weights by PEFT's ``merge_and_unload``) in
``merged/`` beside it, a directory ``from_pretrained`` loads. The merge builds the whole
model once in this process.
"""

from __future__ import annotations

from pathlib import Path

from poplar.models.lora import LoraSource
from poplar.runtime.checkpoint import CheckpointError, find_resumable, read_meta
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
    presets and a factory's modules are the user's or Poplar's own); a LoRA adapter, of one."""
    from poplar.models.lora import LoraSource
    from poplar.models.pretrained import ModelDirectory
    from poplar.models.workload import Workload

    if isinstance(model_source, LoraSource):
        model_source = model_source.base

    hf = isinstance(model_source, ModelDirectory) or (isinstance(model_source, Workload) and
                                                       model_source.family != "tiny")
    if not hf:
        raise ValueError(f"--export: {model_source.name} is not a Hugging Face model: export a model directory "
                         "or a Hugging Face preset (its checkpoints hold the weights of any model)")


def export_run(run_dir: str | Path, out: str | Path) -> Path:
    """Write the run's newest intact checkpoint to ``out`` as a Hugging Face model directory; returns ``out``."""
    import yaml

    from poplar.models.workload import as_workload

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
    out.mkdir(exist_ok=True)
    if isinstance(wl, LoraSource):
        _write_adapter(wl, cfg, checkpoint, meta, out)
    else:
        _write_weights(wl, cfg.seed, cfg.engine, checkpoint, meta, out)
    _save_tokenizer(cfg.model_data, wl, out)
    return out


def _write_adapter(wl, cfg: TrainConfig, checkpoint: Path, meta: dict, out: Path) -> None:
    """The trained adapters as PEFT saves them, read from the checkpoint (frozen weights are in none: they are the
    base's); with ``lora.merge``, the merged model in ``out/merged`` with the tokenizer."""
    import torch

    with torch.device("meta"):
        model = wl.build(seed=cfg.seed)
    adapters = {name: t for unit in _unit_tensors(wl, model, cfg.engine, checkpoint, meta) for name, t in unit.items()}
    model.peft_config["default"].base_model_name_or_path = getattr(wl.base, "directory", None) or wl.base.name
    model.save_pretrained(out, state_dict=adapters, save_embedding_layers=False)
    if cfg.lora is not None and cfg.lora.merge:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()     # the command's output is its own lines
        trained = wl.build(seed=cfg.seed)     # the base's own weights (or its seeded ones), and the adapters
        missing = set(adapters) - set(trained.state_dict())
        if missing:
            raise CheckpointError(f"checkpoint {checkpoint}: {sorted(missing)[0]} is no adapter of {wl.name}")
        trained.load_state_dict(adapters, strict=False)
        merged = trained.merge_and_unload()
        merged.save_pretrained(out / "merged")
        _save_tokenizer(cfg.model_data, wl, out / "merged")


def _unit_tensors(wl, model, engine, checkpoint: Path, meta: dict):
    """Each unit's parameters (``{name: tensor}``, a unit at a time): its fp32 master read from the checkpoint whole
    (any stage, world size and plan wrote it) and cut as ``model`` (``wl``'s, built on the meta device) lays them
    out. ``engine``: the run's engine options (how its units were cut)."""
    import torch

    from poplar.engine.units import build_units, names_of
    from poplar.runtime.checkpoint import read_tensors

    specs = build_units(model, engine.unit_classes, engine.unit_numel)
    if [{"name": s.name, "numel": sum(p.numel() for p in s.params)} for s in specs] != meta.get("layout"):
        raise CheckpointError(f"checkpoint {checkpoint} holds other units than {wl.name} is cut into: export it "
                              "with the engine options it was trained with")
    names = names_of(model)
    for i, spec in enumerate(specs):
        flat = {f"unit{i}.master": torch.empty(sum(p.numel() for p in spec.params))}
        read_tensors(checkpoint, flat)
        tensors, offset = {}, 0
        for p in spec.params:   # a tied parameter once, under its first name (from_pretrained ties the rest)
            tensors[names[id(p)][0]] = flat[f"unit{i}.master"][offset:offset + p.numel()].view(p.shape).clone()
            offset += p.numel()
        yield tensors


def _write_weights(wl, seed: int, engine, checkpoint: Path, meta: dict, out: Path) -> None:
    """The model's config, and its weights unit by unit (:func:`_unit_tensors`), each unit a safetensors file of
    its own, under an index; then the saved buffers. One unit in memory at a time, never the whole model.
    ``seed``: the run's; ``engine``: its engine options (how its units were cut)."""
    import json

    import torch
    from safetensors.torch import save_file

    from poplar.engine.units import names_of
    from poplar.runtime.checkpoint import read_tensors

    with torch.device("meta"):
        model = wl.build(seed=seed)
    params = {n for ns in names_of(model).values() for n in ns}
    buffers = {f"buffer.{k}": torch.empty(v.shape, dtype=v.dtype) for k, v in model.state_dict().items()
               if k not in params}
    units = _unit_tensors(wl, model, engine, checkpoint, meta)
    n = len(meta.get("layout") or []) + bool(buffers)
    files, weight_map, total = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)], {}, 0
    for i, tensors in enumerate(units):
        total += _save(tensors, out / files[i], weight_map, save_file)
    if buffers:
        read_tensors(checkpoint, buffers)
        total += _save({k.removeprefix("buffer."): v for k, v in buffers.items()}, out / files[-1], weight_map,
                       save_file)
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n")
    model.config.save_pretrained(out)
    if getattr(model, "generation_config", None) is not None and model.can_generate():
        model.generation_config.save_pretrained(out)


def _save(tensors: dict, path: Path, weight_map: dict, save_file) -> int:
    save_file(tensors, str(path), metadata={"format": "pt"})
    weight_map.update({name: path.name for name in tensors})
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _save_tokenizer(model_data, wl, out: Path) -> None:
    """The tokenizer the run read its text with, saved beside the model (none where the data was ids alone)."""
    from transformers import PreTrainedTokenizerFast

    from poplar.data.text import EOT, MASK
    from poplar.train.dataset import prepare_data

    directory = getattr(wl, "directory", None)
    if directory is not None and wl.has_tokenizer():
        from poplar.models.pretrained import auto_tokenizer

        auto_tokenizer(directory).save_pretrained(out)
        return
    tok, _ = prepare_data(model_data)
    if tok is not None:
        PreTrainedTokenizerFast(tokenizer_object=tok.backend, eos_token=EOT, pad_token=EOT,
                                mask_token=MASK).save_pretrained(out)
