"""The dynamics lab's two policies: a table of logits and a tiny causal transformer.

Both map a prompt (a context index c) and a response (T tokens of a vocabulary of V) to next-token
logits ``[B, T, V]``, the tensor the lab hands to ``algorithms.logprobs_and_entropy_from_logits``; both
sample responses position by position with the lab's generator. They differ in what the parameters
are shared by:

- ``TablePolicy``: one distribution per (context, position), ``theta [C, T, V]``; a token's update
  moves its own position's distribution and nothing else, and the distribution does not depend on
  the tokens before it.
- ``TransformerPolicy``: a GPT (nanoGPT's block: pre-LayerNorm, causal self-attention, a 4x GELU
  MLP), vocabulary ``C + V`` (a context token, then the response tokens), context length T
  (``[c, y_1, ..., y_{T-1}]`` predicts ``y_1 .. y_T``); every position of every context shares its
  weights, as a language model's do, so one token's update moves every distribution.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class TablePolicy:
    """``theta [C, T, V]`` ~ N(0, ``init_scale``^2); the logits ignore the response's tokens."""

    def __init__(self, contexts: int, positions: int, vocab: int, init_scale: float, gen: torch.Generator):
        self.theta = (init_scale * torch.randn(contexts, positions, vocab, generator=gen)).requires_grad_()

    def parameters(self) -> list[Tensor]:
        return [self.theta]

    def logits(self, contexts: Tensor, tokens: Tensor) -> Tensor:
        """``[B, T, V]`` for contexts ``[B]`` and responses ``[B, T]``."""
        return self.theta[contexts]

    @torch.no_grad()
    def sample(self, contexts: Tensor, samples: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
        """Responses ``[n, G, T]`` to contexts ``[n]``, and the entropy of each position's distribution
        ``[n, 1, T]`` (one distribution per position, whatever the tokens before it)."""
        n, (T, V) = len(contexts), self.theta.shape[1:]
        probs = self.theta[contexts].softmax(-1).reshape(-1, V)  # [n * T, V]
        tok = torch.multinomial(probs, samples, replacement=True, generator=gen)
        tok = tok.view(n, T, samples).transpose(1, 2)  # [n, G, T]
        return tok, table_entropy(self.theta[contexts])[:, None]

    @torch.no_grad()
    def entropy(self) -> float:
        """The mean entropy of all C x T distributions (exact)."""
        return float(table_entropy(self.theta).mean())


def table_entropy(logits: Tensor) -> Tensor:
    """Entropy of every distribution of ``logits [..., V]``: ``[...]``."""
    log_p = logits.log_softmax(-1)
    return -(log_p.exp() * log_p).sum(-1)


class TransformerPolicy(nn.Module):
    """A tiny causal transformer; its initial logits have about ``init_scale`` standard deviation (the
    head's weights are N(0, init_scale^2 / d_model) on a LayerNorm-ed residual stream; every other
    weight N(0, 0.02^2), biases 0, as nanoGPT), drawn from ``gen``, so a run is a function of its seed.
    ``entropy_samples`` responses per context estimate the policy's entropy (``entropy``), with a
    generator of their own so that measuring never changes a run."""

    def __init__(
        self,
        contexts: int,
        positions: int,
        vocab: int,
        init_scale: float,
        gen: torch.Generator,
        *,
        d_model: int = 32,
        layers: int = 2,
        heads: int = 2,
        entropy_samples: int = 4,
        entropy_seed: int = 0,
    ):
        super().__init__()
        self.C, self.T, self.V, self.heads = contexts, positions, vocab, heads
        self.embed = nn.Embedding(contexts + vocab, d_model)  # context tokens, then response tokens
        self.pos = nn.Parameter(torch.empty(positions, d_model))
        self.blocks = nn.ModuleList(_Block(d_model) for _ in range(layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if "ln" in name or name.startswith("norm."):
                    continue  # LayerNorm: weight 1, bias 0
                if p.dim() == 1:
                    p.zero_()
                else:
                    std = init_scale / math.sqrt(d_model) if name == "head.weight" else 0.02
                    p.copy_(std * torch.randn(p.shape, generator=gen))
        self.entropy_samples = entropy_samples
        self._entropy_gen = torch.Generator().manual_seed(entropy_seed)

    def forward(self, contexts: Tensor, prefix: Tensor) -> Tensor:
        """Next-token logits ``[B, t + 1, V]`` after the context and each of ``prefix [B, t]``'s tokens."""
        x = torch.cat([contexts[:, None], self.C + prefix], 1)
        h = self.embed(x) + self.pos[: x.shape[1]]
        for block in self.blocks:
            h = block(h, self.heads)
        return self.head(self.norm(h))

    def logits(self, contexts: Tensor, tokens: Tensor) -> Tensor:
        """``[B, T, V]``, teacher-forced: position t sees the context and ``tokens[:, :t]``."""
        return self(contexts, tokens[:, :-1])

    @torch.no_grad()
    def sample(self, contexts: Tensor, samples: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
        """Responses ``[n, G, T]``, sampled token by token from the policy's own logits, and the entropy
        of the distribution each token was drawn from ``[n, G, T]``."""
        x = contexts.repeat_interleave(samples)  # [n * G]: the context token, then each sampled one
        cache: list[list[Tensor]] = [[] for _ in self.blocks]  # per block: keys and values so far
        tokens, entropies = [], []
        for t in range(self.T):
            h = self.embed(x)[:, None] + self.pos[t]  # [n * G, 1, d]
            for block, kv in zip(self.blocks, cache, strict=True):
                h = block(h, self.heads, kv)
            log_p = self.head(self.norm(h[:, 0])).log_softmax(-1)  # [n * G, V]
            p = log_p.exp()
            entropies.append(-(p * log_p).sum(-1))
            tokens.append(torch.multinomial(p, 1, generator=gen)[:, 0])
            x = self.C + tokens[-1]
        shape = (len(contexts), samples, self.T)
        return torch.stack(tokens, 1).view(shape), torch.stack(entropies, 1).view(shape)

    @torch.no_grad()
    def entropy(self) -> float:
        """The mean entropy per position along ``entropy_samples`` responses sampled from every context
        (an estimate: the distributions depend on the tokens before them)."""
        _, H = self.sample(torch.arange(self.C), self.entropy_samples, self._entropy_gen)
        return float(H.mean())


class _Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, h: Tensor, heads: int, kv: list[Tensor] | None = None) -> Tensor:
        """``h [B, t, d]``; with ``kv`` (sampling, t = 1): the keys and values of the positions before,
        extended by this one's."""
        B, t, d = h.shape
        q, k, v = self.qkv(self.ln1(h)).view(B, t, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
        if kv is not None:
            if kv:
                k, v = torch.cat([kv[0], k], 2), torch.cat([kv[1], v], 2)
            kv[:] = [k, v]
        # [B, heads, t, d / heads]; one query at the end attends to every key
        a = F.scaled_dot_product_attention(q, k, v, is_causal=kv is None)
        h = h + self.proj(a.transpose(1, 2).reshape(B, t, d))
        return h + self.out(F.gelu(self.fc(self.ln2(h))))
