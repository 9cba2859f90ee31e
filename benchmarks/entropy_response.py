"""The paired one-step entropy response of STARE's token subsets and of issue 31's methods, real model.

From one start (``--model``, default the embedded SmolLM2-135M-Instruct), in float32 on CPU:

1. A held-out BANK: sequences sampled at temperature 1 on problems the batches never draw,
   teacher-forced; ``H_bank`` = the mean full-vocabulary entropy over its response tokens.
   ``h = grad H_bank`` (one backward; saved in ``--out/bank.pt`` for ``--resume``).
2. For each BATCH (single-turn, samples at temperature 1; reward = the project's ``compute_reward``
   of the last ``\\boxed{}``, by default correctness only: 1 correct, 0 otherwise): GRPO-ds's dynamic
   sampling draws ``--prompts`` problems x ``--group`` samples at a time (MATH-500 levels 1-2 by
   default) and keeps the groups whose rewards vary until ``--groups`` are kept, so no forward or
   backward is spent on a group without signal. GRPO advantages over the kept groups. Then the
   directional derivatives d_t, e_t of every token's log-prob and entropy along u = h (SGD, D = I) by
   one central difference (two forwards), so ``I_t = A_t d_t / N`` and a subset's first-order
   response is ``dH_S = lr sum_S I_t`` (``stare_research.entropy_response``). Subsets: all
   (the GRPO-ds update), T+, T-, L+ and L- at several P, the bottom-P of T+ by surprisal, a random T+
   subset of |L+| (its expectation), the oracle (the |L+| tokens of T+ with the largest I_t).
   METHODS (``loss_response``): one SGD step of each method's own loss (``policy_loss`` with the
   method's weights, KL-Cov coefficients or entropy bonus at the config defaults), read from the
   loss's per-token coefficients: GRPO-ds, STARE O1 and C2 with the gate on, the entropy bonus
   (beta = 0.001), KL-Cov, Clip-Cov, forking tokens; paired per batch with GRPO-ds.
3. Validation on the first batches: the exact inner product ``-lr <h, g>`` from a backward (GRPO-ds,
   L+ and the entropy bonus's whole loss), and REAL SGD steps ``theta - lr (g_all + (W - 1) g_L+)``
   at W in {1, 2, 4}: H_bank measured after the step.

``--from-run RUN`` replaces 1 and 2's sampling with a run's own saved data (``trainer.save_rollouts``):
the bank is the run's held-out entropy bank (``research.entropy_bank``: multi-turn tool episodes, its
model-written tokens scored, tool output as context), the batches are the groups the run's dynamic
sampling kept at each step, with the run's rewards, and the start is the run's ``model.name_or_path``.
The batches are on-policy for the start only where the run's weights did not move (e.g. a run at
``optim.lr=1e-30``, whose Adam steps are below float32 resolution: docs/research/study.md).

Every subset and method is evaluated on the same batches; the table gives the mean over batches with
a 95 % t-interval, and paired differences. ``lr`` is fixed for the run: the SGD step of the first
batch's full update has the norm of one Adam step of lr 1e-6 on every parameter (1e-6 * sqrt(#params)).

    .venv/bin/python benchmarks/entropy_response.py --quick --out /tmp/er_quick
    .venv/bin/python benchmarks/entropy_response.py --batches 10 --time-limit 1300 --out runs/entropy_response
    .venv/bin/python benchmarks/entropy_response.py --batches 10 --time-limit 1300 --out runs/entropy_response --resume
    .venv/bin/python benchmarks/entropy_response.py --from-run runs/closed_loop/runs/draws --adam-lr 1e-5 \\
        --validate 1 --check 2 --out runs/entropy_response_closed_loop
    .venv/bin/python benchmarks/entropy_response.py --from-records --out runs/entropy_response   # the table
    .venv/bin/python benchmarks/entropy_response.py --from-csv docs/research/entropy_response_sft48.csv
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from stare_agent.algorithms.advantages import broadcast_to_tokens, grpo_advantages
from stare_agent.algorithms.entropy_control import (
    clip_cov_weights,
    forking_token_weights,
    kl_cov_coefficients,
)
from stare_agent.algorithms.logprobs import causal_lm_logprobs_and_entropy
from stare_agent.algorithms.losses import policy_loss
from stare_agent.algorithms.stare import stare_weights
from stare_agent.algorithms.token_weighting import (
    entroadv_advantages,
    first_order_weights,
    stapo_weights,
    steer_weights,
)
from stare_agent.intervals import format_ci, mean_sd_ci
from stare_agent.models import load_policy, tiny_model
from stare_agent.provenance import machine
from stare_envs.problems import generate_problems, load_problems
from stare_envs.rewards import RewardConfig, compute_reward, extract_boxed
from stare_research.entropy_effect import raising_tokens
from stare_research.entropy_response import (
    directional_derivative,
    loss_response,
    response_subsets,
    sign_agreement,
    subset_responses,
    token_influence,
)

INSTRUCTION = "\nAnswer briefly and give the final answer in \\boxed{}."


def generate_rows(model, tok, problems, group: int, max_new: int, seed: int):
    """``(prompt ids, response ids)`` of every prompt x ``group`` samples, and the decoded responses.

    All prompts x ``group`` samples go through ONE left-padded ``generate`` call (a decoding step
    costs about the same for 4 or 16 rows on a memory-bound CPU)."""
    prompts = []
    for prob in problems:
        msgs = [{"role": "user", "content": prob.problem + INSTRUCTION}]
        prompt = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt")
        if not isinstance(prompt, torch.Tensor):
            prompt = prompt["input_ids"]
        prompts += [prompt[0].tolist()] * group
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    Lp = max(len(p) for p in prompts)
    left = torch.full((len(prompts), Lp), pad, dtype=torch.long)
    left_attn = torch.zeros_like(left)
    for n, p in enumerate(prompts):
        left[n, Lp - len(p) :] = torch.tensor(p)
        left_attn[n, Lp - len(p) :] = 1
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(
            left,
            attention_mask=left_attn,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max_new,
            pad_token_id=pad,
        )
    rows, texts = [], []
    for n, p in enumerate(prompts):
        resp = out[n, Lp:].tolist()
        if tok.eos_token_id in resp:
            resp = resp[: resp.index(tok.eos_token_id) + 1]
        elif pad in resp and pad != tok.eos_token_id:
            resp = resp[: resp.index(pad)]
        rows.append((p, resp))
        texts.append(tok.decode(resp, skip_special_tokens=True))
    return rows, texts


def pad_rows(rows, pad: int):
    """Right-padded [N, L] ids, attention mask, score mask [N, L-1] (the response tokens)."""
    L = max(len(p) + len(r) for p, r in rows)
    N = len(rows)
    ids = torch.full((N, L), pad, dtype=torch.long)
    attn = torch.zeros(N, L, dtype=torch.long)
    score = torch.zeros(N, L - 1, dtype=torch.bool)
    for n, (p, r) in enumerate(rows):
        ids[n, : len(p) + len(r)] = torch.tensor(p + r)
        attn[n, : len(p) + len(r)] = 1
        score[n, len(p) - 1 : len(p) + len(r) - 1] = True
    return ids, attn, score


def episode_rows(episodes, pad: int):
    """Right-padded ids, attention mask and score mask of saved episodes (``Trajectory``): the score
    mask marks the positions that predict a MODEL-written response token (loss mask 1), so tool output
    and template glue are context, never scored, as in the learner."""
    ids, attn, score = pad_rows([(t.prompt_ids, t.response_ids) for t in episodes], pad)
    for n, t in enumerate(episodes):
        start = len(t.prompt_ids) - 1
        score[n, start : start + len(t.response_ids)] = torch.tensor(t.loss_mask, dtype=torch.bool)
    return ids, attn, score


def saved_batches(run_dir: Path):
    """``(step, episodes, rewards, group index)`` of every saved step of a run whose dynamic sampling kept
    a group (``stare_research.replay.load_step``: the groups the run trained on, in draw order)."""
    from stare_research.replay import load_step, step_files

    for step, path in step_files(run_dir):
        _, kept = load_step(path)
        if kept:
            episodes = [t for g in kept for t in g.trajectories]
            rewards = torch.tensor([r for g in kept for r in g.rewards], dtype=torch.float32)
            # as the trainer: a group that lost an episode to the sandbox is smaller
            group_index = torch.tensor([i for i, g in enumerate(kept) for _ in g.rewards])
            yield step, episodes, rewards, group_index


def rewards_of(texts, golds, penalty: float) -> torch.Tensor:
    cfg = RewardConfig(format_penalty=penalty)
    return torch.tensor(
        [compute_reward(extract_boxed(t), g, config=cfg)[0] for t, g in zip(texts, golds, strict=True)]
    )


def bank_entropy(model, ids, attn, score, chunk: int = 256) -> torch.Tensor:
    """Mean full-vocabulary entropy over the score-mask positions, WITH its gradient (float32 math)."""
    hidden = model.base_model(input_ids=ids, attention_mask=attn).last_hidden_state[:, :-1][score]
    head = model.get_output_embeddings()
    total = hidden.new_zeros((), dtype=torch.float64)  # fp32 per token, summed in fp64
    for lo in range(0, hidden.shape[0], chunk):
        z = head(hidden[lo : lo + chunk]).float()
        logp = torch.log_softmax(z, dim=-1)
        total = total + (-(logp.exp() * logp).sum(-1)).double().sum()
    return total / hidden.shape[0]


def bank_entropy_by_rows(model, ids, attn, score, rows: int = 4, grad: bool = False) -> float:
    """``H_bank`` (the mean over ALL score positions) computed ``rows`` sequences at a time, each slice cut
    to its longest sequence; with ``grad``, ``grad H_bank`` is accumulated in the parameters' ``.grad``
    (a 32-episode bank in one fp32 forward with grad holds ~18 GB of activations)."""
    total, H = int(score.sum()), 0.0
    for lo in range(0, ids.shape[0], rows):
        length = int(attn[lo : lo + rows].sum(1).max())
        sl = (slice(lo, lo + rows), slice(0, length))
        part_score = score[lo : lo + rows, : length - 1]
        if not part_score.any():
            continue
        with torch.set_grad_enabled(grad):
            part = bank_entropy(model, ids[sl], attn[sl], part_score) * (int(part_score.sum()) / total)
            if grad:
                part.backward()
        H += float(part.detach())
    return H


def batch_scores(model, ids, attn, score) -> torch.Tensor:
    """[2, N, L-1]: every response token's log-prob and full-vocabulary entropy (0 off the mask)."""
    return torch.stack(causal_lm_logprobs_and_entropy(model, ids, attn, score_mask=score))


