"""What frozen parameters (LoRA's base weights) cost, as the simulator counts it: their weights alone, in the compute
precision, on every rank, in every stage; the planner's arithmetic on the trained parameters only; ``poplar
simulate --lora``."""

from __future__ import annotations

import pytest

from poplar.cluster.spec import parse_cluster
from poplar.models.lora import LoraSettings, LoraSource
from poplar.profile.options import ProfileOptions
from poplar.simulate import simulate_profile, simulate_stages
from poplar.stages import frozen_bytes_per_param, stage
from poplar.models.workload import Workload

PAIR = {"devices": [{"kind": "a100-80gb", "gpu": "A100-80GB"}, {"kind": "a100-40gb", "gpu": "A100-40GB"}]}
ADAPTERS = LoraSettings(r=4, targets=["q_proj", "v_proj"])


def lora(vocab_size: int) -> LoraSource:
    return LoraSource(Workload(model="llama-tiny", seq_len=32, vocab_size=vocab_size), ADAPTERS)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_frozen_parameters_cost_their_weights_alone_in_every_stage(precision):
    """Two models alike but for their frozen embeddings and head (a larger vocabulary): the same adapters, so
    every stage's model states differ by exactly the frozen weights, in the compute precision, whole on each rank
    (no gradient, no fp32 master, no optimizer state, no shard)."""
    small, large = lora(1024), lora(1024 + 512)
    assert small.trained_params() == large.trained_params()
    more = large.frozen_params() - small.frozen_params()
    assert more == 2 * 512 * 64     # the embedding's and the head's rows
    options = ProfileOptions(precision=precision, stages=(0, 1, 2, 3), n_points=2)
    a, b = simulate_stages(small, PAIR, options), simulate_stages(large, PAIR, options)
    assert set(a) == {(k, s) for k in ("a100-80gb", "a100-40gb") for s in (0, 1, 2, 3)}
    for key in a:
        assert b[key].state_bytes - a[key].state_bytes == more * frozen_bytes_per_param(precision), key
        assert [m for _, m in b[key].memory_points] and all(
            (sb - sa) == more * frozen_bytes_per_param(precision)
            for (sa, _), (sb, _) in zip(a[key].memory_points, b[key].memory_points)), key


def test_the_profile_says_which_parameters_are_trained_and_the_planner_shards_only_those():
    wl = lora(1024)
    profile = simulate_profile(wl, PAIR, ProfileOptions(precision="bf16", stages=(3,), n_points=2))
    model = profile.model
    assert (model.n_params, model.frozen_params) == (wl.n_params(), wl.frozen_params())
    # 2 layers: q_proj's A (4 x 64) and B (64 x 4), v_proj's A (4 x 64) and B (32 x 4: its two key-value heads)
    assert model.trained_params == wl.trained_params() == sum(model.unit_numels) == 2 * (512 + 384)
    # the sharded states are the adapters': a state's even share differs from the whole by theirs alone
    sp = profile.stage("a100-80gb", 3)
    from poplar.planner.shares import stage_at_share

    whole = stage_at_share(sp, stage=3, precision="bf16", n_params=model.trained_params, world=2, fraction=1.0,
                           capacity=80 * 2**30)
    assert whole.state_bytes - sp.state_bytes == stage(3).sharded_bytes_per_param("bf16") * model.trained_params // 2


def test_a_cluster_holds_lora_on_a_model_whose_full_states_it_cannot():
    v100_t4 = parse_cluster({"devices": [{"kind": "v100", "gpu": "V100-16GB"}, {"kind": "t4", "gpu": "T4-16GB"}]})
    from poplar.profile.fits import check_holds_states

    seven_b = Workload(model="llama-7b", seq_len=2048)
    with pytest.raises(ValueError, match="llama-7b has 6.74B parameters: its model states take at least"):
        check_holds_states(seven_b, v100_t4, "fp16")
    check_holds_states(LoraSource(seven_b, LoraSettings(r=16, targets=["q_proj", "v_proj"])), v100_t4, "fp16")
    with pytest.raises(ValueError, match=r"llama-7b LoRA r=16's 6.74B frozen parameters take 25.1 GiB on every "
                                         r"device \(4 bytes a parameter in fp32\), more than v100's 16.0 GiB"):
        check_holds_states(LoraSource(seven_b, LoraSettings(r=16, targets=["q_proj", "v_proj"])), v100_t4, "fp32")


def test_simulate_counts_lora(tmp_path, monkeypatch):
    """``poplar simulate --lora``: the adapters alone are trained; more samples a micro-step than a full
    fine-tune where memory binds."""
    import json

    from typer.testing import CliRunner

    from poplar.cli.main import app

    monkeypatch.setenv("COLUMNS", "300")
    figures = {}
    for name, extra in (("full", []), ("lora", ["--lora", "r=4,alpha=8,targets=q_proj,v_proj"])):
        result = CliRunner().invoke(app, ["simulate", "--cluster", "compute-differs", "--model", "llama-tiny",
                                          "--seq-len", "64", "--global-batch", "64", "--stages", "0", "--workers",
                                          "0", "--no-alone", "--out", str(tmp_path / f"{name}.json"),
                                          "--profile-out", str(tmp_path / f"{name}-profile.json"), *extra])
        assert result.exit_code == 0, result.output
        figures[name] = json.loads((tmp_path / f"{name}-profile.json").read_text())
    assert "(1,792 trained, the rest frozen)" in result.output
    full, lora_ = (figures[k]["devices"]["t4-16gb"]["stages"]["0"] for k in ("full", "lora"))
    assert 0 < full["max_micro_batch"] < lora_["max_micro_batch"], (full, lora_)
    assert figures["lora"]["model"]["frozen_params"] == figures["full"]["model"]["n_params"]
