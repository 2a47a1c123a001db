"""The training configuration: a typed YAML file, with command-line overrides.

The engine's options are the engine's own :class:`~poplar.engine.config.EngineConfig`,
held under ``engine:`` (``engine.unit_numel=500000`` on the command line). The ones
people set most may also be written at the top level, as earlier configs did
(``clip_grad_norm``, ``mixed_precision``, ``on_nonfinite``; ``on_nonfinite: stop`` is
the engine's ``raise``). ``mixed_precision: auto`` leaves the precision to Poplar: bf16
where every device has bf16 hardware, else fp16 where every device has fp16 (V100, T4),
else fp32, chosen at launch (:func:`~poplar.train.launching.precision_of`), and said.

>>> cfg = TrainConfig(mixed_precision="bf16")
>>> cfg.engine.mixed_precision, cfg.engine.clip_grad_norm
('bf16', 1.0)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from poplar.data.records import DataFields
from poplar.engine.config import EngineConfig
from poplar.models.lora import LoraSettings
from poplar.runtime.replan_settings import ReplanConfig

# engine options accepted at the top level of a training config, as earlier configs wrote them
FLAT_ENGINE_FIELDS = ("clip_grad_norm", "mixed_precision", "on_nonfinite")
ENGINE_DEFAULTS = {"clip_grad_norm": 1.0}   # where training's default differs from the engine's


REPORTERS = ("tensorboard", "wandb")   # report_to's names, as the HF Trainer's


@dataclass(frozen=True)
class LrSchedule:
    """The learning rate of each step: linear warm-up, then cosine decay to a tenth over the run."""

    lr: float
    warmup_steps: int
    steps: int

    def at(self, step: int) -> float:
        """Step ``step``'s rate (from 0; a function of the step: resumable)."""
        if self.warmup_steps and step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        progress = (step - self.warmup_steps) / max(1, self.steps - self.warmup_steps)
        return self.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


@dataclass(frozen=True)
class CheckpointSettings:
    """The checkpointer's section: where, how often, how many kept, whether to resume, and what a checkpoint must
    share with the run (the seed and the data; the workload and global batch come with the run)."""

    out: Path
    every: int
    keep: int
    resume: bool
    seed: int
    data: str

    @property
    def root(self) -> Path:
        return self.out / "checkpoints"


@dataclass(frozen=True)
class ModelData:
    """The model and data section: what the run trains on what (:mod:`poplar.train.dataset`)."""

    model: str
    pretrained: bool
    seq_len: int
    activation_checkpointing: bool
    vocab_size: int
    data: str
    data_fields: DataFields
    global_batch: int
    seed: int
    eval_data: str | float | None = None   # a file read as `data` is, or a fraction of its samples held out
    lora: LoraSettings | None = None       # adapters trained beside the frozen model (poplar.models.lora)
    chat_template: str | None = None       # renders conversations in place of the tokenizer's (poplar.data.chat_template)


@dataclass(frozen=True)
class LogSettings:
    """The step log's section: where, how often, the run's length and tokens a sample, its learning rates; where
    else its figures go (``report_to``: :mod:`poplar.train.reporters`)."""

    out: Path
    every: int
    steps: int
    seq_len: int
    schedule: LrSchedule
    report_to: tuple[str, ...] = ()


