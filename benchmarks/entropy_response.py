"""The paired one-step entropy response of STARE's token subsets on the real model (issue 25, item 3).

From one start (the embedded SmolLM2-135M-Instruct; no SFT checkpoint is used), in float32 on CPU:

1. A held-out BANK: sequences sampled at temperature 1 on procedural problems (other seeds than the
   batches'), teacher-forced; ``H_bank`` = the mean full-vocabulary entropy over its response tokens.
   ``h = grad H_bank`` (one backward).
2. For each BATCH (prompts x a group of samples at temperature 1, single-turn; reward = the project's
   ``compute_reward`` of the last ``\\boxed{}`` with ``format_penalty`` so that 1 correct, 0 wrong,
   -penalty for no boxed answer; GRPO advantages, zero-variance groups contribute nothing as in GRPO-ds):
   the directional derivative d_t of every token's log-prob along u = h (SGD, D = I) by a central
   difference, so ``I_t = A_t d_t / N`` and a subset's first-order response is ``dH_S = lr sum_S I_t``
   (``stare_agent.algorithms.entropy_response``). Subsets: all (the GRPO-ds update), T+, T-, L+ and
   L- at several P, the bottom-P of T+ by surprisal, a random T+ subset of |L+| (its expectation),
   the oracle (the |L+| tokens of T+ with the largest I_t).
3. Validation on the first batches: the exact inner product ``-lr <h, g>`` from a backward, and REAL
   SGD steps ``theta - lr (g_all + (W - 1) g_L+)`` at W in {1, 2, 4}: H_bank measured after the step.

Every subset is evaluated on the same batches; the table gives the mean over batches with a 95 %
t-interval, and paired differences. ``lr`` is fixed for the run: the SGD step of the first batch's
full update has the norm of one Adam step of lr 1e-6 on every parameter (1e-6 * sqrt(#params)).

    .venv/bin/python benchmarks/entropy_response.py --quick --out /tmp/er_quick
    .venv/bin/python benchmarks/entropy_response.py --batches 12 --out runs/entropy_response
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from envs.problems import generate_problems
from envs.rewards import RewardConfig, compute_reward, extract_boxed
from stare_agent.algorithms.advantages import broadcast_to_tokens, grpo_advantages
from stare_agent.algorithms.entropy_response import (
    directional_derivative,
    response_subsets,
    subset_responses,
    token_influence,
)
from stare_agent.algorithms.logprobs import causal_lm_logprobs_and_entropy
from stare_agent.algorithms.losses import policy_loss
from stare_agent.algorithms.stare import stare_weights
from stare_agent.intervals import mean_sd_ci
from stare_agent.models import load_policy, tiny_model

INSTRUCTION = "\nAnswer briefly and give the final answer in \\boxed{}."


def sample(model, tok, problems, group: int, max_new: int, seed: int):
    """Right-padded [N, L] ids, attention mask, score mask [N, L-1] (response tokens), golds, texts.

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
    rows, golds, texts = [], [], []
    for n, p in enumerate(prompts):
        resp = out[n, Lp:].tolist()
        if tok.eos_token_id in resp:
            resp = resp[: resp.index(tok.eos_token_id) + 1]
        rows.append((p, resp))
        texts.append(tok.decode(resp, skip_special_tokens=True))
        golds.append(problems[n // group].answer)
    L = max(len(p) + len(r) for p, r in rows)
    N = len(rows)
    ids = torch.full((N, L), pad, dtype=torch.long)
    attn = torch.zeros(N, L, dtype=torch.long)
    score = torch.zeros(N, L - 1, dtype=torch.bool)
    for n, (p, r) in enumerate(rows):
        ids[n, : len(p) + len(r)] = torch.tensor(p + r)
        attn[n, : len(p) + len(r)] = 1
        score[n, len(p) - 1 : len(p) + len(r) - 1] = True
    return ids, attn, score, golds, texts


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


def batch_logp(model, ids, attn, score) -> torch.Tensor:
    return causal_lm_logprobs_and_entropy(model, ids, attn, score_mask=score)[0]


def flat_grad(params) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in params])


