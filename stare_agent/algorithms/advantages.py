"""GRPO group advantages and their broadcast to model-generated tokens.

GRPO (Shao et al., arXiv 2402.03300) as used by STARE (arXiv 2606.19236, docs/algorithm.md step 4):

    A_i = (r_i - mean_group(r)) / (std_group(r) + 1e-6)       std unbiased (n - 1)
    a group of size 1 gets mean 0, std 1                      (so A_i = r_i / (1 + 1e-6))
    A_{i,t} = A_i * mask_{i,t}                                 0 on every mask-0 token
"""

from __future__ import annotations

import torch
from torch import Tensor


def grpo_advantages(
    rewards: Tensor,
    *,
    group_index: Tensor | None = None,
    group_size: int | None = None,
    eps: float = 1e-6,
) -> tuple[Tensor, dict[str, float]]:
    """Outcome advantages normalized within each group of responses to the same prompt.

    ``A_i = (r_i - mean_g) / (std_g + eps)``, std with Bessel's correction; singleton groups use
    mean 0 and std 1 (verl's convention, as in the authors' code).

    Args:
        rewards: [N] scalar reward of each response.
        group_index: [N] integer group id of each response (any ids, any order), or
        group_size: G, when the N responses are N / G consecutive groups of G. Pass exactly one.
        eps: added to the std (1e-6 in the paper).

    Returns:
        (A [N] in the rewards' float dtype, metrics).
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be [N], got {tuple(rewards.shape)}: pass one reward per response")
    r = rewards if rewards.is_floating_point() else rewards.float()
    if (group_index is None) == (group_size is None):
        raise ValueError("grpo_advantages needs exactly one of group_index or group_size: pass one of them")
    if group_size is not None:
        if group_size < 1 or r.numel() % group_size:
            raise ValueError(
                f"{r.numel()} rewards do not split into groups of {group_size}: pass group_index instead"
            )
        group_index = torch.arange(r.numel(), device=r.device) // group_size
    assert group_index is not None
    if group_index.shape != r.shape:
        raise ValueError(f"group_index {tuple(group_index.shape)} must match rewards {tuple(r.shape)}")
    _, g = torch.unique(group_index, return_inverse=True)
    n_groups = int(g.max()) + 1 if g.numel() else 0
    count = torch.zeros(n_groups, dtype=r.dtype, device=r.device).index_add_(0, g, torch.ones_like(r))
    mean = torch.zeros_like(count).index_add_(0, g, r) / count
    sq_dev = torch.zeros_like(count).index_add_(0, g, (r - mean[g]) ** 2)
    std = torch.sqrt(sq_dev / (count - 1).clamp(min=1))
    singleton = count == 1
    mean = torch.where(singleton, torch.zeros_like(mean), mean)
    std = torch.where(singleton, torch.ones_like(std), std)
    A = (r - mean[g]) / (std[g] + eps)
    metrics = {
        "grpo/groups": float(n_groups),
        "grpo/groups_all_equal": float(((sq_dev == 0) & ~singleton).sum()),
        "grpo/reward_mean": float(r.mean()) if r.numel() else 0.0,
        "grpo/advantage_abs_mean": float(A.abs().mean()) if r.numel() else 0.0,
    }
    return A, metrics


def broadcast_to_tokens(A: Tensor, response_mask: Tensor) -> Tensor:
    """``A_tok[i, t] = A[i]`` where ``response_mask[i, t] = 1``, else exactly 0.

    Args:
        A: [N] sequence advantages.
        response_mask: [N, T], 1 = model-generated token.

    Returns:
        [N, T] token advantages.
    """
    if A.dim() != 1 or response_mask.dim() != 2 or A.shape[0] != response_mask.shape[0]:
        raise ValueError(
            f"A {tuple(A.shape)} must be [N] and response_mask {tuple(response_mask.shape)} [N, T]: "
            "pass one advantage per row"
        )
    expanded = A[:, None].expand(response_mask.shape)
    return torch.where(response_mask.bool(), expanded, torch.zeros((), dtype=A.dtype, device=A.device))
