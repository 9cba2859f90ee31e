"""A rollout engine on a plain transformers model: batched sampling with a KV cache, CPU or GPU.

The engine implements the ``Engine`` protocol of :mod:`stare_envs.rollout`: token-id prompts in, sampled
token ids, their log-probs and a finish reason out. It runs its own decoding loop over
``model(input_ids, attention_mask, position_ids, cache)`` with left padding, so it knows
exactly which distribution every token was drawn from.

Log-probs. For ``temperature > 0`` each returned log-prob is ``log q(token)`` under the distribution
the token was actually drawn from: ``softmax(logits / temperature)``, truncated to the ``top_k``
most likely tokens, then to the smallest prefix of those (by probability) whose mass reaches
``top_p``, and renormalised. With ``top_k`` off and ``top_p = 1`` (the training setting) this is
exactly ``log_softmax(logits / temperature)``, the quantity verl and SGLang report and a learner
recomputes; under truncation it is larger (SGLang keeps the untruncated value). For
``temperature == 0`` (greedy) the point mass carries no information, so the log-prob is that of the
model's own distribution, ``log_softmax(logits)``.
"""

from __future__ import annotations

import copy
import inspect
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from stare_envs.engine import FinishReason, Generation, SamplingParams

# Extra tokens decoded beyond the longest stop string, for tokens that decode to no full character.
_STOP_WINDOW_MARGIN = 8


