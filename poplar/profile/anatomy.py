"""A step's anatomy: where its compute falls between its collectives, measured on the device's clock.

The cost model places each unit's compute between the collectives the engine issues
(:mod:`poplar.planner.schedule`). How the compute divides among units is not their
FLOPs' share: an embedding's gradient or a softmax over the vocabulary moves memory,
and every small operator pays its launch. So one step of one micro-batch is timed
with marks: each layer's forward and backward (module hooks, and gradient hooks on
its inputs and outputs), and each collective's launch (the device is the engine's
observer). The busy time at each mark (waits for other ranks left out) gives a
:class:`~poplar.profile.profile.StepAnatomy`.
"""

from __future__ import annotations

import contextlib

import torch
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten

import poplar
from poplar.profile.profile import StepAnatomy
from poplar.profile.timing import RankRun, warm_up

SMALL_BYTES = 8     # the loss and the squared norm: one fp32 (or fp64) number

CLOCK_RESOLUTION_S = 1e-12   # instants closer than this on a device's clock are one


class Marks:
    """Busy seconds (the device's clock less its waits) at each mark of one step."""

    def __init__(self, device):
        self.device = device
        self.at: dict[tuple[str, int], float] = {}   # (what, unit) -> busy seconds, first time only
        self.launches: list[tuple[str, int, float]] = []
        self.waits: list[float] = []     # busy seconds as each wait for a collective began
        self._start = self._waited = 0.0

    def busy(self) -> float:
        return self.device.clock() - self._start - (self.device.wait_s - self._waited)

    def start(self) -> None:
        self._start, self._waited = self.device.clock(), self.device.wait_s

    def mark(self, what: str, unit: int) -> None:
        self.at.setdefault((what, unit), self.busy())   # a checkpointed forward re-run inside backward: ignored

    @contextlib.contextmanager
    def watch(self, engine):
        """Hooks on every layer unit, and the device's launches seen, while inside."""
        handles = [h for unit in engine.units[1:] for h in self._hooks(unit.index, unit.module)]
        launch = self.device.launch

        def seen(op, nbytes, group=None, groups=1):
            self.launches.append((op, nbytes, self.busy()))
            return launch(op, nbytes, group, groups)

        wait = self.device.wait

        def waited(token, real_wait):
            self.waits.append(self.busy())
            return wait(token, real_wait)

        self.device.launch, self.device.wait = seen, waited
        try:
            yield self
        finally:
            del self.device.launch, self.device.wait   # the class's methods again
            for h in handles:
                h.remove()

    def _hooks(self, index: int, module: torch.nn.Module) -> list:
        def grads(tensors) -> list[torch.Tensor]:
            return [t for t in tree_flatten(tensors)[0] if isinstance(t, torch.Tensor) and t.requires_grad]

        def pre(_module, args, kwargs):
            self.mark("forward", index)
            inputs = grads((args, kwargs))
            if inputs and ("backward_end", index) not in self.at:
                register_multi_grad_hook(inputs, lambda _: self.mark("backward_end", index))

        def post(_module, _args, _kwargs, out):
            self.mark("forward_end", index)
            outputs = grads(out)
            if outputs and ("backward", index) not in self.at:
                register_multi_grad_hook(outputs, lambda _: self.mark("backward", index))

        return [module.register_forward_pre_hook(pre, with_kwargs=True),
                module.register_forward_hook(post, with_kwargs=True)]

    def anatomy(self, n_units: int, micro_batch: int) -> StepAnatomy | None:
        """The marks as shares of the micro-step (see :class:`~poplar.profile.profile.StepAnatomy`); None where
        some were not seen (a layer with no input that needs a gradient has no mark for its backward's end)."""
        small = [i for i, (op, nbytes, _) in enumerate(self.launches) if op == "all_reduce" and nbytes <= SMALL_BYTES]
        layers = range(1, n_units)
        if any((what, i) not in self.at for i in layers for what in ("forward", "forward_end", "backward",
                                                                      "backward_end")):
            return None
        last_backward = max((self.at[("backward_end", i)] for i in layers), default=0.0)
        after = [i for i in small if self.launches[i][2] >= last_backward]
        if not after:     # the loss's all-reduce: the engine issues it after every backward
            return None
        loss = after[0]
        grads = [t for op, nbytes, t in self.launches[:loss] if op in ("all_reduce", "reduce_scatter")
                 and nbytes > SMALL_BYTES]
        end = grads[-1] if grads else self.launches[loss][2]     # the root's gradient collective: its backward done
        norm = after[1] if len(after) > 1 else None
        loss_t = self.launches[loss][2]
        forward, backward, middle = self._shares(n_units, grads, end)
        total = max(end, 1e-12)
        issue, copy = self.gather_phase()
        waits = [t for t in self.waits if end <= t <= loss_t]
        return StepAnatomy(micro_batch=micro_batch, forward=[max(0.0, f / total) for f in forward],
                           backward=[max(0.0, b / total) for b in backward], root_middle=max(0.0, middle / total),
                           before_loss_s=max(0.0, loss_t - end),
                           before_norm_s=0.0 if norm is None else max(0.0, self.launches[norm][2] - loss_t),
                           gather_issue_s=issue, gather_copy_s=copy,
                           before_waits_s=_span(end, waits[0]) if waits else 0.0,
                           between_waits_s=_span(waits[0], waits[-1]) if waits else 0.0)

    def gather_phase(self) -> tuple[float, float]:
        """Busy seconds of the parameter all-gathers after the update (stages 1-2): between the first's launch and
        the last's (each later one's slice made ready: cast, padded), and after the last's launch to the step's
        end (unlike slices copied out as each is waited for). (0, 0) where the step gathers nothing after the
        norm's all-reduce, or where its end was not marked."""
        small = [t for op, nbytes, t in self.launches if op == "all_reduce" and nbytes <= SMALL_BYTES]
        if not small or ("end", 0) not in self.at:
            return 0.0, 0.0
        gathers = [t for op, nbytes, t in self.launches if op == "all_gather" and nbytes > SMALL_BYTES
                   and t >= small[-1]]
        if not gathers:
            return 0.0, 0.0
        return max(0.0, gathers[-1] - gathers[0]), max(0.0, self.at[("end", 0)] - gathers[-1])

    def _shares(self, n_units: int, grads: list[float], end: float) -> tuple[list[float], list[float], float]:
        """Busy seconds of each unit's forward and backward, and the root's middle. A unit's backward ends where the
        engine issues its gradient's collective (its parameters' gradients are in), which comes before its
        inputs' gradient is summed up: where every unit issued one, the backward is cut at those."""
        layers = range(1, n_units)
        forward, backward = [0.0] * n_units, [0.0] * n_units
        if n_units == 1:
            return [end], backward, 0.0
        for i in layers:
            forward[i] = self.at[("forward_end", i)] - self.at[("forward", i)]
            backward[i] = self.at[("backward_end", i)] - self.at[("backward", i)]
        first, last = min(layers, key=lambda i: self.at[("forward", i)]), \
            max(layers, key=lambda i: self.at[("forward", i)])
        forward[0] = self.at[("forward", first)]
        middle = self.at[("backward", last)] - self.at[("forward_end", last)]
        backward[0] = end - self.at[("backward_end", first)]
        before = self.at[("backward", last)]
        grads = [t for t in grads if t >= before]     # not the batch check's, issued as the step starts
        if len(grads) == n_units:    # the layers' in the order their backward ended, the root's last
            done = sorted(layers, key=lambda i: self.at[("backward_end", i)])
            for i, t in zip(done, grads):
                backward[i], before = t - before, t
            backward[0] = end - before
        return forward, backward, middle


