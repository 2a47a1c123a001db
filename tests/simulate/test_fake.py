"""The simulator's meta tensors take the CPU's paths: attention's choice of kernel, forward, backward and a
checkpointed recompute, over a seeded sample of the inputs torch's choice depends on."""

import random

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from poplar.simulate.fake import fake_tensors
from poplar.simulate.trace import Recorder, operator_name


def _case(rng: random.Random) -> dict:
    heads = rng.choice([1, 2, 4, 8])
    return {
        "dtype": rng.choice([torch.float32, torch.bfloat16, torch.float16]),
        "batch": rng.choice([1, 2, 3]), "heads": heads,
        "kv_heads": rng.choice([h for h in (1, 2, heads) if heads % h == 0]),
        "length": rng.choice([1, 5, 16]), "kv_length": rng.choice([None, 1, 7]),
        "head_dim": rng.choice([8, 16, 24]),
        "mask": rng.choice([None, "bool2", "bool4", "float4", "float-broadcast"]),
        "causal": rng.random() < 0.4, "dropout": rng.choice([0.0, 0.0, 0.1]), "scale": rng.choice([None, 0.3]),
        "transposed": rng.random() < 0.3,     # a query whose last dimension is not contiguous
        "checkpointed": rng.random() < 0.4,
    }


def _inputs(c: dict):
    b, h, kh, n, e = c["batch"], c["heads"], c["kv_heads"], c["length"], c["head_dim"]
    s = c["kv_length"] or n
    q = torch.ones(b, h, e, n, dtype=c["dtype"]).transpose(-1, -2) if c["transposed"] else \
        torch.ones(b, h, n, e, dtype=c["dtype"])
    k, v = torch.ones(b, kh, s, e, dtype=c["dtype"]), torch.ones(b, kh, s, e, dtype=c["dtype"])
    mask = {None: None, "bool2": torch.ones(n, s, dtype=torch.bool), "bool4": torch.ones(b, 1, n, s, dtype=torch.bool),
            "float4": torch.zeros(b, h, n, s, dtype=c["dtype"]),
            "float-broadcast": torch.zeros(1, 1, n, s, dtype=c["dtype"])}[c["mask"]]
    return [t.requires_grad_() for t in (q, k, v)], mask


def _ops(c: dict, on_meta: bool):
    """The operators (name, FLOPs, bytes) of the case's forward and backward, or the error it raises."""
    torch.manual_seed(0)
    (q, k, v), mask = _inputs(c)
    if on_meta:
        q, k, v = (t.detach().to("meta").requires_grad_() for t in (q, k, v))
        mask = None if mask is None else mask.to("meta")

    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=c["dropout"], is_causal=c["causal"],
                                              scale=c["scale"], enable_gqa=c["kv_heads"] != c["heads"])
    recorder = Recorder()
    try:
        with recorder:
            out = checkpoint(attend, q, k, v, use_reentrant=False) if c["checkpointed"] else attend(q, k, v)
            out.sum().backward()
    except RuntimeError as e:
        return type(e).__name__
    return [(operator_name(o), f, b) for o, f, b in zip(recorder.ops, recorder.flops, recorder.nbytes)]


@pytest.mark.parametrize("seed", range(6))
def test_attention_on_the_simulators_tensors_runs_the_cpus_operators(seed):
    rng = random.Random(seed)
    fused = 0
    for _ in range(12):
        c = _case(rng)
        if c["causal"] and c["mask"] is not None:
            continue    # torch refuses a mask with is_causal on either device
        real = _ops(c, on_meta=False)
        with fake_tensors():
            meta = _ops(c, on_meta=True)
        assert meta == real, c
        fused += any("flash" in name for name, _, _ in real)
    assert fused > 0      # the sample takes the fused kernel somewhere (else nothing above is about it)


def test_outside_the_simulator_meta_attention_is_torchs_own():
    """The CPU's choice is the simulator's alone: elsewhere in the process meta tensors take torch's own path."""
    q = torch.ones(1, 2, 4, 8, device="meta", requires_grad=True)
    with fake_tensors():
        pass     # the choice is registered once a process
    recorder = Recorder()
    with recorder:
        F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
    assert not any("flash" in operator_name(o) for o in recorder.ops) and len(recorder) > 5


_POINTWISE = [lambda a, b: a + b, lambda a, b: a * b, lambda a, b: a / b, lambda a, b: torch.where(a > 0, a, b),
              lambda a, b: a.pow(2) - b, lambda a, b: torch.lerp(a.float(), b.float(), 0.3), lambda a, b: -a * 2.5,
              lambda a, b: a.add_(b), lambda a, b: a.mul_(3), lambda a, b: a.float().addcdiv_(b.float(), b.float())]


def _operand(rng: random.Random, shape: tuple[int, ...]) -> torch.Tensor:
    dtype = rng.choice([torch.float32, torch.bfloat16, torch.float16, torch.int64])
    t = torch.ones(shape[::-1], dtype=dtype).t() if len(shape) == 2 and rng.random() < 0.3 else \
        torch.ones(shape, dtype=dtype)
    return t.to("meta")


def _result(op, a, b):
    try:
        out = op(a, b)
        return out.shape, out.stride(), out.dtype
    except RuntimeError as e:
        return type(e).__name__


@pytest.mark.parametrize("seed", range(4))
def test_a_pointwise_operators_output_read_again_is_its_shape_functions(seed):
    """Each pointwise operator's output (shape, strides, dtype), or its error, as torch's shape function gives it
    on the first call: on every call after it too, whatever the operands (broadcast, transposed, of mixed dtypes,
    0-dimensional)."""
    from poplar.simulate import fake

    rng = random.Random(seed)
    for _ in range(40):
        op = rng.choice(_POINTWISE)
        shape = rng.choice([(4, 6), (6,), (1, 6), ()])
        other = rng.choice([shape, (6,), (4, 1), (), (5,)])
        a, b = _operand(rng, shape), _operand(rng, other)
        fake.OUTPUTS.clear()
        with fake_tensors():
            first = _result(op, a.clone(), b)
            again = [_result(op, a.clone(), b) for _ in range(2)]
        assert again == [first, first], (first, again)
    assert fake.OUTPUTS      # something was read again


@pytest.mark.parametrize("nested", [False, True])
def test_each_operator_is_counted_once_inside_the_simulator_however_deep(nested):
    """The simulator's mode hands each operator to the recorder once: inside it twice over too (its context
    entered again), as a recorder of its own outside it counts them."""
    import contextlib

    from poplar.simulate.fake import counting

    def step():
        x, w = torch.randn(4, 8, device="meta"), torch.randn(8, 8, device="meta")
        (x @ w).relu().sum()

    with Recorder() as alone:
        step()
    with fake_tensors():
        with fake_tensors() if nested else contextlib.nullcontext(), counting(Recorder()) as counted:
            step()
    assert [operator_name(o) for o in counted.ops] == [operator_name(o) for o in alone.ops]
    assert counted.flops == alone.flops and len(counted.ops) >= 3
