"""STARE weights, gate and adaptive controller: hand-computed cases and hypothesis properties."""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stare_agent.algorithms.selection import top_k_count
from stare_agent.algorithms.stare import AdaptiveController, entropy_gate, stare_weights
from stare_agent.config import AlgorithmConfig

W, M = 1.1, 0.9


def _case():
    """Rows: A = +1 (4 model tokens + 1 pad), A = -1 (3 model tokens), A = 0 (2 model tokens)."""
    A_seq = torch.tensor([1.0, -1.0, 0.0])
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0], [1, 1, 0, 0, 0]])
    logp = torch.tensor(
        [
            [-0.1, -2.0, -0.5, -3.0, -9.0],  # s = 0.1, 2.0, 0.5, 3.0 | pad s = 9 must be ignored
            [-1.0, -0.2, -4.0, -7.0, -7.0],  # s = 1.0, 0.2, 4.0 | pads
            [-5.0, -6.0, -8.0, -8.0, -8.0],  # A = 0: neither T+ nor T-
        ]
    )
    return A_seq[:, None] * mask, logp, mask


def test_o1_and_c2_by_hand():
    A, logp, mask = _case()
    # |T+| = 4, P = 0.3 -> ceil(1.2) = 2: the two largest s in T+ are 3.0 (0,3) and 2.0 (0,1)
    # |T-| = 3 -> ceil(0.9) = 1: the largest s in T- is 4.0 (1,2)
    w, L_plus, L_minus, m = stare_weights(A, logp, mask, gate_on=True, variant="O1", P=0.3, W=W, M=M)
    expected_plus = torch.zeros(3, 5, dtype=torch.bool)
    expected_plus[0, 1] = expected_plus[0, 3] = True
    assert torch.equal(L_plus, expected_plus)
    assert not L_minus.any()  # O1 never selects L-
    expected_w = torch.ones(3, 5)
    expected_w[0, 1] = expected_w[0, 3] = W
    assert torch.equal(w, expected_w)

    w, L_plus, L_minus, m = stare_weights(A, logp, mask, gate_on=True, variant="C2", P=0.3, W=W, M=M)
    expected_w[1, 2] = M
    assert torch.equal(w, expected_w)
    assert L_minus.nonzero().tolist() == [[1, 2]]
    # 9 model tokens: 4 in T+, 3 in T-, 2 with A = 0; 2 + 1 reweighted
    assert m["stare/frac_T_plus"] == pytest.approx(4 / 9)
    assert m["stare/frac_T_minus"] == pytest.approx(3 / 9)
    assert m["stare/frac_reweighted"] == pytest.approx(3 / 9)
    assert m["stare/mean_weight"] == pytest.approx((6 + 2 * 1.1 + 0.9) / 9)  # 9.1 / 9
    assert (m["stare/L_plus"], m["stare/L_minus"], m["stare/gate_on"]) == (2.0, 1.0, 1.0)
    # s of the 9 model tokens sorted: 0.1 0.2 0.5 1 2 3 4 5 6; nearest rank: p50 -> 5th = 2.0,
    # p90 -> ceil(8.1) = 9th = 6.0, p99 -> 9th = 6.0
    assert m["stare/surprisal_p50"] == pytest.approx(2.0)
    assert m["stare/surprisal_p90"] == pytest.approx(6.0)
    assert m["stare/surprisal_p99"] == pytest.approx(6.0)


def test_gate_off_gives_all_ones_but_still_reports_the_selection():
    A, logp, mask = _case()
    w, L_plus, _, m = stare_weights(A, logp, mask, gate_on=False, variant="C2", P=0.3)
    assert torch.equal(w, torch.ones(3, 5))
    assert int(L_plus.sum()) == 2
    assert m["stare/frac_reweighted"] == 0.0 and m["stare/mean_weight"] == 1.0


