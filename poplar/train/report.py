"""What a training run did: figures from its JSON-lines log, and plots."""

from __future__ import annotations

import json
import statistics
from pathlib import Path


def read_log(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def summarize(records: list[dict], skip: int = 1) -> dict:
    """Medians over the steady steps, and the loss at both ends.

    Steady: after the first ``skip`` (warm-up). ``steady_steps`` names them (log step numbers).
    A run resumed on another cluster is summarised on the last one (its trailing records), a run
    that re-planned on its last plan (the steps after the last change); ``replans`` lists each
    change (:class:`poplar.train.replan.Replan`'s record).
    """
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
    """Loss curves, throughput per step, and every rank's busy and idle time, for one or more runs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_tput, ax_busy) = plt.subplots(1, 3, figsize=(15, 4))
    names = list(runs)
    for name, records in runs.items():
        steps = [r["step"] + 1 for r in records]
        ax_loss.plot(steps, [r["loss"] for r in records], label=name)
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
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
