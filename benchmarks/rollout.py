"""Rollout speed, in sections.

Run: ``python benchmarks/rollout.py [--section all|throughput|...]``.

Sections (each a function registered in ``SECTIONS``):

- ``throughput`` (:func:`bench_engine_throughput`): sampled tokens/s of the rollout engines on the
  embedded model (SmolLM2-135M-Instruct, float32) at batch 1, 16 and 64, with 64 new tokens per
  sequence (EOS and stop strings off, so every sequence generates exactly that many), AIME 2024
  problems rendered with the chat template as prompts; median of ``--repeats`` runs. The baseline,
  in the same run, is ``model.generate`` of transformers with the same sampling settings. Engines:
  ``transformers`` (fp32), ``transformers-bf16`` (bf16 autocast), ``vllm`` and ``vllm-fp32`` (the
  vLLM engine's worker in bf16 and fp32, with a Python that has vLLM: ``scripts/setup_vllm.sh``), whose
  weight sync (``update_weights`` of the whole model, median) and log-prob gap to the transformers
  model in fp32 (batch 16) are reported too. With
  ``--engines ...,sglang`` on a CUDA machine (``benchmarks/gpu_check.sh``) the SGLang engine is timed
  too. Also reported: the embedded model's first conversion (fresh cache, new process) and its
  cached load (new process).
- ``draw`` (:func:`bench_draw`): one RL draw of ``configs/quickstart.yaml`` (its prompts per step x
  samples per prompt, procedural problems, ReTool on the config's sandboxes, temperature 1, seeded as
  the trainer seeds) from the quickstart's SFT model (``--model``), played by the old path (the
  transformers engine, lockstep turns), by the vLLM engine in lockstep turns (one ``generate`` per
  turn of all live episodes) and by the vLLM engine with continuous batching (each episode's turn
  submitted as soon as its tool call returns). Rounds of one draw per path, in rotating order, the
  same draw seed for every path within a round; the first round warms up and is left out. Reported:
  median draw seconds, sampled tokens per second, ratios, and whether the paths sampled the same
  tokens (per episode, against vLLM lockstep; seeded per-episode streams make them equal when the
  engine's numbers do not depend on batch composition).
- ``overhead`` (:func:`bench_runner_overhead`): wall time of the rollout runner outside the engine and
  the sandboxes, as a fraction of rollout time, for ReTool episodes on local sandboxes driven by the
  scripted engine (no-model baseline) and by a tiny random Llama through the transformers engine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data"
BASELINE = "model.generate (baseline)"
FALLBACK_PROBLEMS = [
    "Find the number of positive divisors of 2024.",
    "What is the remainder when 7^100 is divided by 13?",
    "How many ordered pairs of integers (x, y) satisfy x^2 + y^2 = 50?",
    "Compute the sum of all primes below 50.",
]


# --------------------------------------------------------------------------- engine throughput


def _prompts(tokenizer, n: int) -> list[list[int]]:
    path = DATA / "aime2024.jsonl"
    problems = [json.loads(line)["problem"] for line in path.open()] if path.is_file() else FALLBACK_PROBLEMS
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": problems[i % len(problems)]}],
            add_generation_prompt=True,
            return_dict=False,
        )
        for i in range(n)
    ]


def _engine_call(engine, params) -> Callable[[list[list[int]], int], None]:
    """One ``engine.generate`` over the batch; checks every sequence ran to ``max_new_tokens``."""

    def call(prompts: list[list[int]], seed: int) -> None:
        outs = engine.generate(prompts, replace(params, seed=seed), [])
        if any(len(o.token_ids) != params.max_new_tokens for o in outs):
            raise RuntimeError("a sequence ended before max_new_tokens: EOS must be off for this benchmark")

    return call


def _hf_generate_call(model, tokenizer, params) -> Callable[[list[list[int]], int], None]:
    """The baseline: ``model.generate`` with left padding and the same sampling settings."""
    import torch

    def call(prompts: list[list[int]], seed: int) -> None:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        torch.manual_seed(seed)
        with torch.no_grad():
            out = model.generate(
                input_ids=ids.to(model.device),
                attention_mask=mask.to(model.device),
                do_sample=True,
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=0,
                max_new_tokens=params.max_new_tokens,
                min_new_tokens=params.max_new_tokens,
                pad_token_id=tokenizer.pad_token_id,
            )
        if out.shape[1] != width + params.max_new_tokens:
            raise RuntimeError("model.generate stopped early")

    return call


def _median_seconds(
    calls: dict[str, Callable], prompts: list[list[int]], repeats: int, sync
) -> dict[str, float]:
    """Median wall time per call, repeats interleaved across calls so that load from other processes
    on the machine hits every engine alike."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for repeat in range(repeats):
        for name, call in calls.items():
            sync()
            start = time.perf_counter()
            call(prompts, seed=repeat)
            sync()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _load_times() -> tuple[float, float]:
    """(first conversion in a fresh cache, cached load), each in a new process, without imports."""
    script = (
        "import time; from stare_agent import models; t = time.perf_counter(); {call}; "
        "print(time.perf_counter() - t)"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with tempfile.TemporaryDirectory() as cache:
        fresh = {**env, "STARE_CACHE_DIR": cache}
        convert = script.format(call="models.embedded_model_path()")
        first = subprocess.run(
            [sys.executable, "-c", convert], env=fresh, capture_output=True, text=True, check=True
        )
    load = script.format(call="models.load_policy()")
    cached = subprocess.run([sys.executable, "-c", load], env=env, capture_output=True, text=True, check=True)
    return float(first.stdout.split()[-1]), float(cached.stdout.split()[-1])


def bench_engine_throughput(args: argparse.Namespace) -> None:
    """Tokens/s of the rollout engines vs ``model.generate`` on the embedded model."""
    import torch

    from stare_agent.engines import TransformersEngine
    from stare_agent.models import embedded_model_path, load_policy
    from stare_agent.provenance import machine
    from stare_envs.engine import SamplingParams

    torch.set_num_threads(args.threads or torch.get_num_threads())
    model, tokenizer = load_policy(device=args.device)
    params = SamplingParams(temperature=1.0, top_p=1.0, top_k=None, max_new_tokens=args.new_tokens)
    calls: dict[str, Callable[[list[list[int]], int], None]] = {}
    if "transformers" in args.engines:
        engine = TransformersEngine(model, tokenizer, eos_token_ids=[], max_batch_size=max(args.batch_sizes))
        calls["TransformersEngine"] = _engine_call(engine, params)
    if "hf-generate" in args.engines:
        calls[BASELINE] = _hf_generate_call(model, tokenizer, params)
    if "transformers-bf16" in args.engines:
        bf16 = TransformersEngine(
            model,
            tokenizer,
            eos_token_ids=[],
            max_batch_size=max(args.batch_sizes),
            autocast_dtype=torch.bfloat16,
        )
        calls["TransformersEngine bf16"] = _engine_call(bf16, params)
    vllm_engines = {}
    # vllm-pinned: vLLM's own thread settings (OpenMP threads pinned to cores, libgomp's default waits)
    # instead of the engine's unpinned, passive ones; vllm-pinned-passive and vllm-spinning change one
    # of the two.
    for name, dtype, env, tag in (
        ("vllm", "bfloat16", {}, ""),
        ("vllm-fp32", "float32", {}, ""),
        ("vllm-pinned", "bfloat16", {"VLLM_CPU_OMP_THREADS_BIND": "auto", "OMP_WAIT_POLICY": ""}, " pinned"),
        ("vllm-pinned-passive", "bfloat16", {"VLLM_CPU_OMP_THREADS_BIND": "auto"}, " pinned passive"),
        ("vllm-spinning", "bfloat16", {"OMP_WAIT_POLICY": ""}, " unpinned spinning"),
        ("vllm-short-spin", "bfloat16", {"OMP_WAIT_POLICY": "", "GOMP_SPINCOUNT": "20000"}, " spin 20k"),
    ):
        if name in args.engines:
            from stare_agent.engines import VLLMEngine

            label = f"VLLMEngine {dtype}{tag}"
            started = time.perf_counter()
            vllm_engines[label] = engine = VLLMEngine(
                embedded_model_path(),
                dtype=dtype,
                max_model_len=2048,
                kv_cache_gib=1,
                sampling_overrides={"ignore_eos": True},
                env=env,
            )
            print(f"{label}: worker ready in {time.perf_counter() - started:.1f} s")
            calls[label] = _engine_call(engine, params)
    if "sglang" in args.engines:
        from stare_agent.engines import SGLangEngine

        sglang_engine = SGLangEngine(
            str(embedded_model_path()),
            sampling_overrides={"ignore_eos": True},
            dtype="float32",
            mem_fraction_static=0.3,
        )
        calls["SGLangEngine"] = _engine_call(sglang_engine, params)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)

    print(
        f"\nEngine throughput: embedded SmolLM2-135M-Instruct on {args.device} ({machine()}, "
        f"load average {os.getloadavg()[0]:.1f}), "
        f"{args.new_tokens} new tokens per sequence, AIME 2024 prompts, median of {args.repeats} "
        f"(torch threads: {torch.get_num_threads()})\n"
    )
    print(f"| {'engine':<30} | " + " | ".join(f"batch {b:>3} tok/s" for b in args.batch_sizes) + " |")
    print("|" + "-" * 32 + "|" + "|".join("-" * 17 for _ in args.batch_sizes) + "|")
    rates: dict[str, list[float]] = {name: [] for name in calls}
    for call in calls.values():  # untimed warm-up: lazy initialisation, allocator, kernels
        call(_prompts(tokenizer, 1), seed=10_000)
    # --busy N: N processes spin on the cores while every engine is timed (a learner, sandboxes, a
    # laptop's other work), one extra core's worth of contention each.
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    try:
        for batch in args.batch_sizes:
            seconds = _median_seconds(calls, _prompts(tokenizer, batch), args.repeats, sync)
            for name, secs in seconds.items():
                rates[name].append(batch * args.new_tokens / secs)
    finally:
        for process in busy:
            process.kill()
            process.wait()
    if args.busy:
        print(f"(timed while {args.busy} busy-loop process(es) ran)")
    for name, row in rates.items():
        print(f"| {name:<30} | " + " | ".join(f"{r:>15.1f}" for r in row) + " |")
    for name, row in rates.items():
        if name != BASELINE and BASELINE in rates:
            ratios = [r / base for r, base in zip(row, rates[BASELINE], strict=True)]
            label = f"{name} / baseline"
            print(f"| {label:<30} | " + " | ".join(f"{r:>14.2f}x" for r in ratios) + " |")
    if "sglang" in args.engines:
        sglang_engine.close()
    for name, engine in vllm_engines.items():
        print(_vllm_sync_and_gap(name, engine, model, tokenizer, params, args.repeats))
        engine.close()
    if args.load_times:
        first, cached = _load_times()
        print(
            f"\nEmbedded model: first conversion {first:.1f} s (fresh cache, new process); "
            f"cached load_policy() {cached:.2f} s (new process, imports excluded)"
        )


