"""A run's directory and the files that say what the run is: ``plan.json``, ``config.yaml``, ``cluster.json``
(and ``basis.json``, the profile a re-plan starts from).

``plan.json`` is one schema, written here and read by ``poplar.Plan.load`` (which
ignores the planner's figures beside the plan): the plan the
run trains with on top, with the planner's result (if it planned) and which allocation
it took. A resumed run keeps its earlier plan and config beside the new ones
(``plan.1.json``, ...) rather than overwriting them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from typing import TYPE_CHECKING

import poplar

if TYPE_CHECKING:
    from poplar.train.description import Run


def check_out(out: str, resume: bool, restarted: bool = False, steps: int | None = None) -> Path:
    """Refuse to clobber an earlier run in ``out``, or to ``resume`` one that is not there or that has trained its
    ``steps`` already."""
    out_dir = Path(out)
    held = out_dir.exists() and ((out_dir / "log.jsonl").exists() or (out_dir / "checkpoints").exists())
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"--out {out_dir} is a file: give a directory for the run")
    if held and not resume:
        raise ValueError(f"{out_dir} already holds a run: pass --resume to continue it, or choose another --out "
                         "(nothing is overwritten)")
    if resume and not held and not restarted:
        raise ValueError(f"--resume: {out_dir} holds no run to continue (no log, no checkpoints): check --out, "
                         "or leave --resume out to start one")
    if resume and steps is not None and not restarted:
        _more_to_train(out_dir, steps)
    return out_dir


def _more_to_train(out_dir: Path, steps: int) -> None:
    from poplar.runtime.checkpoint import latest_checkpoint

    last = latest_checkpoint(out_dir / "checkpoints")
    done = int(last.name.split("-")[1]) if last is not None else 0
    if done >= steps:
        raise ValueError(f"--resume: the run in {out_dir} has trained {done} steps already, and steps is {steps}: "
                         f"give --steps more than {done} to train on")


def cluster_record(cluster, world_size: int) -> dict:
    """What the run's cluster was (``cluster``: its spec, None without one), to tell on resume whether it changed
    (a changed one is planned anew)."""
    return {"world_size": world_size, "cluster": None if cluster is None else cluster.model_dump(mode="json")}


def same_cluster(out: str, world_size: int, cluster) -> bool:
    """Whether the run in ``out`` recorded this cluster (:func:`cluster_record`)."""
    recorded = Path(out) / "cluster.json"
    try:
        return json.loads(recorded.read_text()) == cluster_record(cluster, world_size)
    except (OSError, ValueError):
        return False


def plan_record(plan, result=None, allocation: str = "poplar") -> dict:
    """``plan.json``'s content: the plan trained with on top, the planner's figures beside it."""
    if result is None:
        return plan.to_dict()
    d = result.to_dict()
    if plan != result.plan:   # a baseline's allocation: its plan and its prediction
        d.update(plan.to_dict(), predicted=result.allocations()[allocation].predicted.to_dict())
    d["meta"]["allocation"] = allocation
    return d


def write_plan(out_dir: Path, plan, result=None, allocation: str = "poplar") -> None:
    """Write ``plan.json`` (the earlier one kept aside, unless it is the same plan with nothing to add)."""
    path = out_dir / "plan.json"
    if result is None and path.exists() and poplar.Plan.load(path) == plan:
        return
    keep_aside(path)
    path.write_text(json.dumps(plan_record(plan, result, allocation), indent=2) + "\n")


def write_run_files(run: Run) -> None:
    """The files that say what ``run`` is, in its directory: the plan (with the planner's figures), what the ranks
    plan again from (kept for a resume), the config as the run records it and the cluster it ran on."""
    import yaml

    out_dir = Path(run.config.out)
    write_plan(out_dir, run.plan, run.planning, run.config.baseline)
    if run.basis is not None:    # (on a re-launch, with the speeds measured)
        (out_dir / "basis.json").write_text(json.dumps(run.basis.to_dict()) + "\n")
    keep_aside(out_dir / "config.yaml")
    (out_dir / "config.yaml").write_text(yaml.safe_dump(run.record(), sort_keys=False))
    (out_dir / "cluster.json").write_text(json.dumps(cluster_record(run.cluster, run.plan.world_size), indent=2)
                                          + "\n")


def keep_aside(path: Path) -> None:
    """A resumed run's earlier plan or config is kept beside the new one (``plan.1.json``, ...), not overwritten."""
    if not path.exists():
        return
    n = 1
    while path.with_name(f"{path.stem}.{n}{path.suffix}").exists():
        n += 1
    path.rename(path.with_name(f"{path.stem}.{n}{path.suffix}"))


def keep_log_before(log_path: Path, start: int) -> None:
    """A resumed run repeats the steps after its checkpoint: their earlier records go (the rest stay)."""
    if not log_path.exists():
        return
    kept = [line for line in log_path.read_text().splitlines() if line.strip() and json.loads(line)["step"] < start]
    tmp = log_path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, log_path)
