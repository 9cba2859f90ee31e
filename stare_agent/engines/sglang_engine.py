"""A rollout engine on SGLang's offline ``sglang.Engine`` (GPU only; an optional dependency).

Written against SGLang's documented offline API:

- ``Engine.generate(input_ids=..., sampling_params=..., return_logprob=True)`` returns one dict
  per prompt whose ``meta_info["output_token_logprobs"]`` lists ``(logprob, token_id, text)`` for
  every generated token, and ``meta_info["finish_reason"]`` is ``{"type": "stop" | "length" |
  "abort", "matched": <token id or stop string>}``;
- ``Engine.update_weights_from_tensor(named_tensors=[(name, tensor), ...], flush_cache=...)``
  loads new weights into the running engine; we send them in buckets of bounded size and flush
  the KV/prefix cache once, after the last bucket;
- interrupting (:meth:`SGLangEngine.interrupt`, for a weight sync): each request gets a ``rid`` of
  ours (``Engine.generate(rid=[...])``), and an interrupt calls the tokenizer manager's
  ``abort_request(rid)`` for each request in flight, what the HTTP server's ``/abort_request`` does
  (AReaL and slime abort with ``{"abort_all": true}`` there; we abort our own rids, so nothing
  another caller submitted is touched and an interrupt cannot reach a later call). SGLang ends an
  aborted request at its next scheduler step and answers it with the tokens and log-probs so far
  and ``finish_reason = {"type": "abort", ...}``; ``generate`` returns those as ``"abort"``. The
  abort is scheduled on the engine's own event loop (``loop.call_soon_threadsafe``), which runs
  ``generate`` on the calling thread, since the tokenizer manager's ZeroMQ socket is not thread safe.
  No SGLang server runs on our CI: this path is tested with a recording fake only
  (``tests/stare_agent/engines/test_sglang_engine.py``).

Log-probs are SGLang's: ``log_softmax(logits / temperature)`` of the sampled token, before top-k /
top-p truncation (for temperature 0, SGLang samples greedily and reports ``log_softmax(logits)``).
With top-k off and top-p = 1, the training setting, this equals what
:class:`~stare_agent.engines.transformers_engine.TransformersEngine` reports.

SGLang is imported lazily: constructing :class:`SGLangEngine` without it raises
:class:`SGLangUnavailableError` naming the fix.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from stare_agent.errors import StareError
from stare_envs.engine import FinishReason, Generation, RolloutError, SamplingParams, stream_seed

DEFAULT_BUCKET_BYTES = 512 * 1024**2


class SGLangUnavailableError(StareError, ImportError):
    """SGLang (or the CUDA GPU it needs) is not available on this machine."""


def import_sglang() -> Any:
    """Import and return the ``sglang`` module, or raise :class:`SGLangUnavailableError` with the fix."""
    try:
        import sglang
    except ImportError as exc:
        raise SGLangUnavailableError(
            f"SGLang is not installed ({exc}): pip install 'stare-agent[sglang]' on a machine with a CUDA GPU, "
            "or use the transformers engine"
        ) from exc
    return sglang


class SGLangEngine:
    """Batched generation with an in-process ``sglang.Engine``.

    Args:
        model_path: checkpoint directory or Hugging Face id SGLang loads (for the embedded model,
            ``stare_agent.models.embedded_model_path()``).
        eos_token_ids: token ids reported as finish reason ``"eos"``; default: any token SGLang
            matched as a stop token (its EOS ids).
        bucket_bytes: the most bytes of weights sent per ``update_weights_from_tensor`` call.
        sampling_overrides: extra SGLang ``sampling_params`` entries for every request (e.g.
            ``{"ignore_eos": True}`` for benchmarks, ``{"min_p": 0.05}``); they win over ours.
        **engine_kwargs: passed to ``sglang.Engine`` (``dtype``, ``mem_fraction_static``,
            ``tp_size``, ``enable_deterministic_inference``, ...).

    Raises:
        SGLangUnavailableError: SGLang is not installed.
    """

    own_numerics = True
    """Its log-probs come from kernels of its own, not the learner's forward: the trainer's
    ``algorithm.rollout_correction: auto`` corrects for the difference."""

    def __init__(
        self,
        model_path: str,
        *,
        eos_token_ids: Iterable[int] | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        sampling_overrides: Mapping[str, Any] | None = None,
        **engine_kwargs: Any,
    ) -> None:
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}: pass a positive int")
        sglang = import_sglang()
        self.eos_token_ids = frozenset(eos_token_ids) if eos_token_ids is not None else None
        self.bucket_bytes = bucket_bytes
        self.sampling_overrides = dict(sampling_overrides or {})
        self.engine = sglang.Engine(model_path=str(model_path), **engine_kwargs)
        self._init_interrupts()

    def _init_interrupts(self) -> None:
        self._calls_lock = threading.Lock()
        self._in_flight: set[str] = set()  # rids of the requests of the generate calls in flight
        self._aborted: set[str] = set()  # of those, the ones interrupt() aborted

    def interrupt(self) -> None:
        """End the ``generate`` calls in flight at SGLang's next scheduler step: each unfinished request
        comes back with its tokens so far and finish reason ``"abort"`` (a weight update's wrapper
        resumes it, ``train.async_rollouts``). Calls started later are not affected. Returns at once."""
        with self._calls_lock:
            rids = sorted(self._in_flight - self._aborted)
            self._aborted.update(rids)
        manager = self.engine.tokenizer_manager
        for rid in rids:  # on the loop generate runs (its thread); a rid already done is ignored
            self.engine.loop.call_soon_threadsafe(manager.abort_request, rid)

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, stop: Sequence[str] = ()
    ) -> list[Generation]:
        """Sample one continuation per prompt (see :class:`stare_envs.engine.Engine`).

        Seeds: prompt ``i`` gets SGLang's ``sampling_seed`` from :func:`request_sampling_params`
        (``params.seeds[i]`` from the rollout runner: one stream per episode and turn); SGLang
        honours it exactly when started with ``enable_deterministic_inference=True``.
        """
        if not prompts:
            return []
        sampling = request_sampling_params(params, stop, len(prompts), self.sampling_overrides)
        rids = [f"stare-{uuid.uuid4().hex}" for _ in prompts]  # ours, for interrupt()
        with self._calls_lock:
            self._in_flight.update(rids)
        try:
            outputs = self.engine.generate(
                input_ids=[list(p) for p in prompts], sampling_params=sampling, return_logprob=True, rid=rids
            )
        finally:
            with self._calls_lock:
                self._in_flight.difference_update(rids)
                aborted = {rid for rid in rids if rid in self._aborted}
                self._aborted.difference_update(rids)
        if isinstance(outputs, Mapping):
            outputs = [outputs]
        if len(outputs) != len(prompts):
            raise RolloutError(
                f"SGLang returned {len(outputs)} outputs for {len(prompts)} prompts: report this bug"
            )
        return [
            to_generation(out, self.eos_token_ids, interrupted=rid in aborted)
            for out, rid in zip(outputs, rids, strict=True)
        ]

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]
    ) -> None:
        """Send new weights to the engine in buckets of at most ``bucket_bytes`` (one oversized
        tensor travels alone), flushing SGLang's cache once after the last bucket.

        Raises:
            RolloutError: SGLang refused a bucket (its message is included).
        """
        if self._nccl is not None:  # env.placement.weight_sync=nccl
            self._nccl.send(named_tensors)
            return
        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        pending: list[tuple[str, torch.Tensor]] | None = None
        for bucket in weight_buckets(items, self.bucket_bytes):
            if pending is not None:
                self._send(pending, flush_cache=False)
            pending = bucket
        if pending is not None:
            self._send(pending, flush_cache=True)

    def _send(self, bucket: list[tuple[str, torch.Tensor]], *, flush_cache: bool) -> None:
        result = self.engine.update_weights_from_tensor(named_tensors=bucket, flush_cache=flush_cache)
        success, message = (result[0], result[1]) if isinstance(result, tuple) else (True, "")
        if not success:
            names = ", ".join(name for name, _ in bucket[:3])
            raise RolloutError(f"SGLang refused weights [{names}, ...]: {message}")

    # ------------------------------------------------------------------ placement (env.placement)

    _nccl: Any = None  # a placement.NcclWeightSync once use_nccl_weight_sync was called

    def sleep(self) -> None:
        """Free the engine's GPU memory (weights and KV cache: ``release_memory_occupation``); needs an
        engine started with ``enable_memory_saver=True``."""
        _checked(self.engine.release_memory_occupation(), "release_memory_occupation")

    def wake_up(self) -> None:
        """Take the GPU memory back after :meth:`sleep` (``resume_memory_occupation``)."""
        _checked(self.engine.resume_memory_occupation(), "resume_memory_occupation")

    def use_nccl_weight_sync(self, tensor_parallel_size: int, device: Any, dtype: Any = None) -> None:
        """Send later weight updates over NCCL: this process (the learner rank, on CUDA ``device``) is
        rank 0 of a group with the engine's ``tensor_parallel_size`` ranks (``init_weights_update_group``),
        opened at the first update; each update is ``update_weights_from_distributed`` while we broadcast."""
        from stare_agent.engines.placement import SYNC_GROUP, NcclWeightSync, free_port, torch_trainer_group

        port, world = free_port(), 1 + tensor_parallel_size

        def join() -> None:
            _checked(self.engine.init_weights_update_group(master_address="127.0.0.1", master_port=port,
                     rank_offset=1, world_size=world, group_name=SYNC_GROUP, backend="nccl"),
                     "init_weights_update_group")  # fmt: skip

        def receive(meta: dict[str, list[Any]]) -> None:
            _checked(self.engine.update_weights_from_distributed(names=meta["names"], dtypes=meta["dtype_names"],
                     shapes=meta["shapes"], group_name=SYNC_GROUP, flush_cache=True),
                     "update_weights_from_distributed")  # fmt: skip

        self._nccl = NcclWeightSync(
            receive, lambda: torch_trainer_group(port, world, device), join, dtype=dtype, device=device
        )

    def close(self) -> None:
        """Shut down SGLang's scheduler and detokenizer processes."""
        self.engine.shutdown()

    def __enter__(self) -> SGLangEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _checked(result: Any, what: str) -> None:
    """Raise :class:`RolloutError` for an SGLang ``(success, message)`` answer that failed."""
    if isinstance(result, tuple) and len(result) >= 2 and not result[0]:
        raise RolloutError(f"SGLang {what} failed: {result[1]}")


