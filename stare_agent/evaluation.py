"""Tool-use evaluation: k sampled episodes per problem, scored by the environment's verifier.

Metrics (n = samples per problem, c = correct samples of a problem, averaged over problems):

    avg@n   = c / n                                   mean accuracy of single samples
    pass@k  = 1 - C(n - c, k) / C(n, k)               unbiased estimator (Chen et al., 2021), k <= n
    maj@n   = 1[the most frequent final answer is correct]   (ties: the answer seen first)

An episode lost to an infrastructure failure after its retries (``finish_reason == "failed"``) is
left out and counted in ``failed_episodes``: its problem is scored on the samples it has (pass@k
over the problems with at least k of them).

Answers vote by equivalence, decided as the reward decides correctness (``stare_envs.rewards.answers_equivalent``:
"070" and "70", ``\\frac12`` and "0.5" are one answer). Every episode samples from its own random
stream, named by (problem id, sample index) and turn (``RolloutRunner.run(episode_keys=...)``), so
the results of a seeded evaluation do not depend on ``batch_size``.

Each of avg@n, pass@k and maj@n comes with a 95 % interval over problems (``stare_agent.intervals``),
and ``summary.json`` records the settings that produced them (``stare_agent.provenance``). With an
``out_dir``, problems are written as they finish, so an interrupted evaluation resumes where it stopped.

Defaults follow the paper's validation setting: temperature 1.0, top-p 0.7.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from stare_agent import run_dirs
from stare_agent.eval_files import (
    EPISODES_FILE,
    RESULTS_FILE,
    SUMMARY_FILE,
    EvaluationError,
    append_run,
    check_resume,
    plain_setting,
    replace_file,
)
from stare_agent.eval_progress import EvalProgress, progress_bar
from stare_agent.intervals import BOOTSTRAP_DRAWS, score_interval, wilson_interval
from stare_agent.metrics import ToolHealth, json_ready
from stare_envs.engine import Engine, SamplingParams, Tokenizer
from stare_envs.problems import Problem, ProblemSourceError
from stare_envs.problems.selection import eval_problems
from stare_envs.registry import registered_problems
from stare_envs.rewards import answers_equivalent
from stare_envs.rollout import RolloutRunner
from stare_envs.trajectory import Trajectory


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
    :func:`stare_envs.rewards.answers_equivalent`, the reward's own check. A group is as correct as its
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
    infra_failures: int = 0
    infra_recovered: int = 0
    void_turns: int = 0
    check_timeouts: int = 0

    def add(self, trajectory: Trajectory) -> None:
        info = trajectory.info
        self.infra_failures += int(info.get("retries", 0))  # attempts lost to the infrastructure
        if info.get("finish_reason") == "failed":
            self.failed += 1
            self.infra_failures += 1
            return
        self.infra_recovered += int(info.get("retries", 0))  # failed attempts the episode recovered from
        self.void_turns += bool(info.get("void_turn"))
        self.check_timeouts += bool(info.get("reward_info", {}).get("check_timed_out"))
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
    """Summary metrics, their 95 % intervals, the settings that produced them, and per-problem results."""

    samples: int
    metrics: dict[str, float]
    problems: list[ProblemResult]
    trajectories: list[Trajectory] = field(default_factory=list, repr=False)  # with keep_trajectories
    intervals: dict[str, tuple[float, float]] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)
    run: dict[str, Any] = field(default_factory=dict)
    """How this call ran: its command, start (UTC), package versions, git commit and wall seconds
    (``stare_agent.provenance.run_record``), appended to ``run.json`` beside ``summary.json``; apart from
    ``settings`` and the summary, which a resume must reproduce byte for byte."""

    def table(self) -> str:
        """The main settings, then the metrics as an aligned table with their 95 % intervals."""
        width = max(len(k) for k in self.metrics)
        rows = []
        for key, value in self.metrics.items():
            lo, hi = self.intervals.get(key, (None, None))
            rows.append(
                f"{key:<{width}}  {value:.4f}" + (f"  [{lo:.4f}, {hi:.4f}]" if lo is not None else "")
            )
        return "\n".join([*settings_lines(self.settings), *rows, self.tool_health().line()])

    def tool_health(self) -> ToolHealth:
        """How the episodes' tool calls ended, as the trainer logs it per step."""
        problems = self.problems
        timeouts = sum(r.tool_timeouts for r in problems)
        return ToolHealth(
            episodes=sum(len(r.correct) + r.failed for r in problems),
            calls=sum(sum(r.tool_calls) for r in problems),
            code_errors=sum(r.tool_errors for r in problems) - timeouts,  # a timeout's error is "Timeout"
            timeouts=timeouts,
            infra_failures=sum(r.infra_failures for r in problems),
            recovered=sum(r.infra_recovered for r in problems),
            failed_episodes=sum(r.failed for r in problems),
            void_turns=sum(r.void_turns for r in problems),
        )

    def summary(self, *, complete: bool = True) -> dict[str, Any]:
        """``summary.json``'s content: the metrics at the top level, ``ci95`` (metric -> [low, high]),
        ``complete`` (False for an interrupted evaluation) and ``settings``. In the file a metric that
        is not a number (pass@k where no problem kept k samples) is null."""
        return {
            "samples": self.samples,
            **self.metrics,
            "ci95": {k: list(v) for k, v in self.intervals.items()},
            "ci95_method": INTERVAL_METHOD,
            "complete": complete,
            "problems_evaluated": len(self.problems),
            "settings": self.settings,
        }

    def write(self, out_dir: str | Path) -> Path:
        """Write ``results.jsonl`` (one line per problem, in problem order) and ``summary.json``; return
        the dir. Each file is replaced whole (written beside it, then renamed)."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        replace_file(out / RESULTS_FILE, "".join(json.dumps(asdict(r)) + "\n" for r in self.problems))
        replace_file(
            out / SUMMARY_FILE,
            json.dumps(json_ready(self.summary()), indent=2, default=str, allow_nan=False) + "\n",
        )
        append_run(out, self.run, complete=True)
        return out


INTERVAL_METHOD = (
    "95 % interval over problems: Wilson where a problem's score is one 0/1 outcome (one sample per "
    f"problem; maj@k), else a percentile bootstrap over problems ({BOOTSTRAP_DRAWS} draws, seeded by "
    "the sampling seed)"
)


def settings_lines(settings: dict[str, Any]) -> list[str]:
    """The main settings as the lines printed above the metrics table (none when there are none)."""
    if not settings:
        return []
    lines = []
    model, engine = settings.get("model") or {}, settings.get("engine") or {}
    if model:
        ident = model.get("sha256") or model.get("revision")
        lines.append(f"model: {model.get('name_or_path')}" + (f" ({str(ident)[:12]})" if ident else ""))
    data = settings.get("data") or {}
    if data:
        lines.append(
            f"data: {data.get('source') or 'given problems'}, {data.get('problems')} problems "
            f"(sha256 {str(data.get('sha256'))[:12]})"
        )
    sampling = settings.get("sampling") or {}
    lines.append(
        f"sampling: {settings.get('samples')} per problem, temperature {sampling.get('temperature')}, "
        f"top-p {sampling.get('top_p')}, seed {sampling.get('seed')}, "
        f"max response tokens {settings.get('max_response_tokens')}"
    )
    env = settings.get("env") or {}
    sandbox = settings.get("sandbox") or {}
    lines.append(f"env: {env.get('id')}, sandbox: {sandbox.get('backend')}")
    if engine:
        detail = ", ".join(
            f"{k} {engine[k]}" for k in ("vllm_version", "dtype", "autocast_dtype", "device") if engine.get(k)
        )
        lines.append(f"engine: {engine.get('kind')}" + (f" ({detail})" if detail else ""))
    return [*lines, ""]


def summarize(results: Sequence[ProblemResult], samples: int) -> dict[str, float]:
    """avg@n, pass@k for k in 1, 2, 4, ... <= n, maj@n, and tool-use statistics, over problems."""
    return summarize_with_intervals(results, samples)[0]


def summarize_with_intervals(
    results: Sequence[ProblemResult], samples: int, *, seed: int = 0
) -> tuple[dict[str, float], dict[str, tuple[float, float]]]:
    """:func:`summarize`'s metrics and the 95 % interval of avg@n, each pass@k and maj@n over problems:
    Wilson where each problem's score is one 0/1 outcome (one sample per problem; maj@n always), else
    a percentile bootstrap over problems seeded by ``seed`` (``stare_agent.intervals``)."""
    if not results:
        raise ValueError("no problems were evaluated: check the problem source")
    failed = sum(r.failed for r in results)
    results = [r for r in results if r.correct]  # problems with at least one episode played
    if not results:
        raise ValueError(
            f"all {failed} episodes failed in the sandbox infrastructure: run `stare-agent sandbox doctor`"
        )
    scores: dict[str, list[float]] = {f"avg@{samples}": [sum(r.correct) / len(r.correct) for r in results]}
    ks = [2**i for i in range(samples.bit_length()) if 2**i <= samples]
    for k in ks + ([samples] if samples & (samples - 1) else []):  # and n when not a power of two
        scores[f"pass@{k}"] = [
            pass_at_k(len(r.correct), sum(r.correct), k) for r in results if len(r.correct) >= k
        ]
    scores[f"maj@{samples}"] = [float(majority_correct(r.answers, r.correct)) for r in results]
    metrics: dict[str, float] = {}
    intervals: dict[str, tuple[float, float]] = {}
    for key, values in scores.items():
        metrics[key] = sum(values) / len(values) if values else float("nan")
        if not values:
            continue
        if samples == 1 or key.startswith("maj@"):  # one 0/1 outcome per problem: a binomial count
            intervals[key] = wilson_interval(round(sum(values)), len(values))
        else:
            intervals[key] = score_interval(values, seed=seed)
    n_episodes = sum(len(r.correct) for r in results)
    metrics["tool_calls_per_episode"] = sum(sum(r.tool_calls) for r in results) / n_episodes
    metrics["response_tokens_mean"] = sum(sum(r.response_tokens) for r in results) / n_episodes
    metrics["truncated_fraction"] = sum(sum(r.truncated) for r in results) / n_episodes
    metrics["tool_timeouts_per_episode"] = sum(r.tool_timeouts for r in results) / n_episodes
    metrics["tool_errors_per_episode"] = sum(r.tool_errors for r in results) / n_episodes
    metrics["failed_episodes"] = float(failed)
    # scored False because the answer's check used up its CPU budget: a bound, not a verdict
    metrics["answer_check_timeouts"] = float(sum(r.check_timeouts for r in results))
    return metrics, intervals


def evaluate_config(
    config: Any,
    *,
    engine: Engine,
    tokenizer: Tokenizer,
    batch_size: int,
    pool: Any = None,
    greedy: bool = False,
    problems: Sequence[Problem] | None = None,
    **options: Any,
) -> EvalReport:
    """:func:`evaluate` as a run config says: the one way the trainer, ``stare-agent eval`` and the
    quickstart evaluate.

    ``data.eval`` problems (else the env's registered ones: ``stare_agent.resources.eval_source``; seeded
    by ``trainer.seed``, ``data.difficulty``, at most ``data.eval_limit``) unless ``problems`` are given;
    ``data.eval_samples`` episodes per problem at ``data.eval_temperature`` / ``data.eval_top_p``
    (``greedy``: one temperature-0 episode), seeded by ``trainer.seed``; the env ``env.id`` with
    ``env.env_kwargs(evaluation=True)`` and ``env.max_response_tokens``; sandboxes leased from ``pool``,
    else from one of ``batch_size`` this call builds from the ``sandbox`` section
    (``stare_agent.resources.open_sandboxes``) and closes. ``options`` go to :func:`evaluate` (``out_dir``,
    ``resume``, ``save_episodes``, ``progress``, ``keep_trajectories``; ``settings``, e.g. the model's
    identity, join the data source and sandbox limits the config gives).
    """
    from stare_agent.resources import eval_source, open_sandboxes
    from stare_envs.problems import eval_problems
    from stare_envs.registry import env_needs_sandbox

    data, env, seed = config.data, config.env, config.trainer.seed
    source = eval_source(config)  # data.eval, else the problems env.id was registered with
    if problems is None:
        problems = eval_problems(source, seed=seed, difficulty=data.difficulty, limit=data.eval_limit)
    samples = 1 if greedy else data.eval_samples
    # an env whose tools run no code leases nothing: no pool, and no Docker needed
    own_pool = pool is None and env_needs_sandbox(env.id, **env.env_kwargs(evaluation=True))
    if own_pool:
        pool = open_sandboxes(config.sandbox, max(min(batch_size, len(problems) * samples), 1))
    try:
        return evaluate(
            problems,
            engine=engine,
            tokenizer=tokenizer,
            samples=samples,
            sampling=SamplingParams(
                temperature=0.0 if greedy else data.eval_temperature, top_p=data.eval_top_p, seed=seed
            ),
            max_response_tokens=env.max_response_tokens,
            batch_size=batch_size,
            continuous_batching=env.continuous_batching,
            env_id=env.id,
            env_kwargs={**env.env_kwargs(evaluation=True), "pool": pool},
            settings={
                "data": {
                    "source": source if isinstance(source, str) else data.eval,
                    "difficulty": data.difficulty,
                    "limit": data.eval_limit,
                },
                "sandbox": {"limits": config.sandbox.limits},
                **options.pop("settings", {}),
            },
            **options,
        )
    finally:
        if own_pool and pool is not None:
            pool.close()


def evaluate(
    problems: Sequence[Problem] | str | Path | None = None,
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
    resume: bool = False,
    overwrite: bool = False,
    save_episodes: bool = False,
    settings: dict[str, Any] | None = None,
    progress: bool = True,
    keep_trajectories: bool = False,
) -> EvalReport:
    """Evaluate a policy with the code tool: ``samples`` episodes per problem.

    With ``out_dir``, each problem's line goes to ``results.jsonl`` as soon as its last sample finishes;
    an interrupt writes a partial ``summary.json`` (``"complete": false``) before it propagates, and
    ``resume=True`` continues from ``results.jsonl``. Every episode samples from the stream its (problem
    id, sample index) names, so a resumed evaluation's summary equals an uninterrupted one's.

    Args:
        problems: Problems, a source as ``data.eval`` takes it (a JSONL/Parquet file, a built-in set such
            as ``aime2024``, a hub name, or a procedural family such as ``mixed`` or a registered
            ``unit_conversion``, generated from a held-out seed: the sampling seed), or None for the
            problems ``env_id`` was registered with (``register_tool_env(..., problems=...)``).
        engine: Any ``stare_envs.engine.Engine`` (transformers, SGLang, scripted).
        tokenizer: The policy's Hugging Face tokenizer (its chat template renders the prompts).
        samples: k, the number of sampled episodes per problem.
        sampling: Sampling parameters; default temperature 1.0, top-p 0.7 (the paper's validation setting).
            Without a seed of its own it gets seed 0, the default of ``trainer.seed`` that
            ``stare-agent eval`` uses: two evaluations give the same tokens unless told otherwise. The
            seed is in ``report.settings["sampling"]`` and ``summary.json``.
        max_response_tokens: Response budget per episode (model turns and tool output).
        batch_size: Episodes advanced together (one engine call per turn for all of them).
        continuous_batching: Submit each episode's turn on its own to an engine that batches
            continuously (``stare_envs.rollout.RolloutRunner``'s ``continuous``).
        limit: Evaluate only the first ``limit`` problems.
        env_id: Gymnasium id of the ``ToolEnv`` to play (built-in, registered in Python or by an entry
            point; ``module:id`` imports ``module`` first), made by ``stare_envs.registry.make_tool_env``
            as in training (``evaluate_config`` plays a run config's).
        env_kwargs: Keyword arguments of the env (format, pool, max_turns, ...), over those it was
            registered with. Without a ``pool`` (shared by all the envs: ``stare_sandbox.open_pool``), each
            env leases from a private pool of one of its ``sandbox_backend`` (``auto`` resolved here,
            once) and ``sandbox_config``.
        out_dir: When given, per-problem ``results.jsonl`` and ``summary.json`` are written there.
        overwrite: Delete the evaluation ``out_dir`` holds first; without it (or ``resume``) such an
            ``out_dir`` is refused (``stare_agent.run_dirs``), as is one another process writes.
        resume: Continue the evaluation whose ``results.jsonl`` is in ``out_dir`` (same problems,
            samples and sampling; a different setting stops with the settings that differ).
        save_episodes: Also write ``episodes.jsonl`` to ``out_dir``: each episode's decoded text turn by
            turn (the model's turn, the tool calls parsed from it, the tool output), one line per episode.
        settings: What produced the evaluation beyond what ``evaluate`` sees (the model's identity, the
            data source's name), merged into ``report.settings`` and ``summary.json``.
        progress: Show a progress bar.
        keep_trajectories: Return every episode's ``Trajectory`` in ``report.trajectories`` (with
            ``resume``, those of the problems played by this call).
    """
    if samples < 1 or batch_size < 1:
        raise ValueError(
            f"samples and batch_size must be >= 1, got samples={samples}, batch_size={batch_size}"
        )
    if (resume or save_episodes) and out_dir is None:
        raise ValueError("resume and save_episodes need out_dir: the directory of results.jsonl")
    claim = contextlib.ExitStack()  # one process per out_dir, and no evaluation in it replaced unasked
    if out_dir is not None:
        claim.enter_context(run_dirs.locked(out_dir, "out_dir"))
        try:
            run_dirs.check_evaluation(Path(out_dir), resume=resume, overwrite=overwrite)
        except BaseException:
            claim.close()
            raise
    with claim:
        return _evaluate(
            problems=problems,
            engine=engine,
            tokenizer=tokenizer,
            samples=samples,
            sampling=sampling,
            max_response_tokens=max_response_tokens,
            batch_size=batch_size,
            continuous_batching=continuous_batching,
            limit=limit,
            env_id=env_id,
            env_kwargs=env_kwargs,
            out_dir=out_dir,
            resume=resume,
            save_episodes=save_episodes,
            settings=settings,
            progress=progress,
            keep_trajectories=keep_trajectories,
        )


def _problem_list(
    problems: Sequence[Problem] | str | Path | None,
    env_id: str,
    *,
    seed: int,
    difficulty: int,
    limit: int | None,
) -> tuple[list[Problem], str | None]:
    """:func:`evaluate`'s problems resolved as ``data.eval`` is (None: the env's registered ones), and the
    source's name (None for a list)."""
    if problems is None:  # the env's own, as a config with data.eval unset takes them
        problems = registered_problems(env_id)
        if problems is None:
            raise ProblemSourceError(
                f"{env_id} was registered without problems: pass problems= (a list, a problem file, a built-in "
                "set such as aime2024, or a procedural family such as mixed)"
            )
    if isinstance(problems, Path):
        problems = str(problems)
    source = problems if isinstance(problems, str) else None
    return eval_problems(problems, seed=seed, difficulty=difficulty, limit=limit), source


def _evaluate(
    problems: Sequence[Problem] | str | Path | None,
    *,
    engine: Engine,
    tokenizer: Tokenizer,
    samples: int,
    sampling: SamplingParams | None,
    max_response_tokens: int,
    batch_size: int,
    continuous_batching: bool,
    limit: int | None,
    env_id: str,
    env_kwargs: dict[str, Any] | None,
    out_dir: str | Path | None,
    resume: bool,
    save_episodes: bool,
    settings: dict[str, Any] | None,
    progress: bool,
    keep_trajectories: bool,
) -> EvalReport:
    """:func:`evaluate`, its ``out_dir`` held."""
    from stare_agent.provenance import run_record

    started, record = time.perf_counter(), run_record()
    sampling = sampling or SamplingParams(temperature=1.0, top_p=0.7)
    if sampling.seed is None:  # seeded by default, as `stare-agent eval` is (trainer.seed: 0)
        sampling = replace(sampling, seed=0)
    kwargs = dict(env_kwargs or {})
    problem_list, source = _problem_list(
        problems, env_id, seed=sampling.seed or 0, difficulty=kwargs.get("difficulty", 1), limit=limit
    )
    from stare_envs.registry import env_needs_sandbox

    # resolved once: the settings name the pool's backend
    if kwargs.get("pool") is None and env_needs_sandbox(env_id, **kwargs):
        from stare_sandbox import resolve_backend

        kwargs["sandbox_backend"] = resolve_backend(
            kwargs.get("sandbox_backend", "auto"), kwargs.get("sandbox_config")
        )
    report_settings = _settings(
        settings or {}, problem_list, source, samples, sampling, max_response_tokens, env_id, kwargs, engine
    )
    out = Path(out_dir) if out_dir is not None else None
    done = _resume(out, problem_list, samples, report_settings) if resume and out is not None else {}
    results = {p.id: done.get(p.id) or ProblemResult(problem_id=p.id, gold=p.answer) for p in problem_list}
    todo = [p for p in problem_list if p.id not in done]
    if resume:
        print(f"resuming {out}: {len(done)} of {len(problem_list)} problems finished, {len(todo)} to play")
    jobs = [(p, i) for p in todo for i in range(samples)]
    kept: list[Trajectory] = []
    files = _ResultFiles(out, append=resume, episodes=save_episodes, tokenizer=tokenizer)
    try:
        if jobs:
            _play(jobs, results, files, kept if keep_trajectories else None, engine=engine,
                  tokenizer=tokenizer, sampling=sampling, max_response_tokens=max_response_tokens,
                  batch_size=batch_size, continuous_batching=continuous_batching, env_id=env_id,
                  kwargs=kwargs, samples=samples, progress=progress)  # fmt: skip
    except (KeyboardInterrupt, SystemExit):  # Ctrl-C, or SIGTERM through the sandbox pool's handler
        files.close()
        finished = [results[p.id] for p in problem_list if p.id in files.finished or p.id in done]
        if out is not None:
            run = {**record, "wall_s": round(time.perf_counter() - started, 3)}
            _write_partial(out, finished, samples, report_settings, sampling, run)
            print(
                f"evaluation interrupted: {len(finished)} of {len(problem_list)} problems finished, in "
                f"{out / RESULTS_FILE}; continue with --resume (Python: resume=True) and the same settings",
                file=sys.stderr,
            )
        raise
    files.close()
    ordered = [results[p.id] for p in problem_list]
    metrics, intervals = summarize_with_intervals(ordered, samples, seed=sampling.seed or 0)
    report = EvalReport(
        samples=samples,
        metrics=metrics,
        problems=ordered,
        trajectories=kept,
        intervals=intervals,
        settings=report_settings,
        run={**record, "wall_s": round(time.perf_counter() - started, 3)},
    )
    if out is not None:
        report.write(out)
    return report


def _play(
    jobs: list[tuple[Problem, int]],
    results: dict[str, ProblemResult],
    files: _ResultFiles,
    kept: list[Trajectory] | None,
    *,
    engine: Engine,
    tokenizer: Tokenizer,
    sampling: SamplingParams,
    max_response_tokens: int,
    batch_size: int,
    continuous_batching: bool,
    env_id: str,
    kwargs: dict[str, Any],
    samples: int,
    progress: bool,
) -> None:
    """Play ``jobs`` (problem, sample index) ``batch_size`` at a time into ``results``; hand each problem
    to ``files`` when its last sample is in."""
    from stare_envs.registry import make_tool_envs

    runner = RolloutRunner(
        tokenizer,
        engine,
        max_response_tokens=max_response_tokens,
        sampling=sampling,
        continuous=continuous_batching,
    )
    envs = make_tool_envs(env_id, min(batch_size, len(jobs)), tokenizer=tokenizer, **kwargs)
    bar = progress_bar(len(jobs), progress)
    tracker = EvalProgress(bar, len(jobs), max_response_tokens)
    episodes: dict[str, list[Trajectory]] = {}
    try:
        files.format = getattr(envs[0], "format", None)
        for start in range(0, len(jobs), batch_size):
            chunk = jobs[start : start + batch_size]
            trajectories = runner.run(
                envs[: len(chunk)],
                seeds=[zlib.crc32(f"{p.id}/{i}".encode()) for p, i in chunk],
                options=[{"problem": p} for p, _ in chunk],
                episode_keys=[f"{p.id}/{i}" for p, i in chunk],
                on_turn=tracker.turn if bar is not None else None,
            )
            tracker.chunk_done(
                len(chunk), sum(len(t.response_ids) for t in trajectories), runner.last_stats.turns
            )
            for (problem, _), trajectory in zip(chunk, trajectories, strict=True):
                results[problem.id].add(trajectory)
                episodes.setdefault(problem.id, []).append(trajectory)
                if len(episodes[problem.id]) == samples:
                    files.finish(results[problem.id], episodes.pop(problem.id))
            if kept is not None:
                kept.extend(trajectories)
            if bar is not None:
                bar.update(len(chunk))
    finally:
        if bar is not None:
            bar.close()
        for env in envs:
            env.close()


class _ResultFiles:
    """``results.jsonl`` (and ``episodes.jsonl``) as problems finish: appended and flushed per problem,
    so an interrupted evaluation keeps every finished problem."""

    def __init__(self, out: Path | None, *, append: bool, episodes: bool, tokenizer: Tokenizer) -> None:
        self.finished: set[str] = set()
        self.format: Any = None
        self.tokenizer = tokenizer
        self._results = self._episodes = None
        if out is None:
            return
        out.mkdir(parents=True, exist_ok=True)
        mode = "a" if append else "w"
        self._results = open(out / RESULTS_FILE, mode)
        if episodes:
            self._episodes = open(out / EPISODES_FILE, mode)

    def finish(self, result: ProblemResult, trajectories: list[Trajectory]) -> None:
        self.finished.add(result.problem_id)
        if self._results is not None:
            self._results.write(json.dumps(asdict(result)) + "\n")
            self._results.flush()
        if self._episodes is not None:
            for sample, trajectory in enumerate(trajectories):
                record = episode_text(trajectory, self.tokenizer, self.format)
                self._episodes.write(json.dumps({"sample": sample, **record}, default=str) + "\n")
            self._episodes.flush()

    def close(self) -> None:
        for f in (self._results, self._episodes):
            if f is not None:
                f.close()
        self._results = self._episodes = None


def episode_text(trajectory: Trajectory, tokenizer: Tokenizer, tool_format: Any = None) -> dict[str, Any]:
    """One episode as text a person can read: the prompt, then turn by turn the model's text, the tool
    calls parsed from it (name and arguments, by the env's ``tool_format``) and what came back (the
    tool output with the chat template's glue around it), and the outcome."""
    info = trajectory.info
    ids = trajectory.response_ids
    spans = list(trajectory.turn_spans)
    turns = []
    for n, (start, end) in enumerate(spans):
        model_text = tokenizer.decode(ids[start:end])
        turn: dict[str, Any] = {"model": model_text}
        if tool_format is not None:
            calls = tool_format.parse(model_text).tool_calls
            turn["tool_calls"] = [{"name": c.name, "arguments": c.arguments} for c in calls]
        after = spans[n + 1][0] if n + 1 < len(spans) else len(ids)
        if after > end:
            turn["tool_output"] = tokenizer.decode(ids[end:after])
        turns.append(turn)
    return {
        "problem_id": info.get("problem_id"),
        "correct": info.get("correct"),
        "answer": info.get("answer"),
        "gold": info.get("gold"),
        "finish_reason": info.get("finish_reason"),
        "reward": trajectory.reward,
        "prompt": tokenizer.decode(trajectory.prompt_ids),
        "turns": turns,
        "tool_call_results": info.get("tool_calls", []),
    }


def _settings(
    given: dict[str, Any],
    problems: Sequence[Problem],
    source: str | None,
    samples: int,
    sampling: SamplingParams,
    max_response_tokens: int,
    env_id: str,
    kwargs: dict[str, Any],
    engine: Engine,
) -> dict[str, Any]:
    """The resolved settings of an evaluation, with ``given`` (a caller's) merged in section by section."""
    from stare_agent.provenance import engine_settings, package_versions, problems_sha256
    from stare_sandbox.config import SandboxConfig

    pool = kwargs.get("pool")
    limits = kwargs.get("sandbox_config") or (SandboxConfig() if pool is None else None)
    if "model" not in given:  # the Python API's call: the engine's own model, where it knows one
        model = _engine_model(engine)
        if model is not None:
            given = {**given, "model": model}
    settings: dict[str, Any] = {
        "data": {"source": source, "problems": len(problems), "sha256": problems_sha256(problems)},
        "samples": samples,
        "sampling": asdict(sampling),
        "max_response_tokens": max_response_tokens,
        "env": {
            "id": env_id,
            "kwargs": {
                k: v for k, v in kwargs.items() if k not in ("pool", "sandbox_backend", "sandbox_config")
            },
        },
        "sandbox": {
            # None: the env's tools run no code, so it has none
            "backend": pool.backend if pool is not None else kwargs.get("sandbox_backend"),
            "limits": limits,
        },
        "engine": engine_settings(engine),
        "packages": package_versions(),
    }
    for key, value in given.items():  # a caller's section adds to (and overrides) the one seen here
        if isinstance(value, dict) and isinstance(settings.get(key), dict):
            settings[key] = {**settings[key], **{k: v for k, v in value.items() if v is not None}}
        else:
            settings[key] = value
    return json.loads(json.dumps(settings, default=plain_setting))


def _resume(
    out: Path, problems: Sequence[Problem], samples: int, settings: dict[str, Any]
) -> dict[str, ProblemResult]:
    """The finished problems of the evaluation in ``out``, after checking it is this evaluation."""
    check_resume(out, settings)
    path = out / RESULTS_FILE
    ids = {p.id for p in problems}
    done: dict[str, ProblemResult] = {}
    rows: list[ProblemResult] = []
    lines = path.read_text().splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            result = ProblemResult(**json.loads(line))
        except (json.JSONDecodeError, TypeError) as exc:
            if number == len(lines):  # the last line, cut by a kill: that problem is played again
                continue
            raise EvaluationError(
                f"{path}:{number} is not a problem's result ({exc}): pass another --out"
            ) from None
        if len(result.correct) + result.failed != samples:
            raise EvaluationError(
                f"{path}:{number} has {len(result.correct) + result.failed} samples of {result.problem_id}, "
                f"this evaluation {samples}: pass the same --samples to resume it, or another --out"
            )
        rows.append(result)
        if result.problem_id in ids:
            done[result.problem_id] = result
    replace_file(path, "".join(json.dumps(asdict(r)) + "\n" for r in rows))  # without a cut last line
    return done


def _write_partial(
    out: Path,
    finished: list[ProblemResult],
    samples: int,
    settings: dict[str, Any],
    sampling: SamplingParams,
    run: dict[str, Any],
) -> None:
    """``summary.json`` of an interrupted evaluation: its settings, and the metrics of the finished
    problems when there are any."""
    metrics: dict[str, float] = {}
    intervals: dict[str, tuple[float, float]] = {}
    if any(r.correct for r in finished):
        metrics, intervals = summarize_with_intervals(finished, samples, seed=sampling.seed or 0)
    partial = EvalReport(samples=samples, metrics=metrics, problems=finished, intervals=intervals,
                         settings=settings, run=run)  # fmt: skip
    append_run(out, run, complete=False)
    replace_file(
        out / SUMMARY_FILE,
        json.dumps(json_ready(partial.summary(complete=False)), indent=2, default=str, allow_nan=False)
        + "\n",
    )


def _engine_model(engine: Any) -> dict[str, Any] | None:
    """The model an engine samples from, as ``model_settings`` names it: an in-process model's
    ``name_or_path`` (a local directory is hashed), or a served model's name."""
    from stare_agent.provenance import model_settings

    model = getattr(engine, "model", None)
    if isinstance(model, str):
        return {"name_or_path": model}
    name = getattr(getattr(model, "config", None), "_name_or_path", None) or getattr(
        engine, "name_or_path", None
    )
    if not name:
        return None
    try:
        return model_settings(str(name))
    except Exception:  # noqa: BLE001 - a name that no longer resolves is still a name
        return {"name_or_path": str(name)}