def measure_anatomy(run: RankRun, stage: int, sizes: list[int]) -> StepAnatomy | None:
    """This rank's step anatomy at ``sizes`` (every rank's micro-batch; every rank calls it at once); None where
    the model's layers give no marks to read it from."""
    marks, n_units = marked_step(run, poplar.Plan(stage, sizes, 1))
    return marks.anatomy(n_units, sizes[run.rank])


def marked_step(run: RankRun, plan: poplar.Plan) -> tuple[Marks, int]:
    """One step of ``plan`` with its marks, after warm-up steps (every rank calls it at once), and the engine's
    number of units."""
    engine = run.engine(plan)
    wl = run.workload
    batch = wl.random_batch(plan.local_batch_size(run.rank))
    warm_up(engine, batch, wl.loss, max(1, run.warmup))
    marks = Marks(run.device)
    with marks.watch(engine), run.device.step(engine.held_state):
        marks.start()
        engine.train_batch(batch, wl.loss)
        marks.mark("end", 0)
    n_units = len(engine.units)
    engine.close()
    return marks, n_units


def _span(start: float, end: float) -> float:
    """Seconds from ``start`` to ``end`` on the device clock; instants apart by rounding alone (the same time reached
    by two sums, ~1e-19 s) are one."""
    gap = end - start
    return gap if gap > CLOCK_RESOLUTION_S else 0.0
