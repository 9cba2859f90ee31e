"""Tool-use evaluation: k sampled episodes per problem, scored by the environment's verifier.

Metrics (n = samples per problem, c = correct samples of a problem, averaged over problems):

    avg@n   = c / n                                   mean accuracy of single samples
    pass@k  = 1 - C(n - c, k) / C(n, k)               unbiased estimator (Chen et al., 2021), k <= n
    maj@n   = 1[the most frequent final answer is correct]   (ties: the answer seen first)

An episode lost to an infrastructure failure after its retries (``finish_reason == "failed"``) is
left out and counted in ``failed_episodes``: its problem is scored on the samples it has (pass@k
over the problems with at least k of them).

Answers vote by equivalence, decided as the reward decides correctness (``envs.rewards.answers_equivalent``:
"070" and "70", ``\\frac12`` and "0.5" are one answer). Every episode samples from its own random
stream, named by (problem id, sample index) and turn (``RolloutRunner.run(episode_keys=...)``), so
the results of a seeded evaluation do not depend on ``batch_size``.

Defaults follow the paper's validation setting: temperature 1.0, top-p 0.7.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from envs.problems import Problem, load_problems
from envs.rewards import answers_equivalent
from envs.rollout import Engine, RolloutRunner, SamplingParams, Tokenizer
from envs.trajectory import Trajectory


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: ``1 - C(n-c, k) / C(n, k)``.

    >>> pass_at_k(4, 1, 1), pass_at_k(4, 1, 4), pass_at_k(4, 0, 2)
    (0.25, 1.0, 0.0)
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def majority_correct(
    answers: Sequence[str | None],
    correct: Sequence[bool],
    *,
    same: Callable[[str, str], bool] | None = None,
) -> bool:
    """Whether the most frequent non-empty answer is correct (ties go to the answer seen first).

    Answers are grouped by ``same(answer, first answer of a group)``; default
    :func:`envs.rewards.answers_equivalent`, the reward's own check. A group is as correct as its
    first answer.

    >>> majority_correct(["3", "5", "5", None], [True, False, False, False])
    False
    >>> majority_correct(["3", "5", None], [True, False, False])
    True
    >>> majority_correct(["070", "5", "70"], [True, False, True])
    True
    """
    same = same or answers_equivalent
    groups: list[tuple[str, int, int]] = []  # (first answer, its index, votes), in order of first sight
    for index, answer in enumerate(answers):
        answer = answer.strip() if answer else None
        if not answer:
            continue
        for g, (first, where, votes) in enumerate(groups):
            if answer == first or same(answer, first):
                groups[g] = (first, where, votes + 1)
                break
        else:
            groups.append((answer, index, 1))
    if not groups:
        return False
    top = max(votes for _, _, votes in groups)
    _, where, _ = next(group for group in groups if group[2] == top)
    return bool(correct[where])


@dataclass
class ProblemResult:
    """All samples of one problem."""

    problem_id: str
    gold: str
    answers: list[str | None] = field(default_factory=list)
    correct: list[bool] = field(default_factory=list)
    tool_calls: list[int] = field(default_factory=list)
    response_tokens: list[int] = field(default_factory=list)
    truncated: list[bool] = field(default_factory=list)
    tool_timeouts: int = 0
    tool_errors: int = 0
    failed: int = 0

    def add(self, trajectory: Trajectory) -> None:
        info = trajectory.info
        if info.get("finish_reason") == "failed":
            self.failed += 1
            return
        self.answers.append(info.get("answer"))
        self.correct.append(bool(info.get("correct", False)))
        self.tool_calls.append(int(info.get("num_tool_calls", 0)))
        self.response_tokens.append(len(trajectory.response_ids))
        self.truncated.append(bool(info.get("truncated", False)))
        for call in info.get("tool_calls", []):
            self.tool_timeouts += bool(call.get("timed_out"))
            self.tool_errors += bool(call.get("error_type"))


@dataclass
class EvalReport:
    """Summary metrics and per-problem results of one evaluation."""

    samples: int
    metrics: dict[str, float]
    problems: list[ProblemResult]
    trajectories: list[Trajectory] = field(default_factory=list, repr=False)  # with keep_trajectories

    def table(self) -> str:
        """The metrics as an aligned two-column text table."""
        width = max(len(k) for k in self.metrics)
        return "\n".join(f"{k:<{width}}  {v:.4f}" for k, v in self.metrics.items())

    def write(self, out_dir: str | Path) -> Path:
        """Write ``results.jsonl`` (one line per problem) and ``summary.json``; return the dir."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "results.jsonl", "w") as f:
            for result in self.problems:
                f.write(json.dumps(asdict(result)) + "\n")
        (out / "summary.json").write_text(json.dumps({"samples": self.samples, **self.metrics}, indent=2))
        return out


