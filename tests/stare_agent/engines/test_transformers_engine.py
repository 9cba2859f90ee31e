"""TransformersEngine against independent recomputations with the tiny model and the real tokenizer."""

from __future__ import annotations

import pytest
import torch

from stare_agent.engines.transformers_engine import TransformersEngine, sample_next_tokens
from stare_agent.models import tiny_model
from stare_envs.engine import SamplingParams

GREEDY = SamplingParams(temperature=0.0, top_p=1.0, top_k=None, max_new_tokens=12, seed=None)


@pytest.fixture(scope="module")
def tiny():
    return tiny_model(seed=0)


@pytest.fixture(scope="module")
def prompts(tiny):
    _model, tokenizer = tiny
    texts = ["Compute 2+2.", "What is the integral of x^2 from 0 to 3? Think step by step.", "Hi"]
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": t}], add_generation_prompt=True, return_dict=False
        )
        for t in texts
    ]


def naive_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Argmax step by step, recomputing the full forward pass without a cache."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def full_forward_logits(model, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """Logits that predicted each generated token, from one forward pass over prompt + generated."""
    ids = torch.tensor([list(prompt) + list(generated)])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(generated)]


def test_greedy_equals_naive_argmax_without_cache(tiny, prompts):
    model, tokenizer = tiny
    engine = TransformersEngine(model, tokenizer, eos_token_ids=[])
    out = engine.generate(prompts[:1], GREEDY)[0]
    assert out.token_ids == naive_greedy(model, prompts[0], GREEDY.max_new_tokens)
    assert out.finish_reason == "length"
    assert len(out.logprobs) == len(out.token_ids) == GREEDY.max_new_tokens


def test_batch_of_different_lengths_equals_one_by_one(tiny, prompts):
    model, tokenizer = tiny
    engine = TransformersEngine(model, tokenizer, eos_token_ids=[])
    batched = engine.generate(prompts, GREEDY)
    for prompt, got in zip(prompts, batched, strict=True):
        alone = engine.generate([prompt], GREEDY)[0]
        assert got.token_ids == alone.token_ids
        assert got.logprobs == pytest.approx(alone.logprobs, abs=1e-4)


def test_logprobs_equal_full_forward_log_softmax_at_temperature_one(tiny, prompts):
    model, tokenizer = tiny
    engine = TransformersEngine(model, tokenizer, eos_token_ids=[])
    params = SamplingParams(temperature=1.0, top_p=1.0, top_k=None, max_new_tokens=16, seed=3)
    for prompt, out in zip(prompts, engine.generate(prompts, params), strict=True):
        logits = full_forward_logits(model, prompt, out.token_ids)
        expected = torch.log_softmax(logits, -1)[
            torch.arange(len(out.token_ids)), torch.tensor(out.token_ids)
        ]
        assert torch.allclose(torch.tensor(out.logprobs), expected, atol=1e-4)


def test_logprobs_under_truncated_sampling_distribution(tiny, prompts):
    """temperature 0.7, top-k 50, top-p 0.9: log-prob within the renormalised kept set."""
    model, tokenizer = tiny
    engine = TransformersEngine(model, tokenizer, eos_token_ids=[])
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=50, max_new_tokens=10, seed=5)
    out = engine.generate(prompts[:1], params)[0]
    logits = full_forward_logits(model, prompts[0], out.token_ids) / 0.7
    for step, token in enumerate(out.token_ids):
        order = logits[step].argsort(descending=True)[:50]  # top-k, most likely first
        probs = torch.softmax(logits[step][order], -1)
        kept = []
        mass = 0.0
        for token_id, p in zip(order.tolist(), probs.tolist(), strict=True):
            kept.append(token_id)  # smallest prefix whose mass reaches top_p
            mass += p
            if mass >= 0.9:
                break
        assert token in kept
        kept_logits = logits[step][torch.tensor(kept)]
        expected = kept_logits[kept.index(token)] - torch.logsumexp(kept_logits, -1)
        assert out.logprobs[step] == pytest.approx(float(expected), abs=1e-4)


def test_top_k_one_is_greedy_with_logprob_zero(tiny, prompts):
    model, tokenizer = tiny
    engine = TransformersEngine(model, tokenizer, eos_token_ids=[])
    params = SamplingParams(temperature=1.0, top_p=1.0, top_k=1, max_new_tokens=8, seed=1)
    out = engine.generate(prompts[:1], params)[0]
    assert out.token_ids == naive_greedy(model, prompts[0], 8)
    assert out.logprobs == [0.0] * 8


def test_seed_reproducible_and_different_seeds_differ(tiny, prompts):
    model, tokenizer = tiny
    engine = TransformersEngine(model, tokenizer, eos_token_ids=[])
    params = SamplingParams(temperature=1.0, top_p=1.0, top_k=None, max_new_tokens=10, seed=7)
    first = engine.generate(prompts, params)
    again = engine.generate(prompts, params)
    other = engine.generate(prompts, SamplingParams(1.0, 1.0, None, 10, 8))
    assert [g.token_ids for g in first] == [g.token_ids for g in again]
    assert [g.token_ids for g in first] != [g.token_ids for g in other]


def test_stop_string_ends_at_the_completing_token(tiny, prompts):
    model, tokenizer = tiny
    engine = TransformersEngine(model, tokenizer, eos_token_ids=[])
    free = engine.generate(prompts[:1], GREEDY)[0].token_ids
    # A stop string made of the text of generated tokens 4..5, so it completes at token 5 at the latest.
    stop = tokenizer.decode(free[4:6])
    out = engine.generate(prompts[:1], GREEDY, stop=[stop, "never-generated-stop"])[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == free[: len(out.token_ids)]
    assert len(out.token_ids) <= 6
    assert stop in tokenizer.decode(out.token_ids)
    assert stop not in tokenizer.decode(out.token_ids[:-1])


def test_eos_is_returned_with_reason_eos_and_other_sequences_continue(tiny, prompts):
    model, tokenizer = tiny
    free = TransformersEngine(model, tokenizer, eos_token_ids=[]).generate(prompts, GREEDY)
    eos_token = free[0].token_ids[3]  # make the 4th greedy token of prompt 0 the EOS token
    engine = TransformersEngine(model, tokenizer, eos_token_ids=[eos_token])
    outs = engine.generate(prompts, GREEDY)
    first_eos = free[0].token_ids.index(eos_token)
    assert outs[0].token_ids == free[0].token_ids[: first_eos + 1]
    assert outs[0].finish_reason == "eos"
    for got, ref in zip(outs[1:], free[1:], strict=True):  # finishing one row does not disturb the others
        if eos_token in ref.token_ids:
            assert got.token_ids == ref.token_ids[: ref.token_ids.index(eos_token) + 1]
        else:
            assert got.token_ids == ref.token_ids
            assert got.finish_reason == "length"


def test_default_eos_is_smollm2_im_end(tiny):
    model, tokenizer = tiny
    engine = TransformersEngine(model, tokenizer)
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in engine.eos_token_ids


def test_empty_prompt_is_refused(tiny):
    model, tokenizer = tiny
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        TransformersEngine(model, tokenizer).generate([[1, 2], []], GREEDY, [])


def test_chunks_of_max_batch_size_match_one_batch(tiny, prompts):
    model, tokenizer = tiny
    whole = TransformersEngine(model, tokenizer, eos_token_ids=[]).generate(prompts, GREEDY)
    chunked = TransformersEngine(model, tokenizer, eos_token_ids=[], max_batch_size=2).generate(
        prompts, GREEDY
    )
    assert [g.token_ids for g in whole] == [g.token_ids for g in chunked]


def test_update_weights_copies_in_place_and_changes_outputs(prompts):
    model, tokenizer = tiny_model(seed=0)
    other, _ = tiny_model(tokenizer, seed=1)
    engine = TransformersEngine(model, tokenizer, eos_token_ids=[])
    engine.update_weights(dict(model.named_parameters()))  # same tensors: a no-op
    reference = TransformersEngine(other, tokenizer, eos_token_ids=[]).generate(prompts[:1], GREEDY)[0]
    embed = model.get_input_embeddings().weight
    engine.update_weights(other.named_parameters())
    assert model.get_input_embeddings().weight is embed  # in place, same storage
    assert engine.generate(prompts[:1], GREEDY)[0].token_ids == reference.token_ids
    with pytest.raises(KeyError, match="not a parameter"):
        engine.update_weights({"nope.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="does not match"):
        engine.update_weights({"model.norm.weight": torch.zeros(3)})


def test_with_own_weights_samples_from_a_copy_that_the_original_model_does_not_share(prompts):
    model, tokenizer = tiny_model(seed=0)
    other, _ = tiny_model(tokenizer, seed=1)
    engine = TransformersEngine(model, tokenizer, eos_token_ids=[], max_batch_size=2)
    own = engine.with_own_weights(other.named_parameters())
    assert own.model is not model and (own.eos_token_ids, own.max_batch_size) == (frozenset(), 2)
    reference = TransformersEngine(other, tokenizer, eos_token_ids=[]).generate(prompts[:1], GREEDY)[0]
    assert own.generate(prompts[:1], GREEDY)[0] == reference
    with torch.no_grad():
        other.get_input_embeddings().weight.zero_()  # the source changes: the copy does not
    assert own.generate(prompts[:1], GREEDY)[0] == reference
    with pytest.raises(ValueError, match="were not given, e.g. 'model.norm.weight'"):
        engine.with_own_weights((n, p) for n, p in model.named_parameters() if n != "model.norm.weight")


def test_sample_next_tokens_top_p_keeps_smallest_prefix_reaching_p():
    # probabilities 0.5, 0.3, 0.15, 0.05: top_p 0.8 keeps {0, 1}; renormalised 0.625 / 0.375.
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(2000, 1)
    params = SamplingParams(temperature=1.0, top_p=0.8, top_k=None, max_new_tokens=1, seed=0)
    tokens, logprobs = sample_next_tokens(logits, params, torch.Generator().manual_seed(0))
    assert set(tokens.tolist()) == {0, 1}
    expected = {0: torch.log(torch.tensor(0.625)), 1: torch.log(torch.tensor(0.375))}
    for token, logprob in zip(tokens.tolist(), logprobs.tolist(), strict=True):
        assert logprob == pytest.approx(float(expected[token]), abs=1e-6)
    assert (tokens == 0).float().mean().item() == pytest.approx(0.625, abs=0.05)


@pytest.mark.gpu  # skipped without a CUDA GPU (tests/conftest.py), failed then under STARE_REQUIRE=gpu
def test_cuda_generation_matches_cpu(prompts):
    model, tokenizer = tiny_model(seed=0)
    on_cpu = TransformersEngine(model, tokenizer, eos_token_ids=[]).generate(prompts, GREEDY, [])
    gpu_model, _ = tiny_model(tokenizer, seed=0)
    on_gpu = TransformersEngine(gpu_model, tokenizer, device="cuda", eos_token_ids=[]).generate(
        prompts, GREEDY, []
    )
    assert [g.token_ids for g in on_gpu] == [g.token_ids for g in on_cpu]
    sampled = TransformersEngine(gpu_model, tokenizer, device="cuda").generate(
        prompts, SamplingParams(seed=1), []
    )
    assert all(len(g.token_ids) == len(g.logprobs) > 0 for g in sampled)


def test_bf16_autocast_generation_returns_float32_logprobs_of_the_sampled_tokens():
    from stare_agent.engines import TransformersEngine
    from stare_agent.models import tiny_model
    from stare_envs.engine import SamplingParams

    model, tokenizer = tiny_model(seed=0)
    engine = TransformersEngine(model, tokenizer, autocast_dtype=torch.bfloat16)
    prompt = tokenizer.encode("What is 2 + 2?", add_special_tokens=False)
    (gen,) = engine.generate([prompt], SamplingParams(temperature=1.0, max_new_tokens=8, seed=0), [])
    assert len(gen.token_ids) == len(gen.logprobs) == 8
    assert all(isinstance(x, float) and x <= 0.0 for x in gen.logprobs)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # autocast leaves weights alone


def test_generation_runs_in_eval_mode_and_keeps_the_callers_mode(prompts):
    """A learner keeps the shared module in train mode: dropout must not touch rollouts, and with
    gradient checkpointing (train mode turns the KV cache off) decoding must still use the cache."""
    model, tokenizer = tiny_model(seed=0)
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.5
    engine = TransformersEngine(model, tokenizer, eos_token_ids=[])
    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=12, seed=5)
    expected = engine.generate(prompts, params)  # eval mode
    model.gradient_checkpointing_enable()
    model.train()
    got = engine.generate(prompts, params)
    assert model.training  # given back as found
    for out, ref in zip(got, expected, strict=True):
        assert out.token_ids == ref.token_ids
        assert out.logprobs == pytest.approx(ref.logprobs, abs=1e-5)
