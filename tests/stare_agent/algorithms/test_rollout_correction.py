"""Rollout correction and the sampler/learner mismatch, on values worked out by hand."""

from __future__ import annotations

import math
import re

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
    assert torch.allclose(expected_gradient(mu, "token_mask"), on_policy, atol=1e-6)  # C = 100: nothing out
    assert not torch.allclose(expected_gradient(mu, "none"), on_policy, atol=1e-2)
    # bypass logs, but trains as none does: uncorrected
    assert torch.equal(expected_gradient(mu, "bypass"), expected_gradient(mu, "none"))


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


# --- the field's other modes (issue 42): token ratios on LEARNER/SAMPLER are 2.5 and 0.5 (row 0) and
# 1 (row 1); D = log 1.25 and 0; the geometric-mean ratios exp(D / n) are sqrt(1.25) = 1.1180 and 1.


def metrics_of(mode: str, learner=LEARNER, sampler=SAMPLER, mask=MASK, **kwargs) -> dict[str, float]:
    return correction_weights(learner, sampler, mask, mode=mode, **kwargs)[1]


def test_token_mask_takes_out_what_token_tis_would_truncate():
    # AReaL's token_mask: 2.5 > C = 2 leaves (token_tis would give it 2); 0.5 stays: no lower bound
    assert weights("token_mask", cap=2.0) == [[0.0, 0.5, 0.0], [1.0, 0.0, 0.0]]
    assert weights("token_mask", cap=3.0) == [[2.5, 0.5, 0.0], [1.0, 0.0, 0.0]]
    assert metrics_of("token_mask", cap=2.0)["rollout_correction/masked_frac"] == pytest.approx(1 / 3)
    assert "rollout_correction/seq_rejected" not in metrics_of("token_mask")  # a token-level mode


def test_geo_rs_rejects_on_the_geometric_mean_ratio_with_no_weight():
    # row 0: exp(log(1.25) / 2) = 1.118 leaves verl's [0.999, 1.001]; row 1: 1 stays, weight 1
    assert weights("geo_rs") == [[0.0, 0.0, 0.0], [1.0, 0.0, 0.0]]
    m = metrics_of("geo_rs")
    assert (m["rollout_correction/seq_rejected"], m["rollout_correction/seq_rejected_frac"]) == (1.0, 0.5)
    assert m["rollout_correction/masked_frac"] == pytest.approx(2 / 3)
    # 1.118 <= 1.2: kept, and with weight 1, not its ratio 1.25 (seq_mis would give 1.25)
    assert weights("geo_rs", geo_high=1.2) == [[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]]
    assert weights("geo_rs", geo_high=1.11) == [[0.0, 0.0, 0.0], [1.0, 0.0, 0.0]]


def test_geo_rs_is_length_free_where_seq_mis_is_not():
    # 20 tokens at ratio 1.05 each: the product 1.05^20 = 2.653 leaves seq_mis' [0.5, 2];
    # the geometric mean 1.05 stays in [0.9, 1.1]
    learner = torch.full((1, 20), math.log(0.42))
    sampler = torch.full((1, 20), math.log(0.4))
    mask = torch.ones(1, 20)
    c, m = correction_weights(learner, sampler, mask, mode="seq_mis")
    assert float(c.sum()) == 0.0 and m["rollout_correction/seq_rejected"] == 1.0
    c, m = correction_weights(learner, sampler, mask, mode="geo_rs", geo_low=0.9, geo_high=1.1)
    assert c.tolist() == [[1.0] * 20] and m["rollout_correction/seq_rejected"] == 0.0


def test_geo_rs_combined_with_token_and_sequence_tis():
    # kept rows carry the TIS weight; a rejected row is 0 whatever its weight
    assert weights("geo_rs_token_tis", geo_high=1.2) == [[2.0, 0.5, 0.0], [1.0, 0.0, 0.0]]
    assert weights("geo_rs_token_tis") == [[0.0, 0.0, 0.0], [1.0, 0.0, 0.0]]
    assert weights("geo_rs_seq_tis", geo_high=1.2, cap=1.1) == [[1.1, 1.1, 0.0], [1.0, 0.0, 0.0]]
    assert weights("geo_rs_seq_tis") == [[0.0, 0.0, 0.0], [1.0, 0.0, 0.0]]
    m = metrics_of("geo_rs_token_tis", geo_high=1.2)
    assert m["rollout_correction/capped_frac"] == pytest.approx(1 / 3)  # 2.5 passed the cap
    assert m["rollout_correction/seq_rejected"] == 0.0