def scores_and_moments(model, ids, attn, score):
    """``batch_scores``' log-probs and entropies (the same values) and, from the same pass, the detached
    moments [N, L-1, 2] that the rule ``top_k_raising`` and the first-order weighting read."""
    return causal_lm_logprobs_and_entropy(model, ids, attn, score_mask=score, with_moments=True)


def flat_grad(params) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in params])


def unflatten(vec, params):
    out, i = [], 0
    for p in params:
        out.append(vec[i : i + p.numel()].view_as(p))
        i += p.numel()
    return out


def problem_pool(args):
    """(batch problems, bank problems): disjoint; a built-in set is shuffled by ``--seed`` and filtered
    to ``--levels`` (MATH-500's level, read from its ``source`` field)."""
    if args.source.startswith("procedural:"):
        family = args.source.split(":", 1)[1] or "mixed"
        return (
            generate_problems(family, 10_000, seed=args.seed),
            generate_problems(family, args.bank_prompts, seed=10_000 + args.seed),
        )
    probs = load_problems(args.source)
    if args.levels:
        probs = [p for p in probs if any(f"level {lv})" in p.source for lv in args.levels)]
    if len(probs) <= args.bank_prompts:
        raise SystemExit(f"{args.source} levels {args.levels}: only {len(probs)} problems: widen --levels")
    random.Random(args.seed).shuffle(probs)
    return probs[args.bank_prompts :], probs[: args.bank_prompts]


