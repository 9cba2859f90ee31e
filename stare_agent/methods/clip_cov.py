"""Clip-Cov (Cui et al. 2025, arXiv 2505.22617, Eq. 12): a random few mid-covariance tokens detached.

    I_clip = random max(1, floor(r N)) of {t : omega_low < cov_t < omega_high};  w_t = 0 on I_clip, else 1

(``algorithms.entropy_control.clip_cov_weights``). The draw is the same on every rank: seeded by the
run's seed, the step and the mini-batch.
"""

import zlib

import torch

from stare_agent.algorithms.entropy_control import clip_cov_weights
from stare_agent.methods.base import Batch, Method, Selection


class ClipCov(Method):
    pre_update = True

    def select(self, batch: Batch) -> Selection:
        pre, alg = batch.pre, self.config
        label = f"clip_cov {batch.seed} {batch.step}" + ("" if batch.key is None else f" {batch.key}")
        weights, metrics = clip_cov_weights(
            pre.advantages,
            pre.logprobs,
            pre.mask,
            r=alg.clip_cov_r,
            lb=alg.clip_cov_lb,
            ub=alg.clip_cov_ub,
            generator=torch.Generator().manual_seed(zlib.crc32(label.encode())),
            scope=batch.scope,
            micro_batches=batch.micro_batches,
            sequence_ids=batch.sequence_ids.to(pre.logprobs.device),
        )
        return Selection(weights, metrics=metrics, diagnosed={"weights": weights})
