"""Workloads: the real-size presets, known by their shapes alone and refused where they cannot be built."""

import pytest
import torch

from poplar.models.presets import HF_PRESETS, MODEL_PRESETS
from poplar.models.workload import Workload


@pytest.mark.parametrize("model, billions, vocab", [("llama-1b", 1.50, 128256), ("llama-7b", 6.74, 32000),
                                                     ("llama-13b", 13.02, 32000), ("llama-70b", 68.98, 32000),
                                                     ("bert-large", 0.34, 30522)])
def test_real_size_presets_have_their_models_parameters(model, billions, vocab):
    wl = Workload(model=model)
    assert wl.vocab_size == vocab and wl.n_params() / 1e9 == pytest.approx(billions, abs=0.01)


def test_a_model_too_large_for_this_host_is_refused_before_it_is_built():
    with pytest.raises(ValueError, match=r"llama-70b has 69\.0B parameters .* plan it with `poplar simulate`"):
        Workload(model="llama-70b").build()
    assert Workload(model="llama-tiny", vocab_size=300).build() is not None


def _train_both(rank, world_size):
    return [_train(rank, world_size, checkpointing) for checkpointing in (False, True)]


def _train(rank, world_size, checkpointing: bool):
    """Three AdamW steps of llama-tiny on two ranks in ZeRO-3 with uneven shares; its parameters after."""
    import functools

    import torch

    import poplar

    wl = Workload(model="llama-tiny", seq_len=16, vocab_size=300, activation_checkpointing=checkpointing)
    plan = poplar.Plan(3, [2, 1], [2, 2], shard_shares=[3, 1])
    model = wl.build()
    runs = []    # the first block's MLP's calls: twice a micro-step where the block computes again
    model.model.layers[0].mlp.register_forward_pre_hook(lambda *_: runs.append(1))
    engine = poplar.initialize(model, functools.partial(torch.optim.AdamW, lr=1e-3), plan)
    lo, hi = plan.sample_range(rank)
    losses = [engine.train_batch(tuple(t[lo:hi] for t in wl.random_batch(plan.global_batch_size, seed=s)), wl.loss)
              for s in range(3)]
    return losses, engine.full_state_dict(), len(runs)


@pytest.mark.parametrize("model", ["tiny", "llama-tiny"])
def test_a_checkpointed_model_computes_what_the_plain_one_does(model):
    import torch

    wl = Workload(model=model)
    batch = wl.random_batch(3)
    grads, calls = [], []
    for checkpointing in (False, True):
        m = wl.model_copy(update={"activation_checkpointing": checkpointing}).build()
        seen = []    # every module's calls: the blocks' insides run again in the backward where checkpointed
        handle = torch.nn.modules.module.register_module_forward_pre_hook(lambda *_: seen.append(1))
        try:
            wl.loss(m, batch).backward()
        finally:
            handle.remove()
        grads.append({n: p.grad for n, p in m.named_parameters()})
        calls.append(len(seen))
    assert calls[1] > calls[0]
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=0, atol=1e-7, msg=name)


@pytest.mark.slow
def test_a_checkpointed_model_trains_on_the_engine_as_the_plain_one():
    """ZeRO-3 with uneven shares: the blocks' re-runs inside the backward find their units gathered."""
    from poplar.processes.spawn import spawn

    import torch

    for (losses, state, runs), (ck_losses, ck_state, ck_runs) in spawn(_train_both, 2, timeout_s=300):
        assert (runs, ck_runs) == (6, 12)    # 3 steps of 2 micro-steps
        assert ck_losses == pytest.approx(losses, abs=1e-6) and ck_state.keys() == state.keys()
        for name, value in state.items():
            torch.testing.assert_close(ck_state[name], value, rtol=0, atol=1e-6, msg=name)


@pytest.mark.slow
def test_a_model_source_that_is_no_preset_is_profiled_planned_and_trained(tmp_path, monkeypatch):
    """The interface alone (poplar.models.workload.ModelSource) is what the profiler, the planner and the ranks use: a
    source of the test's own, crossing into the spawned ranks as it is."""
    from poplar.cluster.spec import parse_cluster
    from poplar.compare.measure import measure_plans
    from poplar.planner import make_plan
    from poplar.profile.profiler import profile_cluster
    from poplar.models.workload import ModelSource, as_workload
    from tests.helpers.models import RegressionSource

    monkeypatch.setenv("POPLAR_DILATION", "20")   # a fixed pace: this host keeps up with these steps when quiet
    source = RegressionSource()
    assert isinstance(source, ModelSource) and as_workload(source) is source
    cluster = {"devices": [{"kind": "a100", "gpu": "A100-80GB"}, {"kind": "t4", "gpu": "T4-16GB"}]}
    profile, _ = profile_cluster(source, cluster, stages=(0, 2), cache_dir=tmp_path, timeout_s=300, n_points=2,
                                 repeats=1)
    assert profile.model.name == "regression-384" and profile.model.n_params == source.n_params()
    assert len(profile.model.unit_numels) == 3        # the root, and each block a unit of its own
    result = make_plan(profile, 64, [0, 2])
    predicted = result.allocations()["poplar"].predicted.step_s
    on = parse_cluster(cluster).subset(result.ranks) if result.ranks else parse_cluster(cluster)   # cards left out
    measured = measure_plans(source, on.model_dump(), [result.plan], steps=3)[0]
    assert measured["overruns"] > 0 or measured["step_s"] == pytest.approx(predicted, rel=0.1)
    with pytest.raises(TypeError, match="a workload is a preset's name, its fields or a poplar.models.workload.ModelSource"):
        as_workload(object())


def _built_count(name: str, vocab_size: int) -> int:
    """A preset's parameters as the built model has them (meta tensors; a deep one from one and two layers)."""
    from poplar.models.hf import HF_PRESETS, build_hf_model

    layers = HF_PRESETS[name][1].get("num_hidden_layers", 0) if name in HF_PRESETS else 0
    with torch.device("meta"):
        if layers < 3:
            return sum(p.numel() for p in Workload(model=name, vocab_size=vocab_size).build().parameters())
        one, two = (sum(p.numel() for p in build_hf_model(name, vocab_size, num_hidden_layers=n).parameters())
                    for n in (1, 2))
    return one + (layers - 1) * (two - one)


@pytest.mark.parametrize("name", [*MODEL_PRESETS, *HF_PRESETS])
def test_every_presets_count_from_arithmetic_is_the_built_models(name):
    from poplar.models.presets import param_count

    default = Workload(model=name).vocab_size
    vocabularies = [default] if name in MODEL_PRESETS else [default, 1001]   # the built-in ones fix theirs
    for vocab in vocabularies:
        assert param_count(name, vocab) == _built_count(name, vocab), vocab
