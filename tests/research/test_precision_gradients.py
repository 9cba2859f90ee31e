"""benchmarks/precision_gradients.py: its comparison against vectors worked by hand, and its --quick run."""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks.precision_gradients import compare_gradients, cosine, main
from stare_agent.config import cpu_has_bf16


def test_the_comparison_by_hand():
    g32, g16 = [torch.tensor([3.0]), torch.tensor([4.0])], [torch.tensor([3.0]), torch.tensor([4.5])]
    c32, c16 = [torch.tensor([4.0]), torch.tensor([4.0])], [torch.tensor([3.0]), torch.tensor([5.5])]
    out = compare_gradients(g32, g16, c32, c16)
    # <g16, g32> = 9 + 18 = 27, |g32| = 5, |g16| = sqrt(29.25); |g16 - g32| = 0.5
    assert out["grpo_cos"] == pytest.approx(27 / (5 * math.sqrt(29.25)))
    assert out["grpo_rel_diff"] == pytest.approx(0.1)
    # the levers c - g: (1, 0) in fp32 and (0, 1) in bf16: orthogonal, each of norm 1
    assert (out["lever_norm_fp32"], out["lever_norm_bf16"], out["lever_cos"]) == pytest.approx(
        (1.0, 1.0, 0.0)
    )
    assert math.isnan(cosine([torch.zeros(2)], [torch.ones(2)]))


@pytest.mark.slow  # two learners' DeepSpeed starts and 8 updates on the tiny model
def test_quick_run_compares_the_two_precisions_on_the_tiny_model(capsys):
    if not cpu_has_bf16():  # bf16-autocast would be emulated: the benchmark refuses, saying why
        with pytest.raises(SystemExit, match="no native bf16"):
            main(["--quick", "--batches", "1"])
        return
    rows = main(["--quick", "--batches", "2"])
    assert len(rows) == 2 and "| median (range) |" in capsys.readouterr().out
    for row in rows:
        assert row["grad_norm_fp32"] > 0 and row["grad_norm_bf16"] > 0
        assert 0.5 < row["grpo_cos"] <= 1 + 1e-9  # the same loss: close in direction, not identical
        assert row["lever_norm_fp32"] > 0 and -1 - 1e-9 <= row["lever_cos"] <= 1 + 1e-9
