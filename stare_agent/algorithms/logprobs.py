"""Token log-probs and full-vocabulary entropy, computed in chunks of tokens.

For logits ``z = (h @ W_lm^T + b) / temperature`` of one position and its target token o
(STARE arXiv 2606.19236, docs/algorithm.md step 5):

    logp = z_o - logsumexp(z)
    H    = logsumexp(z) - sum_j softmax(z)_j * z_j

Only ``chunk_size`` rows of the [tokens, vocab] logits exist at any time, in the forward and in
the backward (a custom autograd.Function recomputes each chunk's logits in backward). Gradients
flow through ``logp`` into the hidden states and the LM head; the entropy is returned detached
(it feeds the gate, never the loss). Math runs in at least float32 (float64 stays float64).

Mixed precision. Under ``torch.autocast`` (``deepspeed.precision=bf16-autocast``) the LM-head
matmul runs in the autocast dtype, as a plain ``F.linear`` would, and the softmax in float32. The
backward pass does not run under the caller's autocast, so both passes fix their dtypes explicitly:
the forward records the dtype its logits were computed in and the backward recomputes the SAME
logits (same dtype, same rounding) before normalising them with the forward's logsumexp. (Logits
recomputed in float32 against a logsumexp of bf16 logits mis-normalise the softmax by a few percent,
enough to flip the sign of the gradient of a confident token's log-prob.)
"""

from __future__ import annotations

from typing import Any, Literal, overload

import torch
import torch.nn.functional as F
from torch import Tensor

Scores = tuple[Tensor, Tensor]
ScoresAndMoments = tuple[Tensor, Tensor, Tensor]


@overload
def chunked_logprobs_and_entropy(
    hidden: Tensor,
    lm_head_weight: Tensor,
    targets: Tensor,
    *,
    lm_head_bias: Tensor | None = ...,
    chunk_size: int = ...,
    temperature: float = ...,
    with_moments: Literal[False] = ...,
) -> Scores: ...
@overload
def chunked_logprobs_and_entropy(
    hidden: Tensor,
    lm_head_weight: Tensor,
    targets: Tensor,
    *,
    lm_head_bias: Tensor | None = ...,
    chunk_size: int = ...,
    temperature: float = ...,
    with_moments: Literal[True],
) -> ScoresAndMoments: ...
@overload
def chunked_logprobs_and_entropy(
    hidden: Tensor,
    lm_head_weight: Tensor,
    targets: Tensor,
    *,
    lm_head_bias: Tensor | None = ...,
    chunk_size: int = ...,
    temperature: float = ...,
    with_moments: bool = ...,
) -> Scores | ScoresAndMoments: ...
def chunked_logprobs_and_entropy(
    hidden: Tensor,
    lm_head_weight: Tensor,
    targets: Tensor,
    *,
    lm_head_bias: Tensor | None = None,
    chunk_size: int = 1024,
    temperature: float = 1.0,
    with_moments: bool = False,
) -> Scores | ScoresAndMoments:
    """Log-probs of ``targets`` and entropies from hidden states and the LM head, chunk by chunk.

    Args:
        hidden: [..., D] final hidden states (e.g. [N, T, D] or [S, D]).
        lm_head_weight: [V, D] output embedding.
        targets: [...] token ids scored at each position (same leading shape as ``hidden``).
        lm_head_bias: optional [V].
        chunk_size: rows of logits materialized at once.
        temperature: logits are divided by it (use the sampling temperature).
        with_moments: also return the detached moments ``[..., 2] = (sum_j p_j^2, sum_j p_j^2 log p_j)``
            of each position's distribution, two extra reductions over the chunk's probabilities
            (no second forward), which give the first-order entropy effect of reinforcing the
            target (``stare.first_order_entropy_effect``). logp and entropy are bit-identical
            either way.

    Returns:
        (logp [...], entropy [...] detached), in ``promote(hidden.dtype, float32)``; and the moments
        [..., 2] when ``with_moments``.
    """
    _check(hidden.shape[:-1], targets.shape, chunk_size, temperature)
    if hidden.shape[-1] != lm_head_weight.shape[-1]:
        raise ValueError(f"hidden size {hidden.shape[-1]} != LM head input size {lm_head_weight.shape[-1]}")
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    logp, entropy, moments = _LinearLogprobs.apply(
        flat_h,
        lm_head_weight,
        lm_head_bias,
        targets.reshape(-1).long(),
        chunk_size,
        temperature,
        with_moments,
    )
    return _shaped(logp, entropy, moments, targets.shape, with_moments)


