"""A step counted once, priced for every device kind.

The emulated device prices each operator as it runs (:mod:`poplar.emulate.model`: a
launch, then FLOPs or bytes, whichever takes longer). What an operator *is* (its FLOPs,
its bytes, its dtype) does not depend on the device, only its price does. So the
simulator runs a step once on fake tensors, on a :class:`CountingDevice` that writes
down every operator instead of pricing it (a :class:`Trace`), and prices that list for
each kind with the same roofline: one run of the model's Python for every kind.

A step of ``m`` samples runs the same operators at every ``m``, each with FLOPs and
bytes an affine function of ``m`` (the weights' part fixed, the activations' part
proportional). :class:`Steps` records ``m`` = 2, 3 and 4, checks that the third is on
the line through the first two, operator by operator, and derives every other size from
it; ``m`` = 1 (where a model may take another path: a dimension of one squeezed) and a
model for which the line does not hold are recorded at each size asked for.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from poplar.devices.simulated import SimulatedDevice
from poplar.emulate.model import GpuModel, op_cost
from poplar.profile.anatomy import Marks
from poplar.simulate.fake import counting, launches_no_kernel

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)   # the compute dtypes a price depends on
LINE_SIZES = (2, 3, 4)   # the micro-batches a line is drawn through (the first two) and checked at (the third)
_OP_IDS: dict = {}     # each operator a number, for a step's operators to be compared (poplar.simulate.layers)
COSTS: dict[tuple, tuple | None] = {}    # an operator's cost by its operands (poplar.simulate.fake.operands)
_UNSEEN = object()


def operator_name(number: int) -> str:
    """The operator a trace's number stands for (``Trace.ops``), by its name (``aten.mm.default``)."""
    return next(str(op) for op, n in _OP_IDS.items() if n == number)


class Recorder(TorchDispatchMode):
    """Writes down every operator run inside it that launches a kernel: its FLOPs, bytes and dtype."""

    def __init__(self):
        super().__init__()
        self.flops: list[float] = []
        self.nbytes: list[float] = []
        self.dtypes: list[int] = []
        self.ops: list[int] = []

    def __len__(self) -> int:
        return len(self.flops)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.count(func, args, kwargs, out)
        return out

    def count(self, func, args, kwargs, out, key: tuple | None = None) -> None:
        """One operator that ran: written down if it launches a kernel. ``key``: what its output and cost depend
        on (:func:`poplar.simulate.fake.operands`), where plain: its cost counted once for each."""
        if key is None:
            cost = op_cost(func, args, kwargs, out)
        else:
            cost = COSTS.get(key, _UNSEEN)
            if cost is _UNSEEN:
                cost = COSTS[key] = op_cost(func, args, kwargs, out)
                if cost is None:    # (none for any operands: op_cost says so of the operator alone)
                    launches_no_kernel(func)
        if cost is not None:
            self.flops.append(cost[0])
            self.nbytes.append(cost[1])
            self.dtypes.append(_DTYPES.index(cost[2]) if cost[2] in _DTYPES else 0)
            self.ops.append(_OP_IDS.setdefault(func, len(_OP_IDS)))


class CountingDevice(SimulatedDevice):
    """A simulated device that counts each step's operators (``recorder``) instead of pricing them; no limit
    on memory (each kind's capacity is compared by the simulator)."""

    def __init__(self, cluster, rank: int):
        super().__init__(cluster, rank)
        self.capacity = float("inf")
        self.recorder = Recorder()

    def _step_context(self, held):
        self.recorder = Recorder()
        return counting(self.recorder)


