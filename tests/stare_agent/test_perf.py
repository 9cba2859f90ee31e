"""Model FLOPs and the matmul bound (stare_agent.perf), worked by hand on the tiny test model."""

from __future__ import annotations

import math
import types

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from stare_agent import perf
from stare_agent.methods import method_class
from stare_agent.models import tiny_model


@pytest.fixture(scope="module")
def tiny():
    return tiny_model()[0]


def test_matmul_params_of_the_tiny_model_by_hand(tiny):
    # 2 layers, d 64, 4 heads of 16, 2 KV heads, MLP 128, vocabulary 49152, LM head tied
    c = tiny.config
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == (64, 2, 4, 2)
    assert (c.intermediate_size, c.vocab_size, c.tie_word_embeddings) == (128, 49152, True)
    q = o = 64 * 64
    k = v = 64 * 32
    mlp = 3 * 64 * 128
    head = 64 * 49152  # tied to the embedding, but still a matmul per token
    assert perf.matmul_params(c) == 2 * (q + k + v + o + mlp) + head == 3_219_456
    # the weights of every Linear (the tied head once): the same count
    linear = sum(m.weight.numel() for m in tiny.modules() if isinstance(m, torch.nn.Linear))
    assert linear == perf.matmul_params(c)


def test_forward_flops_are_2n_per_token_plus_causal_attention(tiny):
    c = tiny.config
    n = perf.matmul_params(c)
    # positions 0, 1, 2 score 1, 2, 3 keys: 4 x (1 + 2 + 3) x d_attn 64 per layer, 2 layers
    assert perf.attention_flops(c, 0, 3) == 2 * 4 * 6 * 64 == 3072
    assert perf.forward_flops(c, [3]) == 2 * n * 3 + 3072
    assert perf.train_flops(c, [3, 5]) == 3 * (perf.forward_flops(c, [3]) + perf.forward_flops(c, [5]))
    # decoding 2 tokens after a prompt of 3: positions 3 and 4 score 4 and 5 keys
    assert perf.forward_flops(c, [5], prefix_lens=[3]) == 2 * n * 2 + 2 * 4 * (4 + 5) * 64
    assert perf.forward_flops(c, [5], [3]) + perf.forward_flops(c, [3]) == perf.forward_flops(c, [5])
    # torch's own counter sees exactly 2N per token in the matmuls of a real forward pass
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        tiny(torch.arange(10).unsqueeze(0))
    counts = {str(op): f for op, f in counter.get_flop_counts()["Global"].items()}
    assert counts["aten.mm"] == 2 * n * 10


def test_a_config_without_head_dim_or_kv_heads_and_a_nested_text_config():
    c = types.SimpleNamespace(
        hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16, vocab_size=10
    )
    assert perf.matmul_params(c) == 4 * 8 * 8 + 3 * 8 * 16 + 8 * 10  # MHA: k, v as wide as q
    assert perf.matmul_params(types.SimpleNamespace(text_config=c)) == perf.matmul_params(c)


def test_the_probe_returns_a_sane_bound_and_is_cached():
    bound = perf.probe_matmul("fp32", n=256, repeats=2)
    assert math.isfinite(bound) and 1e8 < bound < 1e15  # 0.1 GFLOP/s to 1 PFLOP/s
    peak = perf.peak_flops("fp32")
    assert math.isfinite(peak) and 1e8 < peak < 1e15
    assert perf.peak_flops("fp32") == peak  # measured once per process


def test_mfu_and_the_learner_metrics():
    assert perf.mfu(50.0, 2.0, 100.0) == 0.25
    assert math.isnan(perf.mfu(1.0, 0.0, 100.0))
    c = types.SimpleNamespace(
        hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16, vocab_size=10
    )
    flops = 2 * perf.train_flops(c, [4, 6]) + 1.5 * perf.forward_flops(c, [4, 6])
    out = perf.learner_perf(c, [4, 6], 2.0, 1e3, updates=2, forward_passes=1.5, world=2)
    assert out == {"perf/tokens_per_s": 5.0, "perf/mfu": pytest.approx(flops / 2.0 / 2e3)}


@pytest.mark.parametrize(
    ("name", "epochs", "selection", "learned", "expected"),
    [
        ("grpo_ds", 1, "per_mini_batch", {}, (1.0, 0.0)),  # its update's forward gives the entropy
        ("stare", 1, "per_mini_batch", {}, (1.0, 1.0)),  # one pre-update pass
        ("grpo_ds", 2, "per_mini_batch", {"ppo/optimizer_steps": 4.0, "ppo/mini_batches": 2.0}, (2.0, 1.0)),
        ("stare", 1, "pre_update", {"ppo/optimizer_steps": 2.0, "ppo/mini_batches": 2.0}, (1.0, 1.0)),
        # per mini-batch: each later mini-batch anew, (2 epochs x 2 - 1) halves of the batch
        ("stare", 2, "per_mini_batch", {"ppo/optimizer_steps": 4.0, "ppo/mini_batches": 2.0}, (2.0, 2.5)),
    ],
)
def test_learner_passes(name, epochs, selection, learned, expected):
    alg = types.SimpleNamespace(name=name, ppo_epochs=epochs, selection=selection)
    pre_update = method_class(name).pre_update
    assert perf.learner_passes(alg, learned, pre_update=pre_update) == expected


def test_precision_dtype():
    assert [perf.precision_dtype(p) for p in ("bf16", "bf16-autocast", "fp32")] == ["bf16", "bf16", "fp32"]
