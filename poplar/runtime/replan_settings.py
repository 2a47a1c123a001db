"""When a run plans again while it trains: :class:`ReplanConfig` (``replan:`` in a run's config, ``replan=`` in the
integrations), the settings of :mod:`poplar.runtime.replanner`, kept apart from it so that reading a config does
not import the planner."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class ReplanConfig(BaseModel):
    """When a run plans again while it trains (see the module's docstring)."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["auto", "off"] = Field("auto", description="auto: re-plan when the steps measure off the "
                                         "prediction; off: keep the plan (a plan given with --plan, or a baseline, "
                                         "is always kept)")
    threshold: float = Field(0.1, gt=0, lt=1, description="a step or a rank's busy time this far off its prediction "
                             "(a fraction) counts as off; a new plan must be predicted faster by half of it")
    patience: int = Field(3, ge=1, description="steps in a row off the prediction before planning again")
    every: int = Field(10, ge=1, description="at most one re-plan in this many steps")

    @model_validator(mode="before")
    @classmethod
    def _mode_alone(cls, data: Any) -> Any:
        """``replan: off`` (or ``auto``) for ``replan: {mode: off}``."""
        if isinstance(data, bool):
            return {"mode": "auto" if data else "off"}
        return {"mode": data} if isinstance(data, str) else data


def replan_config(replan) -> ReplanConfig:
    """A :class:`ReplanConfig` from itself, ``"auto"``/``"off"``, a bool, a dict or None (auto); refused in one
    line otherwise."""
    if isinstance(replan, ReplanConfig):
        return replan
    try:
        return ReplanConfig.model_validate({} if replan is None else replan)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"])
        raise ValueError(f"replan{'.' + where if where else ''}: {err['msg']} (got {replan!r}); give 'auto', "
                         "'off' or a dict of mode, threshold, patience, every") from None