@overload
def logprobs_and_entropy_from_logits(
    logits: Tensor,
    targets: Tensor,
    *,
    chunk_size: int = ...,
    temperature: float = ...,
    with_moments: Literal[False] = ...,
) -> Scores: ...
@overload
def logprobs_and_entropy_from_logits(
    logits: Tensor,
    targets: Tensor,
    *,
    chunk_size: int = ...,
    temperature: float = ...,
    with_moments: Literal[True],
) -> ScoresAndMoments: ...
@overload
def logprobs_and_entropy_from_logits(
    logits: Tensor,
    targets: Tensor,
    *,
    chunk_size: int = ...,
    temperature: float = ...,
    with_moments: bool = ...,
) -> Scores | ScoresAndMoments: ...
def logprobs_and_entropy_from_logits(
    logits: Tensor,
    targets: Tensor,
    *,
    chunk_size: int = 1024,
    temperature: float = 1.0,
    with_moments: bool = False,
) -> Scores | ScoresAndMoments:
    """The same from already computed logits [..., V], without any extra full-size float32 copy."""
    _check(logits.shape[:-1], targets.shape, chunk_size, temperature)
    flat = logits.reshape(-1, logits.shape[-1])
    logp, entropy, moments = _LogitsLogprobs.apply(
        flat, targets.reshape(-1).long(), chunk_size, temperature, with_moments
    )
    return _shaped(logp, entropy, moments, targets.shape, with_moments)


def _shaped(
    logp: Tensor, entropy: Tensor, moments: Tensor, shape: torch.Size, with_moments: bool
) -> Scores | ScoresAndMoments:
    if with_moments:
        return logp.view(shape), entropy.view(shape), moments.view(*shape, 2)
    return logp.view(shape), entropy.view(shape)


