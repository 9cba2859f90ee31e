"""Outcome rewards: bounded answer checking with math-verify, and the reward modes built on it.

``math-verify`` parses LaTeX into SymPy and compares symbolically. Some inputs make SymPy run for
minutes (power towers such as ``9^{9^{9^{9}}}``, even when only printing the parsed result), and the
library's own timeouts use ``signal.alarm``, which fails outside the main thread. ``AnswerChecker``
therefore runs math-verify in a small pool of worker processes and bounds each check from the caller's
side by the worker's CPU time, so that a verdict never depends on how loaded the machine is: a worker
that uses up its CPU budget is killed (SIGKILL) and replaced in the background, and the check scores
False as timed out, which ``compute_reward`` reports (``check_timed_out``) and the runs count. A worker
that gets no CPU at all for a long wall time (a starved machine) is infrastructure, not a verdict: the
check is retried once on a fresh worker, then raises. Plain integer answers (AIME) are decided in the
calling thread without the pool.

Example:
    >>> with AnswerChecker(num_workers=1) as checker:
    ...     checker.check("0204", "204"), checker.check("\\\\frac{1}{2}", "0.5")
    (True, True)
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import math
import multiprocessing
import os
import queue
import re
import signal
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

import psutil

from stare_envs.errors import EnvError

__all__ = [
    "AnswerChecker",
    "AnswerCheckerError",
    "RewardConfig",
    "compute_reward",
    "default_checker",
    "extract_boxed",
    "integer_answers_match",
]

_BOX_COMMANDS = ("\\boxed", "\\fbox")


class AnswerCheckerError(EnvError, RuntimeError):
    """The answer-checking infrastructure failed (not: the answer was wrong, which is ``False``)."""


# --------------------------------------------------------------------------------------------------
# Boxed answers and the integer fast path
# --------------------------------------------------------------------------------------------------


def extract_boxed(text: str) -> str | None:
    r"""Returns the content of the last ``\boxed{...}`` (or ``\fbox{...}``) in ``text``.

    Nested braces are matched; escaped braces (``\{``, ``\}``) do not count.

    Returns:
        The content between the braces, unstripped, or None when there is no box or the last one is
        not closed.

    Example:
        >>> extract_boxed(r"so \boxed{1} or rather \boxed{\frac{1}{2}}.")
        '\\frac{1}{2}'
        >>> extract_boxed(r"\boxed{\{1, 2\}}"), extract_boxed(r"\boxed{12"), extract_boxed("12")
        ('\\{1, 2\\}', None, None)
    """
    start = max(text.rfind(command) for command in _BOX_COMMANDS)
    if start < 0:
        return None
    i = start + (len("\\boxed") if text.startswith("\\boxed", start) else len("\\fbox"))
    while i < len(text) and text[i].isspace():
        i += 1
    if i >= len(text) or text[i] != "{":
        return None
    depth, body_start = 0, i + 1
    while i < len(text):
        char = text[i]
        if char == "\\":
            i += 2
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[body_start:i]
        i += 1
    return None


_INTEGER = re.compile(r"[+-]?\d+")
# A prediction the fast path may decide: digits, optional thousands separators in groups of three,
# an optional all-zero decimal part ("204.0", "204." as at the end of a sentence).
_PLAIN_INTEGER = re.compile(r"([+-]?)(\d+|\d{1,3}(?:,\d{3})+)(?:\.0*)?")


def _strip_math(text: str) -> str:
    """Drops whitespace, ``$`` delimiters, LaTeX thin spaces and a ``{,}`` thousands separator."""
    text = text.replace("{,}", ",").replace("\\!", "").replace("\\,", "")
    return "".join(text.split()).strip("$")


def _normalized_integer(sign: str, digits: str) -> str:
    digits = digits.replace(",", "").lstrip("0") or "0"
    return digits if sign != "-" or digits == "0" else "-" + digits


def integer_answers_match(prediction: str, gold: str) -> bool | None:
    r"""Decides plain-integer answers without SymPy; None when it cannot decide.

    It decides only when ``gold`` is an integer literal (``"204"``, ``"-3"``, ``"025"``) and the
    prediction (or the content of its last ``\boxed{}``) is a plain integer. Integers compare by
    value, so ``"0204"``, ``"+204"``, ``"204.0"``, ``"204."``, ``"$204$"`` all equal ``"204"``, and
    ``"1,000"`` (thousands separators in groups of three) equals ``"1000"``. Anything else
    (``"\frac{408}{2}"``, ``"204^\circ"``, ``"x = 204"``, ``"204 minutes"``) is left to math-verify.
    Values are compared as digit strings, so integers of any length work.

    Example:
        >>> integer_answers_match("0204", "204"), integer_answers_match("205", "204")
        (True, False)
        >>> integer_answers_match("\\frac{408}{2}", "204") is None
        True
    """
    gold_text = _strip_math(gold)
    if not _INTEGER.fullmatch(gold_text):
        return None
    if any(command in prediction for command in _BOX_COMMANDS):
        boxed = extract_boxed(prediction)
        if boxed is None:
            return None
        prediction = boxed
    match = _PLAIN_INTEGER.fullmatch(_strip_math(prediction))
    if match is None:
        return None
    gold_sign = "-" if gold_text.startswith("-") else ""
    gold_value = _normalized_integer(gold_sign, gold_text.lstrip("+-"))
    return _normalized_integer(match.group(1), match.group(2)) == gold_value


# --------------------------------------------------------------------------------------------------
# The worker process
# --------------------------------------------------------------------------------------------------


_UNESCAPED_DOLLAR = re.compile(r"(?<!\\)\$")


def _as_latex(text: str) -> str:
    """Wraps a bare answer in ``$...$`` so that math-verify's LaTeX extraction sees it."""
    if _UNESCAPED_DOLLAR.search(text) or "\\boxed" in text or "\\(" in text or "\\[" in text:
        return text
    return f"${text}$"