class TrainConfig(BaseModel):
    """Everything `poplar train` needs; every field has a default that runs on a laptop."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field("llama-tiny", description="model preset (poplar.models.workload), a Hugging Face model "
                       "directory or its config.json (poplar.models.pretrained), or package.module:factory "
                       "(poplar.models.factory)")
    pretrained: bool = Field(True, description="a model directory's training starts from its weights (false: "
                             "initialised afresh)")
    export: str | None = Field(None, description="at the end, write the trained model here as a directory "
                               "from_pretrained loads (as `poplar export`)")
    seq_len: int = Field(64, gt=1, description="tokens per sample")
    activation_checkpointing: bool = Field(False, description="each block keeps only its input and computes again "
                                           "in the backward (less memory a sample, more compute)")
    vocab_size: int = Field(1024, ge=260, description="tokenizer vocabulary trained on the data")
    data: str = Field("embedded", description="'embedded', 'wikitext', a .txt file / directory, or a table: "
                      ".jsonl/.json/.csv/.parquet/.arrow, a directory of them, a dataset saved to disk")
    data_fields: DataFields = Field(default_factory=DataFields, description="the table's fields and format "
                                    "(recognised by name: 'text'; 'prompt' + 'completion'; 'messages'; alpaca's "
                                    "'instruction' + 'output'; ShareGPT's 'conversations'; 'input_ids' (+ "
                                    "'labels'); format= names it where ambiguous)")
    global_batch: int = Field(32, gt=0, description="samples per optimizer step, over all ranks")
    steps: int = Field(20, gt=0, description="optimizer steps in all (a resumed run continues to this)")
    stop_at: int | None = Field(None, gt=0, description="stop (with a checkpoint) after this step, e.g. to fit a "
                                "job's time limit; --resume continues to `steps`")
    lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.01, ge=0)
    warmup_steps: int = Field(0, ge=0, description="linear learning-rate warm-up")
    engine: EngineConfig = Field(default_factory=lambda: EngineConfig(**ENGINE_DEFAULTS),
                                 description="the engine's options (poplar.engine.config.EngineConfig)")
    seed: int = 0
    cluster: str | None = Field("both-differ", description="emulated cluster: a preset or a YAML file; "
                                "none: plain ranks (torchrun's, or --nproc), which need --plan")
    stages: list[int] = Field(default_factory=lambda: [0, 1, 2, 3], description="ZeRO stages the planner may use")
    plan: str | None = Field(None, description="a plan.json to train with (no profiling or planning)")
    baseline: Literal["poplar", "uniform", "proportional", "measured-peak"] = Field("poplar", description="allocation to train with")
    out: str = Field("runs/poplar", description="directory for the log, plan, checkpoints and report")
    checkpoint_every: int = Field(0, ge=0, description="steps between checkpoints (0: only at the end)")
    keep_checkpoints: int = Field(2, ge=1, description="newest checkpoints kept (more than one: a damaged one "
                                  "leaves another to resume from)")
    resume: bool = Field(False, description="continue from the newest intact checkpoint in `out`, on this cluster "
                         "or another (a changed cluster is profiled and planned anew)")
    dead_rank_timeout_s: float = Field(30.0, gt=0, description="a rank silent this long is taken for dead and the "
                                       "run stops (a rank on the same host whose process is gone: at once)")
    log_every: int = Field(1, gt=0)
    replan: ReplanConfig = Field(default_factory=ReplanConfig, description="re-planning while training from the "
                                 "steps measured: mode auto|off, threshold, patience, every (e.g. --set replan=off)")
    eval_data: str | float | None = Field(None, description="held-out data: a file or table as `data` takes it "
                                          "(the same fields), or a fraction of the training samples held out "
                                          "(0.05)")
    eval_every: int = Field(0, ge=0, description="steps between evaluations of eval_data (0: at the end only)")
    lora: LoraSettings | None = Field(None, description="train LoRA adapters instead of every weight: r, alpha, "
                                      "dropout, targets, merge (needs the lora extra: pip install "
                                      "'poplar-zero[lora]')")
    chat_template: str | None = Field(None, description="a Jinja chat template (a file or the template itself) "
                                      "for conversational data, where the model's tokenizer has none")
    report_to: list[Literal["tensorboard", "wandb"]] = Field(default_factory=list, description="also log to "
                                                             "tensorboard and/or wandb (HF's names; none: "
                                                             "log.jsonl only)")
    profile_cache: bool = True
    peak_tflops: float | None = Field(None, gt=0, description="each GPU's peak dense TFLOP/s in the compute dtype, "
                                      "for model FLOPs utilisation where poplar does not know the GPU")
    auto_precision: bool = Field(False, description="mixed_precision: auto: the precision the devices compute "
                                 "fastest (bf16, else fp16, else fp32), chosen at launch")

    @model_validator(mode="before")
    @classmethod
    def _engine_fields(cls, data: Any) -> Any:
        """Top-level engine options (as earlier configs wrote them) go into ``engine``."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        engine = data.get("engine") or {}
        if isinstance(engine, EngineConfig):
            engine = engine.model_dump(exclude_unset=True)
        if not isinstance(engine, dict):
            return data   # pydantic says what is wrong with it
        flat = {k: data.pop(k) for k in FLAT_ENGINE_FIELDS if k in data}
        if flat.get("on_nonfinite") == "stop":
            flat["on_nonfinite"] = "raise"
        if any(str(d.get("mixed_precision", "")).strip().lower() == "auto" for d in (flat, engine)):
            flat.pop("mixed_precision", None)   # chosen at launch, where the devices are known
            engine = {k: v for k, v in engine.items() if k != "mixed_precision"}
            data["auto_precision"] = True
        data["engine"] = {**ENGINE_DEFAULTS, **engine, **flat}
        return data

    @field_validator("report_to", mode="before")
    @classmethod
    def _reporters(cls, v):
        """``none``, one name, or several (``tensorboard,wandb``), as the HF Trainer's ``report_to``."""
        if v is None:
            return []
        names = [x.strip().lower() for x in v.split(",")] if isinstance(v, str) else v
        if names in (["none"], [""]):
            return []
        return list(REPORTERS) if names == ["all"] else names

    @field_validator("eval_data", mode="before")
    @classmethod
    def _eval_fraction(cls, v):
        """A number (``--eval-data 0.05`` too) is a fraction of the training samples held out, in (0, 1)."""
        if isinstance(v, str):
            try:
                v = float(v) if not Path(v).exists() else v
            except ValueError:
                return v   # a path
        if isinstance(v, bool) or (isinstance(v, (int, float)) and not 0 < v < 1):
            raise ValueError(f"a fraction of the training samples to hold out is between 0 and 1 (e.g. 0.05), "
                             f"got {v}: give one in (0, 1), or a file of evaluation data")
        return float(v) if isinstance(v, int) else v

    @field_validator("cluster", mode="before")
    @classmethod
    def _no_cluster(cls, v):
        return None if isinstance(v, str) and v.strip().lower() in ("", "none", "null") else v

    @model_validator(mode="after")
    def _consistent(self):
        if self.stop_at is not None and self.stop_at > self.steps:
            raise ValueError(f"stop_at ({self.stop_at}) is past steps ({self.steps}): stop at or before the last step")
        if self.warmup_steps > self.steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) exceeds steps ({self.steps}): shorten the warm-up")
        if self.eval_every and self.eval_data is None:
            raise ValueError(f"eval_every ({self.eval_every}) evaluates nothing without eval_data: give eval_data "
                             "(a file, or a fraction held out such as 0.05)")
        return self

    @property
    def schedule(self) -> LrSchedule:
        return LrSchedule(self.lr, self.warmup_steps, self.steps)

    @property
    def checkpointing(self) -> CheckpointSettings:
        trained = self.data if not isinstance(self.eval_data, float) else f"{self.data} ({self.eval_data} held out)"
        return CheckpointSettings(Path(self.out), self.checkpoint_every, self.keep_checkpoints, self.resume,
                                  self.seed, trained)   # what the steps draw from: a resume must draw the same

    @property
    def model_data(self) -> ModelData:
        return ModelData(self.model, self.pretrained, self.seq_len, self.activation_checkpointing, self.vocab_size,
                         self.data, self.data_fields, self.global_batch, self.seed, eval_data=self.eval_data,
                         lora=self.lora, chat_template=self.chat_template)

    @property
    def logging(self) -> LogSettings:
        return LogSettings(Path(self.out), self.log_every, self.steps, self.seq_len, self.schedule,
                           report_to=tuple(self.report_to))

    @field_validator("model")
    @classmethod
    def _model(cls, v: str) -> str:
        from poplar.models.factory import looks_like_factory
        from poplar.models.pretrained import looks_like_directory
        from poplar.models.workload import MODEL_PRESETS, HF_PRESETS

        if looks_like_directory(v) or looks_like_factory(v):
            return v    # checked whole (config, weights; the factory) when the run starts, before anything is profiled
        if v not in MODEL_PRESETS and v not in HF_PRESETS:
            raise ValueError(f"{v!r} is not a model preset: choose one of {', '.join([*MODEL_PRESETS, *HF_PRESETS])}, "
                             "or give a model directory's path (./my-model)")
        return v

    @field_validator("stages")
    @classmethod
    def _stages(cls, v: list[int]) -> list[int]:
        from poplar.stages import parse_stages

        return parse_stages(v)


