"""Synchronous vs asynchronous rollouts (``trainer.max_staleness``), side by side in one run.

Both modes are a real ``Trainer`` (the tiny random model, real DeepSpeed on CPU, local sandboxes) on
addition problems whose episodes are scripted (turn 0 runs code, turn 1 boxes what it printed; every
group of 2 has rewards {0, 1}, so every step trains), with a rollout engine that replays the script
under a latency model of a GPU engine:

    one generate call  =  call_ms  +  decode_ms x (longest continuation in the batch, in tokens)

``call_ms`` (scheduling, prefill; default 50 ms) and ``decode_ms`` (one batched decoding step;
default 8 ms) are assumptions, not measurements: they are the order of magnitude of a 7B model's
batched decode step on one H100 under vLLM (about 10-20 ms), scaled down so that one rollout of a
step takes about as long as one update of the tiny model on two CPU cores, the case where
overlapping them matters most. The tool calls run for real in local sandboxes.

Per mode the table shows medians over the steps after the first (which pays one-off setup) of:
``step`` (time/step_s), ``rollout`` (playing the step's episodes, time/rollout_s; under
max_staleness=1 it overlaps the previous update), ``train`` (log-probs, update and weight sync),
the means of ``learner idle`` (time/learner_idle_frac: waiting for rollouts) and ``engine idle``
(time/engine_idle_frac: no generate call in flight, tool calls and waiting for weights included),
and the mean staleness of the trained tokens (async/staleness_mean, in updates). The last line
compares the asynchronous step with the bounds the synchronous run gives: rollout + train (no
overlap) and max(rollout, train) (perfect overlap).

``--quickstart``: the same two modes on the real engine instead: ``configs/quickstart.yaml`` (the
embedded SmolLM2-135M-Instruct, the vLLM worker of ``.venv-vllm``, the sandbox its ``auto`` backend
picks), from the embedded model (no SFT), with ``data.dynamic_sampling=false``: the model before SFT
solves almost none of its draws, so dynamic sampling would skip most steps; without it every step
trains its 4 groups x 4 samples (zero advantages included: the same forward, backward and weight
sync), and its draw of 8 prompts x 4 samples is played in full either way, in one wave of 32
sandboxes (``sandbox.pool_size=32``; the config's 40 is its evaluation's size). No evaluations or
checkpoints. Here the engine, the sandboxes and the learner share the machine's cores: the overlap
buys only what the hardware lets run at once.

Run: ``.venv/bin/python benchmarks/async_rollouts.py [--steps 8] [--call-ms 50] [--decode-ms 8]``;
``.venv/bin/python benchmarks/async_rollouts.py --quickstart [--steps 6]``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.learner_speed import load_note, machine  # noqa: E402

PROBLEMS = [
    {"id": f"add-{a}-{b}", "problem": f"What is {a} + {b}?", "answer": str(a + b)}
    for a, b in [(2, 3), (10, 7), (40, 2), (6, 6), (9, 1), (8, 5)]
]


def scripted_policy() -> Any:
    """Turn 0 runs code (right on even episodes, off by one on odd ones); turn 1 boxes the output."""
    episodes = itertools.count()

    def turn(prompt_text: str, turn_index: int) -> str:
        if turn_index == 0:
            a, b = map(int, re.findall(r"What is (\d+) \+ (\d+)\?", prompt_text)[-1])
            extra = " + 1" if next(episodes) % 2 else ""
            return f"Let me compute.\n<code>\n```python\nprint({a} + {b}{extra})\n```\n</code>"
        printed = re.findall(r"<interpreter>\s*(\d+)", prompt_text)[-1]
        return f"The interpreter says so.\n<answer>\\boxed{{{printed}}}</answer>"

    return turn


def latency_engine(tokenizer: Any, call_ms: float, decode_ms: float) -> Any:
    """A scripted engine whose generate takes as long as the latency model says (sleeping: the GIL
    is free for the learner meanwhile, as it is while a GPU engine decodes)."""
    from stare_agent.engines.scripted import ScriptedEngine

    class LatencyEngine(ScriptedEngine):
        def generate(self, prompts, params, stop):  # type: ignore[no-untyped-def]
            out = super().generate(prompts, params, stop)
            longest = max((len(g.token_ids) for g in out), default=0)
            time.sleep((call_ms + decode_ms * longest) / 1000)
            return out

    return LatencyEngine(tokenizer, scripted_policy())


def run_mode(max_staleness: int, steps: int, call_ms: float, decode_ms: float, work: Path) -> list[dict]:
    """One scripted run of ``steps`` steps; its metrics.jsonl rows."""
    from stare_agent.config import load_config
    from stare_agent.models import tiny_model
    from stare_agent.train.trainer import Trainer

    run_dir = work / f"staleness-{max_staleness}"
    config = load_config(
        None,
        [
            f"data.train={work / 'problems.jsonl'}",
            "data.prompts_per_step=2",
            "data.samples_per_prompt=2",
            "data.max_sampling_batches=2",
            "env.max_turns=3",
            "env.max_response_tokens=256",
            "sandbox.backend=local",
            "sandbox.pool_size=4",
            "optim.lr=1e-3",
            f"trainer.steps={steps}",
            "trainer.checkpoint_every=0",
            f"trainer.run_dir={run_dir}",
            "deepspeed.micro_batch_tokens=512",
            "algorithm.H_tgt=100.0",
            # the same loss in both modes: the scripted sampler's log-probs are stand-ins
            "algorithm.rollout_correction.mode=token_tis",
            f"trainer.max_staleness={max_staleness}",
            "logger.backends=[]",
        ],
    )
    model, tokenizer = tiny_model()
    engine = latency_engine(tokenizer, call_ms, decode_ms)
    Trainer(config, model=model, tokenizer=tokenizer, engine=engine).fit()
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]


QUICKSTART = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"


def run_quickstart(max_staleness: int, steps: int, work: Path) -> list[dict]:
    """One run of the quickstart config's RL (real model, vLLM, sandboxes); its metrics.jsonl rows."""
    from stare_agent.config import load_config
    from stare_agent.train.trainer import Trainer

    run_dir = work / f"quickstart-staleness-{max_staleness}"
    config = load_config(
        QUICKSTART,
        [
            "env.engine=vllm",
            "data.dynamic_sampling=false",  # the model before SFT: see the module docstring
            "sandbox.pool_size=32",  # the draw's 32 episodes in one wave, as with 40 (the eval's size)
            f"trainer.steps={steps}",
            "trainer.checkpoint_every=0",
            "trainer.eval_every=0",
            f"trainer.run_dir={run_dir}",
            f"trainer.max_staleness={max_staleness}",
            "logger.backends=[]",
        ],
    )
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    Trainer(config).fit()
    print(
        f"[max_staleness={max_staleness}] {time.perf_counter() - t0:.0f} s with setup, load average "
        f"{load0:.1f} -> {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]


def summarize(rows: list[dict]) -> dict[str, float]:
    rows = rows[1:] if len(rows) > 1 else rows
    rows = [r for r in rows if "time/step_s" in r]  # a step that trained nothing has no timings
    train = [r["time/logprob_s"] + r["time/update_s"] for r in rows]
    return {
        "step": statistics.median(r["time/step_s"] for r in rows),
        "rollout": statistics.median(r["time/rollout_s"] for r in rows),
        "train": statistics.median(train),
        "learner idle": statistics.mean(r["time/learner_idle_frac"] for r in rows),
        "engine idle": statistics.mean(r["time/engine_idle_frac"] for r in rows),
        "staleness": statistics.mean(r["async/staleness_mean"] for r in rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--call-ms", type=float, default=50.0)
    parser.add_argument("--decode-ms", type=float, default=8.0)
    parser.add_argument(
        "--quickstart", action="store_true", help="the quickstart config on the real vLLM engine (heavy)"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="async-rollouts-") as tmp:
        work = Path(tmp)
        (work / "problems.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS))
        if args.quickstart:
            results = {k: summarize(run_quickstart(k, args.steps, work)) for k in (0, 1)}
        else:
            results = {
                k: summarize(run_mode(k, args.steps, args.call_ms, args.decode_ms, work)) for k in (0, 1)
            }
    setting = (
        "configs/quickstart.yaml from the embedded model, vLLM, data.dynamic_sampling=false"
        if args.quickstart
        else f"call {args.call_ms:g} ms + {args.decode_ms:g} ms/token"
    )
    print(
        f"\n{args.steps} steps per mode (medians over steps 2..{args.steps}), {setting}; {machine()}; "
        f"{load_note()} at the end\n"
    )
    print("| max_staleness | step s | rollout s | train s | learner idle | engine idle | staleness |")
    print("|---|---|---|---|---|---|---|")
    for k, r in results.items():
        print(
            f"| {k} | {r['step']:.2f} | {r['rollout']:.2f} | {r['train']:.2f} | {r['learner idle']:.0%} | "
            f"{r['engine idle']:.0%} | {r['staleness']:.2f} |"
        )
    sync, stale = results[0], results[1]
    print(
        f"\nsync bounds: rollout + train = {sync['rollout'] + sync['train']:.2f} s, max(rollout, train) = "
        f"{max(sync['rollout'], sync['train']):.2f} s; async step {stale['step']:.2f} s "
        f"({sync['step'] / stale['step']:.2f}x the synchronous step)"
    )


if __name__ == "__main__":
    main()