def test_ties_broken_by_sequence_then_position():
    # one T+ row with s = 1, 2, 2, 2; P = 0.5 -> k = 2 among three tied s = 2: positions 1 and 2 win
    A = torch.ones(1, 4)
    logp = -torch.tensor([[1.0, 2.0, 2.0, 2.0]])
    _, L_plus, _, _ = stare_weights(A, logp, torch.ones(1, 4), gate_on=True, P=0.5)
    assert L_plus.nonzero().tolist() == [[0, 1], [0, 2]]
    # two rows tied at s = 2 (row 0 position 1, row 1 position 0); P = 0.25 of 4 -> k = 1
    logp = -torch.tensor([[1.0, 2.0], [2.0, 0.5]])
    _, L_plus, _, _ = stare_weights(
        torch.ones(2, 2), logp, torch.ones(2, 2), gate_on=True, P=0.25, scope="global"
    )
    assert L_plus.nonzero().tolist() == [[0, 1]]  # default key: row index 0 < 1
    _, L_plus, _, _ = stare_weights(
        torch.ones(2, 2),
        logp,
        torch.ones(2, 2),
        gate_on=True,
        P=0.25,
        scope="global",
        sequence_ids=torch.tensor([5, 1]),
    )
    assert L_plus.nonzero().tolist() == [[1, 0]]  # sequence id 1 < 5


def test_micro_batch_scope_selects_inside_each_block():
    # 4 rows x 2 tokens, all A > 0; s: row0 5, 4 | row1 3, 2 | row2 1, 0.9 | row3 0.8, 0.7; P = 0.25
    logp = -torch.tensor([[5.0, 4.0], [3.0, 2.0], [1.0, 0.9], [0.8, 0.7]])
    A, mask = torch.ones(4, 2), torch.ones(4, 2)
    _, L_global, _, _ = stare_weights(A, logp, mask, gate_on=True, P=0.25, scope="global")
    assert L_global.nonzero().tolist() == [[0, 0], [0, 1]]  # ceil(0.25 * 8) = 2 over the batch
    _, L_micro, _, _ = stare_weights(
        A, logp, mask, gate_on=True, P=0.25, scope="micro_batch", micro_batch_size=2
    )
    assert L_micro.nonzero().tolist() == [[0, 0], [2, 0]]  # ceil(0.25 * 4) = 1 per block of 2 rows


def test_top_k_count_reads_p_as_written():
    assert top_k_count(0.1, 30) == 3  # float 0.1 * 30 = 3.0000000000000004, yet ceil(3) = 3
    assert top_k_count(0.1, 31) == 4
    assert top_k_count(0.1, 1) == 1  # at least one when non-empty
    assert top_k_count(0.1, 0) == 0
    assert top_k_count(0.3, 4) == 2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"variant": "O2"}, "use 'O1'"),
        ({"scope": "batch"}, "use 'micro_batch'"),
        ({"P": 0.0}, "0 < P <= 1"),
        ({"P": 1.5}, "0 < P <= 1"),
        ({"W": 0.9}, "must be >= 1"),
        ({"M": 0.0}, "0 < M <= 1"),
        ({"M": 1.2}, "0 < M <= 1"),
        ({"micro_batch_size": 0}, "micro_batch_size=0"),
    ],
)
def test_invalid_options_name_the_rule(kwargs, message):
    A, logp, mask = _case()
    with pytest.raises(ValueError, match=message):
        stare_weights(A, logp, mask, gate_on=True, **kwargs)