def _errors(e: ValidationError, source: str) -> str:
    parts = []
    for err in e.errors():
        where = ".".join(str(p) for p in err["loc"]) or "(top level)"
        msg = "unknown field" if err["type"] == "extra_forbidden" else err["msg"]
        parts.append(f"{where}: {msg}")
    return f"{source}: " + "; ".join(parts)


def load_config(path: str | Path | None = None, overrides: dict | None = None) -> TrainConfig:
    """The file's values (if any), then ``overrides`` (``None`` values are left out). Errors name the field."""
    data: dict = {}
    source = "config"
    if path is not None:
        path = Path(path)
        source = str(path)
        if not path.exists():
            raise ValueError(f"--config {path}: no such file")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            raise ValueError(f"{path}: not valid YAML{where}: {getattr(e, 'problem', None) or e}") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping of fields, got {type(data).__name__}")
    for key, value in (overrides or {}).items():
        if value is None:
            continue
        *sections, field = key.split(".")
        into = data   # engine.unit_numel=..., engine.loss_scale.init_scale=...: a field of a section
        for depth, section in enumerate(sections):
            if not isinstance(into.get(section, {}), dict):
                raise ValueError(f"{key}: {'.'.join(sections[:depth + 1])} is not a section of the config")
            into[section] = dict(into.get(section) or {})
            into = into[section]
        into[field] = value
    try:
        return TrainConfig(**data)
    except ValidationError as e:
        raise ValueError(_errors(e, source)) from None