def _vllm_sync_and_gap(name, engine, model, tokenizer, params, repeats: int) -> str:
    """A vLLM engine's whole-model weight sync time (median) and its log-prob gap to the transformers
    model (float32) on 16 of its own samples."""
    import torch

    syncs, parts = [], []
    for _ in range(repeats):
        engine.update_weights(model.named_parameters())
        syncs.append(engine.last_sync_s)
        parts.append(engine.last_sync_parts)
    prompts = _prompts(tokenizer, 16)
    gaps = []
    for prompt, out in zip(prompts, engine.generate(prompts, replace(params, seed=0), []), strict=True):
        ids = torch.tensor([prompt + out.token_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 : -1].float() / params.temperature
        expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0]
        gaps.append((torch.tensor(out.logprobs) - expected).abs())
    gap = torch.cat(gaps)
    return (
        f"{name}: weight sync {statistics.median(syncs):.2f} s (median of {repeats}, 135M parameters; "
        f"file {statistics.median(p['write_s'] for p in parts):.2f} s, "
        f"worker reload {statistics.median(p['reload_s'] for p in parts):.2f} s); "
        f"log-prob gap to transformers fp32: mean {gap.mean():.1e}, max {gap.max():.1e} nats/token"
    )


# --------------------------------------------------------------------------- runner overhead

