"""The simulator's tensors: meta tensors (a shape and a dtype, no data), that take the CPU's paths, and the values
a step reads back.

Meta tensors, not ``FakeTensorMode``'s fake ones: the same shape functions, without the fake mode's Python around
each call (it hashes every call's arguments for its cache; docs/simulate.md has the figures). What a meta tensor
does not do as a CPU one does, the simulator does for it: the values a step reads back (:class:`HostValues`),
and the choice of kernel torch makes by device (attention's fused kernel: :func:`_take_cpu_choices`), so that a
step runs the very operators the emulated device runs. A pointwise operator's output is read again for the same
operands (:data:`OUTPUTS`).
"""

from __future__ import annotations

import contextlib
import functools
import gc

import torch
from torch.utils._python_dispatch import TorchDispatchMode

META = torch.device("meta")


class HostValues(TorchDispatchMode):
    """Values read back to the host are a finite step's: floats 1.0 (a finite loss and norm), flags true,
    counts 0. Each operator it runs is handed to its ``counters`` (:func:`counting`), with what its output and
    cost depend on (:func:`operands`: None where that is not plain)."""

    def __init__(self):
        super().__init__()
        self.counters: list = []

    def dispatch(self, func, types, args=(), kwargs=None):
        """The mode's ``__torch_dispatch__`` (set after the class, so that torch does not wrap it to keep its
        compiler out: nothing here is compiled, and the wrapper took a tenth of each operator's time)."""
        kwargs = kwargs or {}
        key = None if func in _UNKEYED else operands(func, args, kwargs)
        out = self._run(func, args, kwargs, key)
        for counter in self.counters:
            counter.count(func, args, kwargs, out, key)
        return out

    def _run(self, func, args, kwargs, key):
        if func is _LOCAL_SCALAR:
            t = args[0]
            return True if t.dtype == torch.bool else (1.0 if t.is_floating_point() else 0)
        if func is _GROUPED_MM and args[0].dtype != torch.bfloat16:
            return _grouped_mm_of(args, kwargs)
        if key is None:
            return func(*args, **kwargs)
        known = OUTPUTS.get(key, _UNSEEN)
        if known is _UNSEEN:
            out = func(*args, **kwargs)
            OUTPUTS[key] = _read_again(func, args, out)
            return out
        if known is None:
            return func(*args, **kwargs)
        if known is _SELF:    # checked as these very arguments were: only values change, and there are none
            return args[0]
        outs = tuple(_EMPTY(shape, stride, dtype=dtype, device=META) for shape, stride, dtype in known[1])
        return outs if known[0] else outs[0]


HostValues.__torch_dispatch__ = HostValues.dispatch


# An operator's output (its shape, strides and dtype) is a function of its inputs' shapes, strides and dtypes and
# of its other arguments: torch's shape functions (many of them Python references: 100-250 us a call, a third of a
# simulated step) are asked once for each, for every operator that makes new tensors; a pointwise operator that
# writes its first argument is run once for each. Values: what to hand back (:func:`_read_again`).
OUTPUTS: dict[tuple, object] = {}
_UNSEEN, _SELF = object(), object()
_SCALARS = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)
_LOCAL_SCALAR = torch.ops.aten._local_scalar_dense.default
_EMPTY = torch.empty_strided
_ANY_SHAPE = (torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output)


_UNKEYED: set = set()     # operators whose operands are not described (:func:`launches_no_kernel`)


def launches_no_kernel(func) -> None:
    """A counter's word that ``func`` launches no kernel (a view: no cost, whatever its operands): where its output
    is not read again either (:func:`_kind`), its operands are not described again (a step's views: a third of its
    operators)."""
    if _kind(func) is None:
        _UNKEYED.add(func)


@functools.cache
def _kind(func) -> str | None:
    """What an operator's output is: new tensors, none an alias of an argument ("new"); a pointwise operator's
    first argument, its values written ("in place"); None for any other (a view, an ``out=`` variant, an output of
    a size its values give)."""
    schema = func._schema
    if any(tag in func.tags for tag in _ANY_SHAPE):
        return None
    if torch.Tag.pointwise in func.tags and torch.Tag.inplace in func.tags and len(schema.returns) == 1:
        alias = schema.returns[0].alias_info
        return "in place" if alias is not None and alias.is_write else None
    if func.is_view or any(a.alias_info is not None for a in (*schema.arguments, *schema.returns)):
        return None
    return "new" if schema.returns and all(str(r.type) == "Tensor" for r in schema.returns) else None


