"""Chunked log-probs and entropy against hand values and the naive full-logits computation."""

from __future__ import annotations

import math

import pytest
import torch

from stare_agent.algorithms.logprobs import (
    causal_lm_logprobs_and_entropy,
    chunked_logprobs_and_entropy,
    logprobs_and_entropy_from_logits,
    shared_prompt_logprobs_and_entropy,
)


def _naive(hidden, weight, targets, bias=None, temperature=1.0):
    logits = torch.nn.functional.linear(hidden, weight, bias) / temperature
    logp_all = logits.log_softmax(-1)
    logp = logp_all.gather(-1, targets[..., None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def test_two_token_vocabulary_by_hand():
    weight = torch.tensor([[1.0], [0.0]], dtype=torch.float64)  # z = (h, 0)
    hidden = torch.tensor([[0.0], [math.log(3.0)]], dtype=torch.float64)
    logp, entropy = chunked_logprobs_and_entropy(hidden, weight, torch.tensor([0, 0]), chunk_size=1)
    # h = 0: z = (0, 0), p = (1/2, 1/2): logp = -log 2, H = log 2
    # h = log 3: z = (log 3, 0), p = (3/4, 1/4): logp = log(3/4), H = -(3/4 log 3/4 + 1/4 log 1/4) = 0.5623
    torch.testing.assert_close(logp, torch.tensor([-math.log(2), math.log(0.75)], dtype=torch.float64))
    h2 = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    torch.testing.assert_close(entropy, torch.tensor([math.log(2), h2], dtype=torch.float64))
    # temperature 2: z = (log 3 / 2, 0) -> p0 = sqrt 3 / (sqrt 3 + 1)
    logp, _ = chunked_logprobs_and_entropy(hidden[1:], weight, torch.tensor([0]), temperature=2.0)
    assert logp.item() == pytest.approx(math.log(math.sqrt(3) / (math.sqrt(3) + 1)), rel=1e-12)


@pytest.mark.parametrize("chunk_size", [1, 7, 64, 1000])
@pytest.mark.parametrize("with_bias", [False, True])
def test_equals_naive_values_and_gradients_float64(chunk_size, with_bias):
    g = torch.Generator().manual_seed(chunk_size)
    N, T, D, V = 3, 11, 8, 50
    hidden = torch.randn(N, T, D, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, D, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(V, generator=g, dtype=torch.float64, requires_grad=True) if with_bias else None
    targets = torch.randint(0, V, (N, T), generator=g)
    upstream = torch.randn(N, T, generator=g, dtype=torch.float64)
    inputs = [hidden, weight] + ([bias] if with_bias else [])

    logp, entropy = chunked_logprobs_and_entropy(
        hidden, weight, targets, lm_head_bias=bias, chunk_size=chunk_size, temperature=0.7
    )
    grads = torch.autograd.grad((logp * upstream).sum(), inputs)
    logp_ref, entropy_ref = _naive(hidden, weight, targets, bias, temperature=0.7)
    grads_ref = torch.autograd.grad((logp_ref * upstream).sum(), inputs)

    assert logp.shape == entropy.shape == (N, T)
    torch.testing.assert_close(logp, logp_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(entropy, entropy_ref.detach(), rtol=1e-12, atol=1e-12)
    assert not entropy.requires_grad  # the entropy feeds the gate only
    for grad, ref in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(grad, ref, rtol=1e-10, atol=1e-12)


def test_gradcheck():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(5, 3, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(6, 3, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 6, (5,), generator=g)
    assert torch.autograd.gradcheck(
        lambda h, w: chunked_logprobs_and_entropy(h, w, targets, chunk_size=2)[0], (hidden, weight)
    )
    logits = torch.randn(5, 6, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda z: logprobs_and_entropy_from_logits(z, targets, chunk_size=2, temperature=1.3)[0], (logits,)
    )


def test_from_logits_equals_naive():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 9, 40, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 40, (2, 9), generator=g)
    logp, entropy = logprobs_and_entropy_from_logits(logits, targets, chunk_size=4)
    (grad,) = torch.autograd.grad(logp.sum(), logits)
    logp_all = logits.log_softmax(-1)
    logp_ref = logp_all.gather(-1, targets[..., None]).squeeze(-1)
    (grad_ref,) = torch.autograd.grad(logp_ref.sum(), logits)
    torch.testing.assert_close(logp, logp_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(entropy, -(logp_all.exp() * logp_all).sum(-1).detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, grad_ref, rtol=1e-12, atol=1e-12)


def test_bfloat16_inputs_compute_in_float32():
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(6, 16, generator=g).to(torch.bfloat16).requires_grad_(True)
    weight = torch.randn(30, 16, generator=g).to(torch.bfloat16).requires_grad_(True)
    targets = torch.randint(0, 30, (6,), generator=g)
    logp, entropy = chunked_logprobs_and_entropy(hidden, weight, targets, chunk_size=4)
    assert logp.dtype == entropy.dtype == torch.float32
    logp_ref, entropy_ref = _naive(hidden.float(), weight.float(), targets)
    torch.testing.assert_close(logp, logp_ref, rtol=2e-2, atol=2e-2)
    logp.sum().backward()
    assert hidden.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.bfloat16


def _tiny_llama64():
    """A 2-layer random Llama in float64 (seed 0), so that any difference beyond rounding shows."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    return LlamaForCausalLM(config).double()


def test_causal_lm_matches_the_models_own_logits():
    model = _tiny_llama64()
    input_ids = torch.randint(0, 97, (2, 12))
    logp, entropy = causal_lm_logprobs_and_entropy(model, input_ids, torch.ones_like(input_ids), chunk_size=5)
    logp.sum().backward()
    grad = model.lm_head.weight.grad.clone()
    model.zero_grad()
    logp_all = model(input_ids).logits[:, :-1].log_softmax(-1)
    logp_ref = logp_all.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    logp_ref.sum().backward()
    torch.testing.assert_close(logp, logp_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(entropy, -(logp_all.exp() * logp_all).sum(-1).detach(), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(grad, model.lm_head.weight.grad, rtol=1e-10, atol=1e-10)


def test_score_mask_scores_only_the_marked_positions_with_the_same_values_and_gradients():
    """Positions left out of score_mask skip the LM head: 0 there, the full pass's values and the full
    pass's parameter gradients elsewhere (float64, so any difference beyond rounding shows)."""
    model = _tiny_llama64()
    input_ids = torch.randint(0, 97, (2, 12))
    scored = torch.zeros(2, 11, dtype=torch.bool)
    scored[0, 6:9] = scored[1, 4:] = True  # a response with tool output after it; one running to the end
    coef = torch.randn(2, 11, dtype=torch.float64) * scored  # a loss that reads only the scored positions

    def run(score_mask):
        model.zero_grad()
        logp, entropy = causal_lm_logprobs_and_entropy(model, input_ids, chunk_size=4, score_mask=score_mask)
        (coef * logp).sum().backward()
        return logp.detach(), entropy, {n: p.grad.clone() for n, p in model.named_parameters()}

    logp_all, entropy_all, grads_all = run(None)
    logp, entropy, grads = run(scored)
    torch.testing.assert_close(logp[scored], logp_all[scored], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(entropy[scored], entropy_all[scored], rtol=1e-12, atol=1e-12)
    assert torch.all(logp[~scored] == 0) and torch.all(entropy[~scored] == 0)
    assert (logp_all[~scored] != 0).all()  # the unmasked pass did score them
    for name, grad in grads_all.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-10, atol=1e-12, msg=name)
    with pytest.raises(ValueError, match="must match the leading shape"):
        causal_lm_logprobs_and_entropy(model, input_ids, score_mask=scored[:, 1:])


def test_errors():
    with pytest.raises(ValueError, match="must match the leading shape"):
        chunked_logprobs_and_entropy(torch.zeros(3, 4), torch.zeros(5, 4), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="hidden size"):
        chunked_logprobs_and_entropy(torch.zeros(3, 4), torch.zeros(5, 2), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="chunk_size >= 1"):
        logprobs_and_entropy_from_logits(torch.zeros(3, 4), torch.zeros(3, dtype=torch.long), chunk_size=0)


def _relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    return float((value.float() - reference.float()).norm() / reference.float().norm())


def test_bf16_autocast_gradients_match_the_fp32_reference():
    """Under bf16 autocast the backward recomputes the forward's own (bf16) logits.

    Confident tokens (p ~ 0.9) make a mis-normalised softmax visible: d log p / dz_o = 1 - p is small,
    so a logsumexp a few percent off flips its sign. bf16 rounding alone keeps the gradient within
    ~6 % of fp32 here; logits recomputed in fp32 against the bf16 logsumexp were 25 % off.
    """
    g = torch.Generator().manual_seed(0)
    S, D, V = 64, 64, 512
    hidden = torch.randn(S, D, generator=g).requires_grad_(True)
    weight = (torch.randn(V, D, generator=g) * 1.5).requires_grad_(True)
    targets = (hidden @ weight.T).argmax(-1)  # the most likely token: median p ~ 0.9

    def grads(autocast: bool) -> tuple[torch.Tensor, ...]:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logp, _ = chunked_logprobs_and_entropy(hidden, weight, targets, chunk_size=16)
        return torch.autograd.grad(logp.sum(), [hidden, weight])

    fp32 = grads(False)
    mixed = grads(True)
    # What autograd computes through a plain autocast F.linear and an fp32 log_softmax.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = torch.nn.functional.linear(hidden, weight)
    naive = logits.float().log_softmax(-1).gather(1, targets[:, None]).sum()
    autograd = torch.autograd.grad(naive, [hidden, weight])
    for ours, ref, auto in zip(mixed, fp32, autograd, strict=True):
        assert _relative_error(ours, ref) < 0.08
        assert _relative_error(ours, auto) < 0.01


def test_bf16_autocast_logits_path_matches_autograd():
    """The logits path (ZeRO-3): a tiny Llama under autocast, gradient w.r.t. every weight."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    input_ids = torch.randint(0, 97, (2, 12))

    def grads(ours: bool) -> list[torch.Tensor]:
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids).logits[:, :-1]
            if ours:
                logp, _ = logprobs_and_entropy_from_logits(logits, input_ids[:, 1:], chunk_size=5)
            else:
                logp = logits.float().log_softmax(-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
        logp.sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    for ours, ref in zip(grads(True), grads(False), strict=True):
        assert _relative_error(ours, ref) < 1e-3


def test_a_shared_prompt_gives_the_per_row_values_and_gradients_in_float64(monkeypatch):
    """N samples of one prompt: running the prompt once and sharing its keys and values gives the
    per-row pass's log-probs, entropies and parameter gradients to float64 rounding. Llama's RMSNorm
    computes in float32 even in a float64 model, which alone would leave ~2e-8 between the two
    summation orders, so it runs in the model's dtype here."""
    from transformers.models.llama import modeling_llama

    def rms_norm_in_input_dtype(self, hidden):
        variance = hidden.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden * torch.rsqrt(variance + self.variance_epsilon))

    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", rms_norm_in_input_dtype)
    model = _tiny_llama64()
    P, R, N = 10, 6, 4
    ids = torch.cat([torch.randint(0, 97, (1, P)).expand(N, -1), torch.randint(0, 97, (N, R))], dim=1)
    mask = torch.ones_like(ids)
    mask[1, -2:] = mask[3, -1:] = 0  # two rows end early (right padding)
    scored = torch.zeros(N, P + R - 1, dtype=torch.bool)
    scored[:, P - 1 :] = True
    scored &= mask[:, 1:].bool()
    coef = torch.randn(N, P + R - 1, dtype=torch.float64) * scored

    def run(fn):
        model.zero_grad()
        logp, entropy = fn()
        (coef * (logp + 0.1 * entropy)).sum().backward()
        return logp.detach(), entropy.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    logp, entropy, grads = run(
        lambda: causal_lm_logprobs_and_entropy(model, ids, mask, chunk_size=5, score_mask=scored)
    )
    logp_s, entropy_s, grads_s = run(
        lambda: shared_prompt_logprobs_and_entropy(model, ids, mask, P, scored, chunk_size=5)
    )
    torch.testing.assert_close(logp_s, logp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(entropy_s, entropy, rtol=1e-12, atol=1e-12)
    assert logp.ne(0).sum() == scored.sum()  # every scored position was scored
    for name, grad in grads.items():
        assert (grads_s[name] - grad).norm() <= 1e-12 * grad.norm(), name


def test_score_tokens_runs_the_shared_prompt_once_only_where_positions_are_chosen(monkeypatch):
    from stare_agent.algorithms import logprobs

    model = _tiny_llama64()
    P, R, N = 6, 4, 3
    ids = torch.cat([torch.randint(0, 97, (1, P)).expand(N, -1), torch.randint(0, 97, (N, R))], dim=1)
    mask = torch.ones_like(ids)
    scored = torch.zeros(N, P + R - 1, dtype=torch.bool)
    scored[:, P - 1 :] = True
    ran: list[str] = []
    for name in ("shared_prompt_logprobs_and_entropy", "causal_lm_logprobs_and_entropy"):
        real = getattr(logprobs, name)
        monkeypatch.setattr(
            logprobs, name, lambda *a, _real=real, _name=name, **k: ran.append(_name) or _real(*a, **k)
        )
    with torch.no_grad():
        shared = logprobs.score_tokens(model, ids, mask, scored, prompt_length=P, chunk_size=5)
        whole = logprobs.score_tokens(model, ids, mask, scored, chunk_size=5)
        unscored = logprobs.score_tokens(model, ids, mask, None, prompt_length=P)  # no positions: whole rows
    assert ran == ["shared_prompt_logprobs_and_entropy", *["causal_lm_logprobs_and_entropy"] * 2]
    for a, b in zip(shared, whole, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(unscored[0][scored], whole[0][scored], rtol=1e-9, atol=1e-9)