_OVERHEAD_SCRIPTS = [
    ["6 × 7 = 42, so the answer is <answer>\\boxed{42}</answer>"],
    [
        "Let me compute it.\n<code>\n```python\nx = 12\nprint(x * x)\n```\n</code>",
        "Check with a loop: <code>\n```python\nprint(sum(12 for _ in range(12)))\n```\n</code>",
        "Both agree: <answer>\\boxed{144}</answer>",
    ],
    [
        "<code>\n```python\nimport sympy\nprint(sympy.factorint(2024))\n```\n</code>",
        "So the answer is \\boxed{2024}.",
    ],
]


def _overhead_problems():
    from stare_envs.problems import Problem

    return [
        Problem(id="mul", problem="What is 6 * 7?", answer="42"),
        Problem(id="sq", problem="What is 12 squared?", answer="144"),
        Problem(id="fac", problem="Factor 2024.", answer="2024"),
    ]


def _runner_rows(name: str, make_engine, tokenizer, pool, args: argparse.Namespace, budget: int) -> list[str]:
    """Median timings of ``args.repeats`` runs of one batch of ``args.episodes`` episodes."""
    from stare_envs.code_interpreter import CodeInterpreterEnv
    from stare_envs.engine import SamplingParams
    from stare_envs.rollout import RolloutRunner

    n = args.episodes
    envs = [
        CodeInterpreterEnv(
            _overhead_problems(), format="retool", pool=pool, tokenizer=tokenizer, timeout_s=10
        )
        for _ in range(n)
    ]
    options = [{"problem_index": i % 3} for i in range(n)]
    runs = []
    try:
        for repeat in range(args.repeats + 1):  # the first run warms up kernels and caches
            runner = RolloutRunner(
                tokenizer, make_engine(), max_response_tokens=budget, sampling=SamplingParams(seed=repeat)
            )
            runner.run(envs, options=options)
            if repeat:
                runs.append(runner.last_stats)
    finally:
        for env in envs:
            env.close()
    med = {
        key: statistics.median(getattr(s, key) for s in runs)
        for key in ("total_s", "engine_s", "env_s", "overhead_s", "overhead_fraction", "turns")
    }
    per_turn_ms = 1000 * statistics.median(s.overhead_s / s.turns for s in runs)
    return [
        f"| {name:<34} | {n:>8} | {med['turns']:>5.0f} | {med['total_s']:>8.3f} | {med['engine_s']:>8.3f} | "
        f"{med['env_s']:>8.3f} | {med['overhead_s']:>9.4f} | {100 * med['overhead_fraction']:>8.2f} % | "
        f"{per_turn_ms:>13.3f} |"
    ]


