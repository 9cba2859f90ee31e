"""Synchronous vs asynchronous rollouts (``trainer.max_staleness``), and a weight sync that waits for
the turns in flight vs one that interrupts them (``trainer.interrupt_on_sync``), side by side in one run.

Both modes are a real ``Trainer`` (the tiny random model, real DeepSpeed on CPU, local sandboxes) on
addition problems whose episodes are scripted (turn 0 runs code, turn 1 boxes what it printed; every
group of 2 has rewards {0, 1}, so every step trains), with a rollout engine that replays the script
under a latency model of a GPU engine:

    one generate call  =  call_ms  +  decode_ms x (longest continuation in the batch, in tokens)

``call_ms`` (scheduling, prefill; default 50 ms) and ``decode_ms`` (one batched decoding step;
default 8 ms) are assumptions, not measurements: they are the order of magnitude of a 7B model's
batched decode step on one H100 under vLLM (about 10-20 ms), scaled down so that one rollout of a
step takes about as long as one update of the tiny model on two CPU cores, the case where
overlapping them matters most. The tool calls run for real in local sandboxes. The engine's
log-probs are its own synced copy of the tiny model's (``ScriptedEngine(model=...)``), so the
token-TIS weights of both modes are near 1, as with a real engine. Its ``interrupt()`` ends a call
early, as a real engine's does: the tokens "decoded" so far come back, and the rest of the turn is
a new call (``call_ms`` again, the prefill).

Modes: ``max_staleness=0`` (synchronous), then ``max_staleness=--staleness`` (default 2) with
``interrupt_on_sync=false`` (a sync waits for the generate call in flight) and ``true`` (it ends the
call at its next token and the turn resumes under the new weights). With ``k = 1`` a sync that waits
costs nothing overall: the learner needs the step the producer is still playing anyway; with
``k >= 2`` the producer may be playing a step the learner does not need yet, and a sync that waits
for its turn is pure learner idle time.

Per mode the table shows medians over the steps after the first (which pays one-off setup) of:
``step`` (time/step_s), ``rollout`` (playing the step's episodes, time/rollout_s; under
max_staleness=1 it overlaps the previous update), ``train`` (log-probs, update and weight sync),
``sync`` (time/sync_s: handing the weights over, waiting for the calls in flight included), the
medians of ``learner idle`` (time/learner_idle_frac: waiting for rollouts), ``sync wait``
(time/sync_s / time/step_s) and their sum ``idle in all`` (the learner waits for the engine either
way), the mean ``engine idle`` (time/engine_idle_frac: no generate call in flight, tool calls and
waiting for weights included), the mean staleness of the trained tokens (async/staleness_mean, in
updates; per token, so a turn resumed under new weights counts fresher) and the engine calls a
sync interrupted. The last lines compare the asynchronous steps with the bounds the synchronous run
gives (rollout + train: no overlap; max(rollout, train): perfect overlap), and the two syncs.

``--quickstart``: the same two modes on the real engine instead: ``configs/quickstart.yaml`` (the
embedded SmolLM2-135M-Instruct, the vLLM worker of ``.venv-vllm``, the sandbox its ``auto`` backend
picks), from the embedded model (no SFT), with ``data.dynamic_sampling=false``: the model before SFT
solves almost none of its draws, so dynamic sampling would skip most steps; without it every step
trains its 4 groups x 4 samples (zero advantages included: the same forward, backward and weight
sync), and its draw of 8 prompts x 4 samples is played in full either way, in one wave of 32
sandboxes (``sandbox.pool_size=32``; the config's 40 is its evaluation's size). No evaluations or
checkpoints. Here the engine, the sandboxes and the learner share the machine's cores: the overlap
buys only what the hardware lets run at once. ``--quickstart-interrupt``: that setting at
``--staleness`` (default 2) on the vLLM engine, a sync that waits against one that interrupts the
vLLM requests in flight (``trainer.interrupt_on_sync``).

Run: ``.venv/bin/python benchmarks/async_rollouts.py [--steps 8] [--call-ms 50] [--decode-ms 8]
[--staleness 2]``; ``.venv/bin/python benchmarks/async_rollouts.py --quickstart [--steps 6]``;
``.venv/bin/python benchmarks/async_rollouts.py --quickstart-interrupt [--steps 5]``.
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

from benchmarks.learner_speed import load_note  # noqa: E402
from stare_agent.provenance import machine  # noqa: E402

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
    is free for the learner meanwhile, as it is while a GPU engine decodes), with the log-probs of
    its own copy of the tiny model (synced at each update), interruptible."""
    from stare_agent.engines.scripted import ScriptedEngine
    from stare_agent.models import tiny_model

    return ScriptedEngine(
        tokenizer,
        scripted_policy(),
        model=tiny_model(tokenizer)[0],
        latency=(call_ms / 1000, decode_ms / 1000),
    )


