"""`stare-agent plot RUN_DIR [RUN_DIR ...]`: the training dynamics of one or more runs, one image."""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from stare_agent.metrics import read_metrics

# (title, y label, metric keys): one panel each, in reading order of an RL step. A key ending in
# "@" stands for every logged key that starts with it (eval/avg@4, eval/avg@32, ...).
PANELS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("Entropy on sampled rollouts (gate's H-bar)", "nats / token", ("entropy",)),
    ("Reward and accuracy", "", ("reward_mean", "accuracy", "eval/avg@")),
    ("Response length", "tokens", ("response_length_mean",)),
    ("STARE gate and weights", "", ("gate_on", "stare/mean_weight", "frac_reweighted")),
    ("Reweighted token sets", "tokens", ("stare/L_plus", "stare/L_minus")),
    ("Tool use", "per episode", ("tool_calls_per_episode", "tool_errors_per_episode")),
)
LINESTYLES = ("-", "--", ":", "-.")


def plot_dashboard(
    run_dirs: str | Path | Sequence[str | Path],
    out: str | Path | None = None,
    labels: Sequence[str] | None = None,
) -> Path:
    """Draw every run's ``metrics.jsonl`` into one dashboard PNG and return its path.

    One panel per entry of ``PANELS`` (a panel no run logged is left out); several runs are
    overlaid, one colour per run, one line style per metric. The entropy panel shows the gate's
    target ``H_tgt`` as a dashed grey line when it was logged.

    Args:
        run_dirs: one run directory or several (each holding ``metrics.jsonl``).
        out: the PNG to write. Default: ``RUN_DIR/plots/dashboard.png`` for one run, else
            ``dashboard.png`` in the runs' common parent directory.
        labels: legend names, one per run (default: the directory names).

    Raises:
        ValueError: a run has no logged step, or ``labels`` does not match ``run_dirs``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dirs = [Path(run_dirs)] if isinstance(run_dirs, str | Path) else [Path(d) for d in run_dirs]
    if not dirs:
        raise ValueError("no run directory given: pass at least one RUN_DIR")
    names = list(labels) if labels is not None else [d.name or str(d) for d in dirs]
    if len(names) != len(dirs):
        raise ValueError(f"{len(names)} labels for {len(dirs)} runs: give one label per run")
    runs = []
    for d in dirs:
        records = read_metrics(d)
        if not records:
            raise ValueError(f"{d}/metrics.jsonl has no steps yet: train for at least one step first")
        runs.append(records)
    if out is None:
        out = (
            dirs[0] / "plots" / "dashboard.png" if len(dirs) == 1 else _common_parent(dirs) / "dashboard.png"
        )
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)

    logged = {k for records in runs for r in records for k in r}
    panels = [(t, y, _expand(keys, logged)) for t, y, keys in PANELS if _expand(keys, logged)]
    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.4 * rows), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (title, ylabel, keys) in zip(axes.flat, panels, strict=False):
        for i, (name, records) in enumerate(zip(names, runs, strict=True)):
            color = colors[i % len(colors)]
            for j, key in enumerate(k for k in keys if any(k in r for r in records)):
                points = [(r["step"], float(r[key])) for r in records if key in r]
                label = key if len(runs) == 1 else f"{name}: {key}"
                ax.plot(*zip(*points, strict=True), LINESTYLES[j % len(LINESTYLES)], color=color,
                        marker="o", ms=2.5, lw=1.3, label=label)  # fmt: skip
        if keys == ("entropy",):
            targets = [r["H_tgt"] for records in runs for r in records if "H_tgt" in r]
            if targets:
                ax.axhline(float(targets[-1]), ls="--", color="gray", label=f"H_tgt = {targets[-1]:g}")
        _finish_panel(ax, title, ylabel)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    fig.suptitle(", ".join(names) if len(names) <= 4 else f"{len(names)} runs", fontsize=11)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _expand(keys: tuple[str, ...], logged: set[str]) -> tuple[str, ...]:
    """The logged keys a panel draws, in the panel's order."""
    out: list[str] = []
    for key in keys:
        out += (
            sorted(k for k in logged if k.startswith(key)) if key.endswith("@") else [key] * (key in logged)
        )
    return tuple(out)


def _common_parent(dirs: list[Path]) -> Path:
    return Path(os.path.commonpath([d.resolve() for d in dirs]))


# (title, y label, metric key or prefix ending in "@"): the study figure's panels.
STUDY_PANELS = (
    ("Entropy on sampled rollouts", "nats / token", "entropy"),
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
            series = [(key, "-")] if not key.endswith("@") else [(key, "-"), ("eval_greedy/avg@", "--")]
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
        _finish_panel(ax, title, ylabel)
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


def _finish_panel(ax: Any, title: str, ylabel: str) -> None:
    """The common look of a panel: integer steps on x, title, labels, grid and legend."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # a panel with nothing logged yet has no legend
        ax.legend(fontsize=7)