def summarize(results: Sequence[ProblemResult], samples: int) -> dict[str, float]:
    """avg@n, pass@k for k in 1, 2, 4, ... <= n, maj@n, and tool-use statistics, over problems."""
    if not results:
        raise ValueError("no problems were evaluated: check the problem source")
    failed = sum(r.failed for r in results)
    results = [r for r in results if r.correct]  # problems with at least one episode played
    if not results:
        raise ValueError(
            f"all {failed} episodes failed in the sandbox infrastructure: run `stare-agent sandbox doctor`"
        )
    n_problems = len(results)
    metrics: dict[str, float] = {
        f"avg@{samples}": sum(sum(r.correct) / len(r.correct) for r in results) / n_problems,
    }
    ks = [2**i for i in range(samples.bit_length()) if 2**i <= samples]
    for k in ks + ([samples] if samples & (samples - 1) else []):  # and n when not a power of two
        scored = [pass_at_k(len(r.correct), sum(r.correct), k) for r in results if len(r.correct) >= k]
        metrics[f"pass@{k}"] = sum(scored) / len(scored) if scored else float("nan")
    metrics[f"maj@{samples}"] = sum(majority_correct(r.answers, r.correct) for r in results) / n_problems
    episodes = [i for r in results for i in range(len(r.correct))]
    n_episodes = len(episodes)
    metrics["tool_calls_per_episode"] = sum(sum(r.tool_calls) for r in results) / n_episodes
    metrics["response_tokens_mean"] = sum(sum(r.response_tokens) for r in results) / n_episodes
    metrics["truncated_fraction"] = sum(sum(r.truncated) for r in results) / n_episodes
    metrics["tool_timeouts_per_episode"] = sum(r.tool_timeouts for r in results) / n_episodes
    metrics["tool_errors_per_episode"] = sum(r.tool_errors for r in results) / n_episodes
    metrics["failed_episodes"] = float(failed)
    return metrics


def evaluate_config(
    config: Any,
    *,
    engine: Engine,
    tokenizer: Tokenizer,
    env_kwargs: dict[str, Any],
    batch_size: int,
    greedy: bool = False,
    problems: Sequence[Problem] | None = None,
    **options: Any,
) -> EvalReport:
    """:func:`evaluate` as a run config says: the one way the trainer, ``stare-agent eval`` and the
    quickstart evaluate.

    ``data.eval`` problems (seeded by ``trainer.seed``, ``data.difficulty``, at most ``data.eval_limit``)
    unless ``problems`` are given; ``data.eval_samples`` episodes per problem at ``data.eval_temperature``
    / ``data.eval_top_p`` (``greedy``: one temperature-0 episode), seeded by ``trainer.seed``; the env
    ``env.id`` with ``env_kwargs`` (the caller adds the pool or the sandbox settings to
    ``env.env_kwargs(evaluation=True)``) and ``env.max_response_tokens``. ``options`` go to
    :func:`evaluate` (``out_dir``, ``progress``, ``keep_trajectories``).
    """
    from stare_agent.trainer import eval_problems

    data, env, seed = config.data, config.env, config.trainer.seed
    if problems is None:
        problems = eval_problems(data.eval, seed=seed, difficulty=data.difficulty, limit=data.eval_limit)
    return evaluate(
        problems,
        engine=engine,
        tokenizer=tokenizer,
        samples=1 if greedy else data.eval_samples,
        sampling=SamplingParams(
            temperature=0.0 if greedy else data.eval_temperature, top_p=data.eval_top_p, seed=seed
        ),
        max_response_tokens=env.max_response_tokens,
        batch_size=batch_size,
        continuous_batching=env.continuous_batching,
        env_id=env.id,
        env_kwargs=env_kwargs,
        **options,
    )