def run_mode(
    max_staleness: int, steps: int, call_ms: float, decode_ms: float, work: Path, interrupt: bool = True
) -> list[dict]:
    """One scripted run of ``steps`` steps; its metrics.jsonl rows (the last with the engine calls a
    sync interrupted, ``interrupted_calls``)."""
    from stare_agent.config import load_config
    from stare_agent.models import tiny_model
    from stare_agent.train.trainer import Trainer

    run_dir = work / f"staleness-{max_staleness}-{'interrupt' if interrupt else 'wait'}"
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
            # the same loss in all modes (auto would be none synchronously)
            "algorithm.rollout_correction.mode=token_tis",
            f"trainer.max_staleness={max_staleness}",
            f"trainer.interrupt_on_sync={str(interrupt).lower()}",
            "logger.backends=[]",
        ],
    )
    model, tokenizer = tiny_model()
    engine = latency_engine(tokenizer, call_ms, decode_ms)
    trainer = Trainer(config, model=model, tokenizer=tokenizer, engine=engine)
    trainer.fit()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    rows[-1]["interrupted_calls"] = trainer.rollout_engine.versioned.interrupted_calls
    return rows


QUICKSTART = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"


def run_quickstart(max_staleness: int, steps: int, work: Path, interrupt: bool = False) -> list[dict]:
    """One run of the quickstart config's RL (real model, vLLM, sandboxes); its metrics.jsonl rows
    (the last with ``interrupted_calls``)."""
    from stare_agent.config import load_config
    from stare_agent.train.trainer import Trainer

    run_dir = work / f"quickstart-staleness-{max_staleness}-{'interrupt' if interrupt else 'wait'}"
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
            f"trainer.interrupt_on_sync={str(interrupt).lower()}",
            "logger.backends=[]",
        ],
    )
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    trainer = Trainer(config)
    trainer.fit()
    interrupted = trainer.rollout_engine.versioned.interrupted_calls
    print(
        f"[max_staleness={max_staleness}] {time.perf_counter() - t0:.0f} s with setup, load average "
        f"{load0:.1f} -> {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    rows[-1]["interrupted_calls"] = interrupted
    return rows


def summarize(rows: list[dict]) -> dict[str, float]:
    interrupted = rows[-1].get("interrupted_calls", 0)
    rows = rows[1:] if len(rows) > 1 else rows
    rows = [r for r in rows if "time/step_s" in r]  # a step that trained nothing has no timings
    train = [r["time/logprob_s"] + r["time/update_s"] for r in rows]
    sync_wait = [r.get("time/sync_s", 0.0) / r["time/step_s"] for r in rows]
    return {
        "step": statistics.median(r["time/step_s"] for r in rows),
        "rollout": statistics.median(r["time/rollout_s"] for r in rows),
        "train": statistics.median(train),
        "sync": statistics.median(r.get("time/sync_s", 0.0) for r in rows),
        "learner idle": statistics.median(r["time/learner_idle_frac"] for r in rows),
        "sync wait": statistics.median(sync_wait),
        "idle in all": statistics.median(
            r["time/learner_idle_frac"] + w for r, w in zip(rows, sync_wait, strict=True)
        ),
        "engine idle": statistics.mean(r["time/engine_idle_frac"] for r in rows),
        "staleness": statistics.mean(r["async/staleness_mean"] for r in rows),
        "interrupted": float(interrupted),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--call-ms", type=float, default=50.0)
    parser.add_argument("--decode-ms", type=float, default=8.0)
    parser.add_argument("--staleness", type=int, default=2, help="max_staleness of the asynchronous modes")
    parser.add_argument(
        "--quickstart", action="store_true", help="the quickstart config on the real vLLM engine (heavy)"
    )
    parser.add_argument(
        "--quickstart-interrupt",
        action="store_true",
        help="the quickstart config on vLLM at --staleness: a sync that waits vs one that interrupts (heavy)",
    )
    args = parser.parse_args()
    k = args.staleness
    with tempfile.TemporaryDirectory(prefix="async-rollouts-") as tmp:
        work = Path(tmp)
        (work / "problems.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS))
        if args.quickstart:
            results = {f"{s}": summarize(run_quickstart(s, args.steps, work)) for s in (0, 1)}
        elif args.quickstart_interrupt:
            results = {
                f"{k}, sync waits": summarize(run_quickstart(k, args.steps, work, interrupt=False)),
                f"{k}, sync interrupts": summarize(run_quickstart(k, args.steps, work, interrupt=True)),
            }
        else:
            modes = {"0": (0, True), f"{k}, sync waits": (k, False), f"{k}, sync interrupts": (k, True)}
            results = {
                name: summarize(run_mode(s, args.steps, args.call_ms, args.decode_ms, work, interrupt))
                for name, (s, interrupt) in modes.items()
            }
    setting = (
        "configs/quickstart.yaml from the embedded model, vLLM, data.dynamic_sampling=false"
        if args.quickstart or args.quickstart_interrupt
        else f"call {args.call_ms:g} ms + {args.decode_ms:g} ms/token"
    )
    print(
        f"\n{args.steps} steps per mode (medians over steps 2..{args.steps}), {setting}; {machine()}; "
        f"{load_note()} at the end\n"
    )
    print(
        "| max_staleness | step s | rollout s | train s | sync s | learner idle | sync wait | idle in all | "
        "engine idle | staleness | interrupted calls |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(
            f"| {name} | {r['step']:.2f} | {r['rollout']:.2f} | {r['train']:.2f} | {r['sync']:.2f} | "
            f"{r['learner idle']:.0%} | {r['sync wait']:.0%} | {r['idle in all']:.0%} | {r['engine idle']:.0%} | "
            f"{r['staleness']:.2f} | {r['interrupted']:.0f} |"
        )
    if "0" in results:
        sync = results["0"]
        print(
            f"\nsync bounds: rollout + train = {sync['rollout'] + sync['train']:.2f} s, max(rollout, train) = "
            f"{max(sync['rollout'], sync['train']):.2f} s"
        )
        for name, r in results.items():
            if name != "0":
                print(
                    f"{name}: step {r['step']:.2f} s ({sync['step'] / r['step']:.2f}x the synchronous step)"
                )
    if not args.quickstart:
        wait, cut = results[f"{k}, sync waits"], results[f"{k}, sync interrupts"]
        ratio = wait["idle in all"] / cut["idle in all"] if cut["idle in all"] > 0 else float("inf")
        print(
            f"interrupting: learner idle in all {wait['idle in all']:.0%} -> {cut['idle in all']:.0%} "
            f"({ratio:.1f}x less), step {wait['step']:.2f} s -> {cut['step']:.2f} s "
            f"({wait['step'] / cut['step']:.2f}x)"
        )


if __name__ == "__main__":
    main()