def _math_verify(prediction: str, gold: str) -> bool:
    """math-verify without its signal-based timeouts (the parent enforces the deadline)."""
    from math_verify import parse, verify

    gold_parsed = list(_parse_gold(gold))
    pred_parsed = parse(_as_latex(prediction), parsing_timeout=None)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))


@lru_cache(maxsize=2048)
def _parse_gold(gold: str) -> tuple:
    """Gold answers repeat across a group of responses: parse each once per worker."""
    from math_verify import parse

    return tuple(parse(_as_latex(gold), parsing_timeout=None))


def _worker_main(conn: Any) -> None:
    """Serves ``(prediction, gold)`` requests with ``(correct, error)`` replies until EOF or None."""
    # Ctrl-C in a terminal reaches the whole process group: the parent decides when workers stop (they
    # are killed with it), so a worker neither dies mid-check nor prints a KeyboardInterrupt traceback
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    logging.getLogger("latex2sympy2_extended").setLevel(logging.ERROR)
    _math_verify("$\\frac{1}{2}$", "0.5")  # import and warm SymPy/ANTLR before saying ready
    conn.send(("ready", None))
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            return
        if request is None:
            return
        prediction, gold = request
        try:
            reply: tuple[bool, str | None] = (_math_verify(prediction, gold), None)
        except Exception as exc:  # noqa: BLE001 - a bad answer is a wrong answer, not a crash
            reply = (False, f"{type(exc).__name__}: {exc}"[:500])
        conn.send(reply)


class _Worker:
    """One worker process and the parent's end of its pipe."""

    def __init__(self, context: Any) -> None:
        self.conn, child_conn = context.Pipe(duplex=True)
        self.process = context.Process(
            target=_worker_main, args=(child_conn,), daemon=True, name="answer-checker"
        )
        with _main_not_inherited():
            self.process.start()
        child_conn.close()

    def wait_ready(self, timeout_s: float) -> None:
        if not self.conn.poll(timeout_s):
            raise AnswerCheckerError(f"worker not ready after {timeout_s:.0f} s")
        message = self.conn.recv()
        if message != ("ready", None):
            raise AnswerCheckerError(f"unexpected first message from worker: {message!r}")

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()


_main_lock = threading.Lock()