@overload
def causal_lm_logprobs_and_entropy(
    model: Any,
    input_ids: Tensor,
    attention_mask: Tensor | None = ...,
    *,
    chunk_size: int = ...,
    temperature: float = ...,
    score_mask: Tensor | None = ...,
    with_moments: Literal[False] = ...,
    **forward_kwargs: Any,
) -> Scores: ...
@overload
def causal_lm_logprobs_and_entropy(
    model: Any,
    input_ids: Tensor,
    attention_mask: Tensor | None = ...,
    *,
    chunk_size: int = ...,
    temperature: float = ...,
    score_mask: Tensor | None = ...,
    with_moments: Literal[True],
    **forward_kwargs: Any,
) -> ScoresAndMoments: ...
@overload
def causal_lm_logprobs_and_entropy(
    model: Any,
    input_ids: Tensor,
    attention_mask: Tensor | None = ...,
    *,
    chunk_size: int = ...,
    temperature: float = ...,
    score_mask: Tensor | None = ...,
    with_moments: bool = ...,
    **forward_kwargs: Any,
) -> Scores | ScoresAndMoments: ...
def causal_lm_logprobs_and_entropy(
    model: Any,
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    *,
    chunk_size: int = 1024,
    temperature: float = 1.0,
    score_mask: Tensor | None = None,
    with_moments: bool = False,
    **forward_kwargs: Any,
) -> Scores | ScoresAndMoments:
    """Run a Hugging Face causal LM's backbone and score ``input_ids[:, 1:]`` chunk by chunk.

    Args:
        score_mask: [N, L-1] bool, or None for every position. When given, only the marked positions
            go through the LM head and the softmax (e.g. the response tokens of RL, whose prompt
            positions are never scored: for a 350-token prompt and 100 sampled tokens, 78 % of the
            head's work); the others come back as 0 and carry no gradient. The marked positions'
            values are the same as without the mask, up to float rounding.
        with_moments: also return the moments [N, L-1, 2] (see :func:`chunked_logprobs_and_entropy`).

    Returns:
        (logp [N, L-1], entropy [N, L-1]); column t scores token ``input_ids[:, t + 1]``.
    """
    config = getattr(model, "config", None)
    for name in ("final_logit_softcapping", "logit_scale"):
        if getattr(config, name, None) not in (None, 1.0):
            raise ValueError(
                f"model config sets {name}: use logprobs_and_entropy_from_logits(model(...).logits)"
            )
    head = model.get_output_embeddings()
    outputs = model.base_model(input_ids=input_ids, attention_mask=attention_mask, **forward_kwargs)
    hidden, targets = outputs.last_hidden_state[:, :-1], input_ids[:, 1:]
    if score_mask is not None:
        _check(score_mask.shape, targets.shape, chunk_size, temperature)
        hidden, targets = hidden[score_mask], targets[score_mask]
    scores = chunked_logprobs_and_entropy(
        hidden,
        head.weight,
        targets,
        lm_head_bias=head.bias,
        chunk_size=chunk_size,
        temperature=temperature,
        with_moments=with_moments,
    )
    if score_mask is None:
        return scores
    return _scatter_all(scores, score_mask)


@overload
def shared_prompt_logprobs_and_entropy(
    model: Any,
    input_ids: Tensor,
    attention_mask: Tensor,
    prompt_length: int,
    score_mask: Tensor,
    *,
    chunk_size: int = ...,
    temperature: float = ...,
    with_moments: Literal[False] = ...,
) -> Scores: ...
@overload
def shared_prompt_logprobs_and_entropy(
    model: Any,
    input_ids: Tensor,
    attention_mask: Tensor,
    prompt_length: int,
    score_mask: Tensor,
    *,
    chunk_size: int = ...,
    temperature: float = ...,
    with_moments: Literal[True],
) -> ScoresAndMoments: ...
@overload
def shared_prompt_logprobs_and_entropy(
    model: Any,
    input_ids: Tensor,
    attention_mask: Tensor,
    prompt_length: int,
    score_mask: Tensor,
    *,
    chunk_size: int = ...,
    temperature: float = ...,
    with_moments: bool = ...,
) -> Scores | ScoresAndMoments: ...
def shared_prompt_logprobs_and_entropy(
    model: Any,
    input_ids: Tensor,
    attention_mask: Tensor,
    prompt_length: int,
    score_mask: Tensor,
    *,
    chunk_size: int = 1024,
    temperature: float = 1.0,
    with_moments: bool = False,
) -> Scores | ScoresAndMoments:
    """:func:`causal_lm_logprobs_and_entropy` for N sequences that start with the same prompt, run once.

    The first ``prompt_length - 1`` tokens (the prompt but its last token, whose logits score the
    first response token) go through the backbone once, as a batch of one; its keys and values are
    repeated for the N rows, which run only their own tokens on top of them. Gradients flow through
    the shared prompt's keys and values (summed over the N rows, as N separate passes would sum them).
    For a group of G samples of a P-token prompt with R-token responses the backbone runs
    P + G * R tokens instead of G * (P + R); the values are the same up to float rounding.

    Args:
        input_ids: [N, L] right-padded sequences whose first ``prompt_length`` tokens are equal.
        attention_mask: [N, L] (1 on tokens, 0 on padding).
        prompt_length: P, at least 1.
        score_mask: [N, L-1] bool, the positions scored (none inside the prompt, i.e. before column P-1).

    Returns:
        (logp [N, L-1], entropy [N, L-1]), 0 where ``score_mask`` is False.
    """
    N, L = input_ids.shape
    _check(score_mask.shape, torch.Size((N, L - 1)), chunk_size, temperature)
    if not 1 <= prompt_length <= L or score_mask[:, : prompt_length - 1].any():
        raise ValueError(
            f"prompt_length {prompt_length}: need 1 <= P <= {L} and no scored column before P - 1"
        )
    head = model.get_output_embeddings()
    P = prompt_length - 1  # tokens in the shared prefix
    cache = None
    if P > 0:
        cache = model.base_model(input_ids=input_ids[:1, :P], use_cache=True).past_key_values
        cache.batch_repeat_interleave(N)
    positions = torch.arange(P, L, device=input_ids.device)[None].expand(N, -1)
    outputs = model.base_model(
        input_ids=input_ids[:, P:],
        attention_mask=attention_mask,
        position_ids=positions,
        cache=cache,
        use_cache=cache is not None,
    )
    own = score_mask[:, P:]  # the scored columns; column P + j is the rows' own position j
    scores = chunked_logprobs_and_entropy(
        outputs.last_hidden_state[:, :-1][own],
        head.weight,
        input_ids[:, P + 1 :][own],
        lm_head_bias=head.bias,
        chunk_size=chunk_size,
        temperature=temperature,
        with_moments=with_moments,
    )
    return _scatter_all(scores, score_mask)


@overload
def score_tokens(
    model: Any,
    input_ids: Tensor,
    attention_mask: Tensor,
    score_mask: Tensor | None,
    *,
    prompt_length: int = ...,
    chunk_size: int = ...,
    temperature: float = ...,
    with_moments: Literal[False] = ...,
    **forward_kwargs: Any,
) -> Scores: ...
@overload
def score_tokens(
    model: Any,
    input_ids: Tensor,
    attention_mask: Tensor,
    score_mask: Tensor | None,
    *,
    prompt_length: int = ...,
    chunk_size: int = ...,
    temperature: float = ...,
    with_moments: Literal[True],
    **forward_kwargs: Any,
) -> ScoresAndMoments: ...
@overload
def score_tokens(
    model: Any,
    input_ids: Tensor,
    attention_mask: Tensor,
    score_mask: Tensor | None,
    *,
    prompt_length: int = ...,
    chunk_size: int = ...,
    temperature: float = ...,
    with_moments: bool = ...,
    **forward_kwargs: Any,
) -> Scores | ScoresAndMoments: ...
def score_tokens(
    model: Any,
    input_ids: Tensor,
    attention_mask: Tensor,
    score_mask: Tensor | None,
    *,
    prompt_length: int = 0,
    chunk_size: int = 1024,
    temperature: float = 1.0,
    with_moments: bool = False,
    **forward_kwargs: Any,
) -> Scores | ScoresAndMoments:
    """The one way a batch is scored: its rows' common prompt of ``prompt_length`` tokens run once
    (:func:`shared_prompt_logprobs_and_entropy`) when that is given and positions are chosen, else
    the whole rows (:func:`causal_lm_logprobs_and_entropy`; ``forward_kwargs`` go to its backbone)."""
    if prompt_length and score_mask is not None:
        return shared_prompt_logprobs_and_entropy(
            model,
            input_ids,
            attention_mask,
            prompt_length,
            score_mask,
            chunk_size=chunk_size,
            temperature=temperature,
            with_moments=with_moments,
        )
    return causal_lm_logprobs_and_entropy(
        model,
        input_ids,
        attention_mask,
        chunk_size=chunk_size,
        temperature=temperature,
        score_mask=score_mask,
        with_moments=with_moments,
        **forward_kwargs,
    )


