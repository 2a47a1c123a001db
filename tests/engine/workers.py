"""Functions run inside spawned ranks (they must be importable by the child processes)."""

from __future__ import annotations

import time
import traceback
from pathlib import Path

import torch

import poplar
from poplar.engine.collectives import Comm
from tests.helpers.models import OPTIMIZER, lm_loss, make_batches, make_model


class PeakMemory:
    """The most bytes of each kind the engine held, sampled as each unit's backward finishes (attached from outside)."""

    def __init__(self, engine):
        self.engine, self.peak = engine, {}
        engine.on_unit_done.append(self.sample)

    def sample(self) -> None:
        now = self.engine.memory_report()
        self.peak = {k: max(v, self.peak.get(k, 0)) for k, v in now.items()}


def train_with_plan(plan: poplar.Plan, n_steps: int, config=None, model_kw=None, optimizer=OPTIMIZER, seed=1,
                    track_peak=False):
    rank = torch.distributed.get_rank()
    model = make_model(**(model_kw or {}))
    engine = poplar.initialize(model, optimizer, plan, config or {})
    peak = PeakMemory(engine) if track_peak else None
    lo, hi = plan.sample_range(rank)
    losses, norms = [], []
    vocab = model.embed.num_embeddings
    for tokens, targets in make_batches(n_steps, plan.global_batch_size, vocab=vocab, seed=seed):
        losses.append(engine.train_batch((tokens[lo:hi], targets[lo:hi]), lm_loss))
        norms.append(engine.last_grad_norm)
    state = engine.full_state_dict()
    # every shard group's copy where the plan is hybrid: its first rank's, and the last rank's
    keep = {0, torch.distributed.get_world_size() - 1} | {g[0] for g in plan.shard_groups or ()}
    out = {"losses": losses, "norms": norms, "state": state if rank in keep else None,
           "memory": engine.memory_report(), "peak": peak.peak if peak else {},
           "unit_numels": [u.padded_numel for u in engine.units]}
    engine.close()
    return out


def run_cases(rank, world_size, cases, n_steps, optimizer=OPTIMIZER, track_peak=False):
    """Several (plan dict, config) cases one after another in the same process group."""
    return [train_with_plan(poplar.Plan.from_dict(plan), n_steps, config, model_kw, optimizer, track_peak=track_peak)
            for plan, config, model_kw in cases]


def until_failure(rank, world_size, worker, cases, *args, progress: str | None = None, **kwargs):
    """``worker(rank, world_size, [case], *args)`` for each case in turn, up to the first that raises.

    Returns ``(results, failure)``: one result per case run, and ``(index, traceback)`` of the case that
    raised (None if none did), so that one case's failure names that case and the cases before it still
    report. The cases after it are not run: the group may be broken. (A rank left waiting in a collective
    its peer abandoned fails too, when the peer leaves or the collective times out.) ``progress``: a file
    that holds the index of the case under way, to name it should the rank die in it (gloo aborts a rank
    whose collective's size is not its peers').
    """
    out = []
    for index, case in enumerate(cases):
        if progress is not None:
            Path(progress).write_text(str(index))
        try:
            out += worker(rank, world_size, [case], *args, **kwargs)
        except Exception:   # the test names the case and shows this
            return out, (index, traceback.format_exc())
    return out, None


def catch(fn, *args):
    try:
        fn(*args)
    except Exception as e:   # the test inspects what every rank raised
        return type(e).__name__, str(e)
    return None


def bad_input_scenarios(rank, world_size):
    """Each scenario must fail on EVERY rank with a clear error, and never hang."""
    plan = poplar.Plan(1, [2, 1], [1, 2])
    out = {}
    out["world_size"] = catch(lambda: poplar.initialize(make_model(), OPTIMIZER, poplar.Plan(0, [1, 1, 1], 1)))
    out["different_plans"] = catch(lambda: poplar.initialize(
        make_model(), OPTIMIZER, poplar.Plan(0, [2, 1] if rank == 0 else [1, 2], 1)))
    out["different_models"] = catch(lambda: poplar.initialize(make_model(layers=2 + rank), OPTIMIZER, plan))
    out["optimizer_instance"] = catch(lambda: poplar.initialize(
        make_model(), torch.optim.SGD(make_model().parameters(), lr=0.1), plan))

    engine = poplar.initialize(make_model(), OPTIMIZER, plan)
    tokens, targets = make_batches(1, plan.global_batch_size)[0]
    lo, hi = plan.sample_range(rank)
    hi = hi - 1 if rank == 1 else hi     # rank 1 passes one sample too few
    out["short_batch"] = catch(engine.train_batch, (tokens[lo:hi], targets[lo:hi]), lm_loss)
    lo, hi = plan.sample_range(rank)
    out["ragged_batch"] = catch(engine.train_batch, (tokens[lo:hi], targets[lo:hi - 1]), lm_loss)
    out["vector_loss"] = catch(engine.train_batch, (tokens[lo:hi], targets[lo:hi]),
                               lambda m, b: torch.nn.functional.cross_entropy(
                                   m(b[0]).flatten(0, 1), b[1].flatten(), reduction="none"))
    # after all of that the engine still trains, in step with the other ranks
    out["still_trains"] = engine.train_batch((tokens[lo:hi], targets[lo:hi]), lm_loss)
    return out


