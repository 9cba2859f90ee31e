"""Steps 1-3 of a training step: draw prompt batches, play G episodes per prompt (rewarded by the
environment), share them over the ranks, and keep the groups dynamic sampling keeps.

Every rank draws the same prompt batch and plays the groups it owns (group g on rank g mod world);
rewards and trajectories are exchanged so that dynamic sampling, advantages and the kept groups
agree on all ranks. Episodes are keyed by (group, sample) within a draw: their sampling streams do
not depend on the rank or the wave they are played in.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from stare_agent.algorithms import dynamic_sampling
from stare_agent.config import RunConfig
from stare_agent.resources import open_sandboxes, train_source
from stare_agent.train.async_rollouts import VersionedEngine
from stare_envs.engine import SamplingParams
from stare_envs.problems import Problem, ProblemStream
from stare_envs.registry import env_needs_sandbox, make_tool_envs
from stare_envs.rollout import RolloutRunner
from stare_envs.tool_env import ToolEnv
from stare_envs.trajectory import Trajectory


@dataclass
class Group:
    """The G episodes of one prompt. ``rewards`` are known on every rank; ``trajectories`` too once
    exchanged (``global_ids`` are the episodes' batch-wide ids, used as STARE's tie-break key).
    Episodes lost to an infrastructure failure (``finish_reason == "failed"``) are left out of all
    three and counted in ``failed``; with ``data.on_failed_episode=drop_group`` (the default) the
    other episodes of such a group are left out too (``dropped``), so it trains nothing."""

    index: int
    problem: Problem | None  # None in a replay: saved episodes keep only the problem's id
    rewards: list[float]
    trajectories: list[Trajectory] = field(default_factory=list)
    global_ids: list[int] = field(default_factory=list)
    failed: int = 0
    dropped: bool = False


@dataclass
class Rollouts:
    """One step's steps 1-3 as they reach the learner: its groups in draw order (``drawn``), those
    dynamic sampling kept, every episode played (failed ones included, for tool health), the problem
    stream's position after the step's draws (what a checkpoint stores once the step is trained)
    and the seconds they took (``reward_s``: answer checking, part of ``rollout_s``)."""

    step: int
    drawn: list[Group]
    kept: list[Group]
    ds_metrics: dict[str, float]
    played: list[Trajectory]
    position: int
    rollout_s: float
    reward_s: float


def problem_stream(config: RunConfig) -> ProblemStream:
    """The run's training problems in their seeded order (``data.train``, else the env's registered
    problems; ``data.difficulty``, ``data.dedupe``, ``trainer.seed``).

    Raises:
        ProblemSourceError: a source that cannot be read or holds no problem.
    """
    return ProblemStream(
        train_source(config),
        seed=config.trainer.seed,
        difficulty=config.data.difficulty,
        dedupe=config.data.dedupe,
    )


class RolloutPhase:
    """Steps 1-3 of a run's steps: its problem stream, its environments and sandbox pool, and how a
    step's groups are drawn, played and kept.

    Args:
        config: The run's config (``data``, ``env``, ``sandbox``, ``trainer.seed``).
        tokenizer: The tokenizer the rollout runner and the envs encode with.
        engine: Returns the rollout engine, labelled with the policy version (it may be restarted
            between calls).
        rank, world: This process's data-parallel rank and the world size.
        process_group: The group the episodes are exchanged over (None: the world).
        stream: The training problems (default :func:`problem_stream` of ``config``).
    """

    def __init__(
        self,
        config: RunConfig,
        tokenizer: Any,
        engine: Callable[[], VersionedEngine],
        *,
        rank: int = 0,
        world: int = 1,
        process_group: Any = None,
        stream: ProblemStream | None = None,
        pool: Any = None,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.engine = engine
        self.rank, self.world = rank, world
        self.process_group = process_group
        self.stream = stream if stream is not None else problem_stream(config)
        self._envs: list[ToolEnv] = []
        self._pool: Any = pool
        self._owns_pool = pool is None  # a caller's pool stays open at close()

    def play(self, step: int) -> Rollouts:
        """Steps 1-3 of step ``step``, on whichever thread plays them."""
        t0 = time.perf_counter()
        checked = sum(env.check_time_s for env in self._envs)
        played: list[Trajectory] = []
        drawn, kept, ds_metrics = self._draw(step, played)
        return Rollouts(
            step,
            drawn,
            kept,
            ds_metrics,
            played,
            self.stream.position,
            time.perf_counter() - t0,
            sum(env.check_time_s for env in self._envs) - checked,
        )

    def _draw(self, step: int, played: list[Trajectory]) -> tuple[list[Group], list[Group], dict[str, float]]:
        """1-3 of step ``step``. Draw prompt batches and play G episodes per prompt (rewarded by the
        environment; every episode, failed ones included, added to ``played``) until dynamic sampling
        keeps ``data.prompts_per_step`` groups (capped): (drawn, kept, metrics)."""
        data = self.config.data
        drawn: list[Group] = []
        per_draw = data.prompts_per_draw or data.prompts_per_step

        def draw_batch() -> list[Group]:
            groups = self.groups(
                self.stream.take(per_draw), draw=len(drawn) // per_draw + 1, step=step, played=played
            )
            drawn.extend(groups)
            return [g for g in groups if g.rewards]  # one dropped for a failed episode has none left

        if not data.dynamic_sampling:
            return drawn, [g for g in draw_batch() if g.trajectories][: data.prompts_per_step], {}
        kept, ds_metrics = dynamic_sampling(
            draw_batch,
            target_groups=data.prompts_per_step,
            max_batches=data.max_sampling_batches,
            on_shortfall="raise" if data.on_short_batch == "raise" else "keep",
        )
        return drawn, kept, ds_metrics

    def groups(
        self,
        problems: list[Problem],
        *,
        draw: int,
        step: int,
        played: list[Trajectory] | None = None,
    ) -> list[Group]:
        """Play G episodes per problem (this rank's groups) for draw ``draw`` of step ``step`` (their
        sampling seeds), then share rewards and trajectories; every episode is added to ``played``."""
        G = self.config.data.samples_per_prompt
        mine = [i for i in range(len(problems)) if i % self.world == self.rank]
        jobs = [(i, k) for i in mine for k in range(G)]
        runner = self._runner(draw, step)
        # Episodes hold a leased sandbox from reset to end: play them in waves of the pool's size.
        wave = self.config.sandbox.pool_size
        envs = self._get_envs(min(wave, len(jobs)))
        trajectories: list[Trajectory] = []
        for start in range(0, len(jobs), wave):
            chunk = jobs[start : start + wave]
            trajectories += runner.run(
                envs[: len(chunk)],
                options=[{"problem": problems[i]} for i, _ in chunk],
                episode_keys=[f"{i}/{k}" for i, k in chunk],  # one sampling stream per episode
            )
        local = {i: trajectories[n * G : (n + 1) * G] for n, i in enumerate(mine)}
        if self.world > 1:
            gathered: list[Any] = [None] * self.world
            dist.all_gather_object(
                gathered, {i: [t.to_dict() for t in ts] for i, ts in local.items()}, group=self.process_group
            )
            local = {i: [Trajectory.from_dict(d) for d in ts] for part in gathered for i, ts in part.items()}
        if played is not None:
            played += [t for i in sorted(local) for t in local[i]]
        base = (draw - 1) * len(problems) * G
        groups = []
        for i, p in enumerate(problems):
            ok = [
                (t, base + i * G + k)
                for k, t in enumerate(local[i])
                if t.info.get("finish_reason") != "failed"
            ]
            failed = G - len(ok)
            drop = failed > 0 and self.config.data.on_failed_episode == "drop_group"
            if drop:  # a group short of an episode would bias its group-relative advantages
                ok = []
            groups.append(
                Group(
                    i,
                    p,
                    [t.reward for t, _ in ok],
                    [t for t, _ in ok],
                    [g for _, g in ok],
                    failed=failed,
                    dropped=drop,
                )
            )
        return groups

    def _runner(self, draw: int, step: int) -> RolloutRunner:
        env = self.config.env
        # Episodes are keyed by (group, sample) within the draw: streams do not depend on rank or wave.
        seed = zlib.crc32(f"rollout/{self.config.trainer.seed}/{step}/{draw}".encode())
        sampling = SamplingParams(temperature=env.temperature, top_p=env.top_p, seed=seed)
        return RolloutRunner(
            self.tokenizer,
            self.engine(),
            max_response_tokens=env.max_response_tokens,
            sampling=sampling,
            continuous=env.continuous_batching,
        )

    def _get_envs(self, n: int) -> list[ToolEnv]:
        if len(self._envs) < n:  # the id checked once for the new ones, not once per env
            env = self.config.env
            self._envs += make_tool_envs(
                env.id,
                n - len(self._envs),
                **env.env_kwargs(),
                pool=self.pool(),
                tokenizer=self.tokenizer,
            )
        return self._envs

    def pool(self) -> Any:
        """The sandbox pool the episodes (and evaluations) lease from: the caller's, or one opened on
        first use; None when the env's tools run no code."""
        env = self.config.env
        if self._pool is None and env_needs_sandbox(env.id, **env.env_kwargs()):
            self._pool = open_sandboxes(self.config.sandbox)
        return self._pool

    def close(self) -> None:
        """Close the envs and the sandbox pool this phase opened (a caller's stays open)."""
        for env in self._envs:
            env.close()
        self._envs = []
        if self._pool is not None and self._owns_pool:
            self._pool.close()
            self._pool = None
