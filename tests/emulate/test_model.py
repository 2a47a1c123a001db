"""The declared device and network models: work counted from the work itself, no host timing."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from poplar.cluster.spec import DeviceGroup, Link, Network
from poplar.emulate import GpuModel, NetworkModel, WorkCounter
from poplar.models.workload import as_workload


def _declared(gpu: str, m: int, model: str = "tiny") -> float:
    wl = as_workload(model)
    net = wl.build()
    with WorkCounter(GpuModel.of(DeviceGroup(kind=gpu, gpu=gpu))) as counter:
        wl.loss(net, wl.random_batch(m)).backward()
    return counter.seconds


def test_throughput_rises_with_the_micro_batch_and_saturates():
    sizes = [1, 4, 16, 64, 256, 1024]
    per_s = [m / _declared("A100-80GB", m) for m in sizes]
    assert all(b > a for a, b in zip(per_s, per_s[1:]))               # rises ...
    gains = [b / a for a, b in zip(per_s, per_s[1:])]
    assert gains[0] > 3 and gains[-1] < 1.3                            # ... and saturates


def test_a_slower_card_is_slower_where_the_work_is_large_and_alike_where_launches_dominate():
    assert _declared("T4-16GB", 1) == pytest.approx(_declared("A100-80GB", 1), rel=0.1)
    assert _declared("T4-16GB", 256) > 3 * _declared("A100-80GB", 256)


def test_a_matrix_product_is_compute_bound_and_a_copy_memory_bound():
    gpu = GpuModel.of(DeviceGroup(kind="x", memory_gb=1, tflops=10.0, memory_bandwidth_gbs=1000,
                                  kernel_overhead_us=0, flops_efficiency=1.0, bandwidth_efficiency=1.0))
    a = torch.randn(1024, 1024)
    with WorkCounter(gpu) as mm:
        a @ a
    assert mm.seconds == pytest.approx(2 * 1024**3 / 10e12)
    with WorkCounter(gpu) as copy:
        a.clone()
    assert copy.seconds == pytest.approx(2 * 4 * 1024**2 / 1000e9)    # read and write
    with WorkCounter(gpu) as views:
        a.view(-1).t() if a.dim() == 1 else a.t().view(-1, 1024)
    assert views.seconds == 0 and views.ops == 0


def test_each_dtype_runs_at_its_own_peak_and_a_card_without_it_is_refused():
    a100 = GpuModel.of(DeviceGroup(kind="a", gpu="A100-80GB"))
    v100 = GpuModel.of(DeviceGroup(kind="v", gpu="V100-16GB"))
    assert a100.flops_per_s(torch.bfloat16) == pytest.approx(16 * a100.flops_per_s(torch.float32))
    assert v100.flops_per_s(torch.float16) == pytest.approx(125 / 15.7 * v100.flops_per_s(torch.float32))
    with pytest.raises(ValueError, match="v has no bf16 hardware"):   # never priced at its fp32 rate
        v100.flops_per_s(torch.bfloat16)


def test_ring_collectives_on_one_node_and_across_two():
    net = Network(intra_node=Link(bandwidth_gbs=100, latency_us=5), inter_node=Link(bandwidth_gbs=10, latency_us=20))
    one, two = NetworkModel(net, [0, 0, 0, 0]), NetworkModel(net, [0, 0, 1, 1])
    assert one.seconds("all_reduce", 8e9) == pytest.approx(6 * 5e-6 + 1.5 * 8e9 / 100e9)
    assert one.seconds("all_gather", 8e9) == pytest.approx(3 * 5e-6 + 0.75 * 8e9 / 100e9)
    # 3 steps, 1 of them across the nodes (NCCL's ring: N-1 of a reduce-scatter's)
    assert two.seconds("reduce_scatter", 8e9) == pytest.approx(20e-6 + 2 * 5e-6 + 0.75 * 8e9 / 10e9)
    assert NetworkModel(net, [0]).seconds("all_reduce", 1e9) == 0.0
    with pytest.raises(ValueError, match="no network model"):
        one.seconds("gossip", 1)


@pytest.mark.parametrize("name", ["_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                                  "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_backward",
                                  "_scaled_dot_product_efficient_attention_backward",
                                  "_scaled_dot_product_cudnn_attention_backward", "_flash_attention_forward",
                                  "_efficient_attention_forward", "_flash_attention_backward",
                                  "_efficient_attention_backward", "_scaled_dot_product_flash_attention_for_cpu",
                                  "_scaled_dot_product_flash_attention_for_cpu_backward"])
def test_grouped_query_attention_costs_what_repeated_key_value_heads_cost(name):
    """CUDA's kernels take fewer key/value heads than query heads as they are (SDPA's enable_gqa, Llama-3's
    shapes): counted as attention over the heads repeated, where flop_counter's formulas would refuse them."""
    from poplar.emulate.model import op_cost

    packet = getattr(torch.ops.aten, name, None)
    if packet is None:
        pytest.skip(f"no {name} in this torch")
    layout = (lambda b, h, s, d: (b, s, h, d)) if "scaled_dot_product" not in name else (lambda *x: x)
    q, kv, full = (torch.empty(layout(2, h, 16, 8), device="meta") for h in (8, 2, 8))
    args = [q, kv, kv] if "backward" not in name else [q, q, kv, kv]
    same = [q, full, full] if "backward" not in name else [q, q, full, full]
    # the varlen kernels' further arguments, up to their longest sequences (no packed sequences)
    rest = {"_flash_attention_forward": [None, None, 16, 16], "_efficient_attention_forward": [None, None, None, 16, 16],
            "_flash_attention_backward": [q, None, None, None, 16, 16],
            "_efficient_attention_backward": [None, q, None, None, 16, 16]}.get(name, [])
    counted, repeated = (op_cost(packet.default, (*operands, *rest), {}, None)[0] for operands in (args, same))
    assert counted == repeated > 0