def bench_runner_overhead(args: argparse.Namespace) -> None:
    """Wall time the rollout runner spends outside the engine and the sandboxes, per batch.

    ReTool episodes on the real ``CodeInterpreterEnv`` with local-kernel sandboxes (one per episode),
    driven by (a) the scripted engine, a no-model baseline whose engine time is ~0, so the runner's
    share is an upper bound, and (b) a tiny random Llama (2 layers, hidden 64) through the
    transformers engine with the real SmolLM2 tokenizer (its turns rarely call a tool, so most
    episodes are one long turn). Target: runner overhead <= 5 % of rollout time.
    """
    from stare_agent.engines.scripted import ScriptedEngine
    from stare_agent.models import load_tokenizer
    from stare_sandbox.pool import SandboxPool

    tokenizer = load_tokenizer()
    scripts = [_OVERHEAD_SCRIPTS[i % 3] for i in range(args.episodes)]
    print(
        f"\nRunner overhead: {args.episodes} ReTool episodes per batch, CodeInterpreterEnv on local sandboxes, "
        f"median of {args.repeats} batches (runner = total - engine - env)\n"
    )
    header = (
        f"| {'engine':<34} | episodes | turns | total s  | engine s | env s    | runner s  | runner %   "
        f"| runner ms/turn |"
    )
    print(header)
    print("|" + "|".join("-" * (len(c) + 0) for c in header.split("|")[1:-1]) + "|")
    with SandboxPool(args.episodes, backend="local") as pool:
        rows = _runner_rows(
            "ScriptedEngine (no model)",
            lambda: ScriptedEngine(tokenizer, scripts),
            tokenizer,
            pool,
            args,
            4096,
        )
        try:
            import torch

            from stare_agent.engines import TransformersEngine
            from stare_agent.models import tiny_model
        except ImportError as exc:  # the transformers engine is optional for this section
            print(f"(tiny-model row skipped: {exc})")
        else:
            torch.set_num_threads(args.threads or torch.get_num_threads())
            model, _ = tiny_model(tokenizer)
            rows += _runner_rows(
                f"TransformersEngine (tiny, {args.new_tokens} tok)",
                lambda: TransformersEngine(model, tokenizer),
                tokenizer,
                pool,
                args,
                args.new_tokens,
            )
    print("\n".join(rows))