def scatter_scored(values: Tensor, score_mask: Tensor) -> Tensor:
    """Values [S, ...] of the S marked positions of ``score_mask`` [N, T] put back in place: [N, T, ...], 0 elsewhere.

    Differentiable in ``values`` (the unmarked positions are constants).

    Example:
        >>> scatter_scored(torch.tensor([1.0, 2.0]), torch.tensor([[False, True], [True, False]])).tolist()
        [[0.0, 1.0], [2.0, 0.0]]
    """
    if values.dim() == 1:
        return values.new_zeros(score_mask.shape).masked_scatter(score_mask, values)
    trailing = values.shape[1:]
    mask = score_mask.reshape(*score_mask.shape, *(1,) * len(trailing)).expand(*score_mask.shape, *trailing)
    return values.new_zeros(mask.shape).masked_scatter(mask, values)


def _scatter_all(scores: Scores | ScoresAndMoments, score_mask: Tensor) -> Any:
    """Each of ``scores`` put back in place with :func:`scatter_scored` (same arity)."""
    return tuple(scatter_scored(values, score_mask) for values in scores)


def _check(lead_shape: torch.Size, targets_shape: torch.Size, chunk_size: int, temperature: float) -> None:
    if lead_shape != targets_shape:
        raise ValueError(f"targets {tuple(targets_shape)} must match the leading shape {tuple(lead_shape)}")
    if chunk_size < 1 or not temperature > 0:
        raise ValueError(f"need chunk_size >= 1 and temperature > 0 (got {chunk_size}, {temperature})")


def _math_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _matmul_dtype(h: Tensor) -> torch.dtype:
    """The dtype of the LM-head matmul: autocast's when it is on (as for a plain F.linear), else h's."""
    device_type = h.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return h.dtype


def _no_autocast(device: torch.device) -> torch.autocast:
    """A region where dtypes are exactly the ones written (the backward may run inside autocast too)."""
    return torch.autocast(device.type, enabled=False)


def _chunk_logits(z: Tensor, dtype: torch.dtype, temperature: float) -> Tensor:
    """One chunk's logits in the math dtype, divided by the temperature; z must be ours to overwrite."""
    z = z.to(dtype)
    return z.div_(temperature) if temperature != 1.0 else z


