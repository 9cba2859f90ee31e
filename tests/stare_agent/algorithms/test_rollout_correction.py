"""Rollout correction and the sampler/learner mismatch, on values worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from stare_agent.algorithms.losses import policy_loss
from stare_agent.algorithms.rollout_correction import correction_weights, mismatch_metrics, mismatch_sums
from stare_agent.engines.openai_engine import OpenAIEngine
from stare_agent.engines.scripted import ScriptedEngine
from stare_agent.engines.sglang_engine import SGLangEngine
from stare_agent.engines.transformers_engine import TransformersEngine
from stare_agent.engines.vllm_engine import VLLMEngine
from stare_agent.options import check_rollout_correction
from stare_agent.train.rollout_engine import resolve_rollout_correction
from tests.helpers_tokenizers import smollm2_tokenizer

# Two sequences. Row 0: tokens the learner gives 0.5 and 0.1, the sampler 0.2 and 0.2, then a
# mask-0 entry (tool output) whose log-probs must never count. Row 1: one token, learner 0.3,
# sampler 0.3.
LEARNER = torch.log(torch.tensor([[0.5, 0.1, 0.9], [0.3, 1.0, 1.0]]))
SAMPLER = torch.log(torch.tensor([[0.2, 0.2, 0.01], [0.3, 1.0, 1.0]]))
MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])


def weights(mode: str, **kwargs) -> list[list[float]]:
    c, _ = correction_weights(LEARNER, SAMPLER, MASK, mode=mode, **kwargs)
    return [[round(v, 6) for v in row] for row in c.tolist()]


def test_token_tis_caps_each_tokens_ratio():
    # ratios 0.5/0.2 = 2.5 -> capped at 2; 0.1/0.2 = 0.5; 0.3/0.3 = 1
    assert weights("token_tis", cap=2.0) == [[2.0, 0.5, 0.0], [1.0, 0.0, 0.0]]
    _, metrics = correction_weights(LEARNER, SAMPLER, MASK, mode="token_tis", cap=2.0)
    assert metrics["rollout_correction/capped_frac"] == pytest.approx(1 / 3)
    assert metrics["rollout_correction/weight_mean"] == pytest.approx((2.0 + 0.5 + 1.0) / 3)


def test_seq_tis_puts_the_sequences_capped_ratio_on_each_of_its_tokens():
    # row 0: 2.5 * 0.5 = 1.25 (under the cap); row 1: 1
    assert weights("seq_tis", cap=2.0) == [[1.25, 1.25, 0.0], [1.0, 0.0, 0.0]]
    assert weights("seq_tis", cap=1.1) == [[1.1, 1.1, 0.0], [1.0, 0.0, 0.0]]


def test_masked_is_keeps_in_range_ratios_and_takes_out_the_rest():
    # token: 2.5 leaves [0.5, 2]; 0.5 is on the bound and stays
    assert weights("token_mis", low=0.5, high=2.0) == [[0.0, 0.5, 0.0], [1.0, 0.0, 0.0]]
    _, metrics = correction_weights(LEARNER, SAMPLER, MASK, mode="token_mis", low=0.5, high=2.0)
    assert metrics["rollout_correction/masked_frac"] == pytest.approx(1 / 3)
    # sequence: row 0's ratio 1.25 stays; with high = 1.2 the whole row leaves
    assert weights("seq_mis", low=0.5, high=2.0) == [[1.25, 1.25, 0.0], [1.0, 0.0, 0.0]]
    assert weights("seq_mis", low=0.5, high=1.2) == [[0.0, 0.0, 0.0], [1.0, 0.0, 0.0]]


def test_off_is_one_on_model_tokens_and_the_weights_carry_no_gradient():
    assert weights("none") == [[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]]
    logp = LEARNER.clone().requires_grad_(True)
    c, _ = correction_weights(logp, SAMPLER, MASK, mode="token_tis")
    assert not c.requires_grad


def test_mismatch_metrics_by_hand():
    d = [math.log(2.5), math.log(0.5), 0.0]  # learner - sampler on the three mask-1 tokens
    sums = mismatch_sums(LEARNER, SAMPLER, MASK, l_plus=torch.tensor([[True, False, True], [False] * 3]))
    metrics = mismatch_metrics(sums)
    assert metrics["mismatch/abs_logp_mean"] == pytest.approx(sum(map(abs, d)) / 3)
    assert metrics["mismatch/abs_logp_max"] == pytest.approx(math.log(2.5))
    # k3: exp(d) - 1 - d = 2.5 - 1 - 0.9163 = 0.5837; 0.5 - 1 + 0.6931 = 0.1931; 0
    assert metrics["mismatch/kl"] == pytest.approx((0.583709 + 0.193147 + 0.0) / 3, abs=1e-6)
    assert metrics["mismatch/L_plus_abs_logp_mean"] == pytest.approx(
        math.log(2.5)
    )  # the mask-0 pick never counts
    # sequences: D = log 1.25 and 0
    assert metrics["mismatch/seq_log_ratio_mean"] == pytest.approx(math.log(1.25) / 2)
    assert metrics["mismatch/seq_log_ratio_std"] == pytest.approx(math.log(1.25) / 2)
    assert math.isnan(
        mismatch_metrics(mismatch_sums(LEARNER, SAMPLER, torch.zeros_like(MASK)))["mismatch/kl"]
    )
    # no L+ (GRPO-ds, a gate that is off): no L+ mean at all, rather than a NaN
    assert "mismatch/L_plus_abs_logp_mean" not in mismatch_metrics(mismatch_sums(LEARNER, SAMPLER, MASK))


def test_the_corrected_gradient_is_the_on_policy_one_in_expectation():
    # One position, four tokens. The learner pi and a deliberately shifted sampler mu. The expected
    # gradient of the corrected loss over mu's draws, sum_a mu(a) grad loss(a), must equal the
    # on-policy one, sum_a pi(a) grad loss_on(a); uncorrected it does not.
    theta = torch.tensor([1.0, 0.2, -0.5, -1.5], requires_grad=True)
    advantage = torch.tensor([1.0, -0.5, 2.0, -1.0])
    mu = torch.tensor([0.1, 0.2, 0.3, 0.4])

    def expected_gradient(draw_probs: torch.Tensor, mode: str) -> torch.Tensor:
        theta.grad = None
        logp_all = torch.log_softmax(theta, dim=0)
        total = torch.zeros(())
        for a in range(4):
            logp = logp_all[a].reshape(1, 1)
            mask = torch.ones(1, 1)
            c, _ = correction_weights(logp, torch.log(mu[a]).reshape(1, 1), mask, mode=mode, cap=100.0)
            loss, _ = policy_loss(logp, logp.detach(), advantage[a].reshape(1, 1), mask, c)
            total = total + draw_probs[a] * loss
        total.backward()
        assert theta.grad is not None
        return theta.grad.clone()

    pi = torch.softmax(theta.detach(), dim=0)
    on_policy = expected_gradient(pi, "none")
    # by hand: the on-policy gradient of -E_pi[A log pi] is -sum_a pi_a A_a (e_a - pi)
    by_hand = -sum(pi[a] * advantage[a] * (torch.eye(4)[a] - pi) for a in range(4))
    assert torch.allclose(on_policy, by_hand, atol=1e-6)
    assert torch.allclose(expected_gradient(mu, "token_tis"), on_policy, atol=1e-6)
    assert torch.allclose(expected_gradient(mu, "seq_tis"), on_policy, atol=1e-6)
    assert not torch.allclose(expected_gradient(mu, "none"), on_policy, atol=1e-2)


def test_bad_options_say_what_to_use():
    with pytest.raises(ValueError, match="unknown: use one of none, token_tis"):
        check_rollout_correction(mode="tis", cap=2.0, low=0.5, high=2.0)
    with pytest.raises(ValueError, match="cap=0.5 must be >= 1"):
        check_rollout_correction(mode="token_tis", cap=0.5, low=0.5, high=2.0)
    with pytest.raises(ValueError, match="0 <= low < 1 < high"):
        check_rollout_correction(mode="token_mis", cap=2.0, low=0.5, high=0.9)


def test_auto_corrects_engines_with_kernels_of_their_own_only():
    tokenizer = smollm2_tokenizer()
    for engine_class in (VLLMEngine, SGLangEngine, OpenAIEngine):
        assert engine_class.own_numerics is True
        assert resolve_rollout_correction("auto", engine_class.__new__(engine_class)) == "token_tis"
    # the in-process transformers engine samples from the learner's own module: ratio 1, no correction
    assert resolve_rollout_correction("auto", TransformersEngine.__new__(TransformersEngine)) == "none"
    assert resolve_rollout_correction("auto", ScriptedEngine(tokenizer, [["x"]])) == "none"
    assert resolve_rollout_correction("seq_mis", ScriptedEngine(tokenizer, [["x"]])) == "seq_mis"
