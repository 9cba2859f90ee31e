"""``test/Bandit-v0``: a one-turn tool env (no tool runs code, so no sandbox) whose reward is 1 when the
model's turn starts with ``A`` and 0 otherwise. A tiny policy first taught to answer ``A`` or ``B`` half
the time (``two_choice_policy``) has reward variance in every group, and a policy-gradient method must
raise P(A) within a few steps: a test of learning, not of formulas. Registered on import, so a config
names it as ``env.id=tests.stare_agent.bandit_env:test/Bandit-v0``."""

from __future__ import annotations

from typing import Any

import gymnasium

from stare_envs import ToolEnv

ENV_ID = "test/Bandit-v0"
CHOICES = ("A", "B")


class BanditEnv(ToolEnv):
    def __init__(self, problems: Any = "multiplication", **kwargs: Any) -> None:
        super().__init__(
            problems, **{**kwargs, "tools": (), "format": "hermes", "max_turns": 1, "system_prompt": ""}
        )

    def _score(self, answer: str | None) -> tuple[float, dict[str, Any]]:
        _, info = super()._score(answer)
        return float(self.messages[-1]["content"].startswith("A")), info


if ENV_ID not in gymnasium.registry:
    gymnasium.register(id=ENV_ID, entry_point=BanditEnv)
