"""A picture of a profile: fitted time curves per device kind, one panel per ZeRO stage."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from poplar.profile.profile import Profile


def plot_profile(profile: Profile, path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = sorted({s for d in profile.devices.values() for s in d.stages})
    fig, axes = plt.subplots(1, len(stages), figsize=(4.2 * len(stages), 3.6), squeeze=False)
    for ax, stage in zip(axes[0], stages):
        for i, (kind, dev) in enumerate(sorted(profile.devices.items())):
            sp = dev.stages.get(stage)
            if sp is None or not sp.points:
                continue
            colour = f"C{i}"
            m = np.array([p[0] for p in sp.points])
            t = np.array([p[1] for p in sp.points])
            grid = np.linspace(m.min(), m.max(), 100)
            ax.plot(grid, [1000 * sp.time(x) for x in grid], color=colour, label=f"{kind} (max {sp.max_micro_batch})")
            ax.plot(m, 1000 * t, "o", color=colour)
        ax.set_title(f"ZeRO stage {stage}")
        ax.set_xlabel("micro-batch size")
        ax.set_ylabel("ms per step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{profile.model.name}: {profile.model.n_params:,} parameters, seq {profile.model.seq_len}")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
