"""`stare-agent quickstart`: the main job on the embedded SmolLM2-135M-Instruct, on a CPU.

1. sandbox   Docker when a daemon and the image are there (the image is built if only it is
             missing), else the local backend with its warning
2. model     the embedded model (converted from GGUF once, then cached), and the rollout engine:
             vLLM (a worker process of .venv-vllm) when found, else the transformers engine
3. baseline  tool-use evaluation on held-out procedural problems
4. SFT       ReTool traces made by running solution code in the sandbox; cold-start SFT
5. RL        a few STARE-O1 steps
6. after     the same evaluation after SFT and after RL; a table of the three, with RL's own change
             and the whole gain as paired intervals over the same problems, and where everything went
"""

from __future__ import annotations

import concurrent.futures
import json
import signal
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from stare_agent import run_dirs
from stare_agent.config import RunConfig, load_config
from stare_agent.metrics import gate_fraction, json_ready
from stare_agent.resources import open_sandboxes

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"


def quickstart(
    config_path: str | Path = CONFIG, overrides: tuple[str, ...] | list[str] = (), *, overwrite: bool = False
) -> dict[str, Any]:
    """Run the main job (see the module docstring); returns the table's numbers and paths.
    ``overwrite``: delete an earlier quickstart's results in ``trainer.run_dir`` first (without it such
    a directory is refused: ``stare_agent.run_dirs``)."""
    start = time.perf_counter()
    config = load_config(config_path, list(overrides))
    run_dir = Path(config.trainer.run_dir)
    sft_output = Path(config.sft.output_dir) if config.sft.output_dir else run_dir / "sft_model"
    with run_dirs.locked(run_dir, "trainer.run_dir"):  # its SFT, training and evaluations claim it again
        run_dirs.check_quickstart(run_dir, sft_output, overwrite=overwrite)
        return _quickstart(config, run_dir, start)


def _quickstart(config: RunConfig, run_dir: Path, start: float) -> dict[str, Any]:
    from stare_agent.engines import start_engine
    from stare_agent.models import load_policy
    from stare_agent.train.checkpoints import seed_all
    from stare_sandbox import resolve_backend

    times: dict[str, float] = {}

    def phase(name: str, t0: float) -> None:
        times[name] = time.perf_counter() - t0
        print(f"[{name}] done in {times[name]:.0f} s", flush=True)

    # 1. sandbox
    t0 = time.perf_counter()
    # auto: Docker, building its image if only that is missing, else local (saying why)
    backend = resolve_backend(config.sandbox.backend, config.sandbox.limits, build=True)
    config = replace(config, sandbox=replace(config.sandbox, backend=backend))
    print(f"[sandbox] backend: {backend}")
    # One pool of warm sandboxes serves the three evaluations and the RL episodes; its 40 containers
    # (~20 s) start while the model loads and the engine starts
    opener = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sandboxes")
    pool_opening = opener.submit(open_sandboxes, config.sandbox)
    opener.shutdown(wait=False)
    phase("sandbox", t0)
    engine = eval_engine = None
    try:
        # 2. model
        t0 = time.perf_counter()
        seed_all(config.trainer.seed)
        model, tokenizer = load_policy(config.model.name_or_path)
        autocast = run_precision(config) == "bf16-autocast"
        engine_name, engine = start_engine(config, model, tokenizer, autocast=autocast)
        print(f"[engine] {engine_name}")
        eval_name, eval_engine = None, engine
        if config.data.eval_fp32:
            eval_name, eval_engine = fp32_eval_engine(config, model, tokenizer, engine)
            if eval_name:
                print(f"[engine] the table's evaluations: {eval_name}")
        phase("model", t0)
        t0 = time.perf_counter()
        pool = pool_opening.result()
        phase("sandboxes", t0)  # what was left to wait for
        result = _run(config, run_dir, model, tokenizer, engine, eval_engine, phase, pool)
    finally:
        for e in {id(engine): engine, id(eval_engine): eval_engine}.values():
            close = getattr(e, "close", None)  # None before the engine started
            if close is not None:
                close()
        _close_when_open(pool_opening)
    result["times_s"] = times
    result["engine"] = engine_name
    result["eval_engine"] = eval_name
    result["total_s"] = time.perf_counter() - start
    save_result(result, run_dir)
    print(format_table(result))
    return result


