"""Rollout-correction modes on a synthetic engine/learner mismatch, the uncorrected baseline beside them.

    .venv/bin/python benchmarks/rollout_correction.py            # 3 lengths x 2 cases x 400 batches
    .venv/bin/python benchmarks/rollout_correction.py --quick    # 60 batches, 2 lengths

The policy: T tokens, each drawn from pi = softmax(theta) over V = 16 tokens (one shared theta, so
the exact gradient is known); 4 of them are "good". The reward is RLVR's pass/fail,
R = 1[S >= k] with S the number of good tokens and k = round(T p), p = pi(good) (J = P(S >= k) near
1/2, where the gradient is largest). Exactly, with S' ~ Binomial(T - 1, p):

    grad J / T = P(S' = k - 1) * pi * (1_good - p)          (the token-mean objective's gradient)

The engine mu samples the tokens instead, and its log-probs are the learner's plus a mismatch:

    bf16    mu_t = softmax(theta + eps_t), eps_t ~ N(0, sigma^2) per position and token: kernel
            noise, zero on average (sigma set so that mean |d| is ~0.036 nats, the bf16 vLLM gap
            measured in docs/algorithm.md)
    drift   mu_t = softmax(theta - eta u + eps_t), u = 1_good - p: a stale engine, one that has not
            seen the learner's last steps toward the good tokens (eta = 0.05 logits: a KL of ~2e-4 a
            token on its own), with the bf16 noise on top. The drift is along the reward at every
            position, so it adds up over a sequence: the engine's pass rate is lower than J, by more
            the longer the sequence, and a token's own ratio does not see the other tokens' shift
            that moved R (token-level IS's bias; sequence-level IS's target)

Each batch: N = 64 sequences, 8 groups of G = 8 (GRPO's groups), the advantage R_i less the mean
of the other 7 rewards of its group (leave-one-out: an unbiased baseline on-policy, and one that
follows the engine's pass rate off-policy, as GRPO's group mean does). Per mode, the learner's
estimate (the gradient of the token-mean loss sum_t c_t A l_t / sum mask at ratio 1):

    g_hat = 1/(N T) sum_i A_i sum_t c_it (e_{y_it} - pi)

and the table's columns, per case and mode, over the batches: the median fraction of tokens and of
sequences with a weight > 0, the median ESS (rollout_correction/eff_sample_size), the scale
E g_hat . g / |g|^2 (1: the right length; a rejecting mode shrinks the step, as a lower learning
rate would), the bias |E g_hat - g| / |g| with its Monte-Carlo standard error (the bias of a pure
noise vector reads about 1-2 s.e.), the standard deviation of g_hat per batch over |g|, and the
median cosine between one batch's estimate and g (what an Adam step, which rescales, sees). All modes read the same draws. The bias is measured against
an on-policy twin of each batch: the same Gumbel noise drawn through pi instead of mu (the
Gumbel-max coupling: most tokens are the same), whose estimate g_pi is unbiased, so
E g_hat - g = E (g_hat - g_pi), a mean of small paired differences (without the twin, the batch
noise would hide any bias below ~0.05 |g| in 400 batches). Torch runs on one thread (on a loaded
2-core machine two threads ran the weights 40x slower).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import torch

from stare_agent.algorithms.rollout_correction import correction_weights
from stare_agent.provenance import machine

V, GOOD, N, GROUP = 16, 4, 64, 8
SIGMA = 0.045  # logit noise: mean |d| ~ 0.036 nats a token on the sampled tokens
ETA = 0.05  # the drift: the engine's logits lag by eta (1_good - p)

# (label, mode, options): the baseline first, then this project's default, then the field's
MODES: list[tuple[str, str, dict]] = [
    ("none (uncorrected, baseline)", "bypass", {}),
    ("token_tis C=2 (ours: auto)", "token_tis", {"cap": 2.0}),
    ("token_tis + batch_normalize", "token_tis", {"cap": 2.0, "batch_normalize": True}),
    ("seq_tis C=2", "seq_tis", {"cap": 2.0}),
    ("seq IS, no cap (C=1e6)", "seq_tis", {"cap": 1e6}),
    ("token_mis [0.5, 2]", "token_mis", {"low": 0.5, "high": 2.0}),
    ("token_mask C=5 (AReaL)", "token_mask", {"cap": 5.0}),
    ("seq_mis [0.5, 2] (verl seq_is_rs)", "seq_mis", {"low": 0.5, "high": 2.0}),
    ("seq_mis [0, 3] (TRL default)", "seq_mis", {"low": 0.0, "high": 3.0}),
    ("geo_rs [0.999, 1.001] (verl)", "geo_rs", {}),
    ("geo_rs_token_tis", "geo_rs_token_tis", {"cap": 2.0}),
]


def exact(theta: torch.Tensor, T: int) -> tuple[torch.Tensor, float, int]:
    """(grad J / T, J, k) for R = 1[S >= k], S ~ Binomial(T, p)."""
    pi = torch.softmax(theta.double(), 0)
    p = float(pi[:GOOD].sum())
    k = round(T * p)
    J = pass_rate(p, T, k)
    good = torch.zeros(V, dtype=torch.float64)
    good[:GOOD] = 1.0
    grad = math.exp(log_pmf(T - 1, k - 1, p)) * pi * (good - p)
    return grad, J, k


def pass_rate(p: float, T: int, k: int) -> float:
    """P(S >= k), S ~ Binomial(T, p)."""
    return sum(math.exp(log_pmf(T, j, p)) for j in range(k, T + 1))


def log_pmf(n: int, j: int, p: float) -> float:
    """log P(S = j), S ~ Binomial(n, p)."""
    return (
        math.lgamma(n + 1)
        - math.lgamma(j + 1)
        - math.lgamma(n - j + 1)
        + j * math.log(p)
        + (n - j) * math.log1p(-p)
    )


def draw(
    theta: torch.Tensor, T: int, eta: float, g: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One batch from the engine: tokens y [N, T], the learner's and the engine's log-probs of them,
    and the on-policy twin: the tokens pi draws with the same Gumbel noise."""
    u = torch.zeros(V)
    u[:GOOD] = 1.0
    logits = theta.expand(N, T, V) - eta * (u - torch.softmax(theta, 0)[:GOOD].sum())
    logits = logits + SIGMA * torch.randn(N, T, V, generator=g)
    gumbel = -torch.log(-torch.log(torch.rand(N, T, V, generator=g).clamp_min(1e-20)))
    y = (logits + gumbel).argmax(-1)
    twin = (theta + gumbel).argmax(-1)
    logp_mu = torch.log_softmax(logits, -1).gather(-1, y[..., None]).squeeze(-1)
    logp_pi = torch.log_softmax(theta, 0)[y]
    return y, logp_pi, logp_mu, twin


