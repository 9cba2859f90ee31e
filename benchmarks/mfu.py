"""Utilisation against the machine's bound: the dense matmul bound in fp32 and bf16, and the model
FLOPs utilisation (MFU) of an SFT step, a learner step and vLLM decoding on the embedded model.

    flock /tmp/bench.lock .venv/bin/python benchmarks/mfu.py            # the table in docs/benchmarks.md
    flock /tmp/bench.lock .venv/bin/python benchmarks/mfu.py --quick    # smaller batches, 1 repeat

The bound is a square dense matmul (``stare_agent.perf.probe_matmul``, n = 2048, best of 4) on the
threads torch uses, in fp32 and, where the CPU computes bf16 natively (AVX-512 BF16 or AMX), in bf16;
the best of ``--repeats`` probes (a bound: the best the machine showed). The work is counted as
``stare_agent.perf`` counts it in training (6 x N x tokens plus attention for a training pass, 2 x N
x tokens plus attention for a forward-only pass or decoding, N = the weights a token multiplies, the
tied LM head included), and each row is set against the bound of the precision it computes in.

- SFT step: one ``Learner.sft_step`` on 8 traces shaped like the quickstart's (``benchmarks/
  learner_speed.py``'s ``sft_batch``), configs/quickstart.yaml settings (bf16-autocast,
  micro_batch_tokens 4096).
- Learner step: STARE's pre-update log-prob pass plus the update on 16 trajectories in groups of 4
  (``rl_batch``; prompt 300-400 + response 60-140 tokens), the quickstart's trained batch (4 prompts
  x 4 samples).
- Decoding: ``VLLMEngine`` (the quickstart's ``env.vllm`` dtype, EOS ignored so that every sequence
  decodes ``--new-tokens``) at batch 1, 16 and 64; the FLOPs of prompt prefill and decoding, the
  rate in generated tokens/s. Skipped, saying why, without ``.venv-vllm``.

This measures today's code only: the change that added it (``stare_agent.perf``, the ``perf/*``
metrics) measures and changes no computation, so today's path is the baseline. Medians over repeats,
parameters restored after every learner job.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # learner_speed, beside this script

from learner_speed import NEW, bench, load_note, make_learner, rl_batch, sft_batch, work  # noqa: E402

from stare_agent import perf  # noqa: E402
from stare_agent.config import cpu_has_bf16, load_config  # noqa: E402
from stare_agent.provenance import machine  # noqa: E402

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"
PROMPTS = [
    "What is the sum of the first 100 positive integers? Use the code tool.",
    "Find the number of primes below 1000.",
    "Compute 17^23 mod 1009.",
    "How many divisors does 720720 have?",
]


def bounds(repeats: int) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for dtype in ("fp32", "bf16"):
        if dtype == "bf16" and not cpu_has_bf16():
            out[dtype] = None
            continue
        out[dtype] = max(perf.probe_matmul(dtype) for _ in range(repeats))
    return out


Row = tuple[str, str, float, float, float, float | None]  # job, precision, tokens, s, FLOPs, executed


def row(job: Row, bound_of: dict[str, float | None]) -> str:
    name, precision, tokens, seconds, flops, executed = job
    bound = bound_of[perf.precision_dtype(precision)]
    assert bound is not None
    ran = "" if executed is None else f"{100 * executed / seconds / bound:6.1f} %"
    return (
        f"| {name:<34} | {precision:<13} | {tokens / seconds:8.0f} | {flops / seconds / 1e9:7.1f} | "
        f"{bound / 1e9:7.1f} | {100 * flops / seconds / bound:6.1f} % | {ran:>8} |"
    )


def executed_forward(cfg: object, learner: object, batch: list) -> float:
    """FLOPs of one forward pass as the learner runs it (``learner_speed.work``): the backbone over
    its token positions (a group's shared prompt once, padding included), the LM head over the
    scored rows only, attention as counted."""
    backbone, head_rows = work(learner, batch, NEW)  # type: ignore[arg-type]
    head = cfg.hidden_size * cfg.vocab_size  # type: ignore[attr-defined]
    lens = [t.num_tokens for t in batch]
    attention = perf.forward_flops(cfg, lens) - 2.0 * perf.matmul_params(cfg) * sum(lens)
    return 2.0 * (perf.matmul_params(cfg) - head) * backbone + 2.0 * head * head_rows + attention


def learner_rows(args: argparse.Namespace) -> list[Row]:
    config = load_config(CONFIG)
    learner = make_learner(config.deepspeed.precision)
    precision = learner.precision
    cfg = learner.module.config
    sft, rl = sft_batch(args.sft_batch), rl_batch(args.trajectories)
    advantages = [1.0 if t.reward else -1.0 for t in rl]
    learner.compute_logprobs_and_entropy(rl[:2])  # warm-up (first-call allocations)
    jobs = {
        "sft": lambda: learner.sft_step(sft),
        "rl": lambda: (learner.compute_logprobs_and_entropy(rl), learner.update(rl, advantages)),
    }
    times = bench(learner, {"today": NEW}, jobs, args.repeats)
    sft_lens, rl_lens = [t.num_tokens for t in sft], [t.num_tokens for t in rl]
    return [
        (
            f"SFT step, {len(sft)} traces ({sum(sft_lens)} tok)",
            precision,
            sum(sft_lens),
            times["today", "sft"],
            perf.train_flops(cfg, sft_lens),
            3 * executed_forward(cfg, learner, sft),
        ),
        (
            f"learner step, {len(rl)} traj ({sum(rl_lens)} tok)",
            precision,
            sum(rl_lens),
            times["today", "rl"],
            perf.train_flops(cfg, rl_lens) + perf.forward_flops(cfg, rl_lens),
            4 * executed_forward(cfg, learner, rl),
        ),
    ]


def decode_rows(args: argparse.Namespace) -> list[Row] | str:
    """Today's worker first, then one run per ``--decode-env`` variant, in this process's order."""
    rows: list[Row] = []
    for name, env in [("", {}), *args.decode_env]:
        got = _decode_rows(args, env, name)
        if isinstance(got, str):
            return got
        rows += got
    return rows


def _decode_rows(args: argparse.Namespace, worker_env: dict[str, str], name: str) -> list[Row] | str:
    from stare_agent.engines.vllm_engine import VLLMEngine, find_vllm_python
    from stare_agent.models import load_tokenizer, resolve_policy_path
    from stare_envs.engine import SamplingParams

    config = load_config(CONFIG)
    if find_vllm_python(config.env.vllm.python) is None:
        return "vLLM decoding: skipped, no Python with vLLM (.venv-vllm; scripts/setup_vllm.sh)"
    dtype = config.env.vllm.dtype
    if dtype == "bfloat16" and not cpu_has_bf16():
        dtype = "float32"  # as start_engine does: emulated bf16 is slower than fp32
    precision = "bf16" if dtype == "bfloat16" else "fp32"
    tokenizer = load_tokenizer(config.model.name_or_path)
    from transformers import AutoConfig

    path = resolve_policy_path(config.model.name_or_path)
    cfg = AutoConfig.from_pretrained(path)
    engine = VLLMEngine(
        path,
        dtype=dtype,
        max_model_len=2048,
        kv_cache_gib=config.env.vllm.kv_cache_gib,
        sampling_overrides={"ignore_eos": True},
        env=worker_env,
    )
    params = SamplingParams(temperature=1.0, top_p=1.0, top_k=None, max_new_tokens=args.new_tokens)
    rows = []
    try:
        engine.generate([_prompt(tokenizer, 0)], params, [])  # warm-up
        for batch in args.batch_sizes:
            prompts = [_prompt(tokenizer, i) for i in range(batch)]
            seconds = []
            for repeat in range(args.repeats):
                start = time.perf_counter()
                outs = engine.generate(prompts, replace(params, seed=repeat), [])
                seconds.append(time.perf_counter() - start)
            new = [len(o.token_ids) for o in outs]
            lens = [len(p) + n for p, n in zip(prompts, new, strict=True)]
            rows.append(
                (
                    f"vLLM decoding, batch {batch} ({args.new_tokens} new)" + (f", {name}" if name else ""),
                    precision,
                    sum(new),
                    statistics.median(seconds),
                    perf.forward_flops(cfg, lens),
                    None,
                )
            )
    finally:
        engine.close()
    return rows


def _prompt(tokenizer, i: int) -> list[int]:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
        add_generation_prompt=True,
        return_dict=False,
    )


def _decode_env(text: str) -> tuple[str, dict[str, str]]:
    name, _, assignments = text.partition("=")
    env = dict(a.split("=", 1) for a in assignments.split(",") if "=" in a)
    if not name or not env:
        raise argparse.ArgumentTypeError(f"{text!r}: write NAME=KEY=VALUE[,KEY=VALUE]")
    return name, env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--trajectories", type=int, default=16, help="learner step batch (default 16)")
    parser.add_argument("--sft-batch", type=int, default=8, help="SFT traces per step (default 8)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument(
        "--quick", action="store_true", help="8 trajectories, 4 traces, 1 repeat, batch 1 and 16"
    )
    parser.add_argument(
        "--decode-env",
        action="append",
        default=[],
        type=_decode_env,
        metavar="NAME=KEY=VALUE[,KEY=VALUE]",
        help="decode again with these worker environment variables (beside today's worker), e.g. "
        "'spin=OMP_WAIT_POLICY=ACTIVE'",
    )
    parser.add_argument("--skip-learner", action="store_true")
    parser.add_argument("--skip-decoding", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.trajectories, args.sft_batch, args.repeats, args.batch_sizes = 8, 4, 1, [1, 16]
    torch.manual_seed(0)
    print(f"command: {' '.join([Path(sys.executable).name, *sys.argv])}")
    print(f"machine: {machine()}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"before: {load_note()}")
    before = bounds(args.repeats)
    rows: list[Row] = []
    skipped = ""
    if not args.skip_learner:
        rows += learner_rows(args)
    if not args.skip_decoding:
        decoded = decode_rows(args)
        rows, skipped = (rows + decoded, "") if isinstance(decoded, list) else (rows, decoded)
    after = bounds(args.repeats)
    # the bound: the best either probe saw (another process on the cores lowers a probe)
    bound_of = {k: max(before[k] or 0.0, after[k] or 0.0) or None for k in before}
    print("\n| dense matmul bound (2048^3, best of 4 x repeats) | before the jobs | after | bound |")
    print("|---|---|---|---|")
    for dtype, value in bound_of.items():
        if value is None:
            print(f"| {dtype} | no native bf16 (emulated): not measured | | |")
        else:
            print(
                f"| {dtype} | {(before[dtype] or 0) / 1e9:.1f} | {(after[dtype] or 0) / 1e9:.1f} | {value / 1e9:.1f} GFLOP/s |"
            )
    print(
        f"\nmedians of {args.repeats}; MFU = model FLOPs / s / the bound of the row's precision; executed: "
        "the FLOPs the learner ran (shared prompts once, LM head on scored tokens) / s / bound"
    )
    print(f"| {'job':<34} | {'precision':<13} | tokens/s | GFLOP/s |   bound |      MFU | executed |")
    print(f"|{'-' * 36}|{'-' * 15}|---------:|--------:|--------:|---------:|---------:|")
    for job in rows:
        print(row(job, bound_of))
    if skipped:
        print(skipped)
    print(f"\nafter: {load_note()}")


if __name__ == "__main__":
    main()
