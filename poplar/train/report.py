"""What a training run did: figures from its JSON-lines log, and plots.

The log holds a record per logged step and one per evaluation (``eval_loss``, beside its
step's): :func:`step_records` and :func:`eval_records` tell them apart.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path


def read_log(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def step_records(records: list[dict]) -> list[dict]:
    """The steps' records of a log (its evaluations' left out)."""
    return [r for r in records if "eval_loss" not in r]


def eval_records(records: list[dict]) -> list[dict]:
    """The evaluations' records of a log, in order."""
    return [r for r in records if "eval_loss" in r]


def summarize(records: list[dict], skip: int = 1) -> dict:
    """Medians over the steady steps, and the loss at both ends (and the last evaluation's, where the run
    evaluated).

    Steady: after the first ``skip`` (warm-up). ``steady_steps`` names them (log step numbers).
    A run resumed on another cluster is summarised on the last one (its trailing records), a run
    that re-planned on its last plan (the steps after the last change); ``replans`` lists each
    change (:class:`poplar.runtime.replanner.Replan`'s record).
    """
    evals = eval_records(records)
    last_eval = {"eval_loss": evals[-1]["eval_loss"], "eval_perplexity": evals[-1]["eval_perplexity"]} if evals else {}
    records = step_records(records)
    ranks = len(records[-1]["busy_s"])
    here = len(records)
    while here > 0 and len(records[here - 1]["busy_s"]) == ranks and "replan" not in records[here - 1]:
        here -= 1
    steady = records[here:][skip:] or records[here:] or records[-1:]
    mfu = {"mfu": statistics.median(r["mfu"] for r in steady)} if all("mfu" in r for r in steady) else {}
    return {
        "steps": len(records),
        "steady_steps": [r["step"] for r in steady],
        "first_loss": records[0]["loss"],
        "last_loss": records[-1]["loss"],
        "step_s": statistics.median(r["step_s"] for r in steady),
        "samples_per_s": statistics.median(r["samples_per_s"] for r in steady),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
        "tflops": statistics.median(r["tflops"] for r in steady),
        "busy_s": [statistics.median(r["busy_s"][i] for r in steady) for i in range(ranks)],
        "idle_s": [statistics.median(r["idle_s"][i] for r in steady) for i in range(ranks)],
        "replans": _replans(records, skip),
        **mfu,
        **last_eval,
    }


def _replans(records: list[dict], skip: int) -> list[dict]:
    """Each re-plan's record, with the step time then measured under the new plan (``measured_after_s``: the median
    of its steps after the first ``skip``, up to the next change; None where it ran no such step)."""
    at = [i for i, r in enumerate(records) if "replan" in r]
    out = []
    for i, j in zip(at, [*at[1:], len(records) - 1]):
        after = records[i + 1:j + 1][skip:]
        out.append({**records[i]["replan"],
                    "measured_after_s": statistics.median(r["step_s"] for r in after) if after else None})
    return out


def plot_runs(runs: dict[str, list[dict]], path: str | Path, title: str = "") -> Path:
    """Loss curves (and evaluation losses), throughput per step, and every rank's busy and idle time, for one or
    more runs (:func:`figure`), saved as ``path``."""
    import matplotlib.pyplot as plt

    fig = figure(runs, title)
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def figure(runs: dict[str, list[dict]], title: str = ""):
    """The report's matplotlib figure: loss (each evaluation's as a dashed series, ``<run> eval``), throughput per
    step, busy and idle per rank."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_tput, ax_busy) = plt.subplots(1, 3, figsize=(15, 4))
    evals = {name: eval_records(records) for name, records in runs.items()}
    runs = {name: step_records(records) for name, records in runs.items()}
    names = list(runs)
    for name, records in runs.items():
        steps = [r["step"] + 1 for r in records]
        drawn, = ax_loss.plot(steps, [r["loss"] for r in records], label=name)
        if evals[name]:
            ax_loss.plot([r["step"] + 1 for r in evals[name]], [r["eval_loss"] for r in evals[name]], ls="--",
                         marker="s", ms=4, color=drawn.get_color(), label=f"{name} eval")
        line, = ax_tput.plot(steps, [r["samples_per_s"] for r in records], marker="o", ms=3, label=name)
        for r in records:
            if "replan" in r:     # the new plan from the next step
                ax_tput.axvline(r["step"] + 1.5, color=line.get_color(), ls="--", lw=1)
                ax_tput.annotate("re-plan", (r["step"] + 1.5, r["samples_per_s"]), fontsize=7,
                                 color=line.get_color(), rotation=90, va="bottom")
    ax_loss.set(xlabel="step", ylabel="loss", title="loss")
    ax_tput.set(xlabel="step", ylabel="samples/s", title="throughput")
    ax_loss.legend()
    ax_tput.legend()
    width = 0.8 / len(names)
    for j, name in enumerate(names):
        s = summarize(runs[name])
        xs = [i + j * width for i in range(len(s["busy_s"]))]
        ax_busy.bar(xs, [1000 * b for b in s["busy_s"]], width, label=f"{name} busy")
        ax_busy.bar(xs, [1000 * i for i in s["idle_s"]], width, bottom=[1000 * b for b in s["busy_s"]],
                    color="lightgrey", edgecolor="grey", hatch="//", label="idle" if j == 0 else None)
    ax_busy.set(xlabel="rank", ylabel="ms per step (median)", title="busy and idle per rank")
    ax_busy.set_xticks([i + 0.4 - width / 2 for i in range(len(summarize(runs[names[0]])["busy_s"]))],
                       [str(i) for i in range(len(summarize(runs[names[0]])["busy_s"]))])
    ax_busy.legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig
