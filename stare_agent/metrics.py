"""Per-step training metrics: rollout statistics and the one step logger of SFT and RL (JSONL, and
TensorBoard / wandb as ``logger.backends`` says)."""

from __future__ import annotations

import collections
import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stare_agent.errors import StareError
from stare_envs.trajectory import Trajectory

# Words whose frequency tracks "reflective" reasoning in RLVR papers (counted case-insensitively,
# as whole words, in the model-written text of each response).
REFLECTION_WORDS = ("wait", "verify", "check", "recheck", "however", "but", "alternatively", "mistake")
_WORD_RE = re.compile(r"\b(" + "|".join(REFLECTION_WORDS) + r")\b", re.IGNORECASE)


def reflection_counts(texts: Sequence[str]) -> dict[str, float]:
    """Mean occurrences per response of each reflection word.

    >>> reflection_counts(["Wait, let me check. wait", "ok"])["wait"]
    1.0
    """
    totals = dict.fromkeys(REFLECTION_WORDS, 0)
    for text in texts:
        for match in _WORD_RE.finditer(text):
            totals[match.group(1).lower()] += 1
    n = max(len(texts), 1)
    return {word: count / n for word, count in totals.items()}


def rollout_metrics(
    trajectories: Sequence[Trajectory], model_texts: Sequence[str] | None = None
) -> dict[str, float]:
    """Reward, accuracy, response length, tool use and reflection statistics of a batch of episodes.

    ``model_texts`` are the decoded model-written parts of each response (for the reflection counts).
    """
    n = len(trajectories)
    if n == 0:
        return {}
    calls = [c for t in trajectories for c in t.info.get("tool_calls", [])]
    metrics = {
        "reward_mean": sum(t.reward for t in trajectories) / n,
        "accuracy": sum(bool(t.info.get("correct")) for t in trajectories) / n,
        "response_length_mean": sum(len(t.response_ids) for t in trajectories) / n,
        "response_length_max": float(max(len(t.response_ids) for t in trajectories)),
        "sampled_tokens_mean": sum(sum(t.loss_mask) for t in trajectories) / n,
        "tool_calls_per_episode": sum(int(t.info.get("num_tool_calls", 0)) for t in trajectories) / n,
        "tool_errors_per_episode": sum(bool(c.get("error_type")) for c in calls) / n,
        "tool_timeouts_per_episode": sum(bool(c.get("timed_out")) for c in calls) / n,
        "truncated_fraction": sum(bool(t.info.get("truncated")) for t in trajectories) / n,
        # answers scored False because their check used up its CPU budget: a bound, not a verdict
        "answer_check_timeouts": float(
            sum(bool(t.info.get("reward_info", {}).get("check_timed_out")) for t in trajectories)
        ),
    }
    if model_texts is not None:
        metrics.update({f"reflection/{k}": v for k, v in reflection_counts(model_texts).items()})
    return metrics


class ToolHealthError(StareError, RuntimeError):
    """Too many episodes were lost to the sandbox infrastructure: the run would go on training without
    its tools and look fine. The message names the share, the cause and the fix."""


