"""The study's figure: per variant, the mean over seeds and the min-max band of each panel."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from stare_agent.recipes.plots import finish_panel

# (title, y label, metric key or prefix ending in "@"): the study figure's panels.
STUDY_PANELS = (
    ("Entropy (solid: sampled rollouts, dotted: held-out bank)", "nats / token", "entropy"),
    ("Reward on RL draws", "mean reward", "reward_mean"),
    ("Held-out accuracy (solid: sampled, dashed: greedy)", "accuracy", "eval/avg@"),
    ("Response length", "tokens", "response_length_mean"),
)


def plot_study(
    runs: dict[str, dict[int, list[dict[str, Any]]]], out: str | Path, *, h_tgt: float | None = None
) -> Path:
    """One figure of a study: per variant the mean over seeds (line) and the min-max band (shaded).

    Args:
        runs: variant -> seed -> that run's metric records (``read_metrics``).
        out: The PNG to write.
        h_tgt: Drawn as a dashed grey line on the entropy panel.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (title, ylabel, key) in zip(axes.flat, STUDY_PANELS, strict=True):
        for i, (variant, by_seed) in enumerate(runs.items()):
            color = colors[i % len(colors)]
            series = {
                "entropy": [(key, "-"), ("eval/bank_entropy", ":")],
                "eval/avg@": [(key, "-"), ("eval_greedy/avg@", "--")],
            }.get(key, [(key, "-")])
            for k, style in series:
                steps, table = _by_step(by_seed.values(), k)
                if not steps:
                    continue
                with np.errstate(all="ignore"), warnings.catch_warnings():
                    warnings.simplefilter("ignore", RuntimeWarning)  # a step every seed skipped: NaN
                    mean, lo, hi = np.nanmean(table, 0), np.nanmin(table, 0), np.nanmax(table, 0)
                label = variant if style == "-" else None
                ax.plot(steps, mean, style, color=color, marker="o", ms=2.5, lw=1.4, label=label)
                if len(by_seed) > 1:
                    ax.fill_between(steps, lo, hi, color=color, alpha=0.15, lw=0)
        if key == "entropy" and h_tgt is not None:
            ax.axhline(h_tgt, ls="--", color="gray", label=f"H_tgt = {h_tgt:g}")
        finish_panel(ax, title, ylabel)
    seeds = sorted({len(s) for s in runs.values()})
    fig.suptitle(
        f"GRPO-ds vs STARE: mean and min-max band over {'/'.join(map(str, seeds))} seed(s)", fontsize=11
    )
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _by_step(seed_runs: Any, key: str) -> tuple[list[int], Any]:
    """Steps where any seed logged ``key`` (a prefix when it ends in "@"), and a seeds x steps array
    with NaN where a seed has no value."""
    import numpy as np

    def value(record: dict[str, Any]) -> float | None:
        if not key.endswith("@"):
            return float(record[key]) if key in record else None
        hits = [float(v) for k, v in record.items() if k.startswith(key)]
        return hits[0] if hits else None

    per_seed = [{r["step"]: v for r in recs if (v := value(r)) is not None} for recs in seed_runs]
    steps = sorted({s for d in per_seed for s in d})
    return steps, np.array([[d.get(s, np.nan) for s in steps] for d in per_seed], dtype=float)
