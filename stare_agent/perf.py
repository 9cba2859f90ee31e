"""Model FLOPs utilisation (MFU): the work a step does, counted from the model's config, against the
machine's dense matmul bound.

What is counted (the convention of PaLM's appendix B and Megatron-LM, as verl's ``FlopsCounter`` in
``verl/utils/flops_counter.py`` and NeMo-RL count it; written here for our models):

- **Matmul parameters** ``N`` (:func:`matmul_params`): the weights each token multiplies, the
  decoder layers' projections (q, k, v, o; gate, up, down) and the LM head. The LM head counts even
  when it is tied to the embedding: it is a ``d_model x vocab`` matmul per token all the same. The
  embedding lookup does not (a gather, no multiply-adds); verl counts it as well (``vocab x d x 2``),
  which makes its MFU of the 135M model about 20 % higher than ours. Norms, biases, rotary
  embeddings and the softmax are left out (a few FLOPs per element, not matmuls).
- **A forward pass** over a token costs ``2 N`` (one multiply-add per weight) plus attention: the
  token at position ``t`` scores ``t + 1`` keys (QK^T) and mixes as many values (AV), ``2 x 2 x
  (t + 1) x d_attn`` per layer, with ``d_attn = heads x head_dim``. Over the positions ``[a, b)`` of
  one sequence that is ``2 x layers x d_attn x (b(b+1) - a(a+1))``
  (:func:`attention_flops`): for a whole causal sequence of length ``s``, ``2 x layers x d_attn x s^2``
  to first order, verl's ``6 x seqlen^2 x head_dim x heads x layers`` for forward and backward
  divided by 3. Per token that is PaLM's ``2 x layers x context x d_model`` with the average context.
- **Training** (:func:`train_flops`) is forward plus backward, 3 forward passes: ``6 N`` per token
  plus 3 x attention. A forward-only pass (log-probs before the update) is 1 forward pass. With
  LoRA the frozen weights need no weight gradient (about 4 N), but the convention still counts 6 N.
- **Decoding** (:func:`forward_flops` of prompt plus generated tokens) is forward only: ``2 N`` per
  token, prompt prefill included, plus attention over each token's context.

The bound is measured (:func:`peak_flops`): a dense square matmul in the run's precision on the
threads torch uses, once per process and cached; on a GPU with a known bf16 peak the datasheet
number (:data:`GPU_BF16_PEAK`). Utilisation is ``flops / seconds / peak`` (:func:`mfu`). Utilisation
above 1 is possible where the learner skips work the convention counts (``deepspeed.share_prompts``
runs a group's shared prompt once; ``score_response_only`` runs the LM head on scored tokens only).

Nothing heavy is imported at module import; torch loads on the first probe.

Example:
    >>> from transformers import LlamaConfig
    >>> config = LlamaConfig(vocab_size=100, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
    ...                      num_attention_heads=2, num_key_value_heads=1)
    >>> matmul_params(config)  # q 8x8, k and v 8x4 each, o 8x8, MLP 3 x 8x16, head 8x100
    1376
    >>> train_flops(config, [10]) == 3 * (2 * 1376 * 10 + 2 * 1 * 8 * 10 * 11)
    True
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Iterable, Sequence
from typing import Any

# Dense bf16 tensor-core peaks (FLOP/s, no sparsity) from the vendors' datasheets; the first name
# contained in torch.cuda.get_device_name() wins, so longer names come first. Others are probed.
GPU_BF16_PEAK: dict[str, float] = {
    "GH200": 989e12,
    "H200": 989e12,
    "H100": 989e12,
    "H800": 989e12,
    "H20": 148e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "L40": 181e12,
    "L4": 121e12,
    "A10G": 70e12,
    "A10": 125e12,
    "RTX 4090": 165e12,
}


def _text_config(config: Any) -> Any:
    """The language model's config (multimodal configs nest it as ``text_config``)."""
    return getattr(config, "text_config", None) or config


def _head_dim(config: Any) -> int:
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def matmul_params(config: Any) -> int:
    """The weights each token multiplies in a forward pass: the decoder layers' attention projections
    (q, o: ``d x heads x head_dim``; k, v: ``d x kv_heads x head_dim``) and gated MLP (gate, up,
    down: ``3 x d x intermediate``), plus the LM head (``d x vocab``, counted tied or not). The
    embedding lookup, norms and biases are not counted. For the Llama/Qwen/Mistral family of HF
    configs (``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``,
    ``intermediate_size``, ``vocab_size``, optional ``head_dim``)."""
    c = _text_config(config)
    d, hd = int(c.hidden_size), _head_dim(c)
    heads = int(c.num_attention_heads)
    kv_heads = int(getattr(c, "num_key_value_heads", None) or heads)
    attn = d * heads * hd * 2 + d * kv_heads * hd * 2  # q and o; k and v
    mlp = 3 * d * int(c.intermediate_size)  # gate, up, down
    return int(c.num_hidden_layers) * (attn + mlp) + d * int(c.vocab_size)