def _close_when_open(opening: concurrent.futures.Future[Any]) -> None:
    """Close the pool ``opening`` opens, once open; a pool that failed to open raised where it was used."""
    try:
        pool = opening.result()
    except Exception:
        return
    pool.close()


def run_precision(config: RunConfig) -> str:
    """What a learner of ``config`` computes in on this machine (``resolve_precision``), for what starts
    before it (engines, the evaluation's entropy)."""
    import torch

    from stare_agent.config import resolve_precision

    return resolve_precision(config.deepspeed.precision, "cuda" if torch.cuda.is_available() else "cpu")


def fp32_eval_engine(config: RunConfig, model: Any, tokenizer: Any, engine: Any) -> tuple[str | None, Any]:
    """The engine of the table's evaluations under ``data.eval_fp32``, as ``(description, engine)``.

    Greedy decoding takes an argmax, which bf16 rounding flips in a few episodes (one SFT model of the
    quickstart: 0.800 in fp32, 0.750 in bf16; ``benchmarks/eval_engines.py``), so the table decodes in fp32
    while the rollouts keep bf16's speed: beside a transformers engine under autocast, a transformers
    engine on the same ``model`` without it; beside a vLLM worker in bf16, a second worker in fp32
    (``_run`` gives it the policy's weights before each evaluation). ``(None, engine)`` when
    ``engine`` already decodes in fp32, or is another kind (SGLang).
    """
    from stare_agent.engines import TransformersEngine, VLLMEngine, start_engine

    if isinstance(engine, TransformersEngine) and engine.autocast_dtype is not None:
        return start_engine(config, model, tokenizer, name="transformers")
    if isinstance(engine, VLLMEngine) and engine.info["dtype"] != "float32":
        fp32 = replace(config.env, vllm=replace(config.env.vllm, dtype="float32"))
        return start_engine(replace(config, env=fp32), model, tokenizer, name="vllm")
    return None, engine


def quickstart_problems(config: RunConfig) -> list[Any]:
    """The held-out problems of the table: ``data.eval``, else those the env was registered with (a
    custom env's own family), else ``mixed`` (the code interpreter's)."""
    from stare_agent.resources import eval_source
    from stare_envs.problems import eval_problems

    data = config.data
    source = eval_source(config) or "mixed"
    return eval_problems(source, seed=config.trainer.seed, difficulty=data.difficulty, limit=data.eval_limit)


