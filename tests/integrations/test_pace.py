"""An integration's emulated ranks are paced by a probe of the user's own module, bounded as the profiler's are.

A module of a few hundred parameters planned from an emulated pair alone (``PoplarStrategy(cluster=...,
global_batch=48)``, ``PoplarTrainer(cluster=...)``, ``poplar.initialize`` with a cluster) used to sleep
through its profile at a pace thousands of times slower than the work needed: the probe's cost per sample
(the host's noise, for so small a model) was taken out to the millions of samples a large card would hold,
and the collectives were probed at sizes it never issues. The fast tests check the probe an integration's
:class:`~poplar.integrations.module_source.ModuleSource` gives (the module's own step on collated samples of
its data, bounded by the global batch and by the model's size); the slow ones profile, plan and train on the
pair at the pace the ranks choose, exactly as one device trains, saying what they profile as they go.
"""

from __future__ import annotations

import re
import statistics

import pytest
import torch
from torch.utils.data import default_collate

from poplar.cluster.spec import load_cluster
from poplar.devices import rank_device
from poplar.emulate.dilation import comm_numels, largest_samples, model_bytes
from poplar.integrations.module_source import ModuleSource
from poplar.processes.spawn import spawn
from tests.integrations import ours
from tests.integrations.pace_workers import (GLOBAL_BATCH, PAIR, deepspeed_fit, features, hf_fit, lightning_fit,
                                             make_mlp, mlp_loss, reference)

MLP_PARAMS = 6 * 17 + 17 + 17 * 9 + 9 + 9 * 2 + 2     # 301


