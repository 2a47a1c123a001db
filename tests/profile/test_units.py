"""The units a profile records are the engine's own, built with the engine options training uses."""

import pytest

from poplar.cluster.spec import parse_cluster
from poplar.engine.config import EngineConfig
from poplar.processes.spawn import spawn
from poplar.profile.cache import ProfileCache, cache_key, engine_key
from poplar.profile.options import ProfileOptions
from poplar.profile.profile import CommProfile, StageProfile, StepAnatomy
from poplar.profile.profiler import profile_cluster, unit_numels
from poplar.profile.units import unit_flops
from poplar.models.workload import as_workload
from tests.profile.workers import engine_unit_numels

SMALL_UNITS = 20_000   # below the tiny model's block size: its blocks' linear layers become units of their own
ONE = {"devices": [{"kind": "small", "gpu": "A100-40GB"}], "memory_scale": 0.0005}


@pytest.mark.slow
def test_a_non_default_unit_size_gives_the_units_the_engine_builds():
    default, small = unit_numels("tiny"), unit_numels("tiny", EngineConfig(unit_numel=SMALL_UNITS))
    assert len(small) > len(default) == 3 and sum(small) == sum(default)
    assert spawn(engine_unit_numels, 1, SMALL_UNITS, timeout_s=120) == [small]


def test_the_cache_key_holds_the_engine_options_that_change_a_profile():
    kind = ONE["devices"][0]
    plain = cache_key("tiny", kind, 0, 1)
    # the defaults add nothing: profiles cached before engine options were keyed are still read
    assert cache_key("tiny", kind, 0, 1, config=EngineConfig()) == plain
    assert cache_key("tiny", kind, 0, 1, config=EngineConfig(clip_grad_norm=1.0, check_batches=False)) == plain
    assert cache_key("tiny", kind, 0, 1, config=EngineConfig(unit_numel=SMALL_UNITS)) != plain
    assert cache_key("tiny", kind, 0, 1, config=EngineConfig(max_inflight_reduces=4)) != plain
    assert cache_key("tiny", kind, 0, 1, config=EngineConfig(prefetch=False)) != plain
    assert engine_key(EngineConfig(unit_classes=["Block"])) == {"unit_classes": ["Block"]}


def test_a_profile_read_from_the_cache_records_the_units_of_its_engine_options(tmp_path):
    config = EngineConfig(unit_numel=SMALL_UNITS)
    options = ProfileOptions(stages=(0,), cache_dir=tmp_path)
    wl, spec = as_workload("tiny"), parse_cluster(ONE)
    anatomy = StepAnatomy(micro_batch=4, forward=[0.1, 0.1], backward=[0.1, 0.5], root_middle=0.2,
                          before_loss_s=1e-3, before_norm_s=0.0)
    stage = StageProfile(max_micro_batch=4, state_bytes=10, points=[(1, 0.1), (4, 0.3)], anatomy=[anatomy])
    cache = ProfileCache(tmp_path, wl, spec, options.stages, options.precision, options.max_micro_batch, config)
    cache.save({("small", 0): stage}, CommProfile(numel=8, all_reduce_s=1e-3, reduce_scatter_s=1e-3, all_gather_s=1e-3,
                                                  between_s={}))
    prof, summary = profile_cluster("tiny", ONE, options, config=config)     # nothing to measure: no rank spawned
    assert summary["from_cache"] == [("small", 0)] and summary["measured"] == []
    assert prof.model.unit_numels == unit_numels("tiny", config) != unit_numels("tiny")
    assert prof.model.unit_flops == unit_flops("tiny", config) and len(prof.model.unit_flops) == len(small_units())
    assert prof.stage("small", 0) == stage
    # the same cluster with the default units is another profile: not read from this cache
    other = ProfileCache(tmp_path, wl, spec, options.stages, options.precision, options.max_micro_batch, None)
    assert other.stages() == {} and other.comm() is not None      # the collectives' times read at any size
    with pytest.raises(ValueError, match="precision 'fp8': choose one of fp32, bf16, fp16"):
        ProfileOptions(precision="fp8")
    from poplar.profile.profiler import still_current
    assert still_current(cache, spec)[1] is not None
    cache.save({}, cache.comm().model_copy(update={"between_s": None}))
    assert still_current(cache, spec)[1] is None     # written before the sizes between were timed: timed again


def small_units() -> list[int]:
    return unit_numels("tiny", EngineConfig(unit_numel=SMALL_UNITS))


def test_each_unit_counts_its_own_forward_flops_and_together_the_whole_model():
    (whole,) = unit_flops("tiny", EngineConfig(unit_classes=["NoSuchModule"]))   # the whole model as one unit
    default, small = unit_flops("tiny"), unit_flops("tiny", EngineConfig(unit_numel=SMALL_UNITS))
    assert sum(default) == pytest.approx(whole) and sum(small) == pytest.approx(whole)
    root, *blocks = default
    assert len(blocks) == 2 and blocks[0] == blocks[1] > root > 0     # the blocks alike; the head in the root
    assert len(small) > len(default) and small[0] == root               # sub-units take their FLOPs from the block


def test_the_bucket_sizes_are_the_units_of_a_preset_a_module_given_and_a_model_that_reads_values():
    """The collectives are timed at the engine's unit sizes, read from the model built on fake tensors: a
    preset's, a module given with real weights (copied as fake ones), and one whose build reads a value (built as
    it is)."""
    import torch

    from poplar.integrations.module_source import ModuleSource, output_loss
    from poplar.models import build_model
    from poplar.profile.units import bucket_numels

    config = EngineConfig(unit_numel=SMALL_UNITS)
    assert bucket_numels("tiny", config) == tuple(unit_numels("tiny", config)) and len(bucket_numels("tiny")) > 1
    given = build_model("tiny")
    source = ModuleSource(given, lambda model, batch: output_loss(model, batch).float().mean(),
                          [torch.randint(0, 100, (8,)) for _ in range(4)], lambda xs: torch.stack(xs))
    assert bucket_numels(source, config) == tuple(unit_numels(given, config))

    class ReadsAValue(ModuleSource):
        def build(self, seed: int = 0):
            model = super().build(seed)
            for p in model.parameters():
                p.requires_grad_(bool(p.detach().abs().sum().item() >= 0))    # a value read: no fake tensor has it
            return model
    reads = ReadsAValue(given, source.loss, source.dataset, source.collate)
    assert bucket_numels(reads, config) == tuple(unit_numels(given, config))