@contextlib.contextmanager
def _main_not_inherited() -> Iterator[None]:
    """Start a worker without the user's main module: multiprocessing's spawn and forkserver children
    import it again (as ``__mp_main__``), which runs a script without ``if __name__ == "__main__":``
    a second time, in the worker (a second trainer there). The worker needs only this module, so the
    main module is hidden from the start's preparation data (its ``__file__`` and ``__spec__``)."""
    main = sys.modules.get("__main__")
    with _main_lock:
        if main is None:
            yield
            return
        saved: dict[str, Any] = {n: main.__dict__[n] for n in ("__file__", "__spec__") if n in main.__dict__}
        main.__dict__.pop("__file__", None)
        main.__dict__["__spec__"] = None
        try:
            yield
        finally:
            main.__dict__.pop("__spec__", None)
            main.__dict__.update(saved)


def _mp_context() -> Any:
    """forkserver with math-verify preloaded: replacing a killed worker is a fork, not an import."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["stare_envs.rewards", "math_verify", "sympy"])
    return context


# --------------------------------------------------------------------------------------------------
# The checker
# --------------------------------------------------------------------------------------------------


class AnswerChecker:
    r"""Thread-safe answer checking with a hard bound per check, on CPU time.

    Each check first tries the integer fast path (``integer_answers_match``), then the result cache,
    then sends the pair to an idle worker process running math-verify (``parse`` both,
    ``verify(gold, prediction)``). A worker that uses ``timeout_s`` CPU seconds on the pair is killed
    and replaced in the background; that check scores False and counts as timed out (:meth:`verdict`).
    One that neither answers nor uses its budget within ``wall_timeout_s`` (the machine starved it)
    is replaced and the pair tried once more; a second such wait raises ``AnswerCheckerError``. A
    check waits for an idle worker first (at most ``startup_timeout_s``).

    Args:
        num_workers: Worker processes; default ``min(4, os.cpu_count())``.
        timeout_s: CPU seconds a math-verify check may use in its worker (the same verdict on a busy
            machine as on an idle one).
        wall_timeout_s: Wall seconds a check may wait for its worker's answer before the worker is taken
            for starved; default ``max(60, 20 * timeout_s)``.
        max_chars: Predictions or golds longer than this score False without parsing (a megabyte of
            model output is never a correct closed-form answer, and would only tie up a worker).
        cache_size: Completed results kept in an LRU keyed by ``(prediction, gold)``; 0 disables it.
            Timed-out checks are not cached.
        startup_timeout_s: How long a check may wait for a worker before raising
            ``AnswerCheckerError`` (covers the first start, which imports SymPy).

    Example:
        >>> with AnswerChecker(num_workers=1, timeout_s=2.0) as checker:
        ...     checker.check_many([("\\sqrt{2}/2", "\\frac{\\sqrt 2}{2}"), ("13", "12")])
        [True, False]
    """

    def __init__(
        self,
        num_workers: int | None = None,
        *,
        timeout_s: float = 3.0,
        wall_timeout_s: float | None = None,
        max_chars: int = 20_000,
        cache_size: int = 8192,
        startup_timeout_s: float = 120.0,
    ) -> None:
        if num_workers is None:
            num_workers = min(4, os.cpu_count() or 1)
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}: pass a positive count")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}: pass a positive number of seconds")
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        self.wall_timeout_s = (
            float(wall_timeout_s) if wall_timeout_s is not None else max(60.0, 20 * self.timeout_s)
        )
        self.max_chars = max_chars
        self.startup_timeout_s = startup_timeout_s
        self._context = _mp_context()
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._lock = threading.Lock()
        self._workers: set[_Worker] = set()
        self._closed = False
        self._last_failure: str | None = None
        self._cache: OrderedDict[tuple[str, str], bool] = OrderedDict()
        self._cache_size = cache_size
        self._executor: ThreadPoolExecutor | None = None
        self._stats = dict(
            checks=0, fast_path=0, cache_hits=0, pool=0, timeouts=0, stalls=0, errors=0, restarts=0
        )
        for _ in range(num_workers):
            self._start_worker_async()

    # -- public API ---------------------------------------------------------------------------------

    def check(self, prediction: str, gold: str) -> bool:
        """True when ``prediction`` is mathematically equal to ``gold``; False when it is not, and on a
        check that used up its CPU budget or failed (:meth:`verdict` says which).

        Raises:
            AnswerCheckerError: The checker is closed, no worker became ready in time, or the machine
                starved the check twice (see the class docstring).
        """
        return self.verdict(prediction, gold)[0]

    def verdict(self, prediction: str, gold: str) -> tuple[bool, bool]:
        """``(correct, timed_out)``: ``timed_out`` when the check used up its ``timeout_s`` CPU seconds
        and scored False for it (a bound on the answer, not a judgement of it: counted, never silent).

        Raises:
            AnswerCheckerError: as :meth:`check`.
        """
        if self._closed:
            raise AnswerCheckerError("AnswerChecker is closed: create a new one or use default_checker()")
        self._count("checks")
        decided = integer_answers_match(prediction, gold)
        if decided is not None:
            self._count("fast_path")
            return decided, False
        if len(prediction) > self.max_chars or len(gold) > self.max_chars:
            return False, False
        key = (prediction, gold)
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                self._stats["cache_hits"] += 1
                return cached, False
        return self._check_in_worker(prediction, gold)

    def check_many(self, pairs: Iterable[tuple[str, str]]) -> list[bool]:
        """``check`` for each ``(prediction, gold)`` pair, spread across the workers; order is kept."""
        pairs = list(pairs)
        results: list[bool | None] = [None] * len(pairs)
        pending: list[int] = []
        for index, (prediction, gold) in enumerate(pairs):
            decided = integer_answers_match(prediction, gold)
            if decided is None:
                pending.append(index)
            else:
                self._count("checks")
                self._count("fast_path")
                results[index] = decided
        if len(pending) == 1:
            results[pending[0]] = self.check(*pairs[pending[0]])
        elif pending:
            executor = self._get_executor()
            for index, correct in zip(
                pending, executor.map(lambda i: self.check(*pairs[i]), pending), strict=True
            ):
                results[index] = correct
        return [bool(result) for result in results]

    @property
    def stats(self) -> dict[str, int]:
        """Counters: checks, fast_path, cache_hits, pool, timeouts (CPU budget used up), stalls (starved
        workers), errors, restarts, idle_workers."""
        with self._lock:
            return {**self._stats, "idle_workers": self._idle.qsize()}

    def close(self) -> None:
        """Stops every worker process. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            workers = list(self._workers)
            self._workers.clear()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
        for worker in workers:
            worker.kill()

    def __enter__(self) -> AnswerChecker:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    # -- internals ----------------------------------------------------------------------------------

    def _count(self, name: str) -> None:
        with self._lock:
            self._stats[name] += 1

    def _get_executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self.num_workers, thread_name_prefix="answer-check")
            return self._executor

    def _acquire(self) -> _Worker:
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            try:
                return self._idle.get(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                if self._closed:
                    raise AnswerCheckerError(
                        "AnswerChecker was closed while waiting for a worker: do not close it in use"
                    ) from None
                if time.monotonic() >= deadline:
                    raise AnswerCheckerError(
                        f"no answer-checking worker ready within {self.startup_timeout_s:.0f} s "
                        f"(last failure: {self._last_failure}): check that "
                        "`python -c 'import math_verify'` works, or raise startup_timeout_s"
                    ) from None

    def _check_in_worker(self, prediction: str, gold: str) -> tuple[bool, bool]:
        """One pool check: ``(correct, timed_out)``. A worker that died while idle (e.g. killed for
        memory) is replaced and the pair goes to another worker once; one that uses up its CPU budget is
        killed: ``(False, True)``; one starved past ``wall_timeout_s`` is replaced and the pair tried once
        more, then ``AnswerCheckerError``."""
        stalls = 0
        for attempt in range(3):
            worker = self._acquire()
            self._count("pool")
            started = time.monotonic()
            try:
                worker.conn.send((prediction, gold))
                outcome = self._wait(worker)
                if outcome == "timeout":
                    self._count("timeouts")
                    self._replace(worker)
                    return False, True
                if outcome == "stall":
                    self._count("stalls")
                    self._replace(worker)
                    stalls += 1
                    if stalls == 2:
                        raise AnswerCheckerError(
                            f"an answer check got no CPU for {self.wall_timeout_s:.0f} s twice (the machine is "
                            "overloaded): lower the load, or raise AnswerChecker's wall_timeout_s"
                        )
                    continue
                correct, error = worker.conn.recv()
            except (EOFError, OSError):
                self._count("errors")
                self._replace(worker)
                if attempt == 0 and time.monotonic() - started < self.wall_timeout_s / 2:
                    continue
                return False, False
            self._release(worker)
            if error is not None:
                self._count("errors")
            with self._lock:
                if self._cache_size > 0:
                    self._cache[(prediction, gold)] = correct
                    if len(self._cache) > self._cache_size:
                        self._cache.popitem(last=False)
            return correct, False
        return False, False

    def _wait(self, worker: _Worker) -> str:
        """Until ``worker`` answers (``"answer"``), uses ``timeout_s`` CPU seconds on the request
        (``"timeout"``), or ``wall_timeout_s`` pass (``"stall"``). The CPU time is the worker's own,
        read from the OS, so load on the machine does not move the bound."""
        try:
            process = psutil.Process(worker.process.pid)
            times = process.cpu_times()
            cpu0 = times.user + times.system
        except psutil.Error:
            return "answer"  # gone already: the read below sees EOF
        deadline = time.monotonic() + self.wall_timeout_s
        while not worker.conn.poll(0.02):
            try:
                times = process.cpu_times()
            except psutil.Error:
                return "answer"
            if times.user + times.system - cpu0 >= self.timeout_s:
                return "timeout"
            if time.monotonic() >= deadline:
                return "stall"
        return "answer"

    def _release(self, worker: _Worker) -> None:
        with self._lock:
            if not self._closed:
                self._idle.put(worker)
                return
        worker.kill()

    def _replace(self, worker: _Worker) -> None:
        """Kills ``worker`` now; a background thread starts its replacement."""
        worker.process.kill()
        with self._lock:
            self._workers.discard(worker)
            self._stats["restarts"] += 1
        threading.Thread(target=worker.kill, daemon=True).start()  # reap without delaying the caller
        self._start_worker_async()

    def _start_worker_async(self) -> None:
        threading.Thread(target=self._start_worker, daemon=True, name="answer-checker-start").start()

    def _start_worker(self) -> None:
        worker: _Worker | None = None
        try:
            worker = _Worker(self._context)
            with self._lock:
                if self._closed:
                    raise AnswerCheckerError("closed")
                self._workers.add(worker)
            worker.wait_ready(self.startup_timeout_s)
        except Exception as exc:  # noqa: BLE001 - reported to callers through _acquire's error
            self._last_failure = f"{type(exc).__name__}: {exc}"
            if worker is not None:
                with self._lock:
                    self._workers.discard(worker)
                worker.kill()
            return
        self._release(worker)


_default_checker: AnswerChecker | None = None
_default_lock = threading.Lock()


def default_checker() -> AnswerChecker:
    """The process-wide shared ``AnswerChecker``, created on first use and closed at exit."""
    global _default_checker
    with _default_lock:
        if _default_checker is None or _default_checker._closed:
            _default_checker = AnswerChecker()
            atexit.register(_default_checker.close)
        return _default_checker


# --------------------------------------------------------------------------------------------------
# Rewards
# --------------------------------------------------------------------------------------------------


def answers_equivalent(prediction: str, gold: str, *, checker: AnswerChecker | None = None) -> bool:
    """Whether ``prediction`` is the same answer as ``gold``, as the reward decides it: integers by
    value (:func:`integer_answers_match`), anything else by math-verify in ``checker`` (the shared
    :func:`default_checker` when None).

    >>> answers_equivalent("070", "70"), answers_equivalent("71", "70")
    (True, False)
    """
    return _equivalence(prediction, gold, checker)[0]


def _equivalence(prediction: str, gold: str, checker: AnswerChecker | None) -> tuple[bool, bool]:
    """``(correct, timed_out)`` of :func:`answers_equivalent`."""
    decided = integer_answers_match(prediction, gold)
    if decided is not None:
        return decided, False
    return (checker or default_checker()).verdict(prediction, gold)


@dataclass(frozen=True)
class RewardConfig:
    """How an episode's outcome becomes a scalar reward.

    Attributes:
        mode: ``"binary"``: 1 if correct else 0 (accuracy; what STARE uses). ``"plus_minus"``: +1 if
            correct else -1 (ReTool, Feng et al. 2025).
        tool_call_bonus: Added when the episode made at least one tool call (tool-use shaping, off by
            default). With ``bonus_requires_correct`` it is only paid on correct answers, so that
            calling a tool cannot by itself raise the reward of a wrong answer.
        bonus_requires_correct: See ``tool_call_bonus``.
        format_penalty: Subtracted when the response gave no final answer at all (``None``); 0 (off)
            by default, so that "no answer" scores the same as a wrong answer.
    """

    mode: Literal["binary", "plus_minus"] = "binary"
    tool_call_bonus: float = 0.0
    bonus_requires_correct: bool = True
    format_penalty: float = 0.0

    def __post_init__(self) -> None:
        if self.mode not in ("binary", "plus_minus"):
            raise ValueError(f"reward mode {self.mode!r} is unknown: use 'binary' or 'plus_minus'")
        for name in ("tool_call_bonus", "format_penalty"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value}: pass e.g. 0.1")


def reward_config(value: RewardConfig | Mapping[str, Any] | None) -> RewardConfig:
    """``value`` as a :class:`RewardConfig`: itself, the default for None, or built from a mapping (a
    YAML config's ``env.kwargs.reward: {mode: plus_minus, tool_call_bonus: 0.1}``).

    Raises:
        ValueError: a key that is not a field, or a value out of range (one line naming it).
    """
    if value is None:
        return RewardConfig()
    if isinstance(value, RewardConfig):
        return value
    if not isinstance(value, Mapping):
        raise ValueError(
            f"reward must be a RewardConfig or a mapping of its fields, got {type(value).__name__}"
        )
    fields = {f.name for f in dataclasses.fields(RewardConfig)}
    unknown = sorted(set(value) - fields)
    if unknown:
        raise ValueError(f"reward has no field {unknown[0]!r}: its fields are {', '.join(sorted(fields))}")
    return RewardConfig(**value)


def compute_reward(
    response_answer: str | None,
    gold: str,
    *,
    config: RewardConfig = RewardConfig(),
    checker: AnswerChecker | None = None,
    num_tool_calls: int = 0,
) -> tuple[float, dict[str, Any]]:
    """The outcome reward of one episode.

    ``reward = base + bonus - penalty`` with ``base`` = 1 if correct, else 0 (binary) or -1
    (plus_minus); ``bonus = tool_call_bonus`` if ``num_tool_calls > 0`` (and the answer is correct,
    when ``bonus_requires_correct``); ``penalty = format_penalty`` if ``response_answer`` is None.

    Args:
        response_answer: The final answer extracted from the response, or None if it gave none.
        gold: The reference answer.
        config: Reward mode and shaping.
        checker: The checker to use; ``default_checker()`` when None.
        num_tool_calls: Tool calls made in the episode.

    Returns:
        ``(reward, info)`` with info keys ``correct``, ``answer``, ``has_answer``, ``base``,
        ``tool_bonus``, ``format_penalty``, ``mode`` and ``check_timed_out`` (the check used up its CPU
        budget, so ``correct`` is False without a verdict: counted by the runs, never silent).

    Example:
        >>> compute_reward("0204", "204")[0], compute_reward(None, "204")[0]
        (1.0, 0.0)
        >>> compute_reward("7", "204", config=RewardConfig(mode="plus_minus"))[0]
        -1.0
    """
    has_answer = response_answer is not None
    correct, timed_out = (
        _equivalence(response_answer, gold, checker) if response_answer is not None else (False, False)
    )
    base = 1.0 if correct else (0.0 if config.mode == "binary" else -1.0)
    bonus = 0.0
    if num_tool_calls > 0 and (correct or not config.bonus_requires_correct):
        bonus = config.tool_call_bonus
    penalty = 0.0 if has_answer else config.format_penalty
    info = {
        "correct": correct,
        "answer": response_answer,
        "has_answer": has_answer,
        "base": base,
        "tool_bonus": bonus,
        "format_penalty": penalty,
        "mode": config.mode,
        "check_timed_out": timed_out,
    }
    return base + bonus - penalty, info
