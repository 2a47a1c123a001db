"""Where a run's plan comes from, written once for every front end: given (a :class:`~poplar.Plan`, its dict, or a
``plan.json``), or profiled and planned on a cluster (:func:`profile_and_plan`).

``poplar train`` (:mod:`poplar.train.planning`), the integrations (:mod:`poplar.integrations.session`) and the
comparisons (:mod:`poplar.compare.bench`) all read and make their plans here.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from poplar.plan import Plan


def read_json(path: Path, name: str, missing: str, broken: str):
    """The JSON value in ``path``; a one-line ValueError (``name``: no such file; ``missing`` / not valid JSON;
    ``broken``) otherwise."""
    if not path.is_file():
        raise ValueError(f"{name}: no such file; {missing}")
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{name}: not valid JSON ({e}); {broken}") from None


def load_plan(plan: Plan | dict | str | Path, *, name: str = "plan", model: tuple[str, int] | None = None) -> Plan:
    """A :class:`Plan` from itself, its dict or a ``plan.json`` file; refused in one line otherwise (``name``: how
    the message calls it, e.g. ``--plan plan.json``). ``model``: the ``(name, seq_len)`` trained, which a plan
    written for another model or sequence length (its ``meta``) is refused against."""
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, (str, Path)):
        path = Path(plan)
        plan = read_json(path, name if name != "plan" else f"plan {path}", "give a plan.json written by `poplar plan` "
                         "or `poplar train`, or a poplar.Plan", "write it again with `poplar plan`")
    if not isinstance(plan, dict):
        raise TypeError(f"plan must be a poplar.Plan, its dict or a plan.json path, got {type(plan).__name__}")
    planned = (plan.get("meta") or {}).get("model")
    if model is not None and planned and (planned.get("name"), planned.get("seq_len")) != tuple(model):
        raise ValueError(f"{name} was planned for {planned.get('name')} at {planned.get('seq_len')} tokens per "
                         f"sample, this run trains {model[0]} at {model[1]}: plan for this model (`poplar profile` "
                         "then `poplar plan`), or leave the plan out")
    try:
        return Plan.from_dict(plan)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{name}: {e}") from None


def profile_and_plan(wl, spec, global_batch: int, stages, config, distributed: bool = False,
                     use_cache: bool = True, progress=None, title: str = "", may_leave_out: bool = True):
    """Profile ``wl`` on ``spec`` (or read the cache) as ``config`` (an
    :class:`~poplar.engine.config.EngineConfig`) will train it, and plan ``global_batch`` over ``stages``: the
    planner's :class:`~poplar.planner.result.PlanResult`. ``distributed``: this process is one rank of the profiled
    group (every rank calls this). ``progress(title)``: a context that hears the profiler's events (``put``).
    ``may_leave_out``: whether the launch can run a plan of some of the ranks (a launcher that starts the ranks it
    is told: not a group already started, :func:`~poplar.planner.make_plan`)."""
    from poplar.planner import make_plan
    from poplar.profile.options import ProfileOptions
    from poplar.profile.profiler import profile_cluster

    options = ProfileOptions(stages=tuple(stages), use_cache=use_cache, max_micro_batch=min(256, global_batch),
                             precision=config.mixed_precision)
    with progress(title) if progress is not None else contextlib.nullcontext() as events:
        profile, _ = profile_cluster(wl, spec, options, config=config, distributed=distributed, progress=events)
    return make_plan(profile, global_batch, list(stages), may_leave_out=may_leave_out)


def basis_of(result):
    """What the ranks plan again from as they measure (:class:`~poplar.planner.replan.PlanBasis`): the planner's
    profile and the ranks it planned; None where the result holds no profile."""
    from poplar.planner.replan import PlanBasis

    return None if result is None or result.profile is None else PlanBasis(result.profile, list(result.ranks))