@pytest.fixture(autouse=True)
def natural_pace(monkeypatch, tmp_path):
    monkeypatch.delenv("POPLAR_DILATION", raising=False)    # the pace the ranks choose: what is tested here
    for name in ("POPLAR_PLAN", "POPLAR_CLUSTER", "POPLAR_WORKLOAD", "POPLAR_GLOBAL_BATCH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("POPLAR_CACHE_DIR", str(tmp_path / "profiles"))   # profiled, not read from a cache


def module_source(loss=mlp_loss) -> ModuleSource:
    return ModuleSource(make_mlp(), loss, features(), default_collate)


def test_the_probe_runs_a_copy_of_the_users_module_on_collated_samples_of_its_data():
    seen = []

    def loss(model, batch):
        seen.append((model, batch))
        return mlp_loss(model, batch)

    source = module_source(loss)
    device = rank_device(load_cluster(PAIR), 0, source, most=GLOBAL_BATCH)
    seen.clear()                      # the source's own check of a sample's loss
    device.probe(5)
    (model, (x, y)), = seen
    assert model is device.probe.model and model is not source.module and isinstance(model, torch.nn.Sequential)
    rows = {tuple(r.tolist()) for r in features().tensors[0]}
    assert x.shape == (5, 6) and y.shape == (5,) and all(tuple(r.tolist()) in rows for r in x)
    assert all(p.grad is None for p in model.parameters())            # nothing left behind for the next probe
    assert all(p.grad is None for p in source.module.parameters())    # the user's module untouched


def test_the_probe_is_bounded_by_the_global_batch_and_its_collectives_by_the_models_size():
    spec = load_cluster(PAIR)
    bounded = rank_device(spec, 0, module_source(), most=GLOBAL_BATCH)
    assert largest_samples(bounded, bounded.probe) == GLOBAL_BATCH
    # the A800's memory at scale 0.01 would hold millions of the MLP's samples: no run takes that many
    free = rank_device(spec, 0, module_source())
    assert largest_samples(free, free.probe) > 10**5
    assert model_bytes(bounded.probe) == 4 * MLP_PARAMS
    assert comm_numels(2, model_bytes(bounded.probe)) == [2, 302]    # a few bytes, and the whole model (padded)
    assert comm_numels(2, None)[-1] == 2 * 256 * 1024                # no model named: up to 1 MiB a rank


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_half_precision_probe_casts_the_modules_float_inputs_as_the_engine_does(precision):
    from poplar.precision import torch_dtype

    device = rank_device(load_cluster(PAIR), 1, module_source(), precision, most=GLOBAL_BATCH)
    device.probe(4)     # float features into half weights: refused by the Linear without the engine's cast
    assert {p.dtype for p in device.probe.model.parameters()} == {torch_dtype(precision)}


@pytest.mark.paced
@pytest.mark.parametrize("rank", [0, 1], ids=["a800-80gb", "v100s-32gb"])
def test_what_the_modules_probe_asks_of_the_pace_is_within_what_a_comparable_presets_asks(rank):
    """On each card of the pair, the ratio of host to declared time the MLP's own step asks of the dilation, over
    the micro-batches its run takes (1 to the global batch), beside a comparable preset's (``tiny``, a two-block
    causal LM of 120k parameters, at the same bound): the same procedure on both, and the MLP's no more. Unbounded
    (its cost a sample taken out to the millions the card holds), it asked thousands here, and the pace of the
    whole run with it."""
    from poplar.emulate.dilation import probe_ratio
    from poplar.models.workload import Workload

    spec, ratios = load_cluster(PAIR), {"module": [], "preset": []}
    for _ in range(3):    # in turn, the median of each: the host's load weighs on both alike
        for name, workload in (("module", module_source()), ("preset", Workload(model="tiny"))):
            device = rank_device(spec, rank, workload, most=GLOBAL_BATCH)
            ratios[name].append(probe_ratio(device, device.probe))
    module, preset = (statistics.median(ratios[name]) for name in ("module", "preset"))
    assert 1 < module <= preset, ratios


def assert_shown(printed: str, model: str) -> None:
    """Rank 0 said what it profiles, each card's stage as it began and ended (the V100S's relayed from rank 1),
    and the plan it chose."""
    lines = ours(printed, PAIR)
    assert lines[0] == (f"{PAIR}: profiling {model} on 1 x a800-80gb, 1 x v100s-32gb in ZeRO stages 0-3 (cached "
                        "after the first run): each stage is shown as it ends"), printed
    where = re.escape(PAIR)
    for kind in ("a800-80gb", "v100s-32gb"):
        for stage in range(4):
            began = [line for line in lines if line.startswith(f"{PAIR}: {kind} stage {stage}: ")]
            assert began and not began[0].endswith(" s)"), printed
            assert re.fullmatch(rf"{where}: {kind} stage {stage}: done \(\d+ s\)", began[-1]), printed
    plan = rf"Plan\(stage \d, global batch {GLOBAL_BATCH}: r0:.*\); stage \d[^;]*: [\d.]+ samples/s predicted"
    assert re.fullmatch(rf"{where}: profiled and planned in \d+ s: {plan}.*", lines[-1]), printed


def assert_planned_and_trained(ranks: list[dict], model: str) -> None:
    first = ranks[0]
    assert first["plan"] == ranks[1]["plan"] and first["dilation"] == ranks[1]["dilation"]
    want = reference()
    for name, value in want.items():
        torch.testing.assert_close(first["state"][name], value, rtol=1e-5, atol=1e-5, msg=name)
    assert_shown(first["printed"], model)
    # every emulated device of the run (the profiler's, then the trainer's) paced by the module's own step
    for rank in ranks:
        probed = [(p["model"], p["most"]) for p in rank["probes"]]
        assert probed == [(model, GLOBAL_BATCH)] * 2, rank["probes"]


@pytest.mark.slow   # exactness and what is said, not time: beside other tests
def test_a_lightning_module_is_profiled_planned_and_trained_on_an_emulated_pair_as_one_device():
    pytest.importorskip("lightning.pytorch")
    assert_planned_and_trained(spawn(lightning_fit, 2, timeout_s=300), "LitMLP")


@pytest.mark.slow   # exactness and what is said, not time: beside other tests
def test_the_hf_trainer_profiles_plans_and_trains_the_model_given_on_an_emulated_pair_as_one_device(tmp_path):
    pytest.importorskip("transformers")
    assert_planned_and_trained(spawn(hf_fit, 2, str(tmp_path / "out"), timeout_s=300), "_MLPWithLoss")


@pytest.mark.slow   # exactness and what is said, not time: beside other tests
def test_the_deepspeed_form_profiles_plans_and_trains_the_model_given_on_an_emulated_pair_as_one_device():
    assert_planned_and_trained(spawn(deepspeed_fit, 2, timeout_s=300), "Sequential")