def sglang_sampling_params(params: SamplingParams, stop: Sequence[str]) -> dict[str, Any]:
    """SGLang's ``sampling_params`` dict for our :class:`SamplingParams` and stop strings.

    Stop strings are kept in the output (``no_stop_trim``) and special tokens are not skipped, so
    the returned token ids run up to and including the token that completed a stop string or EOS.
    """
    return {
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k is not None else -1,
        "max_new_tokens": params.max_new_tokens,
        "stop": [s for s in stop if s],
        "no_stop_trim": True,
        "skip_special_tokens": False,
    }


def request_sampling_params(
    params: SamplingParams, stop: Sequence[str], n: int, overrides: Mapping[str, Any] | None = None
) -> dict[str, Any] | list[dict[str, Any]]:
    """SGLang ``sampling_params`` for a batch of ``n`` prompts: one dict, or one per prompt when seeded.

    With ``params.seeds`` prompt i gets ``sampling_seed = seeds[i]``; with only ``params.seed`` it gets
    ``stream_seed(seed, i)`` (hashed, so no two prompts or turns share a stream, as ``seed + i`` did:
    prompt i + 1 at turn t and prompt i at turn t + 1). ``overrides`` win over ours.
    """
    base = {**sglang_sampling_params(params, stop), **(overrides or {})}
    if params.seeds is not None:
        if len(params.seeds) != n:
            raise ValueError(
                f"params.seeds has {len(params.seeds)} seeds for {n} prompts: pass one per prompt"
            )
        seeds: Sequence[int] = params.seeds
    elif params.seed is not None:
        seeds = [stream_seed(params.seed, i) for i in range(n)]
    else:
        return base
    return [{**base, "sampling_seed": seed, **(overrides or {})} for seed in seeds]


def to_generation(
    output: Mapping[str, Any], eos_token_ids: frozenset[int] | None = None, *, interrupted: bool = False
) -> Generation:
    """Convert one SGLang output dict into a :class:`Generation`.

    ``interrupted``: :meth:`SGLangEngine.interrupt` aborted this request, so an abort is its tokens so
    far (finish reason ``"abort"``; none when SGLang had not scheduled it yet).

    Raises:
        RolloutError: SGLang aborted a request we did not interrupt, or it came back without log-probs.
    """
    meta = output["meta_info"]
    finish = meta.get("finish_reason") or {}
    kind = finish.get("type")
    if kind == "abort" and not interrupted:
        raise RolloutError(f"SGLang aborted a request: {finish.get('message', finish)}")
    entries = meta.get("output_token_logprobs")
    if entries is None and kind == "abort":  # aborted while waiting: no tokens
        entries = []
    if entries is None:
        raise RolloutError("SGLang returned no output_token_logprobs: call generate with return_logprob=True")
    token_ids = [int(entry[1]) for entry in entries]
    logprobs = [float(entry[0]) for entry in entries]
    reason: FinishReason
    if kind == "length":
        reason = "length"
    elif kind == "stop":
        matched = finish.get("matched")
        is_token = isinstance(matched, int) and not isinstance(matched, bool)
        reason = "eos" if is_token and (eos_token_ids is None or matched in eos_token_ids) else "stop"
    elif kind == "abort":
        reason = "abort"
    else:
        raise RolloutError(f"unknown SGLang finish_reason {finish!r}: update stare_agent's SGLang engine")
    return Generation(token_ids=token_ids, logprobs=logprobs, finish_reason=reason)


def weight_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group ``(name, tensor)`` pairs, in order, into lists of at most ``bucket_bytes`` bytes each.

    A tensor larger than ``bucket_bytes`` forms a bucket of its own.
    """
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor.detach()))
        size += nbytes
    if bucket:
        yield bucket