def evaluate(
    problems: Sequence[Problem] | str | Path,
    *,
    engine: Engine,
    tokenizer: Tokenizer,
    samples: int = 4,
    sampling: SamplingParams | None = None,
    max_response_tokens: int = 2048,
    batch_size: int = 16,
    continuous_batching: bool = False,
    limit: int | None = None,
    env_id: str = "stare/CodeInterpreter-v0",
    env_kwargs: dict[str, Any] | None = None,
    out_dir: str | Path | None = None,
    progress: bool = True,
    keep_trajectories: bool = False,
) -> EvalReport:
    """Evaluate a policy with the code tool: ``samples`` episodes per problem.

    Args:
        problems: Problems, or a source for ``envs.problems.load_problems`` (JSONL/Parquet path or hub name).
        engine: Any ``envs.rollout.Engine`` (transformers, SGLang, scripted).
        tokenizer: The policy's Hugging Face tokenizer (its chat template renders the prompts).
        samples: k, the number of sampled episodes per problem.
        sampling: Sampling parameters; default temperature 1.0, top-p 0.7 (the paper's validation setting).
        max_response_tokens: Response budget per episode (model turns and tool output).
        batch_size: Episodes advanced together (one engine call per turn for all of them).
        continuous_batching: Submit each episode's turn on its own to an engine that batches
            continuously (``envs.rollout.RolloutRunner``'s ``continuous``).
        limit: Evaluate only the first ``limit`` problems.
        env_id: Gymnasium id of the ``ToolEnv`` to play (built-in, registered in Python or by an entry
            point; ``module:id`` imports ``module`` first), made by ``stare_agent.config.make_tool_env``
            as in training. ``RunConfig.env`` gives both: ``env_id=cfg.env.id,
            env_kwargs=cfg.env.env_kwargs(evaluation=True)``.
        env_kwargs: Keyword arguments of the env (format, pool, max_turns, ...), over those it was
            registered with; ``sandbox_backend`` / ``sandbox_config`` configure the evaluation's own
            pool when no ``pool`` is given.
        out_dir: When given, per-problem ``results.jsonl`` and ``summary.json`` are written there.
        progress: Show a progress bar.
        keep_trajectories: Return every episode's ``Trajectory`` in ``report.trajectories``.
    """
    if samples < 1 or batch_size < 1:
        raise ValueError(
            f"samples and batch_size must be >= 1, got samples={samples}, batch_size={batch_size}"
        )
    problem_list = list(problems) if not isinstance(problems, (str, Path)) else load_problems(problems)
    problem_list = problem_list[:limit] if limit is not None else problem_list
    sampling = sampling or SamplingParams(temperature=1.0, top_p=0.7)
    results = {p.id: ProblemResult(problem_id=p.id, gold=p.answer) for p in problem_list}
    jobs = [(p, i) for p in problem_list for i in range(samples)]
    runner = RolloutRunner(
        tokenizer,
        engine,
        max_response_tokens=max_response_tokens,
        sampling=sampling,
        continuous=continuous_batching,
    )

    from sandbox import SandboxPool  # the pool is shared by all envs of the evaluation
    from stare_agent.config import check_env_id, make_tool_env

    check_env_id(env_id)
    kwargs = dict(env_kwargs or {})
    own_pool = kwargs.get("pool") is None
    if own_pool:
        kwargs["pool"] = SandboxPool(
            min(batch_size, len(jobs)),
            backend=kwargs.pop("sandbox_backend", "auto"),
            config=kwargs.pop("sandbox_config", None),
        )
    envs = [make_tool_env(env_id, tokenizer=tokenizer, **kwargs) for _ in range(min(batch_size, len(jobs)))]
    bar = _progress(len(jobs), progress)
    kept: list[Trajectory] = []
    try:
        for start in range(0, len(jobs), batch_size):
            chunk = jobs[start : start + batch_size]
            trajectories = runner.run(
                envs[: len(chunk)],
                seeds=[zlib.crc32(f"{p.id}/{i}".encode()) for p, i in chunk],
                options=[{"problem": p} for p, _ in chunk],
                episode_keys=[f"{p.id}/{i}" for p, i in chunk],
            )
            for (problem, _), trajectory in zip(chunk, trajectories, strict=True):
                results[problem.id].add(trajectory)
            if keep_trajectories:
                kept.extend(trajectories)
            if bar is not None:
                bar.update(len(chunk))
    finally:
        if bar is not None:
            bar.close()
        for env in envs:
            env.close()
        if own_pool:
            kwargs["pool"].close()
    ordered = [results[p.id] for p in problem_list]
    report = EvalReport(
        samples=samples, metrics=summarize(ordered, samples), problems=ordered, trajectories=kept
    )
    if out_dir is not None:
        report.write(out_dir)
    return report


def _progress(total: int, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="eval episodes", unit="ep")