def run_case(T: int, case: str, batches: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(V, generator=torch.Generator().manual_seed(1)) * 0.5
    grad, J, k = exact(theta, T)
    eta = ETA if case == "drift" else 0.0
    p_mu = float(torch.softmax(theta.double() - eta * (torch.arange(V) < GOOD).double(), 0)[:GOOD].sum())
    pi = torch.softmax(theta.double(), 0)
    norm = float(grad.norm())
    mask = torch.ones(N, T)
    est: dict[str, list[torch.Tensor]] = {label: [] for label, _, _ in MODES}
    on_policy: list[torch.Tensor] = []
    kept_tok: dict[str, list[float]] = {label: [] for label, _, _ in MODES}
    kept_seq: dict[str, list[float]] = {label: [] for label, _, _ in MODES}
    ess: dict[str, list[float]] = {label: [] for label, _, _ in MODES}
    abs_d, kl = [], []
    for _ in range(batches):
        y, logp_pi, logp_mu, twin = draw(theta, T, eta, g)
        d = (logp_pi - logp_mu).double()
        abs_d.append(float(d.abs().mean()))
        kl.append(float((d.exp() - 1 - d).mean()))
        on_policy.append(estimate(twin, torch.ones(N, T, dtype=torch.float64), pi, k))
        for label, mode, options in MODES:
            c, m = correction_weights(logp_pi, logp_mu, mask, mode=mode, **options)
            c = c.double()
            est[label].append(estimate(y, c, pi, k))
            kept_tok[label].append(float((c > 0).double().mean()))
            kept_seq[label].append(float((c > 0).any(-1).double().mean()))
            ess[label].append(m["rollout_correction/eff_sample_size"])
    P = torch.stack(on_policy)
    rows = [row("on-policy twin (check: bias ~0)", P, P - grad, [1.0], [1.0], [1.0], grad, norm)]
    for label, _, _ in MODES:
        E = torch.stack(est[label])
        rows.append(row(label, E, E - P, kept_tok[label], kept_seq[label], ess[label], grad, norm))
    return {
        "T": T,
        "case": case,
        "J": J,
        "J_mu": pass_rate(p_mu, T, k),
        "abs_d": statistics.median(abs_d),
        "kl": statistics.median(kl),
        "rows": rows,
    }


def estimate(y: torch.Tensor, c: torch.Tensor, pi: torch.Tensor, k: int) -> torch.Tensor:
    """g_hat = 1/(N T) sum_i A_i sum_t c_it (e_{y_it} - pi), A_i = R_i - the mean of its group's others."""
    R = ((y < GOOD).sum(-1) >= k).double().view(-1, GROUP)  # R_i = 1[S_i >= k], by group
    A = (R - (R.sum(-1, keepdim=True) - R) / (GROUP - 1)).view(-1)
    hist = torch.zeros(N, V, dtype=torch.float64).scatter_add_(1, y, c)  # sum_t c_t e_{y_t}
    G = hist - c.sum(-1, keepdim=True) * pi  # sum_t c_t (e_{y_t} - pi)
    return (A[:, None] * G).sum(0) / (N * T_of(y))


def T_of(y: torch.Tensor) -> int:
    return y.shape[-1]


def row(label, E, diff, tokens, seqs, ess, grad, norm) -> dict:
    """One table row: E [batches, V] the estimates, diff [batches, V] what the bias is the mean of."""
    batches = E.shape[0]
    mean = diff.mean(0)
    diff_sd = float(((diff - mean) ** 2).sum(-1).mean().sqrt())
    sd = float(((E - E.mean(0)) ** 2).sum(-1).mean().sqrt())
    return {
        "mode": label,
        "tokens": statistics.median(tokens),
        "seqs": statistics.median(seqs),
        "ess": statistics.median(ess),
        "scale": float((E.mean(0) * grad).sum()) / norm**2,
        "bias": float(mean.norm()) / norm,
        "bias_se": diff_sd / math.sqrt(batches) / norm,
        "sd": sd / norm,
        "cos": statistics.median(float((e * grad).sum() / (e.norm() * norm + 1e-300)) for e in E),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="60 batches, T = 200 and 1000")
    parser.add_argument("--batches", type=int, default=None)
    parser.add_argument("--lengths", type=int, nargs="+", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    batches = args.batches or (60 if args.quick else 400)
    lengths = args.lengths or ([200, 1000] if args.quick else [200, 1000, 4000])
    print(
        f"# rollout correction on synthetic mismatch: {machine()}, "
        f"torch {torch.__version__} on {torch.get_num_threads()} thread(s)"
    )
    print(f"# N = {N} sequences a batch, {batches} batches a case, V = {V}, sigma = {SIGMA}, drift eta {ETA}")
    start = time.perf_counter()
    for case in ("bf16", "drift"):
        for T in lengths:
            r = run_case(T, case, batches, seed=T + (0 if case == "bf16" else 7))
            print(
                f"\n## {case}, T = {T} tokens: median mean|d| {r['abs_d']:.4f} nats, k3 KL {r['kl']:.2e}, "
                f"J = {r['J']:.3f}, the engine's {r['J_mu']:.3f} (noise aside)"
            )
            print(
                "| mode | tokens kept | seqs kept | ESS | scale | bias (+- s.e.) | sd per batch | cos, one batch |"
            )
            print("|---|---:|---:|---:|---:|---:|---:|---:|")
            for row in r["rows"]:
                print(
                    f"| {row['mode']} | {row['tokens']:.3f} | {row['seqs']:.3f} | {row['ess']:.3f} | "
                    f"{row['scale']:.2f} | {row['bias']:.3f} (+- {row['bias_se']:.3f}) | {row['sd']:.2f} | "
                    f"{row['cos']:.2f} |"
                )
            sys.stdout.flush()
    print(f"\n# {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