@dataclass
class Trace:
    """One step's operators in order, and the step's marks (:mod:`poplar.profile.anatomy`) as operator counts."""

    flops: np.ndarray
    nbytes: np.ndarray
    dtypes: np.ndarray
    marks: dict[tuple[str, int], int] = field(default_factory=dict)
    launches: list[tuple[str, int, int]] = field(default_factory=list)   # (op, bytes, operators before it)
    waits: list[int] = field(default_factory=list)     # operators before each wait for a collective
    n_units: int = 0
    ops: np.ndarray | None = None    # what each operator is (a number a process gives it)
    units: tuple[int, ...] = ()      # each unit's parameters, where recorded: what tells a unit's marks apart

    @classmethod
    def of(cls, recorder: Recorder, marks: Marks | None = None, units: tuple[int, ...] = ()) -> Trace:
        return cls(np.array(recorder.flops), np.array(recorder.nbytes), np.array(recorder.dtypes, dtype=np.int8),
                   dict(marks.at) if marks else {}, list(marks.launches) if marks else [],
                   list(marks.waits) if marks else [], len(units), np.array(recorder.ops, dtype=np.int32), units)

    def seconds(self, gpu: GpuModel) -> np.ndarray:
        """Each operator's seconds on ``gpu``: exactly :meth:`GpuModel.op_seconds`, for the whole list."""
        used = set(np.unique(self.dtypes).tolist())   # a dtype the trace does not use need not be the GPU's
        peak = np.array([gpu.flops_per_s(d) if i in used else 1.0 for i, d in enumerate(_DTYPES)])[self.dtypes]
        memory = self.nbytes / (gpu.bandwidth_gbs * 1e9 * gpu.bandwidth_efficiency)
        return gpu.kernel_overhead_s + np.maximum(self.flops / peak, memory)

    def busy(self, gpu: GpuModel) -> float:
        return float(self.seconds(gpu).sum())

    def marks_on(self, gpu: GpuModel) -> Marks:
        """The marks in busy seconds on ``gpu``, as the device's clock would have read them."""
        at = np.concatenate([[0.0], np.cumsum(self.seconds(gpu))])
        marks = Marks(None)
        marks.at = {k: float(at[i]) for k, i in self.marks.items()}
        marks.launches = [(op, nbytes, float(at[i])) for op, nbytes, i in self.launches]
        marks.waits = [float(at[i]) for i in self.waits]
        return marks

    def same_as(self, other: Trace) -> bool:
        """The same operators, sizes, marks, launches and waits."""
        return (self._same_steps(other) and np.array_equal(self.flops, other.flops)
                and np.array_equal(self.nbytes, other.nbytes) and self.n_units == other.n_units)

    def _same_steps(self, other: Trace) -> bool:
        return (len(self.flops) == len(other.flops) and np.array_equal(self.dtypes, other.dtypes)
                and (self.ops is None or other.ops is None or np.array_equal(self.ops, other.ops))
                and self.marks == other.marks and self.launches == other.launches and self.waits == other.waits)

    @staticmethod
    def line(t1: Trace, t2: Trace, t3: Trace | None = None) -> Callable[[int], Trace] | None:
        """The step at any micro-batch ``m`` from those at :data:`LINE_SIZES` (``t1`` at the first, steps of
        one sample apart); None where the third is not on the line through the first two (``t3`` None: the
        line is known to hold, see :class:`Steps`)."""
        if not (t1._same_steps(t2) and (t3 is None or t1._same_steps(t3))):
            return None
        df, db = t2.flops - t1.flops, t2.nbytes - t1.nbytes
        if t3 is not None and not (np.array_equal(t1.flops + 2 * df, t3.flops)
                                   and np.array_equal(t1.nbytes + 2 * db, t3.nbytes)):
            return None
        return lambda m: Trace(t1.flops + (m - LINE_SIZES[0]) * df, t1.nbytes + (m - LINE_SIZES[0]) * db, t1.dtypes, t1.marks,
                               t1.launches, t1.waits, t1.n_units, t1.ops, t1.units)


class Steps:
    """A stage's step traces by ``(micro_batch, accumulation)``: recorded by ``record``, or read from the line
    through 2 and 3 checked at 4 (a micro-batch of one sample may run other operators: it is recorded).

    ``checked``: the accumulations whose line was checked for this model, stage and engine options at another
    world size (a shard's size changes the update's operators, not how a step's grow with its samples): not
    checked again. :attr:`held` says which held here."""

    def __init__(self, record: Callable[[int, int], Trace], checked: frozenset[int] = frozenset()):
        self._record = record
        self._checked = checked
        self._traces: dict[tuple[int, int], Trace] = {}
        self._lines: dict[int, Callable[[int], Trace] | None] = {}

    @property
    def held(self) -> frozenset[int]:
        return frozenset(a for a, line in self._lines.items() if line is not None)

    def recorded(self, m: int, accumulation: int) -> Trace:
        key = (m, accumulation)
        if key not in self._traces:
            self._traces[key] = self._record(m, accumulation)
        return self._traces[key]

    def at(self, m: int, accumulation: int) -> Trace:
        if m == 1 or (m, accumulation) in self._traces:
            return self.recorded(m, accumulation)
        if accumulation not in self._lines:
            sizes = LINE_SIZES[:2] if accumulation in self._checked else LINE_SIZES
            traces = [self.recorded(k, accumulation) for k in sizes]
            self._lines[accumulation] = Trace.line(*traces)
        line = self._lines[accumulation]
        return self.recorded(m, accumulation) if line is None or (m, accumulation) in self._traces else line(m)


class Activations:
    """The bytes autograd saves in a forward and backward of ``m`` samples (a memory probe's peak), by ``m``:
    measured at 1 and at :data:`LINE_SIZES` and, where those are on a line, read from it; ``exact(m)`` measures.

    Where a model runs the same operators at every size, each tensor's bytes grow with ``m`` as a polynomial of
    non-negative coefficients, so the peak (the most, over the step, of the sums of those alive) is convex in ``m``.
    A convex function on the line at 2, 3 and 4 lies on it at every size up to the first one where it leaves it:
    measured on the line at ``M`` too, it is on it all the way to ``M`` (:meth:`proven`)."""

    def __init__(self, measure: Callable[[int], int]):
        self._measure = measure
        self._seen: dict[int, int] = {}
        self._through = LINE_SIZES[-1]    # the line is exact up to here, once it holds at all

    def exact(self, m: int) -> int:
        if m not in self._seen:
            self._seen[m] = self._measure(m)
        return self._seen[m]

    def __call__(self, m: int) -> int:
        if m == 1 or m in self._seen:
            return self.exact(m)
        line = self._line()
        return self.exact(m) if line is None else line(m)

    def proven(self, upto: int) -> bool:
        """Whether every size up to ``upto`` reads exactly as measured (one measurement, at ``upto``)."""
        line = self._line()
        if line is None:
            return False
        if upto > self._through and self.exact(upto) == line(upto):
            self._through = upto
        return upto <= self._through

    def _line(self) -> Callable[[int], int] | None:
        a2, a3, a4 = (self.exact(k) for k in LINE_SIZES)
        if a4 - a3 != a3 - a2:
            return None
        return lambda m: a2 + (m - 2) * (a3 - a2)


class CountedMarks(Marks):
    """The anatomy's marks on a :class:`CountingDevice`: each mark is the number of operators run before it."""

    def busy(self) -> int:
        return len(self.device.recorder)

    def start(self) -> None:
        pass
