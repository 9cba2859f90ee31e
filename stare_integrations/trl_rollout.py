"""TRL: train on our environments with TRL's ``GRPOTrainer``, through its ``rollout_func``.

:class:`EnvRollout` is a ``rollout_func``: for the prompts of a batch it plays one episode per prompt in
our :class:`~stare_envs.tool_env.ToolEnv` (multi-turn, with real sandboxes) through
:class:`~stare_envs.rollout.RolloutRunner`, with the trainer's own model (a
:class:`~stare_agent.engines.transformers_engine.TransformersEngine` on it, so rollouts always use the
current weights). The episodes come back to TRL token-exactly: the prompt ids, the response ids (model
turns, tool output, template glue), the sampling log-probs, and ``env_mask`` (1 for sampled tokens, 0 for
tokens we inserted), which TRL uses as its tool mask, so tool output is never trained on. The env's
reward comes along as the ``env_reward`` column, which :func:`env_reward` hands to TRL as a reward
function.

Why ``rollout_func`` rather than TRL's ``tools``/``environment_factory``: those parse tool calls with the
chat template's response schema (so only models whose template TRL knows, and only JSON tool calls), and
re-tokenize the conversation; ours keeps the env's own formats (ReTool's ``<code>`` blocks, hermes), its
limits and its verified reward, and the tokens exactly as sampled.

Install: ``pip install 'stare-agent[trl]'``. Example in the README ("Use with verl / TRL / verifiers").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from stare_envs.engine import Engine, SamplingParams
from stare_envs.problems import Problem
from stare_envs.rollout import RolloutRunner
from stare_envs.tool_env import ToolEnv

if TYPE_CHECKING:
    import datasets

__all__ = ["EnvRollout", "env_reward"]


class EnvRollout:
    """A TRL ``rollout_func`` that plays our environment's episodes.

    Args:
        make_env: Builds one environment (called as often as a batch needs envs at once; they are kept
            and reset for later batches). Give them one shared ``SandboxPool`` (``pool=``) so a batch
            leases warm sandboxes instead of starting a container per env.
        problems: The problems to train on; :meth:`dataset` makes TRL's dataset from them, and each
            prompt TRL hands back is mapped to its problem. Default: the env's own problem list.
        max_response_tokens: Token budget of one episode (model turns, tool output and glue); default
            the trainer's ``max_completion_length``.
        engine: ``trainer -> Engine``; default a ``TransformersEngine`` on the trainer's (unwrapped) model.
        template_tools: See :class:`~stare_envs.rollout.RolloutRunner`.
        max_episode_retries: How often an episode lost to a sandbox failure is started over before it
            is given up (see :class:`~stare_envs.rollout.RolloutRunner`).

    Sampling follows the trainer's config (``temperature``, ``top_p``, ``top_k``). An episode lost to a
    sandbox failure (after the runner's retries) comes back as one masked EOS token with reward None,
    which TRL leaves out of its group's statistics.
    """

    def __init__(
        self,
        make_env: Callable[[], ToolEnv],
        problems: Sequence[Problem] | None = None,
        *,
        max_response_tokens: int | None = None,
        engine: Callable[[Any], Engine] | None = None,
        template_tools: bool | None = None,
        max_episode_retries: int = 2,
    ) -> None:
        self.make_env = make_env
        self.envs: list[ToolEnv] = [make_env()]
        if problems is None:
            if isinstance(self.envs[0].problems, str):
                raise ValueError(
                    f"the env generates its problems ({self.envs[0].problems!r}): pass problems= "
                    "(e.g. stare_envs.problems.generate_problems(family, n, seed=0))"
                )
            problems = self.envs[0].problems
        self.problems = list(problems)
        self._by_text = {p.problem: p for p in self.problems}
        if len(self._by_text) != len(self.problems):
            raise ValueError("two problems have the same text: TRL's prompts could not be told apart")
        self.max_response_tokens = max_response_tokens
        self.engine = engine
        self.template_tools = template_tools
        self.max_episode_retries = max_episode_retries

    def dataset(self) -> datasets.Dataset:
        """TRL's ``train_dataset``: one conversational prompt per problem (the problem text)."""
        import datasets

        rows = [
            {"prompt": [{"role": "user", "content": p.problem}], "problem_id": p.id} for p in self.problems
        ]
        return datasets.Dataset.from_list(rows)

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        """Play one episode per prompt; the dict TRL's ``rollout_func`` contract asks for."""
        problems = [self._problem(prompt) for prompt in prompts]
        while len(self.envs) < len(problems):
            self.envs.append(self.make_env())
        runner = RolloutRunner(
            trainer.processing_class,
            self.engine(trainer) if self.engine is not None else _model_engine(trainer),
            max_response_tokens=self.max_response_tokens or trainer.args.max_completion_length,
            sampling=SamplingParams(
                temperature=trainer.args.temperature,
                top_p=trainer.args.top_p,
                top_k=trainer.args.top_k or None,
            ),
            template_tools=self.template_tools,
            max_episode_retries=self.max_episode_retries,
        )
        trajectories = runner.run(self.envs[: len(problems)], options=[{"problem": p} for p in problems])
        eos = trainer.processing_class.eos_token_id
        out: dict[str, list[Any]] = {k: [] for k in ("prompt_ids", "completion_ids", "logprobs", "env_mask")}
        out.update(env_reward=[], num_turns=[], num_tool_calls=[])
        for t in trajectories:
            failed = t.info.get("finish_reason") == "failed"
            out["prompt_ids"].append(list(t.prompt_ids))
            out["completion_ids"].append([eos] if failed else list(t.response_ids))
            out["logprobs"].append([0.0] if failed else list(t.logprobs))
            out["env_mask"].append([0] if failed else list(t.loss_mask))
            out["env_reward"].append(None if failed else t.reward)
            out["num_turns"].append(t.info.get("num_turns", 0))
            out["num_tool_calls"].append(t.info.get("num_tool_calls", 0))
        return out

    def close(self) -> None:
        """Close the environments (and the pools they own)."""
        for env in self.envs:
            env.close()

    def _problem(self, prompt: Any) -> Problem:
        text = prompt[-1]["content"] if isinstance(prompt, list) else prompt
        problem = self._by_text.get(text)
        if problem is None:
            raise KeyError(
                f"prompt {str(text)[:80]!r} is none of this rollout's problems: train on EnvRollout.dataset()"
            )
        return problem


def _model_engine(trainer: Any) -> Engine:
    from stare_agent.engines.transformers_engine import TransformersEngine

    model = trainer.accelerator.unwrap_model(trainer.model)
    return TransformersEngine(model, trainer.processing_class)


def env_reward(completions: list[Any], env_reward: list[float | None], **kwargs: Any) -> list[float | None]:
    """A TRL reward function: the episode rewards :class:`EnvRollout` returned (None: episode lost)."""
    return list(env_reward)