def attention_flops(config: Any, start: int, end: int) -> float:
    """Forward FLOPs of attention's scores and mixing (QK^T and AV, all layers) for the positions
    ``[start, end)`` of one sequence: position t attends to t + 1 keys, ``4 x (t + 1) x d_attn`` per
    layer, so ``2 x layers x d_attn x (end(end+1) - start(start+1))`` in all."""
    c = _text_config(config)
    d_attn = int(c.num_attention_heads) * _head_dim(c)
    return 2.0 * int(c.num_hidden_layers) * d_attn * (end * (end + 1) - start * (start + 1))


def forward_flops(config: Any, seq_lens: Iterable[int], prefix_lens: Iterable[int] | None = None) -> float:
    """Model FLOPs of one forward pass over sequences of ``seq_lens`` tokens: ``2 N`` per token plus
    attention. With ``prefix_lens`` only the positions after each prefix are counted (the tokens a
    decoder generates after a prompt it already prefilled, say)."""
    n = matmul_params(config)
    lens = list(seq_lens)
    prefixes = [0] * len(lens) if prefix_lens is None else list(prefix_lens)
    return sum(2.0 * n * (s - p) + attention_flops(config, p, s) for s, p in zip(lens, prefixes, strict=True))


def train_flops(config: Any, seq_lens: Iterable[int]) -> float:
    """Model FLOPs of one training pass (forward and backward, 3 forward passes) over sequences of
    ``seq_lens`` tokens: ``6 N`` per token plus 3 x attention."""
    return 3.0 * forward_flops(config, seq_lens)


def precision_dtype(precision: str) -> str:
    """The matmul dtype of a ``deepspeed.precision`` as resolved (``config.resolve_precision``):
    ``bf16`` for bf16 and bf16-autocast, else ``fp32``."""
    return "bf16" if precision.startswith("bf16") else "fp32"


def probe_matmul(dtype: str = "fp32", device: str = "cpu", n: int = 2048, repeats: int = 4) -> float:
    """The best FLOP/s of an ``n x n`` by ``n x n`` matmul (``2 n^3`` FLOPs) in ``dtype`` (``fp32``
    or ``bf16``) over ``repeats`` timed runs after a warm-up, on the threads torch uses now."""
    import torch

    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    gen = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(device=device, dtype=dt)
    b = torch.randn(n, n, generator=gen).to(device=device, dtype=dt)

    def sync() -> None:
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)

    with torch.no_grad():
        torch.mm(a, b)
        sync()
        best = math.inf
        for _ in range(repeats):
            t = time.perf_counter()
            torch.mm(a, b)
            sync()
            best = min(best, time.perf_counter() - t)
    return 2.0 * n**3 / best


def peak_flops(dtype: str = "fp32", device: str = "cpu") -> float:
    """The dense matmul bound (FLOP/s) of ``device`` in ``dtype``: on a GPU in bf16 with a known
    datasheet peak (:data:`GPU_BF16_PEAK`) that number; otherwise measured by :func:`probe_matmul`,
    once per process, dtype, device and torch thread count (about a second on a 2-core CPU)."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda" and dtype == "bf16":
        name = torch.cuda.get_device_name(dev)
        for key, value in GPU_BF16_PEAK.items():
            if key in name:
                return value
    return _probed(dtype, str(dev), torch.get_num_threads())


@functools.cache
def _probed(dtype: str, device: str, threads: int) -> float:
    del threads  # part of the cache key: the bound scales with the threads
    return probe_matmul(dtype, device)


def mfu(flops: float, seconds: float, peak: float) -> float:
    """Model FLOPs utilisation: achieved FLOP/s over the bound; NaN when nothing was timed."""
    if seconds <= 0 or peak <= 0:
        return math.nan
    return flops / seconds / peak


def learner_perf(
    config: Any,
    seq_lens: Sequence[int],
    seconds: float,
    peak: float,
    *,
    updates: float = 1.0,
    forward_passes: float = 0.0,
    world: int = 1,
) -> dict[str, float]:
    """``perf/tokens_per_s`` and ``perf/mfu`` of a learner's work over all ranks: ``updates`` training
    passes and ``forward_passes`` forward-only passes over sequences of ``seq_lens`` tokens (prompt
    included) in ``seconds`` of wall time, on ``world`` ranks of bound ``peak`` each."""
    tokens = float(sum(seq_lens))
    flops = updates * train_flops(config, seq_lens) + forward_passes * forward_flops(config, seq_lens)
    return {
        "perf/tokens_per_s": tokens / seconds if seconds > 0 else math.nan,
        "perf/mfu": mfu(flops, seconds, peak * world),
    }


def learner_passes(algorithm: Any, learned: dict[str, Any], *, pre_update: bool) -> tuple[float, float]:
    """(training passes, forward-only passes) over the step's batch that ``Trainer.learn`` took, from
    the ``algorithm`` config and its metrics: ``ppo_epochs`` passes of updates; one pre-update
    log-prob pass when the method selects tokens (``pre_update``: STARE, KL-Cov, ...) or there are
    several optimizer steps; and with ``selection: per_mini_batch`` a fresh pass over each later
    mini-batch (``epochs - 1 / mini_batches`` batches more)."""
    epochs = float(algorithm.ppo_epochs)
    several = float(learned.get("ppo/optimizer_steps", 1.0)) > 1
    passes = 1.0 if pre_update or several else 0.0
    if pre_update and several and algorithm.selection == "per_mini_batch":
        passes += epochs - 1.0 / float(learned.get("ppo/mini_batches", 1.0))
    return epochs, passes