def _run(
    config: RunConfig,
    run_dir: Path,
    model: Any,
    tokenizer: Any,
    engine: Any,
    eval_engine: Any,
    phase: Any,
    pool: Any,
) -> dict[str, Any]:
    """Steps 3 to 6 with one rollout engine (and ``eval_engine`` for the evaluations) and ``pool``; the
    table's numbers."""
    import torch

    from stare_agent.evaluation import evaluate_config
    from stare_agent.metrics import policy_entropy, read_metrics
    from stare_agent.provenance import model_settings
    from stare_agent.recipes.plots import plot_dashboard
    from stare_agent.train.checkpoints import latest_checkpoint
    from stare_agent.train.sft import sft
    from stare_agent.train.trainer import Trainer

    data = config.data
    autocast = torch.bfloat16 if run_precision(config) == "bf16-autocast" else None
    problems = quickstart_problems(config)

    def run_eval(tag: str, model_path: str) -> dict[str, Any]:
        """Evaluate the policy in memory, whose weights are those of ``model_path`` (its hash goes
        into the summary's settings); its metrics and ``solved``, each problem's score."""
        t = time.perf_counter()
        if eval_engine is not engine and getattr(eval_engine, "model", None) is not model:
            eval_engine.update_weights(model.named_parameters())  # a worker of its own
        report = evaluate_config(
            config,
            engine=eval_engine,
            tokenizer=tokenizer,
            pool=pool,
            batch_size=max(config.sandbox.pool_size, 1),
            problems=problems,
            out_dir=run_dir / f"eval_{tag}",
            keep_trajectories=True,
            settings={"model": model_settings(model_path)},
        )
        metrics: dict[str, Any] = dict(report.metrics)
        metrics["solved"] = [sum(p.correct) / max(len(p.correct), 1) for p in report.problems]
        device = next(model.parameters()).device.type
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast is not None):
            metrics["entropy"] = policy_entropy(model, report.trajectories, tokenizer.pad_token_id or 0)
        phase(f"eval {tag}", t)
        return metrics

    # 3. baseline
    before = run_eval("before", config.model.name_or_path)

    # 4. cold-start SFT (trains `model` in place and exports it), and its own evaluation: the table
    # tells what SFT did apart from what RL did
    t0 = time.perf_counter()
    sft_summary = sft(config, model=model, tokenizer=tokenizer)
    own_copy = getattr(engine, "model", None) is not model  # vLLM: give it the SFT weights
    if own_copy:
        engine.update_weights(model.named_parameters())
    phase("sft", t0)
    after_sft = run_eval("sft", sft_summary["output_dir"])

    # 5. STARE-O1 RL, starting from the SFT model; the trainer syncs an engine with its own copy after
    # every update (the transformers engine: the trainer's own, on the module it trains)
    t0 = time.perf_counter()
    rl_config = replace(config, model=replace(config.model, name_or_path=sft_summary["output_dir"]))
    trained = Trainer(
        rl_config, model=model, tokenizer=tokenizer, engine=engine if own_copy else None, pool=pool
    ).fit()
    if trained["stopped_by"]:  # Ctrl-C / SIGTERM: the checkpoint is saved (the trainer said where); no eval
        if trained["stopped_by"] == "SIGINT":
            raise KeyboardInterrupt
        raise SystemExit(128 + int(signal.Signals[trained["stopped_by"]]))
    phase("rl", t0)
    steps = read_metrics(run_dir)
    gate_activity, skipped_steps = gate_fraction(steps)

    # 6. after
    last = latest_checkpoint(run_dir)  # the trainer saves the last step's policy
    after = run_eval("after", str(last / "hf") if last else f"{run_dir} (RL policy, no checkpoint)")
    dashboard = plot_dashboard(run_dir)
    checkpoint = latest_checkpoint(run_dir)
    result = {
        "backend": config.sandbox.backend,
        "problems": len(problems),
        "samples": data.eval_samples,
        "before": before,
        "after_sft": after_sft,
        "after": after,
        "gate_activity": gate_activity,
        "skipped_steps": skipped_steps,
        # The gate's quantity: entropy of the policy on its own sampled RL rollouts, per step.
        "rl_entropy": [r["entropy"] for r in steps if "entropy" in r],
        "H_tgt": config.algorithm.H_tgt,
        "rl_steps": len(steps),
        "sft": sft_summary,
        "run_dir": str(run_dir),
        "dashboard": str(dashboard),
        "checkpoint_hf": str(checkpoint / "hf") if checkpoint else None,
    }
    return result


def save_result(result: dict[str, Any], run_dir: Path) -> Path:
    """Write ``run_dir/quickstart.json``: strict JSON, a number that is not one (NaN) written as null."""
    path = run_dir / "quickstart.json"
    path.write_text(json.dumps(json_ready(result), indent=2, default=str, allow_nan=False))
    return path