def _scores(z: Tensor, targets: Tensor, moments: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """(logp, entropy, logsumexp) of one chunk of logits z [c, V]; z is overwritten.

    When ``moments`` [c, 2] is given it receives ``(sum_j p_j^2, sum_j p_j^2 log p_j)`` (two extra
    reductions; the three returned values are computed exactly as without it).
    """
    log_p = torch.log_softmax(z, dim=-1)
    logp = log_p.gather(1, targets[:, None]).squeeze(1)
    lse = z.gather(1, targets[:, None]).squeeze(1) - logp
    p = torch.exp(log_p, out=z)  # reuse z's memory
    entropy = -torch.linalg.vecdot(p, log_p)  # H = -sum_j p_j log p_j = logsumexp(z) - sum_j p_j z_j
    if moments is not None:
        p_sq = p * p
        moments[:, 0] = p_sq.sum(dim=-1)
        moments[:, 1] = torch.linalg.vecdot(p_sq, log_p)
    return logp, entropy, lse


def _dlogp_dz(z: Tensor, lse: Tensor, targets: Tensor, grad: Tensor, temperature: float) -> Tensor:
    """d logp / d(unscaled logits) of one chunk: ``(onehot(o) - softmax(z)) * grad / temperature``.

    z is overwritten with the result.
    """
    scale = grad / temperature
    g = z.sub_(lse[:, None]).exp_().mul_(-scale[:, None])
    return g.scatter_add_(1, targets[:, None], scale[:, None])


class _LinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, bias, targets, chunk_size, temperature, with_moments):  # type: ignore[override]
        dtype, mm_dtype = _math_dtype(h.dtype), _matmul_dtype(h)
        S = h.shape[0]
        logp = torch.empty(S, dtype=dtype, device=h.device)
        entropy = torch.empty_like(logp)
        lse = torch.empty_like(logp)
        moments = torch.empty(S if with_moments else 0, 2, dtype=dtype, device=h.device)
        with _no_autocast(h.device):
            w, b = weight.to(mm_dtype), bias.to(mm_dtype) if bias is not None else None
            for lo in range(0, S, chunk_size):
                hi = min(lo + chunk_size, S)
                z = _chunk_logits(F.linear(h[lo:hi].to(mm_dtype), w, b), dtype, temperature)
                m = moments[lo:hi] if with_moments else None
                logp[lo:hi], entropy[lo:hi], lse[lo:hi] = _scores(z, targets[lo:hi], m)
        ctx.save_for_backward(h, weight, bias, targets, lse)
        ctx.chunk_size, ctx.temperature, ctx.mm_dtype = chunk_size, temperature, mm_dtype
        ctx.mark_non_differentiable(entropy, moments)
        return logp, entropy, moments

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy, _grad_moments):  # type: ignore[override]
        h, weight, bias, targets, lse = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        dtype, mm_dtype = _math_dtype(h.dtype), ctx.mm_dtype
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=dtype, device=weight.device) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=dtype, device=weight.device) if need_b else None
        with _no_autocast(h.device):
            # The forward's logits exactly: same matmul dtype, so they match the saved logsumexp.
            w, b = weight.to(mm_dtype), bias.to(mm_dtype) if bias is not None else None
            for lo in range(0, h.shape[0], ctx.chunk_size):
                hi = min(lo + ctx.chunk_size, h.shape[0])
                z = _chunk_logits(F.linear(h[lo:hi].to(mm_dtype), w, b), dtype, ctx.temperature)
                g = _dlogp_dz(z, lse[lo:hi], targets[lo:hi], grad_logp[lo:hi].to(dtype), ctx.temperature)
                if grad_h is not None:
                    grad_h[lo:hi] = (g.to(mm_dtype) @ w).to(h.dtype)
                if grad_w is not None:
                    grad_w.addmm_(g.T, h[lo:hi].to(dtype))
                if grad_b is not None:
                    grad_b += g.sum(dim=0)
        grad_w = grad_w.to(weight.dtype) if grad_w is not None else None
        grad_b = grad_b.to(bias.dtype) if grad_b is not None else None
        return grad_h, grad_w, grad_b, None, None, None, None


class _LogitsLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, chunk_size, temperature, with_moments):  # type: ignore[override]
        dtype = _math_dtype(logits.dtype)
        S = logits.shape[0]
        logp = torch.empty(S, dtype=dtype, device=logits.device)
        entropy = torch.empty_like(logp)
        lse = torch.empty_like(logp)
        moments = torch.empty(S if with_moments else 0, 2, dtype=dtype, device=logits.device)
        with _no_autocast(logits.device):
            for lo in range(0, S, chunk_size):
                hi = min(lo + chunk_size, S)
                z = _chunk_logits(logits[lo:hi].to(dtype, copy=True), dtype, temperature)
                m = moments[lo:hi] if with_moments else None
                logp[lo:hi], entropy[lo:hi], lse[lo:hi] = _scores(z, targets[lo:hi], m)
        ctx.save_for_backward(logits, targets, lse)
        ctx.chunk_size, ctx.temperature = chunk_size, temperature
        ctx.mark_non_differentiable(entropy, moments)
        return logp, entropy, moments

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy, _grad_moments):  # type: ignore[override]
        logits, targets, lse = ctx.saved_tensors
        dtype = _math_dtype(logits.dtype)
        grad = torch.empty_like(logits)
        with _no_autocast(logits.device):
            for lo in range(0, logits.shape[0], ctx.chunk_size):
                hi = min(lo + ctx.chunk_size, logits.shape[0])
                z = _chunk_logits(logits[lo:hi].to(dtype, copy=True), dtype, ctx.temperature)
                grad[lo:hi] = _dlogp_dz(
                    z, lse[lo:hi], targets[lo:hi], grad_logp[lo:hi].to(dtype), ctx.temperature
                )
        return grad, None, None, None, None
