"""`stare-agent plot RUN_DIR`: the training dynamics of a run as PNG files."""

from __future__ import annotations

from pathlib import Path

from stare_agent.metrics import read_metrics

# (file name, title, metric keys, y label)
PANELS = (
    ("entropy.png", "Policy entropy (mean over model tokens)", ("entropy",), "nats"),
    ("reward.png", "Reward and accuracy", ("reward_mean", "accuracy"), ""),
    ("response_length.png", "Response length", ("response_length_mean",), "tokens"),
    ("gate.png", "STARE gate and reweighting", ("gate_on", "frac_reweighted", "W", "M"), ""),
    ("tool_calls.png", "Tool use", ("tool_calls_per_episode", "tool_errors_per_episode"), "per episode"),
)


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Draw one PNG per panel from ``RUN_DIR/metrics.jsonl``; return the written files.

    The entropy panel shows the gate's target ``H_tgt`` as a dashed line when it was logged.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    records = read_metrics(run_dir)
    if not records:
        raise ValueError(f"{run_dir}/metrics.jsonl has no steps yet: train for at least one step first")
    out = Path(out_dir) if out_dir is not None else Path(run_dir) / "plots"
    out.mkdir(parents=True, exist_ok=True)
    steps = [r["step"] for r in records]
    written = []
    for name, title, keys, ylabel in PANELS:
        present = [k for k in keys if any(k in r for r in records)]
        if not present:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for key in present:
            xs = [s for s, r in zip(steps, records, strict=True) if key in r]
            ax.plot(xs, [float(r[key]) for r in records if key in r], marker="o", ms=3, label=key)
        if name == "entropy.png":
            targets = [r["H_tgt"] for r in records if "H_tgt" in r]
            if targets:
                ax.axhline(float(targets[-1]), ls="--", color="gray", label=f"H_tgt = {targets[-1]:g}")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        written.append(out / name)
    return written