class _Lockstep:
    """An engine seen without ``submit``: the runner plays it in lockstep turns (one batch per turn)."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def generate(self, prompts, params, stop):
        return self.engine.generate(prompts, params, stop)

    def update_weights(self, named_tensors) -> None:
        self.engine.update_weights(named_tensors)


def bench_draw(args: argparse.Namespace) -> None:
    """One RL draw of the quickstart configuration: old path vs vLLM lockstep vs vLLM continuous."""
    import zlib

    from stare_agent.config import load_config
    from stare_agent.engines import start_engine
    from stare_agent.models import load_policy
    from stare_agent.provenance import machine
    from stare_agent.resources import open_sandboxes, train_source
    from stare_envs.engine import SamplingParams
    from stare_envs.problems import ProblemStream
    from stare_envs.registry import make_tool_envs
    from stare_envs.rollout import RolloutRunner

    if not Path(args.model, "config.json").is_file():
        sys.exit(
            f"no model at {args.model}: run `.venv/bin/stare-agent sft --config configs/quickstart.yaml` or pass --model"
        )
    config = load_config(REPO / "configs" / "quickstart.yaml", [f"model.name_or_path={args.model}"])
    data, env = config.data, config.env
    model, tokenizer = load_policy(args.model)
    G = data.samples_per_prompt
    _, old = start_engine(config, model, tokenizer, name="transformers", autocast=True)
    vllm_name, vllm = start_engine(config, model, tokenizer, name="vllm", autocast=True)
    paths = {"old: transformers, lockstep": old, "vLLM, lockstep": _Lockstep(vllm), "vLLM, continuous": vllm}
    n = data.prompts_per_step * G
    pool = open_sandboxes(config.sandbox, n)
    envs = make_tool_envs(env.id, n, **env.env_kwargs(), pool=pool, tokenizer=tokenizer)
    stream = ProblemStream(train_source(config), seed=config.trainer.seed, difficulty=data.difficulty)
    results: dict[str, list[tuple[float, int]]] = {name: [] for name in paths}
    same: dict[str, list[int]] = {name: [] for name in paths}
    print(
        f"\nOne RL draw of configs/quickstart.yaml: {data.prompts_per_step} problems x {G} samples, "
        f"{env.max_response_tokens} response tokens, T = {env.temperature:g}; model {args.model}; vLLM: {vllm_name}; "
        f"{args.repeats} rounds after a warm-up round; machine: {machine()}, "
        f"load average {os.getloadavg()[0]:.1f}\n"
    )
    try:
        for round_ in range(args.repeats + 1):
            problems = stream.take(data.prompts_per_step)
            jobs = [(i, k) for i in range(len(problems)) for k in range(G)]
            seed = zlib.crc32(f"bench-draw/{round_}".encode())
            names = list(paths)
            names = names[round_ % len(names) :] + names[: round_ % len(names)]
            tokens: dict[str, list[list[int]]] = {}
            for name in names:
                runner = RolloutRunner(
                    tokenizer,
                    paths[name],
                    max_response_tokens=env.max_response_tokens,
                    sampling=SamplingParams(temperature=env.temperature, top_p=env.top_p, seed=seed),
                    continuous=True,  # the lockstep paths' engines have no submit
                )
                t0 = time.perf_counter()
                trajectories = runner.run(
                    envs,
                    options=[{"problem": problems[i]} for i, _ in jobs],
                    episode_keys=[f"{i}/{k}" for i, k in jobs],
                )
                seconds = time.perf_counter() - t0
                tokens[name] = [t.response_ids for t in trajectories]
                sampled = sum(t.num_sampled_tokens for t in trajectories)
                print(
                    f"  round {round_} {name:<28} {seconds:6.1f} s  {sampled:5d} sampled tokens", flush=True
                )
                if round_:
                    results[name].append((seconds, sampled))
            if round_:
                for name in paths:
                    same[name].append(
                        sum(a == b for a, b in zip(tokens[name], tokens["vLLM, lockstep"], strict=True))
                    )
    finally:
        for e in envs:
            e.close()
        pool.close()
        vllm.close()
    base = statistics.median(s for s, _ in results["old: transformers, lockstep"])
    print(
        "\n| path | draw s (median) | sampled tok/s | old / path | episodes with the same tokens as vLLM lockstep |"
    )
    print("|---|---:|---:|---:|---|")
    for name, runs in results.items():
        median = statistics.median(s for s, _ in runs)
        tok_s = statistics.median(t / s for s, t in runs)
        agree = "/".join(str(k) for k in same[name]) + f" of {n}"
        print(f"| {name} | {median:.1f} | {tok_s:.0f} | {base / median:.2f}x | {agree} |")


SECTIONS: dict[str, Callable[[argparse.Namespace], None]] = {
    "throughput": bench_engine_throughput,
    "draw": bench_draw,
    "overhead": bench_runner_overhead,
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--section", choices=["all", *SECTIONS], default="all")
    parser.add_argument("--device", default="cpu", help="throughput: cpu or cuda")
    parser.add_argument(
        "--engines",
        default="transformers,transformers-bf16,hf-generate,vllm,vllm-fp32",
        help="throughput: comma list of transformers, transformers-bf16, hf-generate, vllm, vllm-fp32, "
        "vllm-pinned, vllm-pinned-passive, vllm-spinning, vllm-short-spin, sglang",
    )
    parser.add_argument("--busy", type=int, default=0, help="throughput: busy-loop processes while timing")
    parser.add_argument("--batch-sizes", default="1,16,64", help="throughput: comma list")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--episodes", type=int, default=16, help="overhead: episodes per batch")
    parser.add_argument(
        "--model",
        default=str(REPO / "runs" / "quickstart" / "sft_model"),
        help="draw: the SFT model to roll out",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument(
        "--no-load-times",
        dest="load_times",
        action="store_false",
        help="throughput: skip timing the embedded model's conversion and cached load",
    )
    args = parser.parse_args(argv)
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    for name, section in SECTIONS.items():
        if args.section in ("all", name):
            section(args)


if __name__ == "__main__":
    main()
