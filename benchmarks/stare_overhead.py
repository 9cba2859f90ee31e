"""What STARE costs on CPU, side by side with the GRPO-ds baseline in one run.

    python benchmarks/stare_overhead.py            # full run (a few minutes, ~14 GB RAM for the naive case)
    python benchmarks/stare_overhead.py --quick    # smaller sizes, for a smoke run

1. Loss forward + backward of a small Llama at 16K response tokens: GRPO-ds vs STARE-O1 vs STARE-C2
   (STARE adds the gate, the weights and the multiply; target overhead <= 3 %).
2. STARE weights alone on 1M tokens, global scope, with metrics (target <= 50 ms).
3. Chunked log-prob + entropy vs the naive full-logits computation at 16K tokens x 49K vocabulary,
   each variant in its own subprocess: peak RSS increase (target >= 8x lower) and time (within 15 %).

Medians over repeats; the variants of a section are interleaved so that load drifts hit all alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from stare_agent.algorithms import (
    causal_lm_logprobs_and_entropy,
    chunked_logprobs_and_entropy,
    entropy_gate,
    policy_loss,
    stare_weights,
)


def _median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1000


def bench_loss(tokens: int, repeats: int) -> list[tuple[str, float]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    B, T = tokens // 1024, 1024
    input_ids = torch.randint(0, config.vocab_size, (B, T + 1))  # 1 prompt token + T response tokens
    mask = torch.ones(B, T, dtype=torch.long)
    A = torch.randn(B, 1).sign() * mask  # advantages +-1

    def step(variant: str) -> float:
        start = time.perf_counter()
        logp, entropy = causal_lm_logprobs_and_entropy(model, input_ids, chunk_size=2048)
        weights = None
        if variant != "GRPO-ds":
            gate_on, _, _ = entropy_gate(entropy, mask, H_tgt=100.0)  # gate forced on: the costly path
            weights, *_ = stare_weights(A, logp, mask, gate_on=gate_on, variant=variant[-2:], scope="global")
        loss, _ = policy_loss(logp, logp.detach(), A, mask, weights)
        loss.backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    variants = ["GRPO-ds", "STARE-O1", "STARE-C2"]
    step("GRPO-ds")  # warm-up
    times: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(repeats):
        for v in variants:
            times[v].append(step(v))
    return [(v, _median_ms(times[v])) for v in variants]


def bench_weights(tokens: int, repeats: int) -> list[tuple[str, float]]:
    torch.manual_seed(0)
    B = tokens // 1000
    mask = torch.rand(B, 1000) > 0.2
    A = torch.randn(B, 1) * mask
    logp = -torch.rand(B, 1000) * 3
    rows = []
    for variant in ("O1", "C2"):
        samples = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            stare_weights(A, logp, mask, gate_on=True, variant=variant, scope="global")
            samples.append(time.perf_counter() - start)
        rows.append((f"STARE-{variant} weights", _median_ms(samples[1:])))
    return rows


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}: this benchmark needs Linux")


def _reset_peak_rss_kib() -> int:
    """Reset the RSS high-water mark (Linux: write 5 to clear_refs); return the current RSS."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_kib("VmRSS")


def logprob_worker(
    variant: str, mode: str, tokens: int, vocab: int, dim: int, repeats: int
) -> dict[str, float]:
    """Runs in a subprocess: peak RSS increase of the first call, median time of the calls."""
    torch.manual_seed(0)
    hidden = torch.randn(tokens, dim, requires_grad=mode == "fwd+bwd")
    weight = (torch.randn(vocab, dim) / dim**0.5).requires_grad_(mode == "fwd+bwd")
    targets = torch.randint(0, vocab, (tokens,))

    def naive():
        logp_all = torch.nn.functional.linear(hidden, weight).log_softmax(-1)
        logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)
        with torch.no_grad():
            entropy = -(logp_all.exp() * logp_all).sum(-1)
        return logp, entropy

    def chunked():
        return chunked_logprobs_and_entropy(hidden, weight, targets, chunk_size=1024)

    fn = naive if variant == "naive" else chunked

    def call() -> float:
        start = time.perf_counter()
        if mode == "fwd+bwd":
            logp, _ = fn()
            logp.sum().backward()
            hidden.grad = weight.grad = None
        else:
            with torch.no_grad():
                fn()
        return time.perf_counter() - start

    before = _reset_peak_rss_kib()
    samples = [call()]
    peak_kib = _status_kib("VmHWM") - before
    samples += [call() for _ in range(repeats - 1)]
    return {"peak_mib": peak_kib / 1024, "ms": _median_ms(samples)}


