"""The evaluation's progress bar: turns, tokens and a bound on the time left while long episodes run."""

from __future__ import annotations

import time
from typing import Any

from stare_envs.rollout import RolloutProgress


class EvalProgress:
    """The progress bar's turns, tokens and time left while long episodes run (the episode count alone
    stays at 0 for the whole first batch). Time left is an upper bound: the response budget the
    unfinished episodes may still take, at the tokens per second so far."""

    def __init__(self, bar: Any, jobs: int, budget: int) -> None:
        self.bar, self.jobs, self.budget = bar, jobs, budget
        self.start = time.perf_counter()
        self.done_jobs = self.done_tokens = self.turns = 0
        self.postfix: dict[str, Any] = {}

    def turn(self, now: RolloutProgress) -> None:
        tokens = self.done_tokens + now.response_tokens
        elapsed = time.perf_counter() - self.start
        rate = tokens / elapsed if elapsed > 0 else 0.0
        unstarted = self.jobs - self.done_jobs - now.episodes
        left = now.budget_left + unstarted * self.budget
        postfix = {"turns": self.turns + now.turns, "tokens": f"{tokens:,}", "tok/s": f"{rate:.0f}"}
        if rate > 0:
            postfix["at most left"] = _duration(left / rate)
        self.postfix = postfix
        self.bar.set_postfix(postfix, refresh=True)

    def chunk_done(self, jobs: int, tokens: int, turns: int) -> None:
        self.done_jobs += jobs
        self.done_tokens += tokens
        self.turns += turns
        if self.done_jobs >= self.jobs and self.postfix:  # finished: no time is left to bound
            self.postfix.pop("at most left", None)
            self.bar.set_postfix(self.postfix, refresh=True)


def _duration(seconds: float) -> str:
    minutes, s = divmod(int(seconds), 60)
    hours, m = divmod(minutes, 60)
    return f"{hours}h{m:02d}m" if hours else f"{m}m{s:02d}s"


def progress_bar(total: int, enabled: bool) -> Any:
    """The episodes' tqdm bar, or None when not ``enabled``."""
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="eval episodes", unit="ep")
