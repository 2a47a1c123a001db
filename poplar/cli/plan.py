"""`poplar plan`: the ZeRO stage and each rank's micro-batch and accumulation, from a profile (:mod:`poplar.planner`)."""

from __future__ import annotations

from pathlib import Path

import typer

from poplar.cli.inputs import BAD_INPUT_ERRORS, check_writable, print_error, stages_option
from poplar.cli.output import say
from poplar.cli.output import console as _console


def plan(
    profile: Path = typer.Option(..., help="a profile written by `poplar profile`"),
    global_batch: int = typer.Option(..., help="samples per optimizer step, over all ranks"),
    stages: str = typer.Option("0,1,2,3", help="ZeRO stages to consider, comma-separated"),
    out: Path = typer.Option(Path("plan.json"), help="where to write the chosen plan (JSON)"),
    all_stages: bool = typer.Option(False, "--all-stages", help="print every stage's per-rank table, "
                                                                  "not only the chosen one's"),
) -> None:
    """Choose the ZeRO stage and each rank's micro-batch and accumulation from a profile.

    Plans every stage asked for, prints each rank's share and Poplar's allocation beside the uniform,
    proportional and measured-peak ones, says why it chose the stage, and writes the plan, which
    poplar train --plan trains.

    Example:
      poplar plan --profile profile.json --global-batch 128 --out plan.json
    """
    from poplar.planner import make_plan
    from poplar.cli.tables import allocations_table, stage_table
    from poplar.profile.profile import Profile

    console = _console()
    try:
        stage_list = stages_option(stages)
        check_writable(out, "--out")
        if not profile.exists():
            raise ValueError(f"--profile {profile}: no such file; write one with `poplar profile`")
        try:
            prof = Profile.load(profile)
        except Exception as e:   # pydantic or JSON: say which file and what is wrong in it
            from pydantic import ValidationError

            what = ("; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors()[:3])
                    if isinstance(e, ValidationError) else str(e).splitlines()[0])
            raise ValueError(f"--profile {profile}: not a Poplar profile ({what}); write one with "
                             "`poplar profile`") from None
        result = make_plan(prof, global_batch, stage_list)
    except BAD_INPUT_ERRORS as e:   # PlanningError is one
        print_error(console, e)
        raise typer.Exit(2) from None
    for sp in [*result.stages.values(), *result.shaped.values()]:
        if not sp.excluded and (all_stages or sp is result.chosen):
            console.print(stage_table(result, sp))
    console.print(allocations_table(result))
    say(console, f"chosen: {result.reason}")
    result.save(out)
    say(console, f"wrote {out} ({result.plan.summary()})")
