"""A step counted once and priced per kind: the same seconds as the emulated device's, at every micro-batch."""

import numpy as np
import pytest
import torch

from poplar.cluster.spec import parse_cluster
from poplar.emulate.model import GpuModel, WorkCounter
from poplar.engine.config import EngineConfig
from poplar.profile.timing import RankRun
from poplar.simulate.fake import fake_tensors
from poplar.simulate.profile import largest_that_fits, saved_bytes_of
from poplar.simulate.recording import Recording
from poplar.simulate.trace import Activations, CountingDevice, Recorder, Steps, Trace, operator_name
from poplar.models.workload import Workload

CLUSTER = parse_cluster({"devices": [{"kind": "big", "gpu": "A100-80GB"}, {"kind": "small", "gpu": "T4-16GB"}]})


def test_a_trace_is_priced_as_the_emulated_device_prices_each_operator():
    a, b = torch.randn(64, 256), torch.randn(256, 128, dtype=torch.float32)
    with Recorder() as recorder:
        torch.relu(a @ b).sum()
        (a.bfloat16() @ b.bfloat16()).float()
    trace = Trace.of(recorder)
    for kind in CLUSTER.devices:
        gpu = GpuModel.of(kind)
        if not kind.computes("bf16"):   # a V100: both refuse to price bf16 (never at its fp32 rate)
            with pytest.raises(ValueError, match="no bf16 hardware"), WorkCounter(gpu):
                a.bfloat16() @ b.bfloat16()
            with pytest.raises(ValueError, match="no bf16 hardware"):
                trace.busy(gpu)
            continue
        with WorkCounter(gpu) as work:
            torch.relu(a @ b).sum()
            (a.bfloat16() @ b.bfloat16()).float()
        assert work.ops == len(trace.flops) == 7   # matmul, relu, sum; two casts, matmul, cast
        assert trace.busy(gpu) == pytest.approx(work.seconds, rel=1e-12)


@pytest.mark.parametrize("model, stage", [("tiny", 3), ("llama-tiny", 1)])
def test_a_step_read_from_the_line_is_the_step_recorded_at_that_size(model, stage):
    """Every operator's FLOPs and bytes, and the marks, at 7 samples: from the line through 2 and 3, and run."""
    wl = Workload(model=model)
    with fake_tensors():
        device = CountingDevice(CLUSTER, 0)
        with device:
            run = RankRun(device, 0, CLUSTER.world_size, wl, EngineConfig(check_batches=False), 1, 1)
            derived = Steps(Recording(run, stage).trace).at(7, 1)
            recorded = Recording(run, stage).trace(7, 1)
            saved = Activations(saved_bytes_of(device, wl, "fp32"))
            assert saved(9) == saved.exact(9) > saved(8) > saved.exact(1) > 0
    assert np.array_equal(derived.flops, recorded.flops) and np.array_equal(derived.nbytes, recorded.nbytes)
    assert derived.marks == recorded.marks and derived.launches == recorded.launches and recorded.marks
    gpu = GpuModel.of(CLUSTER.devices[1])
    assert derived.marks_on(gpu).anatomy(derived.n_units, 7) == recorded.marks_on(gpu).anatomy(recorded.n_units, 7)


def test_a_model_off_the_line_is_recorded_at_each_size():
    calls = []

    def record(m, accumulation):
        calls.append(m)
        return Trace(np.array([float(m * m)]), np.array([4.0 * m]), np.array([0], dtype=np.int8))

    steps = Steps(record)
    assert steps.at(6, 1).flops[0] == 36.0 and calls == [2, 3, 4, 6]


def test_a_line_checked_at_another_world_size_is_drawn_through_two_sizes():
    calls = []

    def record(m, accumulation):
        calls.append(m)
        return Trace(np.array([3.0 * m + 1]), np.array([4.0 * m]), np.array([0], dtype=np.int8))

    first = Steps(record)
    assert first.at(6, 1).flops[0] == 19.0 and calls == [2, 3, 4] and first.held == {1}
    calls.clear()
    second = Steps(record, checked=first.held)
    assert second.at(6, 1).flops[0] == 19.0 and calls == [2, 3] and second.held == {1}
    calls.clear()
    assert Steps(record, checked=first.held).at(6, 2).flops[0] == 19.0 and calls == [2, 3, 4]   # not checked for 2


class _Named(Recorder):
    """A recorder that also writes down each priced operator's name."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = len(self)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if len(self) > before:
            self.names.append(str(func))
        return out


def _real_and_simulated(wl) -> tuple[_Named, _Named]:
    """The operators of a forward and backward of three samples of ``wl``: on real tensors, and on the simulator's."""
    real = _Named()
    model, batch = wl.build(), wl.random_batch(3)
    with real:
        wl.loss(model, batch).backward()
    with fake_tensors():
        model, batch = wl.build(), wl.random_batch(3)
        fake = _Named()
        with fake:
            wl.loss(model, batch).backward()
    return real, fake


@pytest.mark.parametrize("family", ["llama-tiny", "qwen2", "gpt2", "mistral", "gpt-neox", "bert"])
def test_the_simulators_tensors_run_the_operators_a_real_step_runs(tmp_path, family):
    """A step of a Hugging Face model on the simulator's meta tensors runs the very operators, in order, with the
    FLOPs and bytes, that a real step runs: transformers takes the real tensors' path for masks (no packed rows,
    no mask built), attention the CPU's fused kernel."""
    from poplar.models.workload import model_source
    from tests.helpers.pretrained import save_family, save_qwen2

    if family == "llama-tiny":
        wl = Workload(model=family, seq_len=24, vocab_size=300)
    else:
        directory = save_qwen2(tmp_path / "m") if family == "qwen2" else save_family(tmp_path / "m", family)
        wl = model_source(str(directory), seq_len=24)
    real, fake = _real_and_simulated(wl)
    assert fake.names == real.names and len(real.names) > 50
    assert fake.flops == real.flops and fake.nbytes == real.nbytes and fake.dtypes == real.dtypes