def draw_batch(model, tok, pool, args, cursor: int, log, deadline: float = math.inf):
    """GRPO-ds's dynamic sampling: draw ``--prompts`` problems x ``--group`` samples at a time, keep the
    groups whose rewards vary, until ``--groups`` are kept. Returns (rows, rewards [G * group], cursor,
    groups drawn; rows None when ``--max-draw`` problems or the ``deadline`` (time.time()) passed first);
    a drawn problem is never drawn again in this run while the pool lasts (it cycles
    with new sampling seeds after)."""
    rows, rewards, drawn = [], [], 0
    while len(rewards) < args.groups * args.group:
        probs = [pool[(cursor + i) % len(pool)] for i in range(args.prompts)]
        new_rows, texts = generate_rows(model, tok, probs, args.group, args.max_new, args.seed + cursor)
        golds = [p.answer for p in probs for _ in range(args.group)]
        r = rewards_of(texts, golds, args.penalty)
        if args.tiny:  # the tiny random model never answers: random rewards exercise the pipeline
            r = torch.randint(0, 2, r.shape, generator=torch.Generator().manual_seed(cursor)).float()
        cursor += args.prompts
        drawn += args.prompts
        for g in range(args.prompts):
            rg = r[g * args.group : (g + 1) * args.group]
            if float(rg.max() - rg.min()) > 0 and len(rewards) < args.groups * args.group:
                rows += new_rows[g * args.group : (g + 1) * args.group]
                rewards += rg.tolist()
        log(f"  drew problems up to {cursor}: correct per group {r.view(args.prompts, -1).sum(1).tolist()}")
        if drawn > args.max_draw or time.time() > deadline:
            return None, None, cursor, drawn
    return rows, torch.tensor(rewards), cursor, drawn


