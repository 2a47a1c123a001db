"""`poplar simulate`: what Poplar would do for a model on a cluster, from a simulated profile (no device runs)."""

from __future__ import annotations

import time
from pathlib import Path

import typer


def simulate(
    cluster: str = typer.Option(..., help="cluster YAML file, or a preset (e.g. two-node-10gbe)"),
    model: str = typer.Option(..., help="model preset (see `poplar profile --help`)"),
    global_batch: int = typer.Option(..., min=1, help="samples per optimizer step, over all ranks"),
    seq_len: int | None = typer.Option(None, help="tokens per sample (Hugging Face presets)"),
    stages: str = typer.Option("0,1,2,3", help="ZeRO stages to consider, comma-separated"),
    points: int = typer.Option(6, min=2, help="micro-batch sizes simulated per stage"),
    max_micro_batch: int = typer.Option(256, min=1, help="largest micro-batch the memory search tries"),
    mixed_precision: str = typer.Option("none", help="none (fp32) or bf16 (the engine's bf16 mixed precision)"),
    out: Path = typer.Option(Path("plan.json"), help="where to write the chosen plan (JSON)"),
    profile_out: Path | None = typer.Option(None, help="also write the simulated profile here (JSON)"),
) -> None:
    """Plan a model on a cluster from a simulated profile: the device model counted on fake tensors, not run."""
    from pydantic import ValidationError

    from poplar.cli.main import BAD_INPUT_ERRORS, _check_writable, _error, stages_option
    from poplar.cli.output import console as _console
    from poplar.cli.output import say
    from poplar.cluster.spec import load_cluster
    from poplar.planner import make_plan
    from poplar.planner.report import comparison_table, stage_table
    from poplar.profile.options import ProfileOptions
    from poplar.simulate import simulate_profile
    from poplar.workload import Workload

    console = _console()
    try:   # everything that can be refused is, before anything is simulated
        stage_list = stages_option(stages)
        options = ProfileOptions(stages=stage_list, n_points=points, max_micro_batch=max_micro_batch,
                                 precision=mixed_precision)
        try:
            workload = Workload(model=model, seq_len=seq_len)
        except ValidationError as e:
            raise ValueError(f"--model/--seq-len: {e.errors()[0]['msg']}") from None
        spec = load_cluster(cluster)
        spec.check_global_batch(global_batch)
        _check_writable(out, "--out")
        _check_writable(profile_out, "--profile-out")
    except BAD_INPUT_ERRORS as e:
        _error(console, e)
        raise typer.Exit(2) from None
    start = time.perf_counter()
    prof = simulate_profile(workload, spec, options)
    simulated_s = time.perf_counter() - start
    try:
        result = make_plan(prof, global_batch, stage_list)
    except BAD_INPUT_ERRORS as e:   # PlanningError: no stage can run it
        _error(console, e)
        raise typer.Exit(2) from None
    console.print(stage_table(result, result.chosen))
    console.print(comparison_table(result))
    say(console, f"chosen: {result.reason}")
    say(console, f"simulated {prof.model.n_params:,} parameters on {spec.world_size} ranks in {simulated_s:.1f} s, "
                 f"planned in {time.perf_counter() - start - simulated_s:.1f} s")
    result.save(out)
    say(console, f"wrote {out} ({result.plan})")
    if profile_out:
        prof.save(profile_out)
        say(console, f"wrote {profile_out}")
