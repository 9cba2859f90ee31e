"""`stare-agent plot RUN_DIR [RUN_DIR ...]`: the training dynamics of one or more runs, one image."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from stare_agent.metrics import MetricsError, read_metrics

MISMATCH_KEYS = (
    "mismatch/kl",
    "mismatch/abs_logp_mean",
    "mismatch/L_plus_abs_logp_mean",
    "mismatch/abs_logp_max",
)
CORRECTION_KEYS = (
    "rollout_correction/weight_mean",
    "rollout_correction/weight_mean_L_plus",
    "rollout_correction/capped_frac",
    "rollout_correction/masked_frac",
    "rollout_correction/seq_rejected_frac",
    "rollout_correction/eff_sample_size",
)
PPO_KEYS = ("actor/pg_clipfrac_max", "actor/pg_clipfrac_last", "actor/ppo_kl_max")
# (title, y label, metric keys): one panel each, in reading order of an RL step. A key ending in
# "@" stands for every logged key that starts with it (eval/avg@4, eval/avg@32, ...).
PANELS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("Entropy on sampled rollouts (gate's H-bar)", "nats / token", ("entropy",)),
    ("Reward and accuracy", "", ("reward_mean", "accuracy", "eval/avg@")),
    ("Response length", "tokens", ("response_length_mean",)),
    ("STARE gate and weights", "", ("gate_on", "stare/mean_weight", "frac_reweighted")),
    ("Reweighted token sets", "tokens", ("stare/L_plus", "stare/L_minus")),
    ("Tool use", "per episode", ("tool_calls_per_episode", "tool_errors_per_episode")),
    (
        "Tool health (infrastructure: ours; code errors, timeouts: the model's)",
        "fraction",
        (
            "tools/infra_error_fraction",
            "tools/infra_lost_fraction",
            "tools/code_error_fraction",
            "tools/timeout_fraction",
            "tools/void_turn_fraction",
        ),
    ),
    ("Engine vs learner log-probs (rollout mismatch)", "nats", MISMATCH_KEYS),
    ("Rollout correction (importance weights for the engine's mismatch)", "", CORRECTION_KEYS),
    ("PPO mini-batches: ratio away from 1", "", PPO_KEYS),
    (
        "Asynchronous rollouts: policy staleness",
        "steps behind",
        ("async/staleness_mean", "async/staleness_max"),
    ),
    (
        "Idle time (waiting for the other side)",
        "fraction of the step",
        ("time/learner_idle_frac", "time/engine_idle_frac"),
    ),
)
# Quantities of the update: on a step that trained nothing (``skipped``: no group with reward variance,
# or a non-finite loss) the trainer logs no measurement of them (entropy and gate_on NaN), so such a step
# is a gap in their lines, never a 0. Rollout quantities (reward, length, tool use) were measured.
UPDATE_KEYS = frozenset(
    {
        "entropy",
        "gate_on",
        "stare/mean_weight",
        "frac_reweighted",
        "stare/L_plus",
        "stare/L_minus",
        *MISMATCH_KEYS,
        *CORRECTION_KEYS,
        *PPO_KEYS,
    }
)
SFT_PANEL = ("Cold-start SFT loss (sft_log.jsonl)", "loss", ("loss",))
SKIPPED_LABEL = "skipped step (trained nothing)"
LINESTYLES = ("-", "--", ":", "-.")


def plot_dashboard(
    run_dirs: str | Path | Sequence[str | Path],
    out: str | Path | None = None,
    labels: Sequence[str] | None = None,
) -> Path:
    """Draw every run's ``metrics.jsonl`` into one dashboard PNG and return its path.

    One panel per entry of ``PANELS`` (a panel no run logged is left out), and the cold-start SFT loss
    where a run has ``sft_log.jsonl``; several runs are overlaid, one colour per run, one line style
    per metric. A step that trained nothing (``skipped``) is a shaded band on every RL panel and a gap
    in the update's quantities (``UPDATE_KEYS``). The entropy panel has a log scale (H-bar of a
    trained policy sits far below the gate's target) and shows ``H_tgt`` as a dashed grey line.
    Reward and accuracy are one line where they are equal at every step (a 0/1 correctness reward).

    Args:
        run_dirs: one run directory or several (each holding ``metrics.jsonl``).
        out: the PNG to write. Default: ``RUN_DIR/plots/dashboard.png`` for one run, else
            ``dashboard.png`` in the runs' common parent directory.
        labels: legend names, one per run (default: the directory names).

    Raises:
        ValueError: a run has no logged step, or ``labels`` does not match ``run_dirs``.
    """
    import matplotlib.pyplot as plt

    dirs = [Path(run_dirs)] if isinstance(run_dirs, str | Path) else [Path(d) for d in run_dirs]
    fig = dashboard_figure(dirs, labels)
    if out is None:
        out = (
            dirs[0] / "plots" / "dashboard.png" if len(dirs) == 1 else _common_parent(dirs) / "dashboard.png"
        )
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def dashboard_figure(dirs: Sequence[Path], labels: Sequence[str] | None = None) -> Any:
    """The figure :func:`plot_dashboard` saves (a ``matplotlib.figure.Figure``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not dirs:
        raise ValueError("no run directory given: pass at least one RUN_DIR")
    names = list(labels) if labels is not None else [d.name or str(d) for d in dirs]
    if len(names) != len(dirs):
        raise ValueError(f"{len(names)} labels for {len(dirs)} runs: give one label per run")
    runs = []
    for d in dirs:
        records = read_metrics(d)
        if not records:
            raise MetricsError(f"{d}/metrics.jsonl holds no step yet: plot the run after its first step")
        runs.append(records)
    sft_runs = [read_sft_log(d) for d in dirs]

    logged = {k for records in runs for r in records for k in r}
    one_reward = _reward_is_accuracy(runs)
    panels = [(t, y, _expand(keys, logged)) for t, y, keys in PANELS if _expand(keys, logged)]
    if any(sft_runs):
        panels.append(SFT_PANEL)
    if not panels:
        raise MetricsError(
            f"{dirs[0]}/metrics.jsonl logs none of the dashboard's metrics (reward_mean, entropy, ...): "
            "plot the run directory of `stare-agent train` or `sft`"
        )
    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.4 * rows), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, panel in zip(axes.flat, panels, strict=False):
        title, ylabel, keys = panel
        sft = panel is SFT_PANEL
        if keys[:2] == ("reward_mean", "accuracy") and one_reward:
            keys, title = keys[1:], "Accuracy (= reward: 1 for a correct answer, else 0)"
        elif keys[:2] == ("reward_mean", "accuracy"):
            title = "Reward and accuracy (they differ by the reward's shaping)"
        for i, (name, records) in enumerate(zip(names, sft_runs if sft else runs, strict=True)):
            color = colors[i % len(colors)]
            skipped = {r["step"] for r in records if r.get("skipped")}
            for j, key in enumerate(k for k in keys if any(k in r for r in records)):
                gap = (key in UPDATE_KEYS or sft) and skipped
                points = [(r["step"], math.nan if gap and r["step"] in skipped else float(r[key]))
                          for r in records if key in r]  # fmt: skip
                label = key if len(runs) == 1 else f"{name}: {key}"
                ax.plot(*zip(*points, strict=True), LINESTYLES[j % len(LINESTYLES)], color=color,
                        marker="o", ms=2.5, lw=1.3, label=label)  # fmt: skip
            if not sft:
                for n, step in enumerate(sorted(skipped)):
                    ax.axvspan(step - 0.5, step + 0.5, color=color, alpha=0.12, lw=0,
                               label=SKIPPED_LABEL if n == 0 and i == 0 else None)  # fmt: skip
        if keys == ("entropy",) and _entropy_axis(ax, runs):
            ylabel += " (log scale)"
        finish_panel(ax, title, ylabel)
        if sft:
            ax.set_xlabel("SFT step")
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    fig.suptitle(", ".join(names) if len(names) <= 4 else f"{len(names)} runs", fontsize=11)
    fig.tight_layout()
    return fig