def method_losses(A_tok, logp, entropy, moments, mask, args, batch: int):
    """Each method's loss ``l(logp, H)`` as the learner builds it (config defaults; selections over the
    whole batch), and the seconds its token selection took (its extra cost over GRPO-ds's step).

    The field's token-weighting methods (``stare_agent.algorithms.token_weighting``) at their
    defaults: STEER, STAPO, EntroAdv and this project's first-order weighting (the gate forced on, as
    for STARE's rows). The adaptive entropy coefficient is left out: one step from its start (c = 0)
    is GRPO-ds's, and at any c it is the entropy bonus's row scaled by c / beta (the bonus's response
    is linear in beta)."""
    lp0 = logp.detach()
    A = A_tok.double()
    out = {}

    def timed(fn):
        t = time.perf_counter()
        value = fn()
        return value, time.perf_counter() - t

    def pg(weights=None, kl_coef=None, beta=0.0):
        return lambda lp, H: policy_loss(
            lp, lp.detach(), A, mask, weights, kl_coef=kl_coef, entropy=H, entropy_coef=beta
        )[0]

    out["grpo_ds"] = (pg(), 0.0)
    for variant in ("O1", "C2"):
        (w, *_), sec = timed(
            lambda v=variant: stare_weights(A_tok, lp0, mask, gate_on=True, variant=v, scope="global")
        )
        out[f"stare_{variant}"] = (pg(w.double()), sec)
    out["entropy_bonus"] = (pg(beta=args.entropy_coef), 0.0)
    (kl, _), sec = timed(lambda: kl_cov_coefficients(A_tok, lp0, mask, scope="global"))
    out["kl_cov"] = (pg(kl_coef=kl.double()), sec)
    gen = torch.Generator().manual_seed(args.seed * 1_000 + batch)
    (w, m), sec = timed(lambda: clip_cov_weights(A_tok, lp0, mask, generator=gen, scope="global"))
    out["clip_cov"] = (pg(w.double()), sec)
    (w, _), sec = timed(lambda: forking_token_weights(entropy.detach(), mask, scope="global"))
    out["forking_tokens"] = (pg(w.double()), sec)
    H0 = entropy.detach()
    (w, _), sec = timed(lambda: steer_weights(A_tok, lp0, H0, mask))
    out["steer"] = (pg(w.double()), sec)
    (w, _), sec = timed(lambda: stapo_weights(A_tok, lp0, H0, mask))
    out["stapo"] = (pg(w.double()), sec)
    (A_shaped, _), sec = timed(lambda: entroadv_advantages(A_tok, H0, mask))
    out["entroadv"] = (
        lambda lp, H, A_shaped=A_shaped.double(): policy_loss(lp, lp.detach(), A_shaped, mask)[0],
        sec,
    )
    (w, _), sec = timed(lambda: first_order_weights(A_tok, lp0, H0, moments, mask, gate_on=True))
    out["first_order"] = (pg(w.double()), sec)
    return out, {"clip_cov_candidates": m["clip_cov/frac_candidates"] * int(mask.sum())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: 2 batches, tiny bank, short samples")
    ap.add_argument("--batches", type=int, default=12)
    ap.add_argument("--model", default=None, help="policy to start from (default: the embedded model)")
    ap.add_argument("--source", default="math500", help="a built-in set, or procedural:<family>")
    ap.add_argument("--levels", type=int, nargs="*", default=[1, 2], help="MATH levels kept ([] = all)")
    ap.add_argument("--prompts", type=int, default=4, help="problems per draw (one generate call)")
    ap.add_argument("--groups", type=int, default=2, help="groups with reward variance per batch")
    ap.add_argument("--max-draw", type=int, default=40, help="give up a batch after this many problems")
    ap.add_argument("--group", type=int, default=8, help="samples per prompt")
    ap.add_argument("--max-new", type=int, default=160)
    ap.add_argument("--bank-prompts", type=int, default=4)
    ap.add_argument("--bank-group", type=int, default=4)
    ap.add_argument("--validate", type=int, default=1, help="batches with real SGD steps at W in --W")
    ap.add_argument(
        "--check", type=int, default=3, help="batches whose central difference is checked by a backward"
    )
    ap.add_argument("--W", type=float, nargs="+", default=[1.0, 2.0, 4.0])
    ap.add_argument("--P", type=float, nargs="+", default=[0.05, 0.1, 0.2])
    ap.add_argument("--penalty", type=float, default=0.0, help="format_penalty of the reward")
    ap.add_argument("--entropy-coef", type=float, default=0.001, help="entropy bonus beta (config default)")
    ap.add_argument("--fd-step", type=float, default=1e-2, help="|eps u| of the central difference")
    ap.add_argument("--adam-lr", type=float, default=1e-6, help="sets the SGD step norm (see docstring)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--tiny", action="store_true", help="pipeline smoke test: tiny random model, random rewards"
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--time-limit", type=float, default=1440.0, help="start no batch after this (s)")
    ap.add_argument("--resume", action="store_true", help="continue the run saved in --out")
    ap.add_argument(
        "--from-run",
        type=Path,
        default=None,
        help="batches = the kept groups a run saved (trainer.save_rollouts), multi-turn with tool output "
        "masked; bank = its research.entropy_bank; start = its model.name_or_path (unless --model)",
    )
    ap.add_argument(
        "--from-csv", type=Path, default=None, help="reprint the published tables of a batches.csv"
    )
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument(
        "--from-records",
        action="store_true",
        help="summarize the batches already in --out/records.json (e.g. of a run stopped early) and exit",
    )
    args = ap.parse_args()
    if args.from_csv is not None:
        return print(tables_of_csv(args.from_csv))
    if args.out is None:
        ap.error("--out is required (or --from-csv CSV to reprint the published tables)")
    if args.from_records:
        return summarize_saved(args)
    if args.quick:
        args.batches, args.prompts, args.group, args.max_new, args.groups = 2, 2, 4, 48, 1
        args.bank_prompts, args.bank_group, args.validate = 1, 4, 1
    if args.check < 1 and args.validate < 1 and not args.resume:
        ap.error("--check 0 --validate 0: the first batch's full gradient sets the run's lr; use --check 1")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    run_config = None
    if args.from_run:
        from stare_agent.config import CONFIG_FILENAME
        from stare_research.config import load_research_config

        run_config = load_research_config(args.from_run / CONFIG_FILENAME)
        args.model = args.model or run_config.model.name_or_path
        if not run_config.research.entropy_bank:
            raise SystemExit(f"{args.from_run}: the run has no research.entropy_bank to measure on")
    t0 = time.time()
    log = lambda *a: print(f"[{time.time() - t0:7.1f}s]", *a, flush=True)  # noqa: E731
    if args.tiny:
        model, tok = tiny_model()
    else:
        model, tok = (
            load_policy(args.model, dtype=torch.float32) if args.model else load_policy(dtype=torch.float32)
        )
    model.eval()
    params = [p for p in model.parameters() if p.requires_grad]
    n_params = sum(p.numel() for p in params)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    if args.from_run:
        from stare_research.entropy_bank import read_bank

        saved_steps = list(saved_batches(args.from_run))
        bank_episodes = read_bank(run_config.research.entropy_bank)
    else:
        pool, bank_probs = problem_pool(args)

    # --- the bank and h = grad H_bank (saved, so that a resumed run measures against the same one)
    bank_file = args.out / "bank.pt"
    saved = json.loads((args.out / "records.json").read_text()) if args.resume else None
    if args.resume:
        bank = torch.load(bank_file)
        b_ids, b_attn, b_score, h = bank["ids"], bank["attn"], bank["score"], bank["h"].double()
        H0 = saved["meta"]["H_bank"]
    else:
        if args.from_run:
            b_ids, b_attn, b_score = episode_rows(bank_episodes, pad)
        else:
            b_rows, _ = generate_rows(
                model, tok, bank_probs, args.bank_group, args.max_new, 10_000 + args.seed
            )
            b_ids, b_attn, b_score = pad_rows(b_rows, pad)
        model.zero_grad(set_to_none=True)
        H0 = bank_entropy_by_rows(model, b_ids, b_attn, b_score, grad=True)
        h = flat_grad(params).double()
        model.zero_grad(set_to_none=True)
        torch.save({"ids": b_ids, "attn": b_attn, "score": b_score, "h": h.float()}, bank_file)
    u = unflatten((h / h.norm()).float(), params)  # unit direction; d_t is rescaled by |h| below
    log(
        f"bank: {int(b_score.sum())} tokens, H_bank = {H0:.4f}, |h| = {float(h.norm()):.4g}, params {n_params}"
    )

    def H_bank_now() -> float:
        with torch.no_grad():
            return bank_entropy_by_rows(model, b_ids, b_attn, b_score)

    H_check = H_bank_now()
    log(f"H_bank recomputed without grad: {H_check:.6f} (diff {H_check - H0:.2e})")

    if saved:
        records, val_records = saved["batches"], saved["validation"]
        lr, skipped, cursor = saved["meta"]["lr"], saved["meta"]["skipped"], saved["meta"]["cursor"]
        drawn_total, wall_before = saved["meta"]["drawn"], saved["meta"]["wall_s"]
    else:
        records, val_records, lr, skipped, cursor, drawn_total, wall_before = [], [], None, 0, 0, 0, 0.0

    def save() -> None:
        """The state a --resume continues from (also when a chunk stopped while drawing)."""
        meta = {
            "lr": lr,
            "H_bank": H0,
            "bank_tokens": int(b_score.sum()),
            "skipped": skipped,
            "cursor": cursor,
            "drawn": drawn_total,
            "wall_s": wall_before + time.time() - t0,
            "model": args.model or "embedded:smollm2-135m-instruct",
            "from_run": str(args.from_run) if args.from_run else None,
        }
        (args.out / "records.json").write_text(
            json.dumps({"batches": records, "validation": val_records, "meta": meta}, indent=1)
        )

    last = 0.0
    while len(records) < args.batches:
        if time.time() - t0 + last > args.time_limit:
            log(f"time limit: stopping before batch {len(records)}; continue with --resume")
            break
        tb = time.time()
        if args.from_run:
            if cursor >= len(saved_steps):
                log(f"{args.from_run}: all {len(saved_steps)} saved steps with a kept group measured")
                break
            step_no, episodes, r, group_index = saved_steps[cursor]
            cursor += 1
            ids, attn, score = episode_rows(episodes, pad)
            A, _ = grpo_advantages(r, group_index=group_index)
            drawn = int(group_index.max()) + 1
            rows = episodes
        else:
            rows, r, cursor, drawn = draw_batch(model, tok, pool, args, cursor, log, t0 + args.time_limit)
            if rows is not None:
                ids, attn, score = pad_rows(rows, pad)
                A, _ = grpo_advantages(r, group_size=args.group)
            step_no = None
        drawn_total += drawn
        if rows is None and time.time() > t0 + args.time_limit:
            log(f"time limit while drawing ({drawn} problems, no batch); continue with --resume")
            break
        if rows is None:
            skipped += 1
            log(f"no {args.groups} groups with reward variance in {drawn} problems: batch skipped")
            continue
        t_sampled = time.time()
        mask = score
        A_tok = broadcast_to_tokens(A, mask)
        N = int(mask.sum())
        # the full update's gradient (and L+ at P = 0.1's on validation batches), exact
        validating = len(val_records) < args.validate
        checking = validating or len(records) < args.check
        tf = time.perf_counter()
        if checking:
            logp, ent, moments = scores_and_moments(model, ids, attn, score)
            loss, _ = policy_loss(logp, logp.detach(), A_tok, mask)
            model.zero_grad(set_to_none=True)
            loss.backward(retain_graph=validating)
            g_all = flat_grad(params).double()
            step_s = time.perf_counter() - tf  # GRPO-ds's forward + backward: the reference cost
            model.zero_grad(set_to_none=True)
            del loss
        else:  # the first batches checked the central difference against the exact gradient
            with torch.no_grad():
                logp, ent, moments = scores_and_moments(model, ids, attn, score)
            g_all, step_s = None, None
        if validating:
            # L+ at P = 0.1's own gradient (before the central difference moves the weights)
            w_plus = stare_weights(A_tok, logp.detach(), mask, gate_on=False, P=0.1)[1].to(logp.dtype)
            loss_plus, _ = policy_loss(logp, logp.detach(), A_tok, mask, weights=w_plus, token_count=N)
            loss_plus.backward()
            g_plus = flat_grad(params).double()
            model.zero_grad(set_to_none=True)
            # the entropy bonus's whole loss, its exact gradient and its cost: a fresh forward + backward
            # of each loss, GRPO-ds's first, timed alike
            tf = time.perf_counter()
            logp_r, _ = batch_scores(model, ids, attn, score)
            policy_loss(logp_r, logp_r.detach(), A_tok, mask)[0].backward()
            ref_step_s = time.perf_counter() - tf
            model.zero_grad(set_to_none=True)
            del logp_r
            tf = time.perf_counter()
            logp_b, ent_b = batch_scores(model, ids, attn, score)
            loss_b, _ = policy_loss(
                logp_b, logp_b.detach(), A_tok, mask, entropy=ent_b, entropy_coef=args.entropy_coef
            )
            loss_b.backward()
            g_bonus = flat_grad(params).double()
            bonus_step_s = time.perf_counter() - tf
            model.zero_grad(set_to_none=True)
            del logp_b, ent_b, loss_b
        logp, ent = logp.detach(), ent.detach()
        raising = raising_tokens(logp, ent, moments) & mask.bool()
        if lr is None:
            lr = args.adam_lr * math.sqrt(n_params) / float(g_all.norm())
            log(f"lr (SGD, fixed for the run) = {lr:.4g}")
        # directional derivatives of every token's log p and H along u = h / |h|, then times |h|
        de = (
            directional_derivative(
                lambda ids=ids, attn=attn, score=score: batch_scores(model, ids, attn, score),
                params,
                u,
                args.fd_step,
            )
            * h.norm()
        )
        d, e = de[0], de[1]
        infl = token_influence(A_tok, d, mask)
        exact_all = -float(h @ g_all) if checking else None  # sum_t I_t should equal -<h, g_all>
        rec = {
            "batch": len(records),
            "step": step_no,
            "tokens": N,
            "rewards": r.tolist(),
            "problems_drawn": drawn,
            "fd_sum_all": float(infl.sum()),
            "exact_all": exact_all,
            "step_s": step_s,
            "sample_s": t_sampled - tb,
        }
        for P in args.P:
            subsets = response_subsets(A_tok, logp, mask, infl, P, raising=raising)
            resp = subset_responses(infl, subsets, P)
            for name, value in resp.items():
                rec[f"P{P}/{name}"] = lr * value
            rec[f"P{P}/k"] = int(subsets["L+"].sum())
            rec[f"P{P}/k raising"] = int(subsets["L+ raising"].sum())
            rec[f"P{P}/agree L+"] = sign_agreement(raising, infl, subsets["L+"])
        rec["agree T+"] = sign_agreement(raising, infl, mask.bool() & (A_tok > 0))
        rec["agree T-"] = sign_agreement(~raising & mask.bool(), infl, mask.bool() & (A_tok < 0))
        losses, extra = method_losses(A_tok, logp, ent, moments, mask, args, len(records))
        del moments
        rec.update(extra)
        grpo_coef = None
        for name, (loss_fn, sec) in losses.items():
            out = loss_response(loss_fn, logp, ent, d, e)
            rec[f"m/{name}"] = lr * out.total
            rec[f"m/{name}/entropy_part"] = lr * out.entropy_part
            rec[f"m/{name}/select_s"] = sec
            if name == "grpo_ds":
                grpo_coef = out.dl_dlogp
            if name == "kl_cov":  # 0 exactly: its penalty has no gradient at logp = logp_old
                rec["kl_cov_max_coef_diff"] = float((out.dl_dlogp - grpo_coef).abs().max())
        log(
            f"batch {len(records)}: N={N}, rewards {r.tolist()}, dH(GRPO-ds)={rec['m/grpo_ds']:.3e}, "
            f"fd/exact={rec['fd_sum_all'] / exact_all if exact_all else float('nan'):.4f}, "
            + ", ".join(
                f"{k[2:]} {v:+.2e}" for k, v in rec.items() if k.startswith("m/") and k.count("/") == 1
            )
        )
        if validating:
            v = {"batch": len(records), "fd_L+": lr * float(infl[w_plus.bool()].sum())}
            v["exact_L+"] = -lr * float(h @ g_plus)
            v["fd_bonus"] = rec["m/entropy_bonus"]
            v["exact_bonus"] = -lr * float(h @ g_bonus)
            v["bonus_step_s"], v["step_s"] = bonus_step_s, ref_step_s
            log(f"  entropy bonus: central difference {v['fd_bonus']:.4e}, exact {v['exact_bonus']:.4e}")
            for W in args.W:
                step = unflatten((-lr * (g_all + (W - 1) * g_plus)).float(), params)
                with torch.no_grad():
                    for p, s in zip(params, step, strict=True):
                        p.add_(s)
                H1 = H_bank_now()
                with torch.no_grad():
                    for p, s in zip(params, step, strict=True):
                        p.sub_(s)
                v[f"W{W}/measured"] = H1 - H_check
                v[f"W{W}/predicted"] = -lr * float(h @ (g_all + (W - 1) * g_plus))
                log(
                    f"  W={W}: measured dH_bank {v[f'W{W}/measured']:.4e}, predicted {v[f'W{W}/predicted']:.4e}"
                )
            val_records.append(v)
        del logp, g_all
        records.append(rec)
        save()
        last = time.time() - tb

    save()
    wall = wall_before + time.time() - t0
    if not records:
        return log(f"no batch with reward variance yet ({drawn_total} problems drawn, {wall:.0f} s)")
    summary = summarize(records, val_records, args)
    meta = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "lr": lr,
        "H_bank": H0,
        "bank_tokens": int(b_score.sum()),
        "skipped_batches": skipped,
        "drawn": drawn_total,
        "wall_s": wall,
        "machine": f"{machine()}, {torch.get_num_threads()} torch threads, load average "
        f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}, {platform.platform()}, torch {torch.__version__}",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": " ".join(sys.argv),
    }
    (args.out / "summary.json").write_text(json.dumps({"meta": meta, "summary": summary}, indent=1))
    write_csv(records, args.out / "batches.csv")
    print_table(summary, args, meta)