def test_shape_and_nan_errors():
    A, logp, mask = _case()
    with pytest.raises(ValueError, match=r"must all be \[B, T\]"):
        stare_weights(A[:, :4], logp, mask, gate_on=True)
    logp[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN log-prob on a mask-1 token"):
        stare_weights(A, logp, mask, gate_on=True)
    logp[0, 0], logp[0, 4] = -0.1, float("nan")  # NaN on a pad is fine
    stare_weights(A, logp, mask, gate_on=True)
    with pytest.raises(ValueError, match="distinct id"):
        stare_weights(A, logp, mask, gate_on=True, scope="global", sequence_ids=torch.tensor([1, 1, 2]))


# ------------------------------------------------------------------------------------------
# gate and adaptive schedule
# ------------------------------------------------------------------------------------------


def test_gate_by_hand_and_strictly_less():
    entropy = torch.tensor([[0.25, 0.5, 9.0], [float("nan"), 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    # Hbar = (0.25 + 0.5) / 2 = 0.375 (pads, including NaN, never read)
    gate_on, Hbar, m = entropy_gate(entropy, mask, H_tgt=0.375)
    assert Hbar == 0.375 and gate_on is False  # equal is not "less"
    gate_on, _, m = entropy_gate(entropy, mask, H_tgt=0.376)
    assert gate_on is True
    assert m == {"stare/gate_on": 1.0, "stare/entropy": 0.375, "stare/H_tgt": 0.376}
    with pytest.raises(ValueError, match="no mask-1 tokens"):
        entropy_gate(entropy, torch.zeros(2, 3), H_tgt=0.3)


def test_adaptive_controller_steps_clips_and_round_trips():
    c = AdaptiveController(W=1.1, M=0.9, H_tgt=0.3, alpha=0.01, W_max=1.5, M_min=0.5)
    assert c.update(0.1) == pytest.approx({"stare/W": 1.11, "stare/M": 0.89})  # entropy low: W up, M down
    c.update(0.5)  # entropy high: back
    assert (c.W, c.M) == pytest.approx((1.1, 0.9))
    c.update(0.3)  # sign(0) = 0: unchanged
    assert (c.W, c.M) == pytest.approx((1.1, 0.9))
    top = dataclasses.replace(c, W=1.5, M=0.5)
    top.update(0.0)
    assert (top.W, top.M) == (1.5, 0.5)  # clipped at W_max and M_min
    bottom = dataclasses.replace(c, W=1.0, M=1.0)
    bottom.update(1.0)
    assert (bottom.W, bottom.M) == (1.0, 1.0)  # clipped at 1

    saved = c.state_dict()
    restored = AdaptiveController.from_config(AlgorithmConfig())
    restored.load_state_dict(saved)
    assert restored == c
    with pytest.raises(ValueError, match="W_max"):
        restored.load_state_dict({**saved, "W": 2.0})


# ------------------------------------------------------------------------------------------
# properties
# ------------------------------------------------------------------------------------------


@st.composite
def batches(draw):
    B, T = draw(st.integers(1, 5)), draw(st.integers(1, 7))
    mask = torch.tensor(
        draw(st.lists(st.lists(st.booleans(), min_size=T, max_size=T), min_size=B, max_size=B))
    )
    A_seq = torch.tensor(draw(st.lists(st.sampled_from([-1.5, -0.5, 0.0, 0.5, 2.0]), min_size=B, max_size=B)))
    # a few distinct surprisal levels, so ties are common
    levels = st.sampled_from([0.1, 0.5, 1.0, 2.0, 3.0])
    s = torch.tensor(draw(st.lists(st.lists(levels, min_size=T, max_size=T), min_size=B, max_size=B)))
    return A_seq[:, None] * mask, -s, mask


OPTIONS = st.fixed_dictionaries(
    {
        "variant": st.sampled_from(["O1", "C2"]),
        "scope": st.sampled_from(["micro_batch", "global"]),
        "P": st.sampled_from([0.05, 0.1, 0.25, 0.5, 1.0]),
        "W": st.sampled_from([1.0, 1.1, 1.5]),
        "M": st.sampled_from([0.5, 0.9, 1.0]),
        "micro_batch_size": st.sampled_from([None, 1, 2]),
    }
)
PROPERTY = settings(max_examples=60, deadline=None)


def _ceil(P: float, n: int) -> int:
    return math.ceil(Fraction(str(P)) * n)


@PROPERTY
@given(batch=batches(), options=OPTIONS, garbage=st.floats(-50, 50))
def test_mask_zero_tokens_never_change_any_output(batch, options, garbage):
    A, logp, mask = batch
    reference = stare_weights(A, logp, mask, gate_on=True, **options)
    pad = ~mask.bool()
    A2 = torch.where(pad, garbage, A)
    logp2 = torch.where(pad, -abs(garbage) - 1e3, logp)  # pads look maximally surprising
    # and one more all-pad column on the right
    A2, logp2 = torch.cat([A2, torch.full_like(A2[:, :1], 3.0)], 1), torch.cat([logp2, logp2[:, :1] - 99], 1)
    mask2 = torch.cat([mask, torch.zeros_like(mask[:, :1])], 1)
    result = stare_weights(A2, logp2, mask2, gate_on=True, **options)
    for ref, new in zip(reference[:3], result[:3], strict=True):
        assert torch.equal(ref, new[:, :-1])
    assert torch.equal(result[0][:, -1], torch.ones(A.shape[0]))
    assert reference[3] == result[3]


@PROPERTY
@given(batch=batches(), options=OPTIONS, gate_on=st.booleans())
def test_weights_and_selection_sizes(batch, options, gate_on):
    A, logp, mask = batch
    w, L_plus, L_minus, _ = stare_weights(A, logp, mask, gate_on=gate_on, **options)
    if not gate_on:
        assert torch.equal(w, torch.ones_like(w))
    values = {1.0, options["W"], options["M"]} if options["variant"] == "C2" else {1.0, options["W"]}
    assert set(w.unique().tolist()) <= {float(torch.tensor(v)) for v in values}
    m, s = mask.bool(), -logp
    rows = A.shape[0] if options["scope"] == "global" else options["micro_batch_size"] or A.shape[0]
    for lo in range(0, A.shape[0], rows):  # each selection block
        for name, L, T_set in (("L+", L_plus, m & (A > 0)), ("L-", L_minus, m & (A < 0))):
            L, T_set, s_block = L[lo : lo + rows], T_set[lo : lo + rows], s[lo : lo + rows]
            if name == "L-" and options["variant"] == "O1":
                assert not L.any()
                continue
            assert int(L.sum()) == _ceil(options["P"], int(T_set.sum()))  # |L| = ceil(P |T|)
            assert not (L & ~T_set).any()  # L is inside T
            if L.any() and (T_set & ~L).any():  # top-k: nothing left out is more surprising
                assert s_block[L].min() >= s_block[T_set & ~L].max()


@PROPERTY
@given(batch=batches(), options=OPTIONS, perm_seed=st.integers(0, 2**16))
def test_global_scope_is_invariant_to_permuting_sequences(batch, options, perm_seed):
    A, logp, mask = batch
    options = {**options, "scope": "global", "micro_batch_size": None}
    perm = torch.randperm(A.shape[0], generator=torch.Generator().manual_seed(perm_seed))
    ids = torch.arange(A.shape[0]) * 3 + 7
    # with stable sequence ids, exactly invariant
    w, Lp, Lm, metrics = stare_weights(A, logp, mask, gate_on=True, sequence_ids=ids, **options)
    w2, Lp2, Lm2, metrics2 = stare_weights(
        A[perm], logp[perm], mask[perm], gate_on=True, sequence_ids=ids[perm], **options
    )
    assert torch.equal(w[perm], w2) and torch.equal(Lp[perm], Lp2) and torch.equal(Lm[perm], Lm2)
    assert metrics == metrics2
    # without ids (row index breaks ties) only equal-surprisal tokens may trade places:
    # the counts and the multiset of selected surprisals are invariant
    _, Lp, Lm, metrics = stare_weights(A, logp, mask, gate_on=True, **options)
    _, Lp2, Lm2, metrics2 = stare_weights(A[perm], logp[perm], mask[perm], gate_on=True, **options)
    assert metrics == metrics2
    for L, L2 in ((Lp, Lp2), (Lm, Lm2)):
        assert torch.equal(logp[L].sort().values, logp[perm][L2].sort().values)


@PROPERTY
@given(batch=batches(), options=OPTIONS, gate_on=st.booleans())
def test_c2_with_m_equal_1_is_o1(batch, options, gate_on):
    A, logp, mask = batch
    o1 = stare_weights(A, logp, mask, gate_on=gate_on, **{**options, "variant": "O1"})
    c2 = stare_weights(A, logp, mask, gate_on=gate_on, **{**options, "variant": "C2", "M": 1.0})
    assert torch.equal(o1[0], c2[0]) and torch.equal(o1[1], c2[1])


@PROPERTY
@given(batch=batches(), garbage=st.sampled_from([float("nan"), float("inf"), -1e30, 7.0]))
def test_gate_ignores_mask_zero_entropy(batch, garbage):
    _, logp, mask = batch
    if not mask.any():
        return
    entropy = -logp
    gate, Hbar, _ = entropy_gate(entropy, mask, H_tgt=1.0)
    gate2, Hbar2, _ = entropy_gate(torch.where(mask.bool(), entropy, garbage), mask, H_tgt=1.0)
    assert (gate, Hbar) == (gate2, Hbar2)
    assert Hbar == pytest.approx(float(entropy[mask.bool()].double().mean()))