def stalled_rank(rank, world_size, stall_s):
    """Rank 1 stalls inside its step; rank 0 must get a timeout error, not hang."""
    plan = poplar.Plan(0, [1, 1], 1)
    engine = poplar.initialize(make_model(), OPTIMIZER, plan)
    tokens, targets = make_batches(1, 2)[0]

    def loss_fn(model, batch):
        if rank == 1:
            time.sleep(stall_s)
        return lm_loss(model, batch)

    start = time.monotonic()
    err = catch(engine.train_batch, (tokens[rank:rank + 1], targets[rank:rank + 1]), loss_fn)
    return err, time.monotonic() - start


def feature_scenarios(rank, world_size):
    import functools

    out = {}
    plan3 = poplar.Plan(3, [1, 3], [2, 2])
    # bf16 compute with fp32 masters, in the two extreme stages
    for stage in (0, 3):
        res = train_with_plan(poplar.Plan(stage, [1, 3], [2, 2]), 3, {"mixed_precision": "bf16"})
        out[f"bf16-stage{stage}"] = {"losses": res["losses"], "state": res["state"]}
    # a parameter no micro-step uses: it takes part in every collective with a zero gradient
    no_decay = functools.partial(torch.optim.AdamW, lr=1e-3, weight_decay=0.0)
    res = train_with_plan(poplar.Plan(2, [2, 1], [2, 2]), 3, {}, {"unused": True}, no_decay)
    out["unused"] = res["state"]
    # activation checkpointing re-runs each block's forward inside the backward pass
    for mode in ("early_stop", "full", "reentrant"):
        res = train_with_plan(poplar.Plan(3, [2, 1], [2, 2]), 3, {}, {"checkpoint": mode})
        out[f"checkpoint-{mode}"] = res["state"]

    # ZeRO-3 outside train_batch: an evaluation forward gathers and frees again
    model = make_model()
    engine = poplar.initialize(model, OPTIMIZER, plan3)
    lo, hi = plan3.sample_range(rank)
    for tokens, targets in make_batches(2, plan3.global_batch_size):
        engine.train_batch((tokens[lo:hi], targets[lo:hi]), lm_loss)
    probe = make_batches(1, 4, seed=7)[0][0]
    with torch.no_grad():
        out["eval_logits"] = engine.model(probe)
    out["eval_param_bytes"] = engine.memory_report()["parameters"]
    out["shard_bytes"] = 4 * sum(u.shard_numel for u in engine.units)
    state = engine.full_state_dict()
    out["trained_state"] = state
    # a checkpoint taken in stage 3 loads into a stage-1 engine with another plan
    other = poplar.initialize(make_model(seed=5), OPTIMIZER, poplar.Plan(1, [2, 2], [1, 3]))
    other.load_full_state_dict(state)
    out["reloaded_state"] = other.full_state_dict()
    return out


def nonfinite_step(rank, world_size, plan_dict, policy, bad_rank, bad_step, n_steps, leave_out=-1):
    """Train ``n_steps`` (batch ``leave_out`` left out); on ``bad_step`` rank ``bad_rank``'s loss is NaN."""
    plan = poplar.Plan.from_dict(plan_dict)
    engine = poplar.initialize(make_model(), OPTIMIZER, plan, on_nonfinite=policy, clip_grad_norm=1.0)
    lo, hi = plan.sample_range(rank)
    raised = None
    for step, (tokens, targets) in enumerate(make_batches(n_steps, plan.global_batch_size, seed=5)):
        if step == leave_out:
            continue
        poisoned = step == bad_step and rank == bad_rank
        loss_fn = (lambda m, b: lm_loss(m, b) * float("nan")) if poisoned else lm_loss
        try:
            engine.train_batch((tokens[lo:hi], targets[lo:hi]), loss_fn)
        except poplar.NonFiniteError as e:
            raised = (str(e), e.step, e.ranks)
            break
    state = engine.full_state_dict()
    out = {"raised": raised, "skipped": engine.skipped_steps, "steps": engine.global_steps,
           "state": state if rank == 0 else None}
    engine.close()
    return out