def test_a_grouped_matrix_product_costs_its_groups_products():
    """A mixture of experts' grouped product (every layout torch runs: rows, inner or columns split in groups, or
    batched) costs what its groups' matrix products cost, each counted by flop_counter; seeded splits."""
    import random

    from torch.utils.flop_counter import FlopCounterMode

    from poplar.emulate.model import op_cost

    if not hasattr(torch.ops.aten, "_grouped_mm"):
        pytest.skip("no grouped matrix product in this torch")
    rng = random.Random(3)
    for _ in range(12):
        groups, m, k, n = rng.randint(1, 4), 8 * rng.randint(1, 4), 8 * rng.randint(1, 4), 8 * rng.randint(1, 4)
        sizes = [8 * rng.randint(0, 3) for _ in range(groups)]
        sizes[rng.randrange(groups)] += 8     # (a group may be empty, not all: the kernels want rows)
        ends = torch.tensor(sizes, dtype=torch.int32).cumsum(0).to(torch.int32)
        total, cuts = int(ends[-1]), [0, *ends.tolist()]
        layouts = {  # (a, b, offs), the groups' products
            "rows": (torch.randn(total, k), torch.randn(groups, k, n), ends,
                     lambda a, b: [a[s:e] @ b[g] for g, (s, e) in enumerate(zip(cuts, cuts[1:]))]),
            "inner": (torch.randn(m, total), torch.randn(total, n), ends,
                      lambda a, b: [a[:, s:e] @ b[s:e] for s, e in zip(cuts, cuts[1:])]),
            "columns": (torch.randn(groups, m, k), torch.randn(k, total), ends,
                        lambda a, b: [a[g] @ b[:, s:e] for g, (s, e) in enumerate(zip(cuts, cuts[1:]))]),
            "batched": (torch.randn(groups, m, k), torch.randn(groups, k, n), None,
                        lambda a, b: [a[g] @ b[g] for g in range(groups)]),
        }
        for name, (a, b, offs, products) in layouts.items():
            with FlopCounterMode(display=False) as counter:
                products(a, b)
            out = torch._grouped_mm(a, b, offs)
            counted = op_cost(torch.ops.aten._grouped_mm.default, (a, b, offs), {}, out)[0]
            assert counted == counter.get_total_flops(), (name, groups, m, k, n, sizes)


class _Seen(TorchDispatchMode):
    """What reaches the host below the counter: each operator and its tensors' dtypes."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append((func, {a.dtype for a in args if isinstance(a, torch.Tensor)}))
        return func(*args, **(kwargs or {}))


def _product_args(op: str, dtype: torch.dtype, gen: torch.Generator) -> tuple[list, dict]:
    """A matrix product's arguments, seeded shapes, a transposed operand at times (a backward's)."""
    b, m, k, n = (int(torch.randint(1, hi, (), generator=gen)) for hi in (4, 70, 300, 70))
    batch = (b,) if op in ("bmm", "baddbmm") else ()
    left = torch.randn(*batch, m, k, generator=gen).to(dtype)
    right = torch.randn(*batch, n, k, generator=gen).to(dtype).transpose(-1, -2)
    if op in ("mm", "bmm"):
        return [left, right], {}
    bias = torch.randn(*batch, m, n, generator=gen).to(dtype)
    return [bias, left, right], {"beta": 0.5, "alpha": 2.0}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("op", ["mm", "addmm", "bmm", "baddbmm"])
def test_a_half_precision_product_is_summed_in_fp32_and_rounded_once_and_priced_at_its_dtype(op, dtype):
    """The emulated rank computes a half product from fp32 sums (the host has no fast half kernel):
    the exact result rounded once, as the host's own kernel gives it but for the order of the sums."""
    gpu = GpuModel.of(DeviceGroup(kind="v", gpu="V100-16GB" if dtype == torch.float16 else "A100-80GB"))
    func, gen = getattr(torch.ops.aten, op).default, torch.Generator().manual_seed(7)
    for _ in range(6):
        args, kwargs = _product_args(op, dtype, gen)
        with _Seen() as host, WorkCounter(gpu) as counter:
            out = func(*args, **kwargs)
        assert [dtypes for f, dtypes in host.ops if f == func] == [{torch.float32}]   # the host ran it in fp32
        exact = func(*[a.double() for a in args], **kwargs)
        native = func(*args, **kwargs)
        ulp = torch.finfo(dtype).eps * exact.abs().clamp_min(1.0)
        assert out.dtype == dtype and out.shape == native.shape
        assert ((out.double() - exact).abs() <= ulp).all()           # one rounding of the fp32 sum
        assert (out == native).float().mean() > 0.97                  # the host's kernel, but for order
        flops = 2 * out.numel() * args[-1].shape[-2]
        nbytes = sum(t.numel() * t.element_size() for t in (*args, out))
        assert counter.seconds == pytest.approx(gpu.op_seconds(flops, nbytes, dtype))
