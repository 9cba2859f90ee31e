"""``test/Parity-v0``: the code-interpreter env where a turn ends at its first space and the reward is
1 when that turn has an even number of characters. A tiny random model then plays short episodes
that the env scores, in groups whose rewards differ (so RL steps update the weights), without
scripted rollouts. Registered on import, so a config can name it as
``env.id=tests.stare_agent.parity_env:test/Parity-v0`` (Gymnasium imports the module first)."""

from __future__ import annotations

from typing import Any

import gymnasium

from stare_envs.code_interpreter import CodeInterpreterEnv
from stare_envs.formats import ReToolFormat

ENV_ID = "test/Parity-v0"
# A small RL run on this env with the tiny model: one-turn episodes of a few tokens, groups of 4
# whose rewards differ, a large learning rate so one step visibly moves the weights, and the gate
# always on (a random model's entropy is far below H_tgt = 100).
PARITY_RUN = (
    f"env.id=tests.stare_agent.parity_env:{ENV_ID}",
    "env.max_response_tokens=12",
    "env.max_turns=1",
    "data.train=multiplication",
    "data.prompts_per_step=2",
    "data.samples_per_prompt=4",
    "data.max_sampling_batches=2",
    "sandbox.backend=local",
    "sandbox.pool_size=8",
    "optim.lr=1e-2",
    "algorithm.H_tgt=100.0",
)


class FirstWordFormat(ReToolFormat):
    """ReTool, except that generation stops at the first space (most random tokens hold one)."""

    stop_strings = [" "]


class ParityEnv(CodeInterpreterEnv):
    def __init__(self, problems: Any = "mixed", **kwargs: Any) -> None:
        super().__init__(problems, **{"format": FirstWordFormat(), **kwargs})

    def _score(self, answer: str | None) -> tuple[float, dict[str, Any]]:
        _, info = super()._score(answer)
        return float(len(self.messages[-1]["content"]) % 2 == 0), info


if ENV_ID not in gymnasium.registry:
    gymnasium.register(id=ENV_ID, entry_point=ParityEnv)