def _mixture_of_experts(directory):
    """A Mixtral config (4 experts, 2 a token; widths the grouped kernels' alignment takes), no weights."""
    from transformers import MixtralConfig

    MixtralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=256,
                  max_position_embeddings=64, architectures=["MixtralForCausalLM"]).save_pretrained(directory)
    return directory


def test_a_mixture_of_experts_is_counted_on_fake_tensors_as_on_real_ones(tmp_path):
    """A mixture of experts' step (transformers' grouped products of the experts' rows, which torch's shape
    function takes only in bf16): on the simulator's fake tensors in fp32, the operators, FLOPs and bytes a real
    step counts, the experts' products with their FLOPs; and a step in each mixed precision is recorded."""
    from poplar.models.workload import model_source

    wl = model_source(str(_mixture_of_experts(tmp_path / "m")), seq_len=16)
    real, fake = _real_and_simulated(wl)
    assert fake.names == real.names and fake.flops == real.flops and fake.nbytes == real.nbytes
    grouped = [f for f, name in zip(real.flops, real.names) if "grouped_mm" in name]
    assert len(grouped) >= 6 and min(grouped) > 0      # each layer's two products forward, their gradients
    for precision in ("bf16", "fp16"):
        run = RankRun(CountingDevice(CLUSTER, 0), 0, 2, wl, EngineConfig(mixed_precision=precision,
                                                                          check_batches=False), 1, 1)
        with fake_tensors(), run.device:
            trace = Recording(run, 2).trace(1, 1)
        experts = [f for f, op in zip(trace.flops, trace.ops) if "grouped_mm" in operator_name(int(op))]
        assert len(experts) == len(grouped) and min(experts) > 0     # one sample's: its tokens through them


@pytest.mark.parametrize("kink", [5, 20, 63, 64, 65, None])
def test_saved_bytes_read_from_the_line_only_as_far_as_it_is_proven(kink):
    """A convex peak (a line, then steeper past ``kink``): read from the line up to a size measured on it, and the
    largest micro-batch that fits is the one found by measuring every size."""
    measured = []

    def measure(m):
        measured.append(m)
        return 100 + 10 * m + (0 if kink is None else 7 * max(0, m - kink))

    for capacity in range(100, 1000, 37):
        truth = max((m for m in range(1, 65) if measure(m) <= capacity), default=0)
        assert largest_that_fits(Activations(measure), 0, capacity, 64) == truth
    saved, measured[:] = Activations(measure), []
    on_line = kink is None or kink >= 65
    assert saved.proven(65) == on_line and sorted(measured) == [2, 3, 4, 65]
    assert all(saved(m) == measure(m) for m in range(1, 65)) == (kink is None or kink >= 64)


SHARES_CLUSTER = parse_cluster({"devices": [{"kind": "big", "gpu": "A100-80GB", "count": 2},
                                            {"kind": "small", "gpu": "T4-16GB", "count": 3}]})


@pytest.mark.parametrize("model, precision", [("tiny", "fp32"), ("llama-tiny", "bf16")])
def test_a_recording_re_cut_to_unlike_shares_is_an_engine_built_at_them(model, precision):
    """The model states before a step and at their most, the sharded bytes, and every operator, mark, launch and
    wait of steps of one and two samples and two micro-batches, in every sharded stage: the even share's engine,
    re-cut to the shares before each step (warmed up once, at its own shares), records what an engine built and
    warmed up at them records; its own steps are as before the detours (seeded share vectors, some with ranks
    that hold nothing, as the simulator asks)."""
    import random

    rng = random.Random(7)
    config = EngineConfig(mixed_precision=precision, check_batches=False)
    with fake_tensors():
        device = CountingDevice(SHARES_CLUSTER, 0)
        with device:
            run = RankRun(device, 0, SHARES_CLUSTER.world_size, Workload(model=model), config, 1, 1)
            for stage in (1, 2, 3):
                even = Recording(run, stage)
                vectors = [(2.0, 1.0, 1.0, 1.0, 1.0), (1.0, 0.0, 0.0, 1.0, 1.0), (0.0, 1.0, 1.0, 0.0, 0.0)]
                vectors += [tuple(rng.choice([0.0, 0.5, 1.0, 1.5, 2.0]) for _ in range(4)) + (1.0,) for _ in range(2)]
                # made together before any step (the even engine cold): each re-cuts the engine before its steps
                views = [even.recut(v) for v in vectors]
                for shares, view in zip(vectors, views):
                    built = Recording(run, stage, shares)
                    assert (view.before, view.sharded) == (built.before, built.sharded), (stage, shares)
                    for size in ((1, 1), (2, 1), (1, 2)):
                        assert view.trace(*size).same_as(built.trace(*size)), (stage, shares, size)
                        assert view.trace(*size).launches == built.trace(*size).launches
                    assert view.most == built.most
                alone = Recording(run, stage)
                assert even.trace(1, 2).same_as(alone.trace(1, 2)) and even.most == alone.most
                assert (even.before, even.sharded) == (alone.before, alone.sharded)