def unflatten(vec, params):
    out, i = [], 0
    for p in params:
        out.append(vec[i : i + p.numel()].view_as(p))
        i += p.numel()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: 2 batches, tiny bank, short samples")
    ap.add_argument("--batches", type=int, default=12)
    ap.add_argument("--prompts", type=int, default=2, help="prompts per batch")
    ap.add_argument("--group", type=int, default=8, help="samples per prompt")
    ap.add_argument("--max-new", type=int, default=160)
    ap.add_argument("--bank-prompts", type=int, default=4)
    ap.add_argument("--bank-group", type=int, default=4)
    ap.add_argument("--validate", type=int, default=3, help="batches with real SGD steps at W in --W")
    ap.add_argument("--W", type=float, nargs="+", default=[1.0, 2.0, 4.0])
    ap.add_argument("--P", type=float, nargs="+", default=[0.05, 0.1, 0.2])
    ap.add_argument("--family", default="mixed")
    ap.add_argument("--penalty", type=float, default=0.5, help="format_penalty of the reward")
    ap.add_argument("--fd-step", type=float, default=1e-2, help="|eps u| of the central difference")
    ap.add_argument("--adam-lr", type=float, default=1e-6, help="sets the SGD step norm (see docstring)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--tiny", action="store_true", help="pipeline smoke test: tiny random model, random rewards"
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument(
        "--from-records",
        action="store_true",
        help="summarize the batches already in --out/records.json (e.g. of a run stopped early) and exit",
    )
    args = ap.parse_args()
    if args.from_records:
        return summarize_saved(args)
    if args.quick:
        args.batches, args.prompts, args.group, args.max_new = 2, 1, 4, 48
        args.bank_prompts, args.bank_group, args.validate = 1, 4, 1
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    model, tok = tiny_model() if args.tiny else load_policy(dtype=torch.float32)
    model.eval()
    params = [p for p in model.parameters() if p.requires_grad]
    n_params = sum(p.numel() for p in params)
    log = lambda *a: print(f"[{time.time() - t0:7.1f}s]", *a, flush=True)  # noqa: E731

    # --- the bank and h = grad H_bank
    bank_probs = generate_problems(args.family, args.bank_prompts, seed=10_000 + args.seed)
    b_ids, b_attn, b_score, _, _ = sample(
        model, tok, bank_probs, args.bank_group, args.max_new, 10_000 + args.seed
    )
    model.zero_grad(set_to_none=True)
    H0 = bank_entropy(model, b_ids, b_attn, b_score)
    H0.backward()
    h = flat_grad(params).double()
    H0 = float(H0.detach())
    model.zero_grad(set_to_none=True)
    u = unflatten((h / h.norm()).float(), params)  # unit direction; d_t is rescaled by |h| below
    log(
        f"bank: {int(b_score.sum())} tokens, H_bank = {H0:.4f}, |h| = {float(h.norm()):.4g}, params {n_params}"
    )

    def H_bank_now() -> float:
        with torch.no_grad():
            return float(bank_entropy(model, b_ids, b_attn, b_score))

    H_check = H_bank_now()
    log(f"H_bank recomputed without grad: {H_check:.6f} (diff {H_check - H0:.2e})")

    records, val_records, lr, skipped = [], [], None, 0
    problems = generate_problems(args.family, 10 * args.batches * args.prompts, seed=args.seed)
    cursor = 0
    while len(records) < args.batches and cursor < len(problems):
        probs = problems[cursor : cursor + args.prompts]
        cursor += args.prompts
        ids, attn, score, golds, texts = sample(
            model, tok, probs, args.group, args.max_new, args.seed + cursor
        )
        r = rewards_of(texts, golds, args.penalty)
        if args.tiny:  # the tiny random model never answers: random rewards exercise the pipeline
            r = torch.randint(0, 2, r.shape, generator=torch.Generator().manual_seed(cursor)).float()
        A, _ = grpo_advantages(r, group_size=args.group)
        mask = score
        A_tok = broadcast_to_tokens(A, mask)
        if not bool((A_tok != 0).any()):
            skipped += 1
            log(f"batch at problem {cursor}: rewards {r.tolist()} all equal in each group: skipped (GRPO-ds)")
            continue
        N = int(mask.sum())
        # the full update's gradient (and L+ at P = 0.1's on validation batches), exact
        logp = batch_logp(model, ids, attn, score)
        loss, _ = policy_loss(logp, logp.detach(), A_tok, mask)
        model.zero_grad(set_to_none=True)
        loss.backward(retain_graph=len(val_records) < args.validate)
        g_all = flat_grad(params).double()
        model.zero_grad(set_to_none=True)
        validating = len(val_records) < args.validate
        if validating:  # L+ at P = 0.1's own gradient (before the central difference moves the weights)
            w_plus = stare_weights(A_tok, logp.detach(), mask, gate_on=False, P=0.1)[1].to(logp.dtype)
            loss_plus, _ = policy_loss(logp, logp.detach(), A_tok, mask, weights=w_plus, token_count=N)
            loss_plus.backward()
            g_plus = flat_grad(params).double()
            model.zero_grad(set_to_none=True)
        if lr is None:
            lr = args.adam_lr * math.sqrt(n_params) / float(g_all.norm())
            log(f"lr (SGD, fixed for the run) = {lr:.4g}")
        # directional derivatives of every token's log p along u = h / |h|, then d_t = |h| * that
        eps = args.fd_step
        d = (
            directional_derivative(
                lambda ids=ids, attn=attn, score=score: batch_logp(model, ids, attn, score), params, u, eps
            )
            * h.norm()
        )
        infl = token_influence(A_tok, d, mask)
        exact_all = -float(h @ g_all)  # sum_t I_t should equal -<h, g_all>
        rec = {
            "batch": len(records),
            "tokens": N,
            "rewards": r.tolist(),
            "fd_sum_all": float(infl.sum()),
            "exact_all": exact_all,
            "H_batch": None,
        }
        for P in args.P:
            subsets = response_subsets(A_tok, logp.detach(), mask, infl, P)
            resp = subset_responses(infl, subsets, P)
            for name, value in resp.items():
                rec[f"P{P}/{name}"] = lr * value
            rec[f"P{P}/k"] = int(subsets["L+"].sum())
        log(
            f"batch {len(records)}: N={N}, rewards {r.tolist()}, dH(all)={rec[f'P{args.P[0]}/all']:.3e}, "
            f"fd/exact={rec['fd_sum_all'] / exact_all if exact_all else float('nan'):.4f}"
        )
        if validating:
            v = {"batch": len(records), "fd_L+": lr * float(infl[w_plus.bool()].sum())}
            v["exact_L+"] = -lr * float(h @ g_plus)
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
        del logp, loss
        records.append(rec)
        (args.out / "records.json").write_text(
            json.dumps(
                {
                    "batches": records,
                    "validation": val_records,
                    "meta": {"lr": lr, "H_bank": H0, "bank_tokens": int(b_score.sum()), "skipped": skipped},
                },
                indent=1,
            )
        )

    wall = time.time() - t0
    summary = summarize(records, val_records, args)
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model_name = next(
        (ln.split(":", 1)[1].strip() for ln in cpu.splitlines() if ln.startswith("Model name")), "?"
    )
    machine = f"{model_name}, {torch.get_num_threads()} torch threads, {platform.platform()}, torch {torch.__version__}"
    meta = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "lr": lr,
        "H_bank": H0,
        "bank_tokens": int(b_score.sum()),
        "skipped_batches": skipped,
        "wall_s": wall,
        "machine": machine,
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
    out["fd_over_exact_all"] = ci([r["fd_sum_all"] / r["exact_all"] for r in records if r["exact_all"]])
    for W in args.W:
        ratios = [v[f"W{W}/measured"] / v[f"W{W}/predicted"] for v in val_records if v[f"W{W}/predicted"]]
        out[f"W{W}/measured_over_predicted"] = ci(ratios) if ratios else None
        out[f"W{W}/measured"] = ci([v[f"W{W}/measured"] for v in val_records])
        out[f"W{W}/predicted"] = ci([v[f"W{W}/predicted"] for v in val_records])
    out["fd_L+_over_exact_L+"] = ci([v["fd_L+"] / v["exact_L+"] for v in val_records if v["exact_L+"]])
    return out


def write_csv(records, path):
    keys = [k for k in records[0] if k != "rewards"] if records else []
    lines = [",".join(keys)] + [",".join(str(r[k]) for k in keys) for r in records]
    path.write_text("\n".join(lines) + "\n")


def fmt(s):
    if s is None:
        return "n/a"
    return f"{s['mean']:+.3e} ± {s['ci95']:.1e}" if not math.isnan(s["ci95"]) else f"{s['mean']:+.3e}"


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
    print(
        f"\nfirst-order check: sum_t I_t (central difference) / exact -<h, g_all>: {fmt(summary['fd_over_exact_all'])}"
    )
    print(f"L+ (P=0.1): central difference / exact: {fmt(summary['fd_L+_over_exact_L+'])}")
    for W in args.W:
        print(
            f"real SGD step, W={W}: measured {fmt(summary[f'W{W}/measured'])}, predicted {fmt(summary[f'W{W}/predicted'])}, "
            f"measured/predicted {fmt(summary[f'W{W}/measured_over_predicted'])}"
        )
    print(f"\nmachine: {meta['machine']}; wall {meta['wall_s']:.0f} s; {meta['date']}")


if __name__ == "__main__":
    main()