def bench_logprobs(tokens: int, vocab: int, dim: int, repeats: int) -> list[tuple[str, str, float, float]]:
    rows = []
    for mode in ("fwd", "fwd+bwd"):
        for variant in ("naive", "chunked"):
            args = ["--worker", variant, mode, str(tokens), str(vocab), str(dim), str(repeats)]
            out = subprocess.run(
                [sys.executable, __file__, *args], check=True, capture_output=True, text=True
            )
            result = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append((mode, variant, result["peak_mib"], result["ms"]))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sections", default="1,2,3", help="comma-separated sections to run")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--worker", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.worker:
        variant, mode, tokens, vocab, dim, repeats = args.worker
        print(json.dumps(logprob_worker(variant, mode, int(tokens), int(vocab), int(dim), int(repeats))))
        return
    sections = {int(s) for s in args.sections.split(",")}
    loss_tokens, weight_tokens, lp_tokens, vocab = (2048, 100_000, 2048, 8192) if args.quick else (
        16_384, 1_000_000, 16_384, 49_152
    )  # fmt: skip
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, repeats {args.repeats}\n")

    if 1 in sections:
        _print_loss(loss_tokens, args.repeats)
    if 2 in sections:
        print(
            f"\n2. STARE weights alone (global scope, with metrics), {weight_tokens} tokens (target <= 50 ms)"
        )
        for name, ms in bench_weights(weight_tokens, args.repeats * 2):
            print(f"   {name:<20}{ms:>10.1f} ms")
    if 3 in sections:
        _print_logprobs(lp_tokens, vocab, args.repeats)


def _print_loss(loss_tokens: int, repeats: int) -> None:
    rows = bench_loss(loss_tokens, repeats)
    base = rows[0][1]
    print(
        f"1. policy loss forward+backward, small Llama, {loss_tokens} response tokens (target overhead <= 3 %)"
    )
    print(f"   {'variant':<12}{'median ms':>12}{'vs GRPO-ds':>12}")
    for name, ms in rows:
        print(f"   {name:<12}{ms:>12.1f}{(ms / base - 1) * 100:>+11.1f}%")


def _print_logprobs(lp_tokens: int, vocab: int, repeats: int) -> None:
    dim = 128
    print(f"\n3. log-prob + entropy, {lp_tokens} tokens x {vocab} vocab, hidden {dim}, chunk 1024")
    print("   (targets: peak >= 8x lower, time within 15 %)")
    print(
        f"   {'mode':<9}{'variant':<9}{'peak MiB':>10}{'median ms':>11}{'peak ratio':>12}{'time ratio':>12}"
    )
    lp_rows = bench_logprobs(lp_tokens, vocab, dim, max(repeats // 2, 2))
    for i in range(0, len(lp_rows), 2):
        (mode, _, naive_mib, naive_ms), (_, _, chunk_mib, chunk_ms) = lp_rows[i], lp_rows[i + 1]
        print(f"   {mode:<9}{'naive':<9}{naive_mib:>10.0f}{naive_ms:>11.0f}")
        print(
            f"   {mode:<9}{'chunked':<9}{chunk_mib:>10.0f}{chunk_ms:>11.0f}"
            f"{naive_mib / max(chunk_mib, 1e-9):>11.1f}x{chunk_ms / naive_ms:>11.2f}x"
        )


if __name__ == "__main__":
    main()