def _read_again(func, args, out):
    """What a call with the same operands hands back: the first argument (``_SELF``); ``(tuple?, [(shape, stride,
    dtype)])`` for new meta tensors, each the whole of a storage of its own (as an empty one of its shape and
    strides: the same bytes count against a device); None, the operator run each time."""
    kind = _kind(func)
    if kind == "in place":
        return _SELF if out is args[0] else None
    if kind is None:
        return None
    outs = out if isinstance(out, tuple) else (out,)
    mine = {a.untyped_storage()._cdata for a in _tensors_in(args)}
    for t in outs:
        if (not isinstance(t, torch.Tensor) or t.device != META or t.storage_offset() or t.untyped_storage()._cdata in mine
                or t.untyped_storage().nbytes() != _EMPTY(t.shape, t.stride(), dtype=t.dtype, device=META)
                .untyped_storage().nbytes()):
            return None
    return isinstance(out, tuple), [(t.shape, t.stride(), t.dtype) for t in outs]


def _tensors_in(values) -> list[torch.Tensor]:
    out = []
    for a in values:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif type(a) in (list, tuple):
            out.extend(_tensors_in(a))
    return out


def operands(func, args, kwargs) -> tuple | None:
    """What an operator's output and its cost depend on: each tensor's shape, strides, dtype and device, every
    other argument; None where that is not plain (an argument of another type, a complex tensor, or tensors of no
    dimension only: whether a number was wrapped then sets the dtype, and it is not seen here)."""
    parts: list = [func]
    dims = _described(args, parts)
    if kwargs and dims is not None:
        parts.append(tuple(kwargs))
        more = _described(kwargs.values(), parts)
        dims = None if more is None else dims or more
    return tuple(parts) if dims else None


def _described(values, parts: list) -> bool | None:
    """``values`` written into ``parts``; whether a tensor of some dimension is among them (None: not plain)."""
    dims = False
    for a in values:
        if isinstance(a, torch.Tensor):
            shape, dtype = a.shape, a.dtype
            if dtype.is_complex:
                return None
            dims = dims or len(shape) > 0
            parts.append((shape, a.stride(), dtype, a.device))
        elif type(a) in _SCALARS:
            parts.append((type(a), a))
        elif type(a) in (list, tuple):
            parts.append(len(a))
            inner = _described(a, parts)
            if inner is None:
                return None
            dims = dims or inner
        else:
            return None
    return dims


_GROUPED_MM = getattr(torch.ops.aten, "_grouped_mm", None)
if _GROUPED_MM is not None:
    _GROUPED_MM = _GROUPED_MM.default


def _grouped_mm_of(args, kwargs):
    """A grouped matrix product (a mixture of experts' layers) in fp32 or fp16, which the devices' kernels run and
    torch's shape function refuses (it knows bf16 only): its output's shape taken at bf16, in the inputs' dtype."""
    a, b, *rest = args
    kwargs = dict(kwargs)
    dtype = kwargs.pop("out_dtype", None) or a.dtype
    return _GROUPED_MM(a.to(torch.bfloat16), b.to(torch.bfloat16), *rest, **kwargs).to(dtype)


_SDPA = torch.ops.aten.scaled_dot_product_attention.default
_ACTIVE = [0]      # inside fake_tensors(): meta tensors take the CPU's choices
_LIBRARY: list = []


def _take_cpu_choices() -> None:
    """Meta tensors take the CPU's choice of attention kernel (on meta, torch always takes the unfused path, a
    dozen operators more a layer), inside :func:`fake_tensors` only. A kernel of the autograd key, as torch's own
    decomposition is: it runs for a step's forward and for its recomputation in the backward alike."""
    if not _LIBRARY:
        _LIBRARY.append(torch.library.Library("aten", "IMPL"))
        _LIBRARY[0].impl("scaled_dot_product_attention", _attention, "AutogradMeta")