def test_the_veto_rejects_a_sequence_with_one_token_below_the_threshold():
    # row 0 holds a token at ratio 0.5 < 0.6: the whole row leaves, in any mode
    assert weights("token_tis", token_veto_threshold=0.6) == [[0.0, 0.0, 0.0], [1.0, 0.0, 0.0]]
    assert weights("bypass", token_veto_threshold=0.6) == [[0.0, 0.0, 0.0], [1.0, 0.0, 0.0]]
    assert weights("seq_tis", token_veto_threshold=0.6) == [[0.0, 0.0, 0.0], [1.0, 0.0, 0.0]]
    m = metrics_of("token_tis", token_veto_threshold=0.6)
    assert m["rollout_correction/veto_seq_frac"] == 0.5
    assert m["rollout_correction/veto_token_frac"] == pytest.approx(1 / 3)
    assert (m["rollout_correction/seq_rejected"], m["rollout_correction/masked_frac"]) == (
        1.0,
        pytest.approx(2 / 3),
    )
    # 0.5 >= 0.4: nothing vetoed, the weights are token_tis' own
    assert weights("token_tis", token_veto_threshold=0.4) == weights("token_tis")
    # a mask-0 entry (tool output) at ratio 0.01 vetoes nothing
    learner = LEARNER.clone()
    learner[1, 1] = math.log(0.01)
    c, m = correction_weights(learner, SAMPLER, MASK, mode="token_tis", token_veto_threshold=0.4)
    assert c[1, 0] == 1.0 and m["rollout_correction/veto_seq_frac"] == 0.0


def test_batch_normalize_divides_by_the_mean_weight():
    # token_tis weights 2, 0.5, 1: mean 3.5 / 3 = 7/6; divided: 12/7, 3/7, 6/7
    c, m = correction_weights(LEARNER, SAMPLER, MASK, mode="token_tis", batch_normalize=True)
    assert torch.allclose(c, torch.tensor([[12 / 7, 3 / 7, 0.0], [6 / 7, 0.0, 0.0]]))
    assert m["rollout_correction/batch_norm_factor"] == pytest.approx(7 / 6)
    assert m["rollout_correction/weight_mean"] == pytest.approx(7 / 6)  # logged before the division
    # every token out (ratios 1/3 < low = 0.5): nothing to divide by, the weights stay 0
    c, m = correction_weights(LEARNER, LEARNER + math.log(3.0), MASK, mode="token_mis", batch_normalize=True)
    assert float(c.abs().sum()) == 0.0 and m["rollout_correction/batch_norm_factor"] == 0.0


def test_effective_sample_size_and_chi_square_by_hand():
    m = metrics_of("token_tis")
    # weights 2, 0.5, 1: (3.5)^2 / (3 * (4 + 0.25 + 1)) = 12.25 / 15.75
    assert m["rollout_correction/eff_sample_size"] == pytest.approx(12.25 / 15.75)
    # raw ratios 2.5, 0.5, 1: (6.25 + 0.25 + 1) / 3 - 1 = 1.5; sequences 1.25 and 1: (1.5625 + 1) / 2 - 1
    assert m["rollout_correction/chi2_token"] == pytest.approx(1.5)
    assert m["rollout_correction/chi2_seq"] == pytest.approx(0.28125)
    assert metrics_of("seq_mis")["rollout_correction/chi2_token"] == pytest.approx(1.5)  # whatever the mode
    assert metrics_of("geo_rs", geo_high=1.2)["rollout_correction/eff_sample_size"] == 1.0  # equal weights
    assert metrics_of("geo_rs")["rollout_correction/eff_sample_size"] == pytest.approx(1 / 3)  # 0, 0, 1


def test_bypass_is_weight_one_with_the_metrics_and_trains_as_none():
    c, m = correction_weights(LEARNER, SAMPLER, MASK, mode="bypass")
    assert c.tolist() == weights("none") == [[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]]
    assert m["rollout_correction/chi2_token"] == pytest.approx(1.5)
    assert m["rollout_correction/eff_sample_size"] == 1.0
    assert "rollout_correction/capped_frac" not in m and "rollout_correction/masked_frac" not in m
    assert set(correction_weights(LEARNER, SAMPLER, MASK, mode="none")[1]) == {
        "rollout_correction/weight_mean"
    }


def test_sequence_level_modes_count_the_sequences_they_reject():
    # item 5: seq_mis logged a token fraction only. A third row with no model token is no sequence.
    learner = torch.cat([LEARNER, torch.zeros(1, 3)])
    sampler = torch.cat([SAMPLER, torch.zeros(1, 3)])
    mask = torch.cat([MASK, torch.zeros(1, 3, dtype=MASK.dtype)])
    m = metrics_of("seq_mis", learner, sampler, mask, high=1.2)  # row 0's 1.25 leaves
    assert (m["rollout_correction/seq_rejected"], m["rollout_correction/seq_rejected_frac"]) == (1.0, 0.5)
    assert m["rollout_correction/masked_frac"] == pytest.approx(2 / 3)
    m = metrics_of("seq_mis", learner, sampler, mask)
    assert (m["rollout_correction/seq_rejected"], m["rollout_correction/seq_rejected_frac"]) == (0.0, 0.0)