class TransformersEngine:
    """Batched generation with a transformers causal LM.

    Args:
        model: a causal LM (``PreTrainedModel``), used as is (no copy), so a learner that trains the
            same module in this process is always in sync; each ``generate`` runs it in eval mode and
            leaves its train/eval mode as it found it.
        tokenizer: its tokenizer; used to decode generated tails for stop strings and for the pad
            and EOS ids.
        device: where generation runs; default the model's device (the model is moved if needed).
        eos_token_ids: token ids that end a sequence (returned, finish reason ``"eos"``); default
            the model's generation config EOS ids plus the tokenizer's EOS id.
        max_batch_size: prompts are generated in chunks of at most this many sequences.
        autocast_dtype: run forward passes under ``torch.autocast`` in this dtype (e.g.
            ``torch.bfloat16`` on a CPU with bf16 support); None: the model's own dtype.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        device: str | torch.device | None = None,
        eos_token_ids: Iterable[int] | None = None,
        max_batch_size: int = 64,
        autocast_dtype: torch.dtype | None = None,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}: pass a positive int")
        self.model = model
        self.tokenizer = tokenizer
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        if next(model.parameters()).device != self.device:
            model.to(self.device)  # type: ignore[arg-type]  # transformers' typed wrapper of to() reads wrong
        self.eos_token_ids = frozenset(
            eos_token_ids if eos_token_ids is not None else _default_eos(model, tokenizer)
        )
        self.max_batch_size = max_batch_size
        self.autocast_dtype = autocast_dtype
        # transformers >= 5.x names the cache argument `cache`; older releases `past_key_values`.
        forward_args = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in forward_args else "past_key_values"
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_token_id = int(pad) if pad is not None else 0
        self._calls_lock = threading.Lock()
        self._calls: set[threading.Event] = set()  # one per generate call in flight (interrupt())

    def interrupt(self) -> None:
        """End the ``generate`` calls in flight after their current token: each unfinished sequence
        comes back with the tokens so far and finish reason ``"abort"`` (a weight update's wrapper
        resumes it, ``train.async_rollouts``). Calls started later are not affected."""
        with self._calls_lock:
            for event in self._calls:
                event.set()

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, stop: Sequence[str] = ()
    ) -> list[Generation]:
        """Sample one continuation per prompt.

        A sequence ends at the first of: an EOS token (included, ``"eos"``); a stop string appearing
        in its decoded continuation (tokens up to and including the one that completed it,
        ``"stop"``); ``params.max_new_tokens`` tokens (``"length"``); :meth:`interrupt` (the tokens so
        far, ``"abort"``).

        Randomness: with ``params.seeds`` each prompt is sampled from its own generator seeded with
        its seed, so its tokens do not depend on which prompts share the batch (up to the float
        rounding of batched kernels); else the same ``params.seed`` with the same prompts gives the
        same tokens; ``seed=None`` draws from torch's global RNG.

        The model is put in eval mode for the call (no dropout, KV cache on even with gradient
        checkpointing) and given back in the mode it was in, since a learner that trains the same
        module keeps it in train mode.
        """
        for index, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise ValueError(f"prompt {index} is empty: give at least one token (e.g. the BOS token)")
        if params.seeds is not None and len(params.seeds) != len(prompts):
            raise ValueError(
                f"params.seeds has {len(params.seeds)} seeds for {len(prompts)} prompts: pass one per prompt"
            )
        # One generator per prompt, or one for the whole call (sampled in one batched draw).
        generators: list[torch.Generator] | torch.Generator | None = None
        if params.seeds is not None:
            generators = [torch.Generator(device=self.device).manual_seed(s) for s in params.seeds]
        elif params.seed is not None:
            generators = torch.Generator(device=self.device).manual_seed(params.seed)
        stop = tuple(s for s in stop if s)
        results: list[Generation] = []
        was_training = self.model.training
        interrupted = threading.Event()
        with self._calls_lock:
            self._calls.add(interrupted)
        self.model.eval()
        try:
            for start in range(0, len(prompts), self.max_batch_size):
                end = start + self.max_batch_size
                if interrupted.is_set():
                    results.extend(Generation([], [], "abort") for _ in prompts[start:end])
                    continue
                with torch.autocast(
                    self.device.type,
                    dtype=self.autocast_dtype or torch.bfloat16,
                    enabled=self.autocast_dtype is not None,
                ):
                    results.extend(
                        self._generate_batch(
                            prompts[start:end],
                            params,
                            stop,
                            generators[start:end] if isinstance(generators, list) else generators,
                            interrupted,
                        )
                    )
        finally:
            with self._calls_lock:
                self._calls.discard(interrupted)
            self.model.train(was_training)
        return results

    @torch.inference_mode()
    def _generate_batch(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        stop: tuple[str, ...],
        generators: list[torch.Generator] | torch.Generator | None,
        interrupted: threading.Event | None = None,
    ) -> list[Generation]:
        n = len(prompts)
        token_ids: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list[float]] = [[] for _ in range(n)]
        finish: list[FinishReason] = ["length"] * n

        input_ids, attention_mask = self._left_pad(prompts)
        # Positions count real tokens only, so a left-padded row sees the same positions as alone.
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        next_position = position_ids[:, -1] + 1
        cache = DynamicCache(config=self.model.config)
        logits = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_arg: cache},
        ).logits[:, -1]
        live = list(range(n))  # row j of the batch tensors is sequence live[j]
        stop_window = max((len(s) for s in stop), default=0) + _STOP_WINDOW_MARGIN
        for _ in range(params.max_new_tokens):
            row_generators = [generators[seq] for seq in live] if isinstance(generators, list) else generators
            tokens, token_logprobs = sample_next_tokens(logits, params, row_generators)
            keep: list[int] = []
            for row, (seq, token, logprob) in enumerate(
                zip(live, tokens.tolist(), token_logprobs.tolist(), strict=True)
            ):
                token_ids[seq].append(token)
                logprobs[seq].append(logprob)
                if token in self.eos_token_ids:
                    finish[seq] = "eos"
                elif stop and self._completes_stop(token_ids[seq][-stop_window:], stop):
                    finish[seq] = "stop"
                elif len(token_ids[seq]) < params.max_new_tokens:
                    keep.append(row)
            if not keep:
                break
            if interrupted is not None and interrupted.is_set():  # a weight update: stop after this token
                for row in keep:
                    finish[live[row]] = "abort"
                break
            if len(keep) < len(live):  # drop finished rows from the batch and the KV cache
                rows = torch.tensor(keep, device=self.device)
                cache.batch_select_indices(rows)
                attention_mask, next_position, tokens = (
                    attention_mask[rows],
                    next_position[rows],
                    tokens[rows],
                )
                live = [live[row] for row in keep]
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(live), 1)], dim=-1)
            logits = self.model(
                input_ids=tokens[:, None],
                attention_mask=attention_mask,
                position_ids=next_position[:, None],
                use_cache=True,
                **{self._cache_arg: cache},
            ).logits[:, -1]
            next_position = next_position + 1
        return [
            Generation(token_ids=token_ids[i], logprobs=logprobs[i], finish_reason=finish[i])
            for i in range(n)
        ]

    def _left_pad(self, prompts: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt) :] = torch.as_tensor(list(prompt), dtype=torch.long)
            attention_mask[row, width - len(prompt) :] = 1
        return input_ids.to(self.device), attention_mask.to(self.device)

    def _completes_stop(self, tail: list[int], stop: tuple[str, ...]) -> bool:
        text = self.tokenizer.decode(tail, skip_special_tokens=False)
        return any(s in text for s in stop)

    def with_own_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]
    ) -> TransformersEngine:
        """This engine on a model of its own: the same architecture (the base model's under LoRA), on
        the same device and in the same dtype, holding ``named_tensors`` (every parameter, by name, as
        :meth:`update_weights` takes them), for a learner that updates ``self.model`` in place while
        this engine samples (asynchronous rollouts). It costs one more copy of the weights on the
        engine's device: 0.5 GB for the 135M model in fp32, about 15 GB for a 7B model in bf16.

        Raises:
            ValueError: a parameter of the model is missing from ``named_tensors``.
        """
        from transformers import AutoModelForCausalLM

        base: PreTrainedModel = getattr(self.model, "get_base_model", lambda: self.model)()
        with torch.device(self.device):
            model = AutoModelForCausalLM.from_config(
                copy.deepcopy(base.config), dtype=next(base.parameters()).dtype
            )
        model.generation_config = copy.deepcopy(base.generation_config)
        model.requires_grad_(False).eval()
        engine = TransformersEngine(
            model,
            self.tokenizer,
            device=self.device,
            eos_token_ids=self.eos_token_ids,
            max_batch_size=self.max_batch_size,
            autocast_dtype=self.autocast_dtype,
        )
        given: set[str] = set()

        def loaded() -> Iterator[tuple[str, torch.Tensor]]:  # one tensor at a time (ZeRO-3 gathers each)
            items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
            for name, tensor in items:
                given.add(name)
                yield name, tensor

        engine.update_weights(loaded())
        missing = [name for name, _ in model.named_parameters() if name not in given]
        if missing:
            raise ValueError(
                f"{len(missing)} parameters of the model were not given, e.g. {missing[0]!r}: pass every "
                "parameter of the policy (Learner.named_weights)"
            )
        return engine

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]
    ) -> None:
        """Copy weights into the model in place, by parameter or buffer name.

        When the learner trains this very module in the same process the engine is always in sync
        and this is a no-op for tensors that already are the model's own (same storage).

        Raises:
            KeyError: a name is not a parameter or buffer of the model.
            ValueError: a tensor's shape differs from the model's.
        """
        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        own: dict[str, torch.Tensor] = dict(self.model.named_parameters())
        own.update(self.model.named_buffers())
        with torch.no_grad():
            for name, tensor in items:
                target = own.get(name)
                if target is None:
                    raise KeyError(
                        f"{name!r} is not a parameter of the engine's model: send the policy's own names"
                    )
                if target.shape != tensor.shape:
                    raise ValueError(
                        f"{name}: shape {tuple(tensor.shape)} does not match the model's {tuple(target.shape)}: "
                        "send weights of the same architecture"
                    )
                if tensor.data_ptr() != target.data_ptr():
                    target.copy_(tensor)


def sample_next_tokens(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | Sequence[torch.Generator | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row and return it with its log-prob under the sampling distribution.

    Args:
        logits: ``[batch, vocab]`` next-token logits.
        params: temperature (0 = greedy), ``top_k`` (<= 0 = off), ``top_p`` (1 = off).
        generator: the random stream (None = torch's global one), or one per row: row r then draws
            from ``generator[r]`` alone, whatever the other rows are. The same generator object may
            appear in several rows.

    Returns:
        ``(tokens [batch] long, logprobs [batch] float32)``; see the module docstring for which
        distribution the log-probs refer to.
    """
    logits = logits.float()
    if params.temperature <= 0:
        tokens = logits.argmax(dim=-1)
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None])[:, 0]
        return tokens, logprobs
    scaled = logits / params.temperature
    vocab = scaled.shape[-1]
    top_k = params.top_k if params.top_k is not None and 0 < params.top_k < vocab else 0
    top_p = params.top_p if params.top_p is not None else 1.0
    if top_k == 0 and top_p >= 1.0:
        logq = torch.log_softmax(scaled, dim=-1)
        tokens = _multinomial(logq.exp(), generator)[:, 0]
        return tokens, logq.gather(-1, tokens[:, None])[:, 0]
    # Candidates sorted by probability (all of them when only top-p is on).
    values, indices = scaled.topk(top_k or vocab, dim=-1)
    if top_p < 1.0:
        probs = torch.softmax(values, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        values = values.masked_fill(mass_before >= top_p, float("-inf"))  # never drops the first
    logq = torch.log_softmax(values, dim=-1)
    choice = _multinomial(logq.exp(), generator)
    return indices.gather(-1, choice)[:, 0], logq.gather(-1, choice)[:, 0]


def _multinomial(
    probs: torch.Tensor, generator: torch.Generator | Sequence[torch.Generator | None] | None
) -> torch.Tensor:
    """One draw per row ``[batch, 1]``: from one stream, or row r from ``generator[r]``."""
    if generator is None or isinstance(generator, torch.Generator):
        return torch.multinomial(probs, 1, generator=generator)
    if len(generator) != probs.shape[0]:
        raise ValueError(f"{len(generator)} generators for {probs.shape[0]} rows: pass one per row")
    return torch.cat([torch.multinomial(probs[r : r + 1], 1, generator=g) for r, g in enumerate(generator)])


def _default_eos(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    ids: set[int] = set()
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(configured, int):
        ids.add(configured)
    elif configured is not None:
        ids.update(int(i) for i in configured)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids
