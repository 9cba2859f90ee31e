"""Exact top-k token selection, the one machinery under STARE's L+/L- and the field's other selections.

A selection block is a set of rows: the whole batch on every data-parallel rank (``global`` scope) or
one of the learner's micro-batches (``micro_batch``). Inside a block, ``top_k`` takes the top
``ceil(P * n)`` of the n candidate tokens by a score, exactly: ties at the k-th value are broken by a
stable key, (sequence key, token position) ascending, where the sequence key is a global episode id
when given, else the global row index. So every selection is deterministic, and with sequence ids
exactly invariant to permuting sequences. Used by ``stare.stare_weights`` and by KL-Cov, Clip-Cov and
the forking-token update (``entropy_control``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

POSITION_BITS = 32  # tie-break key = sequence_key << 32 | token position


def top_k_count(P: float, n: int) -> int:
    """``ceil(P * n)`` with P read as the decimal it was written as (0.1 * 30 -> 3, not 4).

    At least 1 whenever n > 0, since P > 0.
    """
    return math.ceil(Fraction(repr(float(P))) * n)


def selection_blocks(
    B: int, scope: str, micro_batches: Sequence[Sequence[int]] | None, size: int | None, device: torch.device
) -> list[Tensor]:
    """Row indices of each selection block: all rows (global scope, or no split given), or the micro-batches."""
    if micro_batches is not None and size is not None:
        raise ValueError(
            "pass micro_batches or micro_batch_size, not both: micro_batches is the learner's split"
        )
    if size is not None:
        if size < 1:
            raise ValueError(f"micro_batch_size={size} must be >= 1: pass the learner's micro-batch rows")
        micro_batches = [range(lo, min(lo + size, B)) for lo in range(0, B, size)]
    if scope == "global" or micro_batches is None:
        return [torch.arange(B, device=device)]
    if sorted(i for rows in micro_batches for i in rows) != list(range(B)):
        raise ValueError(
            f"micro_batches must cover each of the {B} rows exactly once: pass the learner's micro_batches()"
        )
    return [torch.tensor(list(rows), dtype=torch.int64, device=device) for rows in micro_batches]


def top_k(
    s: Tensor,
    candidates: Tensor,
    seq_key: Tensor,
    P: float,
    process_group: Any,
    count: Callable[[int], int] | None = None,
) -> Tensor:
    """Mask [b, T] of the top ``ceil(P * n)`` of the n candidates by s, over all ranks when ``process_group`` is used.

    Exact: the k-th largest value v is found with a selection (kthvalue); all candidates with
    s > v are taken, and the remaining slots go to the candidates with s == v in key order.
    ``count(n)``, when given, replaces ``ceil(P * n)`` (e.g. KL-Cov's ``max(1, floor(k * n))``).
    """
    flat_idx = candidates.flatten().nonzero().squeeze(1)
    s_c = s.flatten()[flat_idx]
    all_s = gather_cat(s_c, process_group)
    n = all_s.numel()
    k = min(count(n), n) if count is not None else top_k_count(P, n)
    selected = torch.zeros(candidates.numel(), dtype=torch.bool, device=s.device)
    if k == 0:
        return selected.view_as(candidates)
    v = torch.kthvalue(all_s, n - k + 1).values
    above, tied = s_c > v, s_c == v
    need = k - int((all_s > v).sum())
    if need == int((all_s == v).sum()):  # every tied candidate fits: no tie-break needed
        selected[flat_idx[above | tied]] = True
        return selected.view_as(candidates)
    T = candidates.shape[1]
    tied_idx = flat_idx[tied]
    tied_key = (seq_key[tied_idx // T] << POSITION_BITS) | (tied_idx % T)
    chosen = torch.sort(gather_cat(tied_key, process_group)).values[:need]
    selected[flat_idx[above]] = True
    selected[tied_idx[torch.isin(tied_key, chosen)]] = True
    return selected.view_as(candidates)


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def scope_group(scope: str, process_group: Any) -> Any:
    """The process group of a selection: all ranks for ``global`` under torch.distributed, else none."""
    if scope != "global" or not is_distributed():
        return None
    return process_group if process_group is not None else dist.group.WORLD


def gather_cat(x: Tensor, process_group: Any) -> Tensor:
    """Concatenate a 1-D tensor of any length over all ranks in rank order (identity without process_group)."""
    if process_group is None:
        return x
    world = dist.get_world_size(group=process_group)
    length = torch.tensor([x.numel()], dtype=torch.int64, device=x.device)
    lengths = [torch.zeros_like(length) for _ in range(world)]
    dist.all_gather(lengths, length, group=process_group)
    longest = int(max(int(t) for t in lengths))
    padded = torch.zeros(longest, dtype=x.dtype, device=x.device)
    padded[: x.numel()] = x
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=process_group)
    return torch.cat([part[: int(size)] for part, size in zip(parts, lengths, strict=True)])


def sequence_keys(B: int, sequence_ids: Tensor | None, device: torch.device, process_group: Any) -> Tensor:
    """[B] int64 global tie-break keys: ``sequence_ids`` (checked distinct) or the global row index."""
    if sequence_ids is None:
        rows = torch.arange(B, dtype=torch.int64, device=device)
        offset = 0
        if process_group is not None:
            sizes = gather_cat(torch.tensor([B], dtype=torch.int64, device=device), process_group)
            offset = int(sizes[: dist.get_rank(group=process_group)].sum())
        return rows + offset
    ids = sequence_ids.to(device=device, dtype=torch.int64).flatten()
    if ids.numel() != B:
        raise ValueError(f"sequence_ids has {ids.numel()} entries for {B} sequences: pass one id per row")
    all_ids = gather_cat(ids, process_group)
    if all_ids.numel() and (all_ids.min() < 0 or all_ids.max() >= 1 << (62 - POSITION_BITS)):
        raise ValueError("sequence_ids must lie in [0, 2**30): use episode indices, not hashes")
    if torch.unique(all_ids).numel() != all_ids.numel():
        raise ValueError(
            "sequence_ids repeat across the batch: pass one distinct id per sequence (e.g. episode index)"
        )
    return ids
