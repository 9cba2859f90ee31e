"""Collation of trajectories into tensors for the learner: padded, packed, and micro-batch splits.

Alignment (the same as ``stare_agent.algorithms.logprobs.causal_lm_logprobs_and_entropy``): a sequence
of L tokens has L - 1 scored positions, and **column t scores token t + 1**, i.e. the logits at
position t predict ``targets[:, t] = input_ids[:, t + 1]``. Every per-token tensor (``targets``,
``response_mask``, ``old_logprobs``, ``advantages``) uses this alignment, so

    logp, entropy = causal_lm_logprobs_and_entropy(model, batch["input_ids"], batch["attention_mask"])
    loss, metrics = policy_loss(logp, batch["old_logprobs"], batch["advantages"], batch["response_mask"])

lines up without any slicing. ``response_mask[:, t]`` is the trajectory's loss mask of token t + 1
(0 for prompt tokens, tool output, template glue and padding).

Example:
    >>> from stare_envs.trajectory import TrajectoryBuilder
    >>> b = TrajectoryBuilder([7, 8]); b.append([9], 1, [-0.5]); b.append([4], 0)
    >>> batch = collate([b.build(reward=1.0)], pad_id=0)
    >>> batch["targets"].tolist(), batch["response_mask"].tolist(), batch["old_logprobs"].tolist()
    ([[8, 9, 4]], [[0.0, 1.0, 0.0]], [[0.0, -0.5, 0.0]])
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from stare_envs.trajectory import Trajectory


def _full_sequence(t: Trajectory) -> tuple[list[int], list[float], list[float]]:
    """Token ids, loss mask and log-probs over prompt + response (the prompt is mask 0)."""
    n = len(t.prompt_ids)
    return t.input_ids, [0.0] * n + [float(m) for m in t.loss_mask], [0.0] * n + list(t.logprobs)


def _check(trajectories: Sequence[Trajectory], advantages: Sequence[float] | None) -> list[float]:
    if not trajectories:
        raise ValueError("cannot collate an empty list of trajectories: pass at least one")
    if advantages is None:
        return [0.0] * len(trajectories)
    if len(advantages) != len(trajectories):
        raise ValueError(
            f"got {len(advantages)} advantages for {len(trajectories)} trajectories: pass one per trajectory"
        )
    return [float(a) for a in advantages]


def collate(
    trajectories: Sequence[Trajectory],
    pad_id: int,
    device: torch.device | str | None = None,
    *,
    advantages: Sequence[float] | None = None,
) -> dict[str, Tensor]:
    """Right-padded batch of B trajectories, L = the longest prompt + response.

    Args:
        trajectories: The batch, in order.
        pad_id: Token id used for padding (never scored: its mask is 0).
        device: Where the tensors go (default: CPU).
        advantages: One scalar per trajectory (e.g. GRPO's A_i), broadcast over its mask-1 tokens;
            None fills ``advantages`` with zeros for the algorithm to set.

    Returns:
        ``input_ids`` [B, L] long, ``attention_mask`` [B, L] long, and scored per token (column t
        scores token t + 1): ``targets`` [B, L-1] long, ``response_mask`` [B, L-1] float (1 = sampled
        by the model), ``old_logprobs`` [B, L-1] float (sampling log-probs), ``advantages`` [B, L-1]
        float; per sequence: ``rewards`` [B] float, ``prompt_lengths`` [B] and ``lengths`` [B] long.
    """
    adv = _check(trajectories, advantages)
    B, L = len(trajectories), max(t.num_tokens for t in trajectories)
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, L), dtype=torch.long)
    mask = torch.zeros((B, L), dtype=torch.float32)
    logprobs = torch.zeros((B, L), dtype=torch.float32)
    for i, t in enumerate(trajectories):
        ids, m, lp = _full_sequence(t)
        n = len(ids)
        input_ids[i, :n] = torch.tensor(ids, dtype=torch.long)
        attention_mask[i, :n] = 1
        mask[i, :n] = torch.tensor(m)
        logprobs[i, :n] = torch.tensor(lp)
    response_mask = mask[:, 1:].contiguous()
    batch = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "targets": input_ids[:, 1:].contiguous(),
        "response_mask": response_mask,
        "old_logprobs": logprobs[:, 1:].contiguous(),
        "advantages": torch.tensor(adv, dtype=torch.float32)[:, None] * response_mask,
        "rewards": torch.tensor([t.reward for t in trajectories], dtype=torch.float32),
        "prompt_lengths": torch.tensor([len(t.prompt_ids) for t in trajectories], dtype=torch.long),
        "lengths": torch.tensor([t.num_tokens for t in trajectories], dtype=torch.long),
    }
    return {k: v.to(device) for k, v in batch.items()} if device is not None else batch


def pack(
    trajectories: Sequence[Trajectory],
    device: torch.device | str | None = None,
    *,
    advantages: Sequence[float] | None = None,
) -> dict[str, Tensor | int]:
    """All trajectories concatenated into one row of T tokens, without padding.

    Attention must stay within each sequence: pass ``position_ids`` (restarting at 0 for every
    sequence, which Hugging Face's flash-attention path turns into variable-length attention) or
    ``cu_seqlens``/``max_seqlen`` to a varlen kernel. Per-token tensors follow the module's alignment
    (column t scores token t + 1); the column of a sequence's last token would score the next
    sequence's first token, so it is always mask 0.

    Returns:
        ``input_ids`` [1, T] long, ``position_ids`` [1, T] long, ``cu_seqlens`` [B+1] int32 (sequence
        starts and the total), ``max_seqlen`` int; ``targets``, ``response_mask``, ``old_logprobs``,
        ``advantages`` [1, T-1]; ``sequence_ids`` [1, T-1] long (which trajectory each column belongs
        to); ``rewards`` [B] float.
    """
    adv = _check(trajectories, advantages)
    ids: list[int] = []
    positions: list[int] = []
    mask: list[float] = []
    logprobs: list[float] = []
    owner: list[int] = []
    advantage: list[float] = []
    cu = [0]
    for i, t in enumerate(trajectories):
        seq_ids, m, lp = _full_sequence(t)
        n = len(seq_ids)
        ids += seq_ids
        positions += range(n)
        # column j of this sequence scores its token j + 1; its last column scores the next sequence.
        mask += m[1:] + [0.0]
        logprobs += lp[1:] + [0.0]
        owner += [i] * n
        advantage += [adv[i]] * n
        cu.append(cu[-1] + n)
    response_mask = torch.tensor(mask[:-1], dtype=torch.float32)[None]
    input_ids = torch.tensor(ids, dtype=torch.long)[None]
    batch: dict[str, Tensor | int] = {
        "input_ids": input_ids,
        "position_ids": torch.tensor(positions, dtype=torch.long)[None],
        "cu_seqlens": torch.tensor(cu, dtype=torch.int32),
        "max_seqlen": max(t.num_tokens for t in trajectories),
        "targets": input_ids[:, 1:].contiguous(),
        "response_mask": response_mask,
        "old_logprobs": torch.tensor(logprobs[:-1], dtype=torch.float32)[None],
        "advantages": torch.tensor(advantage[:-1], dtype=torch.float32)[None] * response_mask,
        "sequence_ids": torch.tensor(owner[:-1], dtype=torch.long)[None],
        "rewards": torch.tensor([t.reward for t in trajectories], dtype=torch.float32),
    }
    if device is not None:
        batch = {k: v.to(device) if isinstance(v, Tensor) else v for k, v in batch.items()}
    return batch


MIN_SHARED_PREFIX = 16
"""Fewest tokens of a common prompt prefix that a micro-batch runs once (:func:`shared_prefix_length`):
below it the separate pass costs more than the repeated tokens."""


def shared_prefix_length(trajectories: Sequence[Trajectory]) -> int:
    """Tokens at the start of every prompt of ``trajectories`` that they all share: the whole prompt
    when all prompts are one (the samples of a GRPO group), else their common prefix (SFT traces and
    other prompts share the chat template's system prompt) when it has at least
    :data:`MIN_SHARED_PREFIX` tokens; 0 otherwise and for fewer than two trajectories. Never more than
    the shortest prompt, so no token the model wrote (and no scored position) lies inside the prefix.

    Example:
        >>> from stare_envs.trajectory import TrajectoryBuilder
        >>> def traj(prompt):
        ...     b = TrajectoryBuilder(prompt); b.append([9], 1, [0.0]); return b.build(reward=0.0)
        >>> system = list(range(20))
        >>> shared_prefix_length([traj(system + [1, 2]), traj(system + [1, 3])])
        21
        >>> shared_prefix_length([traj([1, 2, 3]), traj([1, 2, 3])]), shared_prefix_length([traj([1, 2, 3]), traj([1, 2, 4])])
        (3, 0)
    """
    if len(trajectories) < 2:
        return 0
    first = trajectories[0].prompt_ids
    n = min(len(t.prompt_ids) for t in trajectories)
    for t in trajectories[1:]:
        prompt = t.prompt_ids
        n = next((i for i in range(n) if prompt[i] != first[i]), n)
    if all(len(t.prompt_ids) == n for t in trajectories):
        return n  # one prompt
    return n if n >= MIN_SHARED_PREFIX else 0


def split_by_token_budget(
    trajectories: Sequence[Trajectory], max_tokens: int, *, padded: bool = True
) -> list[list[int]]:
    """Split a batch into consecutive micro-batches of at most ``max_tokens`` tokens each.

    Order is kept (greedy: a micro-batch is closed when the next trajectory would overflow it).

    Args:
        trajectories: The batch.
        max_tokens: Token budget per micro-batch.
        padded: Count the padded size (count x longest, what :func:`collate` allocates); False counts
            the sum of lengths (what :func:`pack` allocates).

    Returns:
        Lists of indices into ``trajectories``, e.g. ``[[0, 1], [2]]``.

    Raises:
        ValueError: one trajectory alone exceeds ``max_tokens``.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens = {max_tokens}: use a positive token budget")
    micro: list[list[int]] = []
    current: list[int] = []
    longest = total = 0
    for i, t in enumerate(trajectories):
        n = t.num_tokens
        if n > max_tokens:
            raise ValueError(
                f"trajectory {i} has {n} tokens, more than the micro-batch budget of {max_tokens}: "
                "raise the token budget to at least the longest prompt + response"
            )
        new_longest, new_total = max(longest, n), total + n
        size = new_longest * (len(current) + 1) if padded else new_total
        if current and size > max_tokens:
            micro.append(current)
            current, new_longest, new_total = [], n, n
        current.append(i)
        longest, total = new_longest, new_total
    if current:
        micro.append(current)
    return micro


MICRO_BATCH_OVERHEAD = 64
"""Tokens that one more micro-batch costs beyond its own (the per-pass work that does not scale with
its tokens: reading every weight, launching every layer): :func:`bucket_by_length` cuts a micro-batch
in two only where that saves more padded tokens than this."""


def _least_padded_parts(widths: Sequence[int], shared: int) -> list[int]:
    """Start indices of the consecutive parts of rows of ``widths`` (longest first) that run the fewest
    tokens: a part of k >= 2 rows runs ``shared + k * (longest - shared)`` (its common prefix once, the
    rest padded to its longest row), a single row its own width, each part :data:`MICRO_BATCH_OVERHEAD`
    more. Exact, by dynamic programming over the cut points (ties keep fewer parts)."""
    n = len(widths)
    cost = [0.0] + [math.inf] * n
    start = [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j):
            k, width = j - i, widths[i]
            tokens = width if k == 1 else shared + k * (width - shared)
            c = cost[i] + tokens + MICRO_BATCH_OVERHEAD
            if c < cost[j]:
                cost[j], start[j] = c, i
    starts, j = [], n
    while j > 0:
        starts.append(start[j])
        j = start[j]
    return starts[::-1]


def bucket_by_length(
    trajectories: Sequence[Trajectory], max_tokens: int, *, share_prompts: bool = False
) -> list[list[int]]:
    """Micro-batches of at most ``max_tokens`` padded tokens, trajectories of similar length together.

    The batch is sorted by length (longest first, ties in batch order), then split greedily like
    :func:`split_by_token_budget`: each micro-batch is padded to a width close to all of its rows,
    instead of to the longest of whatever happens to lie next to it in the batch. A micro-batch is then
    cut further where its padding costs more than running another micro-batch
    (:data:`MICRO_BATCH_OVERHEAD`): a GRPO group of three 200-token samples and one 1,000-token one runs
    the long one alone instead of padding the others to 1,000. With ``share_prompts`` the cost counts
    the rows' common prompt prefix once (:func:`shared_prefix_length`), as the learner runs it.

    Returns:
        Lists of indices into ``trajectories`` (each index once), e.g. ``[[2, 0], [1]]``.

    Raises:
        ValueError: one trajectory alone exceeds ``max_tokens``.

    Example:
        >>> from stare_envs.trajectory import TrajectoryBuilder
        >>> def traj(n):
        ...     b = TrajectoryBuilder([1] * n); b.append([2], 1, [0.0]); return b.build(reward=0.0)
        >>> batch = [traj(2), traj(9), traj(3), traj(8)]
        >>> split_by_token_budget(batch, 20), bucket_by_length(batch, 20)
        ([[0, 1], [2, 3]], [[1, 3], [2, 0]])
    """
    order = sorted(range(len(trajectories)), key=lambda i: -trajectories[i].num_tokens)
    try:
        split = split_by_token_budget([trajectories[i] for i in order], max_tokens, padded=True)
    except ValueError:
        split_by_token_budget(trajectories, max_tokens, padded=True)  # the same error, in batch order
        raise
    parts = []
    for micro in split:
        rows = [trajectories[order[j]] for j in micro]
        shared = shared_prefix_length(rows) if share_prompts else 0
        starts = _least_padded_parts([t.num_tokens for t in rows], shared)
        parts += [
            [order[j] for j in micro[a:b]] for a, b in zip(starts, [*starts[1:], len(micro)], strict=True)
        ]
    return parts