def summarize_saved(args) -> None:
    """The table of the batches saved so far; lr and the bank's size come from records.json's meta or
    else from the run's log (``--out/log.txt``, lines ``bank: ...`` and ``lr ...``)."""
    import re

    saved = json.loads((args.out / "records.json").read_text())
    meta = dict(saved.get("meta") or {})
    log_path = args.out / "log.txt"
    if not meta and log_path.is_file():
        text = log_path.read_text()
        bank = re.search(r"bank: (\d+) tokens, H_bank = ([0-9.]+)", text)
        lr = re.search(r"lr \(SGD, fixed for the run\) = ([0-9.e+-]+)", text)
        wall = re.findall(r"\[\s*([0-9.]+)s\]", text)
        meta = {
            "bank_tokens": int(bank.group(1)),
            "H_bank": float(bank.group(2)),
            "lr": float(lr.group(1)),
            "skipped": text.count("skipped (GRPO-ds)"),
            "wall_s": float(wall[-1]) if wall else math.nan,
        }
    meta.setdefault("wall_s", math.nan)
    meta["skipped_batches"] = meta.get("skipped", 0)
    meta["machine"] = "see the run's log"
    meta["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    summary = summarize(saved["batches"], saved["validation"], args)
    (args.out / "summary_partial.json").write_text(json.dumps({"meta": meta, "summary": summary}, indent=1))
    write_csv(saved["batches"], args.out / "batches.csv")
    print_table(summary, args, meta)


def ci(xs):
    """Mean, 95 % t half-width and n of ``xs``; None when there is none (e.g. ``--validate 0``)."""
    if not xs:
        return None
    s = mean_sd_ci(xs)
    return {"mean": s["mean"], "ci95": s["ci95"], "n": s["n"]}


def summarize(records, val_records, args):
    out = {}
    for P in args.P:
        k = f"P{P}"
        for name in ("all", "T+", "T-", "L+", "L-", "random", "bottom", "oracle"):
            out[f"{k}/{name}"] = ci([r[f"{k}/{name}"] for r in records])
        out[f"{k}/L+ - random"] = ci([r[f"{k}/L+"] - r[f"{k}/random"] for r in records])
        out[f"{k}/oracle - L+"] = ci([r[f"{k}/oracle"] - r[f"{k}/L+"] for r in records])
        out[f"{k}/L+ - bottom"] = ci([r[f"{k}/L+"] - r[f"{k}/bottom"] for r in records])
        # O1 holds entropy where dH_all + (W - 1) dH_L+ = 0 (ratio of batch means)
        m_all = out[f"{k}/all"]["mean"]
        m_plus = out[f"{k}/L+"]["mean"]
        out[f"{k}/W_hold_O1"] = 1 - m_all / m_plus if m_plus else math.nan
        out[f"{k}/L+ raises (batches)"] = sum(r[f"{k}/L+"] > 0 for r in records)
        if records and f"{k}/L+ raising" in records[0]:  # the rule top_k_raising (records since 2026-12-05)
            rule, matched = f"{k}/L+ raising", f"{k}/random (raising size)"
            out[rule] = ci([r[rule] for r in records])
            out[matched] = ci([r[matched] for r in records])
            out[f"{rule} - L+"] = ci([r[rule] - r[f"{k}/L+"] for r in records])
            out[f"{rule} - random"] = ci([r[rule] - r[matched] for r in records])
            out[f"{rule} raises (batches)"] = sum(r[rule] > 0 for r in records)
            out[f"{rule} - random > 0 (batches)"] = sum(r[rule] > r[matched] for r in records)
            out[f"{k}/k raising over k"] = sum(r[f"{k}/k raising"] for r in records) / max(
                1, sum(r[f"{k}/k"] for r in records)
            )
            out[f"{k}/agree L+"] = ci(
                [r[f"{k}/agree L+"] for r in records if not math.isnan(r[f"{k}/agree L+"])]
            )
    for side in ("T+", "T-"):
        if records and f"agree {side}" in records[0]:
            out[f"agree {side}"] = ci(
                [r[f"agree {side}"] for r in records if not math.isnan(r[f"agree {side}"])]
            )
    out["fd_over_exact_all"] = ci([r["fd_sum_all"] / r["exact_all"] for r in records if r["exact_all"]])
    for W in args.W:
        ratios = [v[f"W{W}/measured"] / v[f"W{W}/predicted"] for v in val_records if v[f"W{W}/predicted"]]
        out[f"W{W}/measured_over_predicted"] = ci(ratios) if ratios else None
        out[f"W{W}/measured"] = ci([v[f"W{W}/measured"] for v in val_records])
        out[f"W{W}/predicted"] = ci([v[f"W{W}/predicted"] for v in val_records])
    out["fd_L+_over_exact_L+"] = ci([v["fd_L+"] / v["exact_L+"] for v in val_records if v["exact_L+"]])
    bonus = [v["fd_bonus"] / v["exact_bonus"] for v in val_records if v.get("exact_bonus")]
    out["fd_bonus_over_exact_bonus"] = ci(bonus) if bonus else None
    out["methods"] = (
        [k[2:] for k in records[0] if k.startswith("m/") and k.count("/") == 1] if records else []
    )
    if not out["methods"]:  # records of a run before the methods were measured
        return out
    step = statistics.median(r["step_s"] for r in records if r["step_s"] is not None)
    for name in out["methods"]:
        m = f"m/{name}"
        diff = [r[m] - r["m/grpo_ds"] for r in records]
        out[m] = ci([r[m] for r in records])
        out[f"{m} - grpo_ds"] = ci(diff)
        out[f"{m} - grpo_ds > 0"] = sum(x > 0 for x in diff)
        out[f"{m} > 0"] = sum(r[m] > 0 for r in records)
        out[f"{m}/select_s"] = statistics.median(r[f"{m}/select_s"] for r in records)
        out[f"{m}/select_over_step"] = out[f"{m}/select_s"] / step
    out["step_s"] = step
    out["kl_cov_max_coef_diff"] = max((r["kl_cov_max_coef_diff"] for r in records), default=math.nan)
    # the beta at which the bonus's own push cancels the GRPO-ds step's (ratio of batch means)
    per_beta = statistics.fmean(r["m/entropy_bonus/entropy_part"] for r in records) / args.entropy_coef
    out["bonus_per_beta"] = per_beta
    out["beta_to_cancel_grpo"] = -out["m/grpo_ds"]["mean"] / per_beta if per_beta else math.nan
    bonus_cost = [v["bonus_step_s"] / v["step_s"] for v in val_records if "bonus_step_s" in v]
    out["bonus_step_over_step"] = statistics.fmean(bonus_cost) if bonus_cost else math.nan
    return out


def write_csv(records, path):
    keys = [k for k in records[0] if k != "rewards"] if records else []
    lines = [",".join(keys)] + [",".join(str(r[k]) for k in keys) for r in records]
    path.write_text("\n".join(lines) + "\n")


def fmt(s):
    if s is None:
        return "n/a"
    return f"{s['mean']:+.3e} ± {s['ci95']:.1e}" if not math.isnan(s["ci95"]) else f"{s['mean']:+.3e}"


def share(s):
    """A share's mean ± 95 % t half-width, three decimals ("n/a": no batch had one)."""
    return format_ci(s) if s is not None else "n/a"


def print_table(summary, args, meta):
    n = summary[f"P{args.P[0]}/all"]["n"]
    print(
        f"\nOne-step dH_bank (nats) per SGD step at lr = {meta['lr']:.4g}; mean ± 95 % t half-width over {n} batches"
    )
    print(
        f"bank: {meta['bank_tokens']} tokens, H_bank = {meta['H_bank']:.4f}; skipped batches (no signal): {meta['skipped_batches']}"
    )
    print(
        f"GRPO-ds (all tokens): {fmt(summary[f'P{args.P[0]}/all'])}   T+: {fmt(summary[f'P{args.P[0]}/T+'])}   T-: {fmt(summary[f'P{args.P[0]}/T-'])}"
    )
    head = ["P", "L+", "random T+ (same k)", "bottom-P T+", "oracle", "L-", "L+ - random", "W to hold (O1)"]
    print(" | ".join(head))
    for P in args.P:
        k = f"P{P}"
        row = [str(P)] + [
            fmt(summary[f"{k}/{x}"]) for x in ("L+", "random", "bottom", "oracle", "L-", "L+ - random")
        ]
        row.append(f"{summary[f'{k}/W_hold_O1']:.3g}")
        print(" | ".join(row))
    if f"P{args.P[0]}/L+ raising" in summary:
        n_agree = summary["agree T+"]["n"]
        print(
            "\nthe rule top_k_raising (L+ less its own-position first-order lowerers): "
            f"sign agreement of the own-position rule with the bank's influence, per batch mean over {n_agree} "
            f"batches: T+ {share(summary['agree T+'])}, T- {share(summary['agree T-'])}"
        )
        print(
            "P | L+ raising | batches > 0 | random T+ (same k) | minus random (paired) | batches > random | minus L+ (paired) | |L+ raising| / |L+| | agreement on L+"
        )
        for P in args.P:
            k = f"P{P}"
            rule = f"{k}/L+ raising"
            print(
                f"{P} | {fmt(summary[rule])} | {summary[f'{rule} raises (batches)']}/{n} | "
                f"{fmt(summary[f'{k}/random (raising size)'])} | {fmt(summary[f'{rule} - random'])} | "
                f"{summary[f'{rule} - random > 0 (batches)']}/{n} | {fmt(summary[f'{rule} - L+'])} | "
                f"{summary[f'{k}/k raising over k']:.3f} | {share(summary[f'{k}/agree L+'])}"
            )
    print(
        f"\nfirst-order check: sum_t I_t (central difference) / exact -<h, g_all>: {fmt(summary['fd_over_exact_all'])}"
    )
    print(f"L+ (P=0.1): central difference / exact: {fmt(summary['fd_L+_over_exact_L+'])}")
    for W in args.W:
        print(
            f"real SGD step, W={W}: measured {fmt(summary[f'W{W}/measured'])}, predicted {fmt(summary[f'W{W}/predicted'])}, "
            f"measured/predicted {fmt(summary[f'W{W}/measured_over_predicted'])}"
        )
    if summary["methods"]:
        print(f"entropy bonus: central difference / exact: {fmt(summary['fd_bonus_over_exact_bonus'])}")
        print_methods(summary, meta)
    print(f"\nmachine: {meta['machine']}; wall {meta['wall_s']:.0f} s; {meta['date']}")


def print_methods(summary, meta):
    """The methods' one-step responses, each paired per batch with GRPO-ds's (the baseline row)."""
    n = summary["m/grpo_ds"]["n"]
    print(
        f"\nMethods, one SGD step of each one's loss at lr = {meta['lr']:.4g}, paired with GRPO-ds ({n} batches)"
    )
    print(
        "method | dH_bank | batches > 0 | minus GRPO-ds (paired) | batches > GRPO-ds | selection s (x GRPO-ds step)"
    )
    for name in summary["methods"]:
        m = f"m/{name}"
        print(
            f"{name} | {fmt(summary[m])} | {summary[f'{m} > 0']}/{n} | {fmt(summary[f'{m} - grpo_ds'])} | {summary[f'{m} - grpo_ds > 0']}/{n} | "
            f"{summary[f'{m}/select_s']:.2g} ({summary[f'{m}/select_over_step']:.1e})"
        )
    bonus_cost = summary["bonus_step_over_step"]  # timed only in --validate batches
    bonus_cost = "not timed" if math.isnan(bonus_cost) else f"{bonus_cost:.3f}x"
    print(
        f"GRPO-ds step (forward + backward, median) {summary['step_s']:.1f} s; with the entropy bonus's "
        f"entropy gradient: {bonus_cost}; KL-Cov's coefficients minus GRPO-ds's: "
        f"max |diff| {summary['kl_cov_max_coef_diff']:.1e}; bonus push per unit beta {summary['bonus_per_beta']:+.3e}, "
        f"beta that cancels the GRPO-ds step's mean {summary['beta_to_cancel_grpo']:.3g}"
    )


# ------------------------------------------------------------------- the published tables


SUBSET_ROWS = (
    ("all tokens (the GRPO-ds step)", "P0.1/all", None, True),
    ("T+", "P0.1/T+", None, False),
    ("T-", "P0.1/T-", None, False),
    ("L+ (the paper's: top 10 % of T+ by surprisal)", "P0.1/L+", None, True),
    ("random T+ subset of \\|L+\\| tokens", "P0.1/random", None, True),
    ("oracle: the \\|L+\\| T+ tokens that raise it most", "P0.1/oracle", None, True),
    ("L-", "P0.1/L-", None, True),
    ("L+ of `top_k_raising` (L+ less its own-position lowerers)", "P0.1/L+ raising", None, True),
    ("random T+ subset of its size", "P0.1/random (raising size)", None, False),
    (
        "`top_k_raising` minus that random subset (paired)",
        "P0.1/L+ raising",
        "P0.1/random (raising size)",
        True,
    ),
    ("`top_k_raising` minus the paper's L+ (paired)", "P0.1/L+ raising", "P0.1/L+", True),
)
"""(label, column, column subtracted per batch or None, whether batches > 0 are counted)."""
METHOD_ROWS = (
    ("STARE O1 (W 1.1, gate on)", "stare_O1"),
    ("STARE C2 (W 1.1, M 0.9, gate on)", "stare_C2"),
    ("entropy bonus (beta 0.001)", "entropy_bonus"),
    ("KL-Cov (k 0.2 %)", "kl_cov"),
    ("Clip-Cov (r 2e-4)", "clip_cov"),
    ("forking tokens (top 20 % by H)", "forking_tokens"),
    ("STEER (\\|Omega\\| onto [0.8, 1.2])", "steer"),
    ("STAPO (tau_p 0.002, q 0.75)", "stapo"),
    ("EntroAdv (alpha 0.4, kappa 2)", "entroadv"),
    ("first-order weighting (ours, lambda_max 0.1, gate on)", "first_order"),
)


def read_batches_csv(path: Path) -> list[dict[str, float]]:
    """The per-batch records a run wrote to ``batches.csv`` (``write_csv``), as floats."""
    with open(path, newline="") as f:
        return [
            {k: float(v) if v not in ("None", "") else math.nan for k, v in row.items()}
            for row in csv.DictReader(f)
        ]


def mean_ci(xs: list[float]) -> str:
    """``mean ± 95 % t half-width``, the half-width to 2 significant digits and at least 4 decimals,
    the mean to the same decimals; "0 exactly" when every value is 0."""
    if all(x == 0 for x in xs):
        return "0 exactly"
    s = mean_sd_ci(xs)
    half = s["ci95"]
    decimals = max(4, 1 - math.floor(math.log10(half))) if half > 0 else 4
    return f"{s['mean']:+.{decimals}f} ± {half:.{decimals}f}"


def tables_of_csv(path: str | Path) -> str:
    """The subset table, the sign-agreement line and the methods table of a run's ``batches.csv`` (P
    0.1), as docs/research/study.md publishes them; ``--from-csv`` prints them and
    tests/research/test_published_tables.py compares them."""
    rows = read_batches_csv(Path(path))
    n = len(rows)
    out = [
        f"| subset (P = 0.1) | mean ± 95 % ({n} batches) | batches > 0 |",
        "|---|---:|---:|",
    ]
    for label, column, minus, count in SUBSET_ROWS:
        xs = [r[column] - (r[minus] if minus else 0.0) for r in rows]
        above = f"{sum(x > 0 for x in xs)}/{n}" if count else ""
        out.append(f"| {label} | {mean_ci(xs)} | {above} |")
    agree = ", ".join(
        f"{name} {share(ci([r[key] for r in rows if not math.isnan(r[key])]))}"
        for name, key in (("T+", "agree T+"), ("T-", "agree T-"), ("L+", "P0.1/agree L+"))
    )
    methods = [
        f"| method (its defaults) | dH_bank minus GRPO-ds (mean ± 95 %, {n} batches) | batches above GRPO-ds |",
        "|---|---:|---:|",
    ]
    for label, name in METHOD_ROWS:
        xs = [r[f"m/{name}"] - r["m/grpo_ds"] for r in rows]
        methods.append(f"| {label} | {mean_ci(xs)} | {sum(x > 0 for x in xs)}/{n} |")
    return (
        "\n".join(out)
        + f"\n\nsign agreement, the mean of the batches' shares: {agree}\n\n"
        + "\n".join(methods)
    )


if __name__ == "__main__":
    main()