def read_sft_log(run_dir: str | Path) -> list[dict[str, Any]]:
    """The cold-start SFT steps of ``run_dir/sft_log.jsonl`` (its closing summary left out); [] when
    the run did no SFT."""
    path = Path(run_dir) / "sft_log.jsonl"
    if not path.is_file():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [{k: math.nan if v is None else v for k, v in r.items()} for r in records if "loss" in r]


def _reward_is_accuracy(runs: list[list[dict[str, Any]]]) -> bool:
    """Whether every logged step of every run has reward_mean equal to accuracy."""
    pairs = [
        (r["reward_mean"], r["accuracy"])
        for records in runs
        for r in records
        if "reward_mean" in r and "accuracy" in r
    ]
    return bool(pairs) and all(abs(float(a) - float(b)) < 1e-9 for a, b in pairs)


def _entropy_axis(ax: Any, runs: list[list[dict[str, Any]]]) -> bool:
    """H_tgt as a dashed line, and a log scale when every value is positive (returns whether): a
    trained policy's H-bar (0.006-0.02 nats) sits flat on a linear axis that reaches up to H_tgt (0.3)."""
    targets = [r["H_tgt"] for records in runs for r in records if "H_tgt" in r]
    if targets:
        ax.axhline(float(targets[-1]), ls="--", color="gray", label=f"H_tgt = {targets[-1]:g}")
    values = [float(r["entropy"]) for records in runs for r in records if "entropy" in r]
    values = [v for v in values if v == v] + [float(t) for t in targets[-1:]]
    if values and min(values) > 0:
        ax.set_yscale("log")
        return True
    return False


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


def finish_panel(ax: Any, title: str, ylabel: str) -> None:
    """The common look of a panel: integer steps on x, title, labels, grid and legend."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # a panel with nothing logged yet has no legend
        ax.legend(fontsize=7)