@dataclass
class ToolHealth:
    """How a set of episodes used their tools and how the calls ended, counted per kind of fault.

    A failure in the sandbox infrastructure (a sandbox, host or node lost, a container killed from
    outside: :class:`~stare_sandbox.errors.SandboxKilled`, a backend error; our doing) ends its episode's
    attempt, which the rollout runner plays again up to its retries. Such an attempt is either
    *recovered* (a later attempt played the episode to its end: time lost, no data) or part of an
    episode *lost* for good (every attempt failed: the episode, and by default its group, is left
    out of training). Failures of the model's code (its exceptions, a kernel it crashed or ran out
    of memory, its timeouts) are observations, counted in ``code_errors`` and ``timeouts``.

    Attributes:
        episodes: Episodes played (those that failed included).
        calls: Tool calls of the episodes that finished.
        code_errors: Calls whose code raised or crashed its interpreter (the model's doing, an
            observation).
        timeouts: Calls that ran past their time limit.
        infra_failures: Attempts that failed in the sandbox infrastructure: the ``recovered`` ones
            and every attempt of the ``failed_episodes``.
        recovered: Attempts that failed in the infrastructure and whose episode was then played to
            its end on a retry.
        failed_episodes: Episodes lost to the infrastructure: every attempt failed there.
        void_turns: Episodes that ended on a model turn with neither a tool call nor an answer.
        last_failure: The cause of the last failed episode ("" when none failed).
    """

    episodes: int = 0
    calls: int = 0
    code_errors: int = 0
    timeouts: int = 0
    infra_failures: int = 0
    recovered: int = 0
    failed_episodes: int = 0
    void_turns: int = 0
    last_failure: str = ""

    @classmethod
    def of(cls, trajectories: Iterable[Trajectory]) -> ToolHealth:
        """The counts of ``trajectories`` (as the rollout runner builds them: ``info["retries"]`` failed
        attempts before the last, ``finish_reason == "failed"`` when the last failed too)."""
        health = cls()
        for trajectory in trajectories:
            info = trajectory.info
            retries = int(info.get("retries", 0))
            health.episodes += 1
            health.infra_failures += retries
            if info.get("finish_reason") == "failed":
                health.failed_episodes += 1
                health.infra_failures += 1
                health.last_failure = str(info.get("failed", ""))
                continue
            health.recovered += retries
            calls = info.get("tool_calls", [])
            health.calls += len(calls)
            health.timeouts += sum(bool(c.get("timed_out")) for c in calls)
            health.code_errors += sum(bool(c.get("error_type")) and not c.get("timed_out") for c in calls)
            health.void_turns += trajectory.void_turn
        return health

    @property
    def infra_error_rate(self) -> float:
        """Infrastructure failures per attempted call (the calls that ran and the attempts that failed)."""
        attempts = self.calls + self.infra_failures
        return self.infra_failures / attempts if attempts else 0.0

    @property
    def lost_fraction(self) -> float:
        """Episodes lost to the infrastructure per episode played."""
        return self.failed_episodes / self.episodes if self.episodes else 0.0

    def metrics(self) -> dict[str, float]:
        """Per-step metrics: ``tools/...`` (fractions of calls, void turns and lost episodes per episode,
        and the counts of failed, recovered and lost)."""
        calls, episodes = max(self.calls, 1), max(self.episodes, 1)
        return {
            "tools/calls_per_episode": self.calls / episodes,
            "tools/code_error_fraction": self.code_errors / calls,
            "tools/timeout_fraction": self.timeouts / calls,
            "tools/infra_error_fraction": self.infra_error_rate,
            "tools/infra_failures": float(self.infra_failures),
            "tools/infra_recovered": float(self.recovered),
            "tools/infra_lost": float(self.failed_episodes),
            "tools/infra_lost_fraction": self.lost_fraction,
            "tools/void_turn_fraction": self.void_turns / episodes,
        }

    def line(self) -> str:
        """One line for a person: the counts behind ``metrics``.

        >>> print(ToolHealth(episodes=4, calls=10, code_errors=2, timeouts=1, infra_failures=1, recovered=1).line())
        tool health: 10 calls in 4 episodes (2.5 per episode): 2 raised in the model's code (20.0%), 1 timed out (10.0%); 1 attempt failed in the sandbox infrastructure (9.1% of attempts): 1 recovered on a retry, 0 episodes lost (0.0%); 0 void turns (0.0% of episodes)
        """
        calls, episodes = max(self.calls, 1), max(self.episodes, 1)
        return (
            f"tool health: {self.calls} calls in {self.episodes} episodes ({self.calls / episodes:.1f} per "
            f"episode): {self.code_errors} raised in the model's code ({self.code_errors / calls:.1%}), "
            f"{self.timeouts} timed out ({self.timeouts / calls:.1%}); {self.infra_failures} "
            f"attempt{'' if self.infra_failures == 1 else 's'} failed in the sandbox infrastructure "
            f"({self.infra_error_rate:.1%} of attempts): {self.recovered} recovered on a retry, "
            f"{self.failed_episodes} episodes lost ({self.lost_fraction:.1%}); {self.void_turns} void turns "
            f"({self.void_turns / episodes:.1%} of episodes)"
        )


ALARM_SIGNIFICANCE = 1e-3
"""How unlikely the window's lost episodes must be at a true share of ``max_rate`` for the alarm to stop
a run: the chance that a run whose infrastructure loses exactly that share is stopped at a given step."""


class ToolHealthAlarm:
    """Stops a run that loses its episodes to the sandbox infrastructure: over the last ``window``
    steps, the share of episodes lost (every attempt failed there) must not exceed ``max_rate`` by
    more than chance explains.

    Attempts that failed and then recovered on a retry cost time, not data: they are logged
    (``tools/infra_recovered``), never counted here, so a lost host whose episodes all recovered
    elsewhere stops nothing. The minimum sample is a one-sided binomial test: with ``L`` of ``N``
    episodes lost in the window, the run stops when ``L > max_rate * N`` and the chance of ``L`` or
    more at a true share of ``max_rate`` is below ``significance``. A small run is not stopped by a
    loss or two, a large one close to ``max_rate``; at ``max_rate`` 0.05 it takes 3 of 3, 4 of 8, 8 of
    40, 43 of 512 or 164 of 2,560 lost episodes (computed with :func:`binomial_tail`). ``max_rate``
    0 stops at the first lost episode, 1 never.

    Args:
        max_rate: ``trainer.max_infra_error_rate``.
        window: Steps the share is taken over (``trainer.infra_error_window``).
        significance: ``ALARM_SIGNIFICANCE`` unless told otherwise.
    """

    def __init__(self, max_rate: float, window: int, *, significance: float = ALARM_SIGNIFICANCE) -> None:
        self.max_rate, self.window, self.significance = max_rate, window, significance
        self._steps: collections.deque[ToolHealth] = collections.deque(maxlen=window)

    def observe(self, step: int, health: ToolHealth) -> None:
        """Add one step's counts.

        Raises:
            ToolHealthError: the window lost more episodes than ``max_rate`` and chance explain.
        """
        self._steps.append(health)
        lost = sum(h.failed_episodes for h in self._steps)
        episodes = sum(h.episodes for h in self._steps)
        if (
            lost <= self.max_rate * episodes
            or binomial_tail(episodes, lost, self.max_rate) >= self.significance
        ):
            return
        recovered = sum(h.recovered for h in self._steps)
        last = next((h.last_failure for h in reversed(self._steps) if h.last_failure), "")
        cause = f" (last: {last})" if last else ""
        raise ToolHealthError(
            f"step {step}: {lost} of {episodes} episodes over the last {len(self._steps)} steps "
            f"({lost / episodes:.1%}) were lost to the sandbox infrastructure (every attempt failed; "
            f"{recovered} other failed attempts recovered on a retry): above "
            f"trainer.max_infra_error_rate={self.max_rate:g} beyond chance{cause}: the run would train without "
            "its tools; fix the sandboxes (`stare-agent sandbox doctor`; with sandbox.backend=ray, `ray status` "
            "and the sandbox nodes' Docker) and continue with `stare-agent train --resume`, or raise "
            "trainer.max_infra_error_rate"
        )