def format_table(result: dict[str, Any]) -> str:
    """The table of the three evaluations (before, after SFT, after RL), the changes with their paired
    intervals, and the paths, as plain text."""
    k = result["samples"]
    columns = (result["before"], result.get("after_sft") or {}, result["after"])

    def row(name: str, key: str, spec: str) -> tuple[str, ...]:
        return (name, *(_number(c.get(key), spec) for c in columns))

    rows = [
        row(f"tool-use accuracy (avg@{k})", f"avg@{k}", ".3f"),
        row(f"pass@{k}", f"pass@{k}", ".3f"),
        row("tool calls per episode", "tool_calls_per_episode", ".2f"),
        row("entropy, greedy eval rollouts (nats/token)", "entropy", ".3f"),
        ("STARE gate on (fraction of trained RL steps)", "-", "-", _number(result["gate_activity"], ".2f")),
        (
            "RL steps that trained nothing (skipped)",
            "-",
            "-",
            f"{result.get('skipped_steps', 0)} of {result.get('rl_steps')}",
        ),
    ]
    width = max(len(r[0]) for r in rows)
    lines = [
        f"\n{result['problems']} held-out procedural problems x {k} samples, sandbox: {result['backend']}, "
        f"engine: {result.get('engine', 'transformers')}"
        + (f", evaluated by {result['eval_engine']}" if result.get("eval_engine") else ""),
        f"{'':<{width}}  {'before':>8}  {'SFT':>8}  {'SFT+RL':>8}",
        *(f"{name:<{width}}  {x:>8}  {y:>8}  {z:>8}" for name, x, y, z in rows),
        _rl_entropy_line(result),
        *_change_lines(result),
        "",
        f"total time: {result['total_s'] / 60:.1f} min  ("
        + ", ".join(f"{name} {secs:.0f} s" for name, secs in result["times_s"].items())
        + ")",
        f"run directory: {result['run_dir']}",
        f"dashboard: {result['dashboard']}",
        f"HF checkpoint: {result['checkpoint_hf']}",
    ]
    return "\n".join(lines)


def _change_lines(result: dict[str, Any]) -> list[str]:
    """RL's own change in accuracy (SFT -> SFT+RL) and the whole gain (before -> SFT+RL), each with its
    95 % interval paired over the same problems (``intervals.paired_difference_interval``)."""
    from stare_agent.intervals import paired_difference_interval

    lines = []
    # where RL's change is not measurable, the line says where RL has room to show it learns
    room = "; RL learns visibly with room to: stare-agent quickstart --config configs/rl_demo.yaml"
    for name, first, second, pointer in (
        ("RL's change in accuracy (SFT -> SFT+RL)", result.get("after_sft"), result["after"], room),
        ("whole gain in accuracy (before -> SFT+RL)", result["before"], result["after"], ""),
    ):
        a, b = (first or {}).get("solved"), second.get("solved")
        if not a or not b or len(a) != len(b):
            continue
        lo, hi = paired_difference_interval(a, b)
        gained = sum(1 for x, y in zip(a, b, strict=True) if y > x)
        lost = sum(1 for x, y in zip(a, b, strict=True) if y < x)
        change = (sum(b) - sum(a)) / len(a)
        verdict = f" - not measurable here: the interval holds 0{pointer}" if lo <= 0 <= hi else ""
        lines.append(
            f"{name}: {change:+.3f}, 95 % interval [{lo:+.3f}, {hi:+.3f}] paired over the {len(a)} problems "
            f"({gained} better, {lost} worse){verdict}"
        )
    return lines


def _number(value: float | None, spec: str) -> str:
    """``value`` formatted, or "-" where there is none (null in quickstart.json, or NaN)."""
    return "-" if value is None or value != value else format(value, spec)


def _rl_entropy_line(result: dict[str, Any]) -> str:
    """The entropy the STARE gate controls: on the RL steps' sampled rollouts, not on greedy eval."""
    # a skipped step logs no entropy: NaN in memory, null in quickstart.json
    H = [h for h in result.get("rl_entropy", []) if h is not None and h == h]
    if not H:
        return "entropy, sampled RL rollouts (gate's H-bar): no RL step trained"
    return (
        f"entropy, sampled RL rollouts (gate's H-bar): {H[0]:.3f} at the first RL step -> {H[-1]:.3f} "
        f"at the last (H_tgt = {result['H_tgt']:g})"
    )


__all__ = [
    "format_table",
    "fp32_eval_engine",
    "quickstart",
    "run_precision",
]