def skip_and_leave_out(rank, world_size, plan_dict):
    """A run whose second step is skipped (NaN on rank 0), and one that never saw that batch."""
    return (nonfinite_step(rank, world_size, plan_dict, "skip", 0, 1, 3),
            nonfinite_step(rank, world_size, plan_dict, "skip", -1, -1, 3, leave_out=1))


class CountingComm(Comm):
    """A Comm that records every collective as ``(op, nbytes)``, and the start of each micro-step as a marker.

    Its comms on sub-groups (a hybrid plan's shard groups) record into the same log, as ``op/group``.
    """

    def __init__(self, group=None, root: "CountingComm | None" = None):
        super().__init__(group)
        self.root = root or self
        self.log: list[tuple[str, int]] = []

    def on_group(self, group):
        return CountingComm(group, self.root)

    def run(self, op, nbytes, issue, async_op, groups=1):
        self.root.log.append((op if self.root is self else f"{op}/group", nbytes))
        return super().run(op, nbytes, issue, async_op, groups)


def count_collectives(rank, world_size, cases, model_kw, n_steps=2):
    """Per (plan dict, config) case: each step's collectives in issue order, micro-steps marked.

    A step's log reads ``[ops before the first forward, ("micro_step", 0), its ops, ("micro_step", 1), ...]``;
    the last micro-step's segment ends with the step's own collectives.
    """
    out = []
    for plan_dict, config in cases:
        plan = poplar.Plan.from_dict(plan_dict)
        comm = CountingComm()
        model = make_model(**model_kw)
        engine = poplar.initialize(model, OPTIMIZER, plan, config, comm=comm)
        lo, hi = plan.sample_range(rank)
        steps = []
        for tokens, targets in make_batches(n_steps, plan.global_batch_size, vocab=model.embed.num_embeddings):
            comm.log = []
            micro = iter(range(plan.accum_steps[rank]))

            def loss_fn(model, batch):
                comm.log.append(("micro_step", next(micro)))
                return lm_loss(model, batch)
            engine.train_batch((tokens[lo:hi], targets[lo:hi]), loss_fn)
            steps.append(comm.log)
        out.append({"steps": steps, "padded_numels": [u.padded_numel for u in engine.units]})
        engine.close()
    return out


def _states(engine) -> list[tuple[str, str]]:
    return [(u.param_state.value, u.grad_state.value) for u in engine.units]


def unit_states(rank, world_size, model_kw):
    """ZeRO-3 units' (parameter, gradient) states as backward finishes each unit, after a step, and on abandoning."""
    plan = poplar.Plan(3, [1, 2], [2, 2])
    engine = poplar.initialize(make_model(**model_kw), OPTIMIZER, plan)
    done = []
    engine.on_unit_done.append(lambda: done.append(_states(engine)))
    tokens, targets = make_batches(1, plan.global_batch_size)[0]
    lo, hi = plan.sample_range(rank)
    engine.train_batch((tokens[lo:hi], targets[lo:hi]), lm_loss)
    out = {"unit_done": done, "after_step": _states(engine)}
    unit = engine.units[1]
    unit.unshard(async_op=True)       # a gather in flight when the step is given up
    works = unit.abandon_collectives()
    out["abandoned"] = (unit.param_state.value, len(works))
    for w in works:
        w.wait()
    unit.reset_after_abandon()
    out["reset"] = (unit.param_state.value, unit.grad_state.value)
    engine.close()
    return out


def collectives_and_states(rank, world_size, cases, model_kw):
    """One launch for tests/engine/test_collectives.py: :func:`count_collectives`, then :func:`unit_states`."""
    return {"counts": count_collectives(rank, world_size, cases, model_kw),
            "states": unit_states(rank, world_size, model_kw)}