def binomial_tail(n: int, k: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p), summed in log space (exact to float precision for any n).

    >>> round(binomial_tail(8, 4, 0.05), 5), binomial_tail(8, 0, 0.05), binomial_tail(3, 1, 0.0)
    (0.00037, 1.0, 0.0)
    """
    if k <= 0:
        return 1.0
    if k > n or p <= 0.0:
        return 0.0
    if p >= 1.0:
        return 1.0
    log_p, log_q = math.log(p), math.log1p(-p)
    terms = (
        math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * log_p + (n - i) * log_q
        for i in range(k, n + 1)
    )
    return min(1.0, sum(math.exp(t) for t in terms))


def policy_entropy(
    model: Any, trajectories: Sequence[Trajectory], pad_id: int, *, batch_size: int = 8
) -> float:
    """Mean full-vocabulary entropy of ``model`` over the model-written (mask-1) tokens of trajectories.

    The same quantity as the STARE gate's Hbar, for a policy outside training (e.g. before/after tables).
    The LM head runs on model tokens only, a batch's common prompt prefix (the system prompt) once, and
    the batches take trajectories of similar length (longest first), so little of them is padding.
    """
    import torch

    from stare_agent.algorithms.logprobs import score_tokens
    from stare_agent.train.batch import collate, shared_prefix_length

    total, count = 0.0, 0.0
    device = next(model.parameters()).device
    by_length = sorted(trajectories, key=lambda t: -t.num_tokens)  # a mean over tokens: order-free
    with torch.no_grad():
        for start in range(0, len(by_length), batch_size):
            rows = by_length[start : start + batch_size]
            batch = collate(rows, pad_id, device)
            mask = batch["response_mask"]
            _, entropy = score_tokens(
                model,
                batch["input_ids"],
                batch["attention_mask"],
                mask.bool(),
                prompt_length=shared_prefix_length(rows),
            )
            total += float((entropy.float() * mask).sum())
            count += float(mask.sum())
    return total / count if count else float("nan")


class StepLogger:
    """The one step logger of SFT and RL: one JSON object per step appended to ``run_dir/filename``,
    scalars mirrored to each tracker of ``backends``: ``tensorboard`` (``run_dir/tensorboard/<job_type>``,
    so SFT and RL in one run directory stay apart) and ``wandb``.

    The JSONL file is flushed at every step, so a killed run loses nothing it logged. A wandb run's
    id is derived from the run directory and ``job_type``, so a resumed run continues the same one.

    Args:
        run_dir: The run directory.
        filename: ``metrics.jsonl`` (RL) or ``sft_log.jsonl`` (SFT).
        backends: Trackers besides the JSONL file.
        job_type: ``rl`` or ``sft``: the TensorBoard subdirectory, the wandb job type and part of its run id.
        config: The run's :class:`~stare_agent.config.RunConfig`, recorded by wandb; its ``logger``
            section names the project, run name and mode.
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        filename: str = "metrics.jsonl",
        backends: Sequence[str] = ("tensorboard",),
        job_type: str = "rl",
        config: Any = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._file = open(self.run_dir / filename, "a")
        self._tb: Any = None
        self._wandb: Any = None
        if "tensorboard" in backends:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.run_dir / "tensorboard" / job_type))
        if "wandb" in backends:
            self._wandb = _start_wandb(self.run_dir, job_type, config)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(json_ready(record), allow_nan=False) + "\n")
        self._file.flush()
        scalars = {
            k: v for k, v in record.items() if k != "step" and isinstance(v, int | float) and math.isfinite(v)
        }
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def __enter__(self) -> StepLogger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _start_wandb(run_dir: Path, job_type: str, config: Any) -> Any:
    try:
        import wandb
    except ImportError:
        raise ImportError(
            "logger.backends has wandb, which is not installed: pip install 'stare-agent[wandb]', "
            "or drop wandb from logger.backends"
        ) from None
    import dataclasses
    import hashlib

    section = config.logger if config is not None else None
    key = f"{run_dir.resolve()}/{job_type}".encode()
    return wandb.init(
        project=section.project if section else "stare-agent",
        name=(section.name if section and section.name else run_dir.name),
        job_type=job_type,
        dir=str(run_dir),
        mode=section.wandb_mode if section else "offline",
        id=hashlib.blake2b(key, digest_size=8).hexdigest(),
        resume="allow",
        config=dataclasses.asdict(config) if config is not None else None,
    )


def json_ready(value: Any) -> Any:
    """``value`` with every NaN or infinity (in nested dicts and lists too) replaced by ``None``: strict
    JSON has no NaN, and ``json.dumps`` would write a bare ``NaN`` that strict parsers reject.

    >>> json_ready({"entropy": float("nan"), "H": [0.5, float("inf")]})
    {'entropy': None, 'H': [0.5, None]}
    """
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_ready(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_ready(v) for v in value]
    return value


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The logged steps of a run, last record per step winning (a resumed run may re-log a step).

    A value logged as ``null`` (a number that was NaN: a skipped step's entropy) reads as NaN, as do
    the bare ``NaN`` of files written before nulls. A cut last line (a killed writer) is left out.

    Raises:
        FileNotFoundError: no ``metrics.jsonl``.
        MetricsError: a line before the last is not a record."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: pass the run directory of a `stare-agent train` run")
    by_step: dict[int, dict[str, Any]] = {}
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    for n, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
            step = int(record["step"])
        except (ValueError, KeyError, TypeError):
            if n == len(lines):  # a writer killed mid-line: the steps before it stand
                break
            raise MetricsError(
                f"{path}:{n} is not a metrics record: the file is damaged; move it aside to start the run "
                "over, or delete that line"
            ) from None
        by_step[step] = {k: math.nan if v is None else v for k, v in record.items()}
    return [by_step[s] for s in sorted(by_step)]


class MetricsError(StareError, ValueError):
    """A metrics file that cannot be read or holds nothing to show; the message names the fix."""


def gate_fraction(steps: list[dict[str, Any]]) -> tuple[float | None, int]:
    """The fraction of trained RL steps with the STARE gate on, and the number of steps that trained
    nothing (``skipped``: no group with reward variance, or a non-finite loss): such a step has no gate
    (the trainer logs gate_on NaN there), so it counts neither as on nor as off. ``None`` when no step
    trained."""
    trained = [r for r in steps if not r.get("skipped")]
    if not trained:
        return None, len(steps)
    return sum(float(r.get("gate_on", 0)) for r in trained) / len(trained), len(steps) - len(trained)


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, bool):
        return int(value)
    return value
