"""A dynamics lab: STARE and GRPO-ds on a seeded synthetic task, thousands of steps in minutes on a CPU.

``python -m stare_research.lab`` (docs/research/lab.md). The policy (``lab_policy``, ``--policy``) is a
table of logits, one next-token distribution per (context, position): ``theta [C, T, V]`` (64
contexts x 12 positions x 16 tokens), initialised N(0, ``init_scale``^2); or a tiny causal
transformer whose weights every position shares. A prompt is a context c; a response is T tokens
sampled position by position; the reward is ``1[sum(tokens) = c mod 7]`` (binary, verifiable). Each
step runs the project's own functions, in the paper's order:

    draw         32 contexts x 8 samples (``draw_batch``), again until dynamic sampling
                 (``algorithms.dynamic_sampling``, cap 10 batches) keeps 32 groups with reward variance
    advantages   ``algorithms.grpo_advantages``, broadcast to the T tokens
    log-probs    ``algorithms.logprobs_and_entropy_from_logits(..., with_moments=True)`` on the
                 policy's logits [B, T, V] for the kept responses
    gate         ``algorithms.entropy_gate`` on the kept batch (the paper) or on the whole draw (ours)
    weights      ``algorithms.stare_weights`` (global scope: one selection over the batch)
    loss         ``algorithms.policy_loss`` (token-mean, on-policy), one Adam step on the policy

Tasks: ``mod7`` (the reward saturates: once a context is solved its groups are dropped) and
``drift`` (the reward does not saturate: each context keeps a running accuracy over its groups,
an exponential average of weight ``DRIFT_EMA``; once it reaches 0.5 the context's target residue
moves by one and its running accuracy restarts at 0, so no context stays solved: a policy has to
keep finding the next answer, which a collapsed one samples rarely). Variants: see ``VARIANTS``. The control ``random`` reweights a random subset of T+ of the
size of L+ (same W, same gate), so it separates "which tokens" from "how many".

Logged per step: the policy's entropy (mean over all contexts and positions of theta's
distributions; for the transformer, estimated along responses sampled from every context), the batch entropy of the kept groups and of the whole draw, the gate, the reward of
the first drawn batch (fresh prompts), and the first-order diagnostics of ``entropy_effect``.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

from stare_agent.algorithms import (
    broadcast_to_tokens,
    dynamic_sampling,
    entropy_gate,
    grpo_advantages,
    logprobs_and_entropy_from_logits,
    policy_loss,
    stare_weights,
)
from stare_agent.algorithms.entropy_control import (
    clip_cov_weights,
    forking_token_weights,
    kl_cov_coefficients,
)
from stare_agent.algorithms.token_weighting import (
    AdaptiveEntropyCoefficient,
    entroadv_advantages,
    first_order_weights,
    stapo_weights,
    steer_weights,
)
from stare_agent.config import AlgorithmConfig
from stare_agent.intervals import format_ci, mean_sd_ci
from stare_research.config import ResearchSection
from stare_research.entropy_effect import mechanism_metrics, raising_tokens
from stare_research.lab_policy import TablePolicy, TransformerPolicy

DRIFT_EMA = 0.1  # drift task: weight of a context's latest group in its running accuracy


_ALG = AlgorithmConfig()  # the run config's algorithm section: the lab's defaults, stated there once
_RESEARCH = ResearchSection()  # and its research section


@dataclass(frozen=True)
class LabConfig:
    """One lab run. ``algorithm``: ``grpo_ds``, ``stare``, ``random`` (the random-subset control), or one
    of the field's other entropy controls (``algorithms.entropy_control``): ``entropy_bonus``,
    ``kl_cov``, ``clip_cov``, ``forking_tokens``; or one of its token-weighting methods
    (``algorithms.token_weighting``): ``steer``, ``stapo``, ``entroadv``, ``adaptive_entropy``,
    ``first_order`` (which reads the gate as STARE does). ``minibatches`` > 1 splits each kept batch into that
    many optimizer steps (verl's ``ppo_mini_batch``), each against the pre-update log-probs, so that
    the PPO clip (``eps_high``) and KL-Cov's ``|logp - logp_old|`` act; 1 is the paper's one step.
    The algorithm's fields default to ``AlgorithmConfig``'s (see there); ``entropy_coef`` is the
    lab's own. ``policy``: ``table`` or ``transformer`` (``d_model``, ``layers``, ``heads``; its
    initial logits have about ``init_scale`` standard deviation, as the table's); ``lr`` None: the
    policy's own (``LR``)."""

    task: str = "mod7"
    policy: str = "table"
    algorithm: str = _ALG.name
    variant: str = _ALG.variant
    W: float = _ALG.W
    M: float = _ALG.M
    P: float = _ALG.P
    H_tgt: float = _ALG.H_tgt
    gate: str = _ALG.gate  # or "always_on" (open loop)
    gate_batch: str = _RESEARCH.gate_batch  # or "drawn" (ours: the gate reads the whole draw)
    L_plus_rule: str = _RESEARCH.L_plus_rule  # or "top_k_raising" (ours)
    contexts: int = 64
    positions: int = 12
    vocab: int = 16
    modulus: int = 7
    prompts: int = 32
    samples: int = 8
    max_batches: int = 10
    lr: float | None = None
    d_model: int = 32
    layers: int = 2
    heads: int = 2
    init_scale: float = 3.4
    steps: int = 2000
    seed: int = 0
    eps_high: float = _ALG.eps_high
    minibatches: int = 1
    # The lab's own default, not the config's 0.001 (the variants name theirs: entropy-bonus-*).
    entropy_coef: float = 0.01
    kl_cov_k: float = _ALG.kl_cov_k
    kl_cov_coef: float = _ALG.kl_cov_coef
    clip_cov_r: float = _ALG.clip_cov_r
    clip_cov_lb: float = _ALG.clip_cov_lb
    clip_cov_ub: float = _ALG.clip_cov_ub
    forking_rho: float = _ALG.forking_rho
    steer_w_min: float = _ALG.steer_w_min
    steer_w_max: float = _ALG.steer_w_max
    stapo_tau_p: float = _ALG.stapo_tau_p
    stapo_q: float = _ALG.stapo_q
    entroadv_alpha: float = _ALG.entroadv_alpha
    entroadv_kappa: float = _ALG.entroadv_kappa
    adaptive_entropy_target: float | None = _ALG.adaptive_entropy_target  # None: H_tgt
    adaptive_entropy_delta: float = _ALG.adaptive_entropy_delta
    adaptive_entropy_init: float = _ALG.adaptive_entropy_init
    adaptive_entropy_max: float = _ALG.adaptive_entropy_max
    first_order_lambda_max: float = _ALG.first_order_lambda_max


VARIANTS: dict[str, dict[str, Any]] = {
    "grpo-ds": {"algorithm": "grpo_ds"},
    "o1": {},
    "c2": {"variant": "C2"},
    "random": {"algorithm": "random"},
    "open-W1.01": {"gate": "always_on", "W": 1.01},
    "open-W1.1": {"gate": "always_on", "W": 1.1},
    "open-W2": {"gate": "always_on", "W": 2.0},
    "o1-W2": {"W": 2.0},
    "o1-W3": {"W": 3.0},
    "o1-W5": {"W": 5.0},
    "o1-W10": {"W": 10.0},
    "o1-drawgate": {"gate_batch": "drawn"},
    "o1-raising": {"L_plus_rule": "top_k_raising"},
    "o1-W3-drawgate": {"W": 3.0, "gate_batch": "drawn"},
    "o1-W3-raising": {"W": 3.0, "L_plus_rule": "top_k_raising"},
    # the field's other entropy controls (issue 31; algorithms.entropy_control)
    "clip-higher-0.2": {"algorithm": "grpo_ds", "eps_high": 0.2},
    "clip-higher-0.4": {"algorithm": "grpo_ds", "eps_high": 0.4},
    "entropy-bonus-0.001": {"algorithm": "entropy_bonus", "entropy_coef": 0.001},
    "entropy-bonus-0.01": {"algorithm": "entropy_bonus", "entropy_coef": 0.01},
    "kl-cov": {"algorithm": "kl_cov"},
    "kl-cov-k2%": {"algorithm": "kl_cov", "kl_cov_k": 0.02},
    "clip-cov": {"algorithm": "clip_cov"},
    "clip-cov-r2%": {"algorithm": "clip_cov", "clip_cov_r": 0.02},
    "forking": {"algorithm": "forking_tokens"},
    # the field's token-weighting methods (issue 44; algorithms.token_weighting)
    "steer": {"algorithm": "steer"},
    "stapo": {"algorithm": "stapo"},
    "entroadv": {"algorithm": "entroadv"},
    "adaptive-entropy": {"algorithm": "adaptive_entropy"},
    "first-order": {"algorithm": "first_order"},
    # the target sweep (issue 44, item 5): regulation to H_tgt, or a level set by W?
    "o1-W5-drawgate": {"W": 5.0, "gate_batch": "drawn"},
    # Skywork-OR1's controller with 10 times its cap on the bonus (0.05; its step stays 1e-4)
    "adaptive-entropy-cap0.05": {"algorithm": "adaptive_entropy", "adaptive_entropy_max": 0.05},
}
TARGET_SWEEP = (
    ("o1-W3-drawgate", "drawn_entropy"),
    ("o1-W5-drawgate", "drawn_entropy"),
    ("adaptive-entropy", "kept_entropy"),
    ("adaptive-entropy-cap0.05", "kept_entropy"),
    ("o1-W2", "kept_entropy"),
    ("o1-W3", "kept_entropy"),
)
"""The variants the target sweep runs at each of ``TARGETS`` and the estimator each one's controller
reads: the whole-draw gate reads every drawn group; the paper's gate and the adaptive coefficient
read the kept batch's Hbar. Their variants at the other targets are ``<name>-H<target>``."""
TARGETS = (0.15, 0.3, 0.45)  # 0.3: the config's H_tgt, the variants' own
VARIANTS.update(
    {f"{name}-H{t}": {**VARIANTS[name], "H_tgt": t} for name, _ in TARGET_SWEEP for t in TARGETS if t != 0.3}
)


LR = {"table": 0.03, "transformer": 0.001}  # Adam's learning rate per policy (LabConfig.lr None)

Policy = TablePolicy | TransformerPolicy


@dataclass
class Group:
    """One prompt's G responses: context index, tokens [G, T], rewards, and the entropy of the
    distributions the tokens were drawn from ([G, T]; [1, T] for the table, whose G share them)."""

    context: int
    tokens: torch.Tensor
    rewards: list[float]
    entropy: torch.Tensor


def make_policy(cfg: LabConfig, gen: torch.Generator) -> Policy:
    """The run's policy, its initial weights drawn from ``gen``."""
    shape = (cfg.contexts, cfg.positions, cfg.vocab, cfg.init_scale, gen)
    if cfg.policy == "table":
        return TablePolicy(*shape)
    if cfg.policy == "transformer":
        return TransformerPolicy(
            *shape, d_model=cfg.d_model, layers=cfg.layers, heads=cfg.heads, entropy_seed=20_000 + cfg.seed
        )
    raise ValueError(f"LabConfig.policy is {cfg.policy!r}: choose 'table' or 'transformer'")


def run(cfg: LabConfig, *, log_every: int = 1) -> list[dict[str, float]]:
    """Train one lab run; the per-step records (every ``log_every`` steps)."""
    gen = torch.Generator().manual_seed(cfg.seed)
    policy = make_policy(cfg, gen)
    opt = torch.optim.Adam(policy.parameters(), lr=LR[cfg.policy] if cfg.lr is None else cfg.lr)
    target = torch.arange(cfg.contexts) % cfg.modulus
    accuracy = torch.zeros(cfg.contexts, dtype=torch.float64)  # drift task: each context's running accuracy
    control = torch.Generator().manual_seed(10_000 + cfg.seed)
    entropy_ctl = AdaptiveEntropyCoefficient(  # algorithm adaptive_entropy: its state across steps
        coef=cfg.adaptive_entropy_init,
        target=cfg.H_tgt if cfg.adaptive_entropy_target is None else cfg.adaptive_entropy_target,
        delta=cfg.adaptive_entropy_delta,
        max_coef=cfg.adaptive_entropy_max,
    )
    records: list[dict[str, float]] = []
    for step in range(1, cfg.steps + 1):
        drawn: list[Group] = []
        draw_batch = partial(_draw, cfg, policy, target, gen, drawn)
        kept, ds = dynamic_sampling(draw_batch, target_groups=cfg.prompts, max_batches=cfg.max_batches)
        first = drawn[: cfg.prompts]
        rec: dict[str, float] = {
            "step": step,
            "reward": sum(sum(g.rewards) for g in first) / (cfg.prompts * cfg.samples),
            "kept_groups": ds["ds/groups_kept"],
            "batches_drawn": ds["ds/batches_drawn"],
        }
        logged = step % log_every == 0 or step == cfg.steps
        if logged:  # before the update, as the batch entropies
            rec["policy_entropy"] = policy.entropy()
        rec["drawn_entropy"] = float(torch.cat([g.entropy for g in drawn]).mean())
        if kept:
            rec.update(_update(cfg, policy, opt, kept, rec["drawn_entropy"], control, entropy_ctl))
        if cfg.task == "drift":  # a context that is solved half the time gets the next target
            for g in drawn:
                accuracy[g.context] += DRIFT_EMA * (sum(g.rewards) / len(g.rewards) - accuracy[g.context])
                if accuracy[g.context] >= 0.5:
                    target[g.context], accuracy[g.context] = (target[g.context] + 1) % cfg.modulus, 0.0
        if logged:
            records.append(rec)
    return records


def _draw(
    cfg: LabConfig, policy: Policy, target: torch.Tensor, gen: torch.Generator, drawn: list[Group]
) -> list[Group]:
    """One prompt batch: ``cfg.prompts`` contexts x ``cfg.samples`` responses, scored; appended to ``drawn``."""
    c = torch.randint(cfg.contexts, (cfg.prompts,), generator=gen)
    tok, H = policy.sample(c, cfg.samples, gen)  # [n, G, T], [n, G or 1, T]
    r = (tok.sum(-1) % cfg.modulus == target[c][:, None]).float()
    groups = [Group(int(c[i]), tok[i], r[i].tolist(), H[i]) for i in range(cfg.prompts)]
    drawn.extend(groups)
    return groups


def _update(
    cfg: LabConfig,
    policy: Policy,
    opt: torch.optim.Optimizer,
    kept: Sequence[Group],
    drawn_entropy: float,
    control: torch.Generator,
    entropy_ctl: AdaptiveEntropyCoefficient,
) -> dict[str, float]:
    """Advantages, log-probs, gate, weights, loss and one optimizer step on the kept groups."""
    G, T = cfg.samples, cfg.positions
    rewards = torch.tensor([r for g in kept for r in g.rewards])
    A, _ = grpo_advantages(rewards, group_size=G)
    contexts = torch.tensor([g.context for g in kept]).repeat_interleave(G)  # [B]
    tokens = torch.cat([g.tokens for g in kept])  # [B, T]
    mask = torch.ones(len(tokens), T, dtype=torch.bool)
    logits = policy.logits(contexts, tokens)  # [B, T, V]
    logp, entropy, moments = logprobs_and_entropy_from_logits(logits, tokens, with_moments=True)
    A_tok = broadcast_to_tokens(A, mask)
    gate_on, Hbar, _ = entropy_gate(entropy, mask, cfg.H_tgt)
    out = {"kept_entropy": Hbar}
    if cfg.gate_batch == "drawn":
        gate_on = drawn_entropy < cfg.H_tgt
    if cfg.gate == "always_on":
        gate_on = True
    weights = None
    if cfg.algorithm in ("stare", "random"):
        raising = raising_tokens(logp, entropy, moments) if cfg.L_plus_rule == "top_k_raising" else None
        weights, L_plus, L_minus, metrics = stare_weights(
            A_tok,
            logp,
            mask,
            gate_on=gate_on,
            variant="C2" if cfg.variant == "C2" else "O1",
            P=cfg.P,
            W=cfg.W,
            M=cfg.M,
            scope="global",
            L_plus_filter=raising,
        )
        metrics.update(mechanism_metrics(A_tok, weights, L_plus, L_minus, mask, logp, entropy, moments))
        if cfg.algorithm == "random":  # the same number of T+ tokens, chosen at random
            T_plus = (mask & (A_tok > 0)).flatten().nonzero().squeeze(1)
            pick = T_plus[torch.randperm(len(T_plus), generator=control)[: int(L_plus.sum())]]
            weights = torch.ones_like(logp.detach())
            if gate_on:
                weights.view(-1)[pick] = cfg.W
            L_plus = torch.zeros_like(mask)
            L_plus.view(-1)[pick] = True
            metrics.update(
                mechanism_metrics(A_tok, weights, L_plus, L_plus & False, mask, logp, entropy, moments)
            )
            metrics["stare/mean_weight"] = float(weights.mean())
        out.update({k.removeprefix("stare/"): v for k, v in metrics.items() if k in _KEPT_METRICS})
    kl_coef = None
    if cfg.algorithm == "kl_cov":
        kl_coef, metrics = kl_cov_coefficients(A_tok, logp, mask, k=cfg.kl_cov_k, coef=cfg.kl_cov_coef)
        out["frac_selected"] = metrics["kl_cov/frac_selected"]
    elif cfg.algorithm == "clip_cov":
        weights, metrics = clip_cov_weights(
            A_tok, logp, mask, r=cfg.clip_cov_r, lb=cfg.clip_cov_lb, ub=cfg.clip_cov_ub, generator=control
        )
        out["frac_selected"] = metrics["clip_cov/frac_selected"]
    elif cfg.algorithm == "forking_tokens":
        weights, metrics = forking_token_weights(entropy, mask, rho=cfg.forking_rho)
        out["frac_selected"] = metrics["forking/frac_selected"]
    elif cfg.algorithm in ("steer", "stapo", "entroadv", "first_order"):
        A_tok, weights = _token_weighting(cfg, A_tok, logp, entropy, moments, mask, gate_on, out)
    beta = {"entropy_bonus": cfg.entropy_coef, "adaptive_entropy": entropy_ctl.beta}.get(cfg.algorithm)
    if cfg.minibatches == 1 and not beta:  # a bonus needs H's gradient
        loss, _ = policy_loss(
            logp, logp.detach(), A_tok, mask, weights, eps_high=cfg.eps_high, kl_coef=kl_coef
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
    else:
        _minibatch_steps(
            cfg, policy, opt, contexts, tokens, logp.detach(), A_tok, mask, weights, kl_coef, beta or None
        )
    if cfg.algorithm == "adaptive_entropy":  # steps on the kept batch's entropy, after the update
        out["entropy_coef"] = beta or 0.0
        entropy_ctl.update(Hbar)
    out["gate_on"] = float(gate_on)
    return out


def _token_weighting(
    cfg: LabConfig,
    A_tok: torch.Tensor,
    logp: torch.Tensor,
    entropy: torch.Tensor,
    moments: torch.Tensor,
    mask: torch.Tensor,
    gate_on: bool,
    out: dict[str, float],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The field's token-weighting methods on the kept batch (global scope): (advantages, weights),
    their selection's share or mean weight written to ``out``."""
    weights = None
    if cfg.algorithm == "steer":
        weights, _ = steer_weights(A_tok, logp, entropy, mask, w_min=cfg.steer_w_min, w_max=cfg.steer_w_max)
    elif cfg.algorithm == "stapo":
        weights, metrics = stapo_weights(A_tok, logp, entropy, mask, tau_p=cfg.stapo_tau_p, q=cfg.stapo_q)
        out["frac_selected"] = metrics["stapo/frac_silenced"]
    elif cfg.algorithm == "entroadv":
        A_tok, _ = entroadv_advantages(
            A_tok, entropy, mask, alpha=cfg.entroadv_alpha, kappa=cfg.entroadv_kappa
        )
    elif cfg.algorithm == "first_order":
        weights, _ = first_order_weights(
            A_tok, logp, entropy, moments, mask, gate_on=gate_on, lambda_max=cfg.first_order_lambda_max
        )
    if weights is not None:
        out["mean_weight"] = float(weights[mask].double().mean())
    return A_tok, weights


def _minibatch_steps(
    cfg: LabConfig,
    policy: Policy,
    opt: torch.optim.Optimizer,
    contexts: torch.Tensor,
    tokens: torch.Tensor,
    logp_old: torch.Tensor,
    A_tok: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor | None,
    kl_coef: torch.Tensor | None,
    entropy_coef: float | None = None,
) -> None:
    """``cfg.minibatches`` optimizer steps over consecutive row blocks of the kept batch, each a
    token-mean over its block against the pre-update ``logp_old`` (an entropy bonus of coefficient
    ``entropy_coef`` with the gradient of each position's full entropy; None: no bonus)."""
    for rows in torch.arange(len(tokens)).chunk(cfg.minibatches):
        log_p = policy.logits(contexts[rows], tokens[rows]).log_softmax(-1)  # [b, T, V]
        logp = log_p.gather(-1, tokens[rows, :, None]).squeeze(-1)
        entropy = -(log_p.exp() * log_p).sum(-1) if entropy_coef is not None else None
        loss, _ = policy_loss(
            logp,
            logp_old[rows],
            A_tok[rows],
            mask[rows],
            weights[rows] if weights is not None else None,
            eps_high=cfg.eps_high,
            kl_coef=kl_coef[rows] if kl_coef is not None else None,
            entropy=entropy,
            entropy_coef=entropy_coef or 0.0,
        )
        opt.zero_grad()
        loss.backward()
        opt.step()


_KEPT_METRICS = {
    "stare/L_plus_raising",
    "stare/L_plus_s_above_H",
    "stare/mass_weight",
    "stare/mean_weight",
    "stare/L_plus_mass_share",
    "stare/dH_first_order",
    "stare/dH_first_order_L_plus",
}


# ----------------------------------------------------------------------------------------------
# The study: variants x seeds, a table and a figure
# ----------------------------------------------------------------------------------------------

TAIL = 0.1  # summary statistics are means over the last 10 % of the steps (never a single step)
COLUMNS = (
    ("policy_entropy", "policy H (last 10 %)"),
    ("kept_entropy", "kept-batch H"),
    ("drawn_entropy", "whole-draw H"),
    ("reward", "reward (fresh draw)"),
    ("gate_on", "gate on (all steps)"),
    ("L_plus_raising", "L+ raising"),
    ("mass_weight", "mass weight"),
    ("mean_weight", "token weight"),
    ("frac_selected", "tokens selected"),
    ("step_ms", "ms per step"),  # a run's wall time over its steps (lab() measures it; not per record)
)


def run_summary(records: list[dict[str, float]]) -> dict[str, float]:
    """Per-run numbers: means over the last 10 % of steps; the gate's on-fraction over all steps."""
    tail = records[-max(1, int(len(records) * TAIL)) :]
    out: dict[str, float] = {}
    for key, _ in COLUMNS:
        rows = records if key == "gate_on" else tail
        values = [r[key] for r in rows if key in r and math.isfinite(r[key])]
        if values:
            out[key] = sum(values) / len(values)
    out["policy_entropy_start"] = records[0]["policy_entropy"]
    return out


def lab(
    variants: Sequence[str],
    seeds: int,
    *,
    task: str = "mod7",
    steps: int = 2000,
    out_dir: Path,
    log_every: int = 10,
    minibatches: int = 1,
    policy: str = "table",
) -> dict[str, Any]:
    """Run every variant x seed, write ``lab_<task>.json`` (again after each variant, so a stopped run
    keeps the variants it finished) and return the summaries."""
    torch.set_num_threads(1)
    out_dir.mkdir(parents=True, exist_ok=True)
    curves: dict[str, list[list[dict[str, float]]]] = {}
    summary: dict[str, dict[str, dict[str, float]]] = {}
    t0 = time.perf_counter()
    base = LabConfig(task=task, steps=steps, minibatches=minibatches, policy=policy)
    result: dict[str, Any] = {}
    for name in variants:
        per_seed: dict[str, list[float]] = {}
        for seed in range(seeds):
            cfg = replace(base, seed=seed, **VARIANTS[name])
            t_run = time.perf_counter()
            records = run(cfg, log_every=log_every)
            per_seed.setdefault("step_ms", []).append(1000 * (time.perf_counter() - t_run) / steps)
            curves.setdefault(name, []).append(records)
            for key, value in run_summary(records).items():
                per_seed.setdefault(key, []).append(value)
        summary[name] = {key: mean_sd_ci(values) for key, values in per_seed.items()}
        print(
            f"[lab {policy} {task}] {name}: {format_table_row(name, summary[name])}  ({time.perf_counter() - t0:.0f} s)"
        )
        result = _result(base, seeds, summary, curves, time.perf_counter() - t0)
        (out_dir / f"lab_{task}.json").write_text(json.dumps(result))
    return result


def _result(
    base: LabConfig,
    seeds: int,
    summary: dict[str, dict[str, dict[str, float]]],
    curves: dict[str, list[list[dict[str, float]]]],
    wall_s: float,
) -> dict[str, Any]:
    return {
        "task": base.task,
        "policy": base.policy,
        "steps": base.steps,
        "seeds": seeds,
        "config": asdict(base),
        "variants": {name: VARIANTS[name] for name in summary},
        "summary": summary,
        "curves": {
            name: [
                [
                    {
                        k: r[k]
                        for k in ("step", "policy_entropy", "kept_entropy", "drawn_entropy", "reward")
                        if k in r
                    }
                    for r in recs
                ]
                for recs in runs
            ]
            for name, runs in curves.items()
        },
        "wall_s": wall_s,
    }


def format_table_row(name: str, numbers: dict[str, dict[str, float]]) -> str:
    cells = [format_ci(numbers[key]) if key in numbers else "-" for key, _ in COLUMNS]
    return f"| {name} | " + " | ".join(cells) + " |"


def format_table(result: dict[str, Any]) -> str:
    """Markdown table: mean ± 95 % t interval over seeds of each run's last-10 % means."""
    lines = [
        "| variant | " + " | ".join(title for _, title in COLUMNS) + " |",
        "|---|" + "---:|" * len(COLUMNS),
    ]
    lines += [format_table_row(name, numbers) for name, numbers in result["summary"].items()]
    return "\n".join(lines) + "\n"


def format_paired_table(results: Sequence[dict[str, Any]]) -> str:
    """One markdown table over tasks: per variant, each task's policy entropy (last 10 %), fresh-draw
    reward and wall time per step, mean ± 95 % t interval over seeds (the variants of the first task)."""
    cells = [("policy_entropy", "H"), ("reward", "reward"), ("step_ms", "ms/step")]
    head = [f"{r['task']} {title}" for r in results for _, title in cells]
    lines = ["| variant | " + " | ".join(head) + " |", "|---|" + "---:|" * len(head)]
    for name in results[0]["summary"]:
        row = [
            format_ci(r["summary"][name][key]) if name in r["summary"] and key in r["summary"][name] else "-"
            for r in results
            for key, _ in cells
        ]
        lines.append(f"| {name} | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def format_target_sweep(result: dict[str, Any]) -> str:
    """Per target-sweep variant: the last-10 % mean of the estimator its controller reads at each H_tgt
    (mean ± 95 % t over seeds), and the paired (same seed) difference between H_tgt 0.45 and 0.15 with
    its share of the targets' difference (1: the level follows the target; 0: it does not move), and
    the same paired difference of the policy's own entropy (where a gate reads the kept groups, its
    estimator can follow the target while the policy does not). Empty when the result holds no sweep."""
    head = ["method (the estimator it reads)", *(f"H_tgt {t}" for t in TARGETS)]
    head += ["0.45 minus 0.15 (paired by seed)", "share of the target's 0.30", "policy H: 0.45 minus 0.15"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for name, key in TARGET_SWEEP:
        names = {t: name if t == 0.3 else f"{name}-H{t}" for t in TARGETS}
        if not all(v in result["curves"] for v in names.values()):
            continue
        runs = {t: [run_summary(recs) for recs in result["curves"][v]] for t, v in names.items()}
        tails = {t: [r[key] for r in rs] for t, rs in runs.items()}
        diff = mean_sd_ci([hi - lo for hi, lo in zip(tails[0.45], tails[0.15], strict=True)])
        policy = mean_sd_ci(
            [
                hi["policy_entropy"] - lo["policy_entropy"]
                for hi, lo in zip(runs[0.45], runs[0.15], strict=True)
            ]
        )
        estimator = {"drawn_entropy": "whole-draw H", "kept_entropy": "kept-batch H"}[key]
        cells = [format_ci(mean_sd_ci(tails[t])) for t in TARGETS]
        cells += [format_ci(diff), f"{diff['mean'] / (TARGETS[-1] - TARGETS[0]):.2f}", format_ci(policy)]
        lines.append(f"| {name} ({estimator}) | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n" if len(lines) > 2 else ""


def plot(results: Sequence[dict[str, Any]], path: Path, shown: Sequence[str]) -> None:
    """Policy entropy over steps (mean and min-max over seeds), one panel per task, log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6.5 * len(results), 4.5), squeeze=False)
    for ax, result in zip(axes[0], results, strict=True):
        for name in shown:
            runs = result["curves"].get(name)
            if not runs:
                continue
            steps = [r["step"] for r in runs[0]]
            H = torch.tensor([[r["policy_entropy"] for r in recs] for recs in runs])
            (line,) = ax.plot(steps, H.mean(0), label=name, lw=1.2)
            ax.fill_between(steps, H.min(0).values, H.max(0).values, color=line.get_color(), alpha=0.15)
        ax.axhline(LabConfig().H_tgt, color="k", ls="--", lw=0.8, label="H_tgt")
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel("policy entropy (nats)")
        policy = result.get("policy", "table")
        ax.set_title(f"{policy} policy, task {result['task']}: {result['seeds']} seeds, mean and min-max")
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


FIGURE_VARIANTS = (
    "grpo-ds",
    "o1",
    "random",
    "open-W1.1",
    "o1-W2",
    "o1-W3",
    "o1-W5",
    "o1-W10",
    "o1-drawgate",
    "o1-W3-drawgate",
)


def load_result(out: Path, task: str, merge: Sequence[Path] = ()) -> dict[str, Any]:
    """``out/lab_<task>.json``, with the variants of each ``merge/lab_<task>.json`` (where there is one)
    added: runs of one study (the same policy, steps, seeds and config but the variant's) split over processes."""
    result = json.loads((out / f"lab_{task}.json").read_text())
    for other_dir in merge:
        if not (other_dir / f"lab_{task}.json").is_file():
            continue  # that process ran other tasks
        other = json.loads((other_dir / f"lab_{task}.json").read_text())
        for key in ("policy", "steps", "seeds", "config"):
            if other.get(key) != result.get(key):
                raise SystemExit(
                    f"--merge {other_dir}: its {key} differs from {out}'s; merge only runs of the same study"
                )
        for key in ("variants", "summary", "curves"):
            result[key].update(other[key])
        result["wall_s"] += other["wall_s"]
    return result


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m stare_research.lab", description=__doc__.split("\n")[0])
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names of VARIANTS")
    parser.add_argument("--tasks", default="mod7,drift")
    parser.add_argument("--policy", default="table", choices=("table", "transformer"))
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--log-every", type=int, default=10, help="steps between records (the tail's mean)")
    parser.add_argument("--out", type=Path, default=Path("runs/lab"))
    parser.add_argument(
        "--minibatches", type=int, default=1, help="optimizer steps per kept batch (1: the paper's)"
    )
    parser.add_argument(
        "--figure-only", action="store_true", help="draw lab.png from the tasks' saved lab_<task>.json"
    )
    parser.add_argument(
        "--table-only",
        action="store_true",
        help="print one table over the tasks' saved lab_<task>.json, then each task's whole table",
    )
    parser.add_argument(
        "--merge",
        type=Path,
        action="append",
        default=[],
        metavar="DIR",
        help="with --figure-only / --table-only: add the variants saved in DIR (a study split over processes)",
    )
    args = parser.parse_args(argv)
    tasks = args.tasks.split(",")
    if args.table_only or args.figure_only:
        saved = [load_result(args.out, task, args.merge) for task in tasks]
    if args.table_only:
        print(format_paired_table(saved))
        for result in saved:
            print(f"{result['policy']} policy, task {result['task']}\n{format_table(result)}")
            if sweep := format_target_sweep(result):
                print(f"target sweep, {result['policy']} policy, task {result['task']}\n{sweep}")
        return
    if args.figure_only:
        plot(saved, args.out / "lab.png", shown=FIGURE_VARIANTS)  # each panel: the variants its task ran
        return
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}: choose from {', '.join(VARIANTS)}")
    results = []
    for task in tasks:
        result = lab(
            variants,
            args.seeds,
            task=task,
            steps=args.steps,
            out_dir=args.out,
            minibatches=args.minibatches,
            policy=args.policy,
            log_every=args.log_every,
        )
        results.append(result)
        table = format_table(result)
        (args.out / f"lab_{task}.md").write_text(table)
        print(
            f"\n{args.policy} policy, task {task}, {args.seeds} seeds x {args.steps} steps, {result['wall_s']:.0f} s\n{table}"
        )
    plot(results, args.out / "lab.png", shown=[v for v in FIGURE_VARIANTS if v in variants])


if __name__ == "__main__":
    main()