def _before_issue_42(logp, logp_sampler, response_mask, *, mode, cap=2.0, low=0.5, high=2.0):
    """correction_weights as it was before issue 42 (the existing modes must not move a bit)."""
    mask = response_mask.bool()
    zero = torch.zeros((), dtype=torch.float32, device=logp.device)
    d = torch.where(mask, logp.detach().float() - logp_sampler.float(), zero)
    if mode.startswith("seq"):
        d = torch.where(mask, d.sum(dim=-1, keepdim=True).expand_as(d), zero)
    ratio = torch.exp(d.clamp(-20.0, 20.0))
    n = max(int(mask.sum()), 1)
    metrics: dict[str, float] = {}
    if mode == "none":
        c = torch.ones_like(ratio)
    elif mode.endswith("tis"):
        c = ratio.clamp(max=cap)
        metrics["rollout_correction/capped_frac"] = float(((ratio > cap) & mask).sum()) / n
    else:
        kept = (ratio >= low) & (ratio <= high)
        c = torch.where(kept, ratio, zero)
        metrics["rollout_correction/masked_frac"] = float((~kept & mask).sum()) / n
    c = torch.where(mask, c, zero).to(logp.dtype)
    metrics["rollout_correction/weight_mean"] = float(c.float().sum()) / n
    return c, metrics


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_existing_modes_are_bit_identical_to_before(dtype):
    g = torch.Generator().manual_seed(0)
    logp = (-torch.rand(6, 50, generator=g) * 3).to(dtype)
    sampler = logp.float() + 0.3 * torch.randn(6, 50, generator=g)
    mask = torch.rand(6, 50, generator=g) > 0.3
    mask[5] = False
    for mode in ("none", "token_tis", "seq_tis", "token_mis", "seq_mis"):
        for kwargs in ({}, {"cap": 1.3, "low": 0.8, "high": 1.25}):
            c, m = correction_weights(logp, sampler, mask, mode=mode, **kwargs)
            c_old, m_old = _before_issue_42(logp, sampler, mask, mode=mode, **kwargs)
            assert c.dtype == c_old.dtype and torch.equal(c, c_old), mode
            assert {k: m[k] for k in m_old} == m_old, mode


def test_the_config_passes_every_option_of_correction_weights():
    # the learner calls correction_weights(..., mode=mode, **rc.options()): no option may be left behind
    import inspect

    from stare_agent.config import RolloutCorrectionConfig

    params = set(inspect.signature(correction_weights).parameters)
    options = RolloutCorrectionConfig().options()
    assert set(options) == params - {"logp", "logp_sampler", "response_mask", "mode"}
    rc = RolloutCorrectionConfig(mode="geo_rs_token_tis", token_veto_threshold=0.6, geo_high=1.2)
    c, _ = correction_weights(LEARNER, SAMPLER, MASK, mode=rc.mode, **rc.options())
    assert c.tolist() == [[0.0, 0.0, 0.0], [1.0, 0.0, 0.0]]  # the veto took row 0


def test_new_options_say_what_to_use():
    from stare_agent.config import ConfigError, RolloutCorrectionConfig

    base = {"mode": "token_tis", "cap": 2.0, "low": 0.5, "high": 2.0}
    with pytest.raises(ValueError, match="0 < geo_low < 1 < geo_high .* verl's 0.999 and 1.001"):
        check_rollout_correction(**base, geo_low=0.999, geo_high=0.9995)
    with pytest.raises(ValueError, match=r"token_veto_threshold=1.0 must lie in \(0, 1\).*e.g. 1e-4"):
        check_rollout_correction(**base, token_veto_threshold=1.0)
    with pytest.raises(ValueError, match="mode none applies nothing.*bypass for the veto alone"):
        check_rollout_correction(**{**base, "mode": "none"}, token_veto_threshold=1e-4)
    with pytest.raises(ConfigError, match="algorithm.rollout_correction: .*batch_normalize"):
        RolloutCorrectionConfig(mode="none", batch_normalize=True)
    RolloutCorrectionConfig(mode="auto", token_veto_threshold=1e-4)  # auto: checked as a correcting mode


def test_the_algorithm_page_lists_every_mode_and_the_options_defaults():
    from pathlib import Path

    from stare_agent.config import RolloutCorrectionConfig
    from stare_agent.config_reference import yaml_value
    from stare_agent.options import ROLLOUT_CORRECTION_MODES

    page = (Path(__file__).resolve().parents[3] / "docs" / "algorithm.md").read_text(encoding="utf-8")
    table = page.split("| rollout correction | config field | default |")[1].split("\n\n")[0]
    rows = dict(
        re.findall(r"^\| [^|]+ \| `algorithm\.rollout_correction\.(\w+)` \| `([^`]+)` \|", table, re.M)
    )
    defaults = RolloutCorrectionConfig()
    assert rows == {f: yaml_value(getattr(defaults, f)) for f in rows}
    assert set(rows) == {"mode", *defaults.options()}
    for mode in ROLLOUT_CORRECTION_MODES:
        assert f"`{mode}`" in table, mode