def shape_cases(rank, world_size, train, counted, n_steps, optimizer, model_kw, progress_dir):
    """One launch for tests/engine/test_shapes.py: :func:`run_cases`' cases, then :func:`count_collectives`',
    each kind up to its first case that fails (:func:`until_failure`; the case under way in
    ``progress_dir/<kind>-<rank>``)."""
    train_at, counts_at = (str(Path(progress_dir) / f"{kind}-{rank}") for kind in ("train", "counts"))
    return {"train": until_failure(rank, world_size, run_cases, train, n_steps, optimizer, progress=train_at),
            "counts": until_failure(rank, world_size, count_collectives, counted, model_kw, n_steps,
                                    progress=counts_at)}


def fp16_cases(rank, world_size, cases, n_steps, optimizer):
    """Each (plan dict, engine config, overflow_from) in fp16, a step whose loss scale is at least
    ``overflow_from`` made to overflow (its loss infinite). Per case: the state, the losses, the scale each step ran at, the steps
    skipped; or the error a case raised (its type, message)."""
    out = []
    for plan, config, overflow_from in cases:
        plan = poplar.Plan.from_dict(plan)
        engine = poplar.initialize(make_model(), optimizer, plan, {**config, "mixed_precision": "fp16"})
        lo, hi = plan.sample_range(rank)

        def loss_fn(model, batch):
            return lm_loss(model, batch) * (float("inf") if engine.loss_scale >= overflow_from else 1.0)

        losses, scales = [], []
        try:
            for tokens, targets in make_batches(n_steps, plan.global_batch_size):
                scales.append(engine.loss_scale)
                losses.append(engine.train_batch((tokens[lo:hi], targets[lo:hi]), loss_fn))
        except poplar.NonFiniteError as e:
            out.append({"error": str(e), "step": e.step, "scales": scales})
            engine.close()
            continue
        out.append({"state": engine.full_state_dict(), "losses": losses, "scales": scales,
                    "skipped": engine.skipped_steps})
        engine.close()
    return out


def plans_in_turn(rank, world_size, cases, model_kw):
    """Each case (a plan dict per step, engine config): one engine trained step by step, ``set_plan`` between
    steps (other splits, accumulation and shares of the states); its full state, every group's first and last
    rank's."""
    out = []
    for plans, config in cases:
        plans = [poplar.Plan.from_dict(p) for p in plans]
        model = make_model(**model_kw)
        engine = poplar.initialize(model, OPTIMIZER, plans[0], config)
        batches = make_batches(len(plans), plans[0].global_batch_size, vocab=model.embed.num_embeddings)
        for plan, (tokens, targets) in zip(plans, batches):
            engine.set_plan(plan)
            lo, hi = plan.sample_range(rank)
            engine.train_batch((tokens[lo:hi], targets[lo:hi]), lm_loss)
        state = engine.full_state_dict()
        keep = {0, world_size - 1} | {g[0] for g in plans[0].shard_groups or ()}
        out.append({"state": state if rank in keep else None, "held": [u.master.numel() for u in engine.units],
                    "numels": [u.numel for u in engine.units]})
        engine.close()
    return out


def stages_in_turn(rank, world_size, cases, model_kw, scratch):
    """Each case (a plan dict per step, engine config): one rank runtime on this host's CPU trained step by step,
    ``change_plan`` between steps (other stages and shapes through a checkpoint under ``scratch``); its full
    state (rank 0's) and the engine's step count."""
    from poplar.devices import rank_device_of
    from poplar.runtime.rank import RankRuntime

    out = []
    for i, (plans, config) in enumerate(cases):
        plans = [poplar.Plan.from_dict(p) for p in plans]
        model = make_model(**model_kw)
        device = rank_device_of(None, rank)
        device.__enter__()
        runtime = RankRuntime(device, model, OPTIMIZER, plans[0], poplar.EngineConfig(**config))
        batches = make_batches(len(plans), plans[0].global_batch_size, vocab=model.embed.num_embeddings)
        for plan, (tokens, targets) in zip(plans, batches):
            runtime.change_plan(plan, f"{scratch}/case-{i}")
            lo, hi = plan.sample_range(rank)
            runtime.train_batch((tokens[lo:hi], targets[lo:hi]), lm_loss)
        state = runtime.engine.full_state_dict()
        out.append({"state": state if rank == 0 else None, "steps": runtime.engine.global_steps,
                    "stage": runtime.engine.zero_stage})
        runtime.close()
        device.__exit__(None, None, None)
    return out
