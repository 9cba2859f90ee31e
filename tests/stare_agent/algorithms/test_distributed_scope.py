"""STARE over 2 gloo ranks equals a single process on the concatenated batch: the global scope's
selection, and in both scopes the metrics (counts and surprisal quantiles of the whole batch)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from stare_agent.algorithms.stare import entropy_gate, stare_weights
from tests.conftest import require

OPTIONS = {"variant": "C2", "P": 0.1, "W": 1.1, "M": 0.9, "scope": "global"}
SPLIT = 3  # rank 0 gets rows [0, 3), rank 1 rows [3, 7): uneven on purpose
MICRO_BATCHES = ([[2, 0], [1]], [[3, 1], [0, 2]])  # each rank's own split (row indices), as the learner's


def _batch():
    """7 sequences x 20 positions, mixed advantages, padded masks, surprisal on a coarse grid (ties)."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([20, 5, 13, 1, 17, 9, 20])
    mask = (torch.arange(20)[None, :] < lengths[:, None]).long()
    A_seq = torch.tensor([1.2, -0.7, 0.0, 0.5, -1.1, 2.0, -0.3])
    logp = -torch.randint(0, 6, (7, 20), generator=g).float() / 2  # s in {0, 0.5, ..., 2.5}
    entropy = torch.rand(7, 20, generator=g) * 0.6
    return A_seq[:, None] * mask, logp, mask, entropy


def _rank_main(rank: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        A, logp, mask, entropy = _batch()
        rows = slice(0, SPLIT) if rank == 0 else slice(SPLIT, None)
        gate_on, Hbar, _ = entropy_gate(entropy[rows], mask[rows], H_tgt=0.3)
        weights, L_plus, L_minus, metrics = stare_weights(
            A[rows], logp[rows], mask[rows], gate_on=True, Hbar=Hbar, **OPTIONS
        )
        micro = stare_weights(
            A[rows],
            logp[rows],
            mask[rows],
            gate_on=True,
            Hbar=Hbar,
            **{**OPTIONS, "scope": "micro_batch", "micro_batches": MICRO_BATCHES[rank]},
        )
        torch.save(
            {
                "gate_on": gate_on,
                "Hbar": Hbar,
                "w": weights,
                "L+": L_plus,
                "L-": L_minus,
                "metrics": metrics,
                "micro": micro,
            },
            Path(out_dir) / f"rank{rank}.pt",
        )
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_match_single_process(tmp_path):
    require("train", None if dist.is_available() else "this torch build has no torch.distributed")
    init_file = tmp_path / "rendezvous"
    os.environ.pop("TORCH_DISTRIBUTED_DEBUG", None)
    mp.spawn(_rank_main, args=(str(init_file), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]

    A, logp, mask, entropy = _batch()
    gate_on, Hbar, _ = entropy_gate(entropy, mask, H_tgt=0.3)
    weights, L_plus, L_minus, metrics = stare_weights(A, logp, mask, gate_on=True, Hbar=Hbar, **OPTIONS)
    # the same micro-batches over the concatenated batch (rank 1's rows shifted by SPLIT)
    blocks = MICRO_BATCHES[0] + [[SPLIT + i for i in rows] for rows in MICRO_BATCHES[1]]
    micro = stare_weights(
        A, logp, mask, gate_on=True, Hbar=Hbar, **{**OPTIONS, "scope": "micro_batch", "micro_batches": blocks}
    )

    for r in ranks:
        assert r["gate_on"] == gate_on
        assert r["Hbar"] == pytest.approx(Hbar, rel=1e-12)
        assert r["metrics"] == pytest.approx(metrics, rel=1e-12)  # quantiles too: the whole batch
        assert r["micro"][3] == pytest.approx(micro[3], rel=1e-12)
    for i in range(3):
        assert torch.equal(torch.cat([ranks[0]["micro"][i], ranks[1]["micro"][i]]), micro[i])
    assert not torch.equal(micro[2], L_minus)  # the scopes really select differently here
    assert torch.equal(torch.cat([ranks[0]["w"], ranks[1]["w"]]), weights)
    assert torch.equal(torch.cat([ranks[0]["L+"], ranks[1]["L+"]]), L_plus)
    assert torch.equal(torch.cat([ranks[0]["L-"], ranks[1]["L-"]]), L_minus)
    # the batch is built to have ties at the cut-off and a selection on both ranks
    assert L_plus[:SPLIT].any() and L_plus[SPLIT:].any()
    s_plus = -logp[(A > 0) & mask.bool()]
    cut = (-logp[L_plus]).min()
    assert int((s_plus == cut).sum()) > int((L_plus & (-logp == cut)).sum())  # a real tie-break happened
