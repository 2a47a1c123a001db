"""What the simulator reads again instead of running (an operator's output and cost by its operands,
poplar.simulate.fake and poplar.simulate.trace), and a cluster however its file lists its nodes: the same profile."""

import json

import pytest

from poplar.profile.options import ProfileOptions
from poplar.simulate import fake, recording, trace
from poplar.simulate import profile as simulated

NETWORK = {"inter_node": {"bandwidth_gbs": 25, "latency_us": 5}, "intra_node": {"bandwidth_gbs": 150, "latency_us": 3}}
GPUS = {"a": "A100-80GB", "l": "L40S", "t": "T4-16GB"}
# a deep model (its steps drawn from shallow ones), three kinds of unlike memory (steps at unlike shares), one that
# holds no sample beside ZeRO-1's states at this scale (simulated among the others)
WORKLOAD = {"model": "llama-125m", "seq_len": 64}
OPTIONS = ProfileOptions(stages=(1, 3), n_points=3, max_micro_batch=16, precision="fp16")
SCALE = 0.02


def _by_kind() -> dict:
    return {"network": NETWORK, "memory_scale": SCALE,
            "devices": [{"kind": k, "gpu": g, "count": 4, "gpus_per_node": 2} for k, g in GPUS.items()]}


def _by_node() -> dict:
    """The same GPUs, one entry a node, the kinds in turn."""
    return {"network": NETWORK, "memory_scale": SCALE,
            "devices": [{"kind": k, "gpu": g, "count": 2, "gpus_per_node": 2} for _ in range(2) for k, g in GPUS.items()]}


def _fresh() -> None:
    """The process's memos dropped: what follows is simulated from nothing."""
    for memo in (recording.COUNTED, recording.SHARED, recording.DRAWN, simulated.SAVED, fake.OUTPUTS, trace.COSTS):
        memo.clear()


def _simulated(cluster) -> dict:
    _fresh()
    return json.loads(simulated.simulate_profile(WORKLOAD, cluster, OPTIONS).model_dump_json())


def test_reading_outputs_and_costs_again_gives_the_profile_of_running_every_operator(monkeypatch):
    """Every operator run and counted (no operands are plain: nothing read again) against the simulator as it
    goes: the same profile, to the byte."""
    read_again = _simulated(_by_node())
    assert fake.OUTPUTS and trace.COSTS
    monkeypatch.setattr(fake, "operands", lambda func, args, kwargs: None)
    run_each = _simulated(_by_node())
    assert not fake.OUTPUTS and not trace.COSTS
    assert read_again == run_each


def test_a_cluster_listed_one_entry_a_node_is_simulated_as_listed_by_kind():
    """Each kind's stages, the model, the engine and the collectives: the same whatever the file's form; the ranks
    (one a GPU, in the file's order) the same kinds."""
    by_node, by_kind = _simulated(_by_node()), _simulated(_by_kind())
    assert by_node["devices"] == by_kind["devices"] and by_node["devices"]["t"]["stages"]
    for part in ("model", "engine", "comm"):
        assert by_node[part] == by_kind[part], part
    assert sorted(json.dumps(r, sort_keys=True) for r in by_node["ranks"]) == \
        sorted(json.dumps(r, sort_keys=True) for r in by_kind["ranks"])


@pytest.mark.parametrize("op", ["mm", "cat", "mean", "nll"])
def test_an_operators_output_read_again_is_the_one_it_gives(op):
    """Not only pointwise ones: a product, a concatenation, a reduction, a loss of two outputs; read again for the
    same operands, each output as the operator gives it (shape, strides, dtype, its own storage's bytes)."""
    import torch

    def run():
        x = torch.empty(6, 8, dtype=torch.float16).t()
        calls = {"mm": lambda: x @ torch.empty(6, 3, dtype=torch.float16),
                 "cat": lambda: torch.cat([x, x], dim=1), "mean": lambda: x.mean(dim=0, keepdim=True),
                 "nll": lambda: torch.ops.aten.nll_loss_forward(torch.empty(4, 5), torch.zeros(4, dtype=torch.int64),
                                                                None, 1, -100)}
        out = calls[op]()
        return [(t.shape, t.stride(), t.dtype, t.untyped_storage().nbytes(), t.device.type)
                for t in (out if isinstance(out, tuple) else (out,))]

    fake.OUTPUTS.clear()
    with fake.fake_tensors():
        first = run()
        assert any(v is not None for v in fake.OUTPUTS.values())
        assert run() == first == run()
