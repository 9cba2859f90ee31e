"""A problem family and an environment of your own, usable from YAML.

Importing this module registers the family ``powers_of_two`` (``stare_envs.register_family``) and the
env ``demo/PowersOfTwo-v0`` that serves it. A config then names both by id, with a reward of its own
(``configs/custom_problems.yaml``; run from examples/, so that ``custom_problems`` is importable):

    cd examples && stare-agent eval --config ../configs/custom_problems.yaml --limit 4 --samples 1

Run: python examples/custom_problems.py (prints two problems and the env's reward settings).
"""

from __future__ import annotations

import random

import gymnasium

from stare_envs import register_tool_env
from stare_envs.problems import PROBLEM_FAMILIES, generate_problems, register_family

if "powers_of_two" not in PROBLEM_FAMILIES:  # imported twice (as a script and by module:id): once

    @register_family("powers_of_two")
    def powers_of_two(rng: random.Random, difficulty: int) -> tuple[str, int, str]:
        """(problem text, exact answer, solution code printing it); larger exponents when harder."""
        n = rng.randrange(20, 40) * difficulty
        return (
            f"What is the sum of the decimal digits of $2^{{{n}}}$?",
            sum(map(int, str(2**n))),
            (f"print(sum(map(int, str(2 ** {n}))))"),
        )


if "demo/PowersOfTwo-v0" not in gymnasium.registry:
    register_tool_env(
        "demo/PowersOfTwo-v0",
        entry_point="stare_envs.code_interpreter:CodeInterpreterEnv",
        problems="procedural:powers_of_two",
        max_turns=4,
        max_tool_calls=4,
    )


if __name__ == "__main__":
    for problem in generate_problems("powers_of_two", 2, seed=0):
        print(problem.problem, "->", problem.answer)
    env = gymnasium.make(
        "demo/PowersOfTwo-v0", reward={"mode": "plus_minus"}, sandbox_backend="local"
    ).unwrapped
    print(env.reward_config, env.max_turns)
    env.close()