def _attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False):
    """``scaled_dot_product_attention`` as a CPU runs it: its fused kernel where the CPU's choice (asked of
    tensors of the inputs' dtypes and layouts, a few elements each) takes it, after a boolean mask is made
    additive as torch makes it; else torch's own decomposition (the unfused path, the same on both devices)."""
    args = (query, key, value, attn_mask, dropout_p, is_causal)
    if not _ACTIVE[0] or _choice(*args, scale, enable_gqa) != _FLASH:
        return _SDPA.decompose(*args, scale=scale, enable_gqa=enable_gqa)
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.where(attn_mask, torch.scalar_tensor(0.0, dtype=query.dtype, device=query.device),
                                torch.scalar_tensor(-float("inf"), dtype=query.dtype, device=query.device))
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]


_FLASH = 1    # torch's SDPBackend.flash_attention
_CHOICES: dict[tuple, int] = {}


def _choice(query, key, value, mask, dropout, causal, scale, gqa) -> int:
    """The CPU's choice of attention kernel for these inputs (torch's ``SDPBackend`` as a number), once a
    signature."""
    tensors = [t for t in (query, key, value, mask) if t is not None]
    dims = [_varying(t, i == 3) for i, t in enumerate(tensors)]
    sizes = sorted({t.shape[d] for t, ds in zip(tensors, dims) for d in ds if t.shape[d] > 1})
    small = {s: i + 2 for i, s in enumerate(sizes)}   # batch and sequence sizes, their order and equalities kept
    shapes = [tuple(small.get(n, n) if d in ds else n for d, n in enumerate(t.shape)) for t, ds in zip(tensors, dims)]
    signature = tuple((t.dtype, shape, t.stride(-1) == 1, t.requires_grad) for t, shape in zip(tensors, shapes))
    key_ = (signature, mask is not None, dropout, causal, scale, gqa)
    if key_ not in _CHOICES:
        q, k, v, *m = [_proxy(*s) for s in signature]
        _CHOICES[key_] = torch.ops.aten._fused_sdp_choice(q, k, v, m[0] if m else None, dropout, causal,
                                                           scale=scale, enable_gqa=gqa)
    return _CHOICES[key_]


def _varying(t, mask: bool) -> set[int]:
    """The dimensions of ``t`` that are batch or sequence sizes (a mask's last two and its batch; an input's batch
    and its length), which a proxy may make small; heads and head sizes are kept as they are."""
    n = t.dim()
    if mask:
        return {n - 2, n - 1} | ({0} if n == 4 else set())
    return {0, n - 2}


def _proxy(dtype, shape, unit_stride, grad):
    """A CPU tensor of ``shape`` and ``dtype``, its last dimension's stride 1 or not as the input's."""
    full = torch.empty((*shape[:-1], shape[-1] * (1 if unit_stride else 2)), dtype=dtype, device="cpu")
    t = full if unit_stride else full[..., ::2]
    return t.requires_grad_(grad) if t.is_floating_point() else t


_MODE: list[HostValues] = []   # one for the process
YOUNG = 10_000     # the young generation's collection threshold while simulating (Python's default: 700)


@contextlib.contextmanager
def counting(counter):
    """``counter`` (a mode with a ``count(func, args, kwargs, out)``) counts each operator run inside: inside
    :func:`fake_tensors` told by its mode (one Python dispatch an operator, not two: a tenth of a step), else
    as a mode of its own."""
    if not _ACTIVE[0]:
        with counter:
            yield counter
        return
    _MODE[0].counters.append(counter)
    try:
        yield counter
    finally:
        _MODE[0].counters.remove(counter)


@contextlib.contextmanager
def fake_tensors():
    """Every tensor made inside is a meta tensor taking the CPU's paths, and what is read back from one is
    :class:`HostValues`'."""
    if _ACTIVE[0]:     # inside already: the device and the mode are the outer one's (a mode twice counts twice)
        yield
        return
    if not _MODE:
        _MODE.append(HostValues())
        _take_cpu_choices()
    threshold = gc.get_threshold()   # a step makes tens of thousands of objects, few in cycles: collected less often
    gc.set_threshold(max(threshold[0], YOUNG), *threshold[1:])
    _ACTIVE[0] = 1
    try:
        with META, _MODE[0]:
            yield
    finally:
        _ACTIVE[0] = 0
        gc.set_threshold(*threshold)
