"""A tool environment of your own, end to end: an exact unit converter, its problem family (whose solution
is a call of the tool, so `stare-agent sft` makes cold-start traces in the env's format) and its env.

Play one episode: python examples/unit_converter.py
Train it (from examples/, so that module:id finds this file; docs/environments.md, "Cold-start traces"):
  stare-agent quickstart --config ../configs/custom_env.yaml env.id=unit_converter:newcomer/UnitConvert-v0 \\
      sft.data=procedural:unit_conversion
"""

from fractions import Fraction

import gymnasium

from stare_envs import ToolInputError, register_tool, register_tool_env
from stare_envs.problems import register_family

METERS = {"mm": Fraction(1, 1000), "cm": Fraction(1, 100), "m": Fraction(1), "km": Fraction(1000),
          "in": Fraction(254, 10000), "ft": Fraction(3048, 10000), "mi": Fraction(1609344, 1000)}  # fmt: skip


@register_tool("convert")
def convert(value: str, from_unit: str, to_unit: str) -> str:
    """Convert a length exactly, e.g. convert("3.5", "km", "m") gives 3500; units: mm cm m km in ft mi."""
    if from_unit not in METERS or to_unit not in METERS:
        raise ToolInputError(f"units must be among {sorted(METERS)}")
    try:
        amount = Fraction(value)
    except (ValueError, ZeroDivisionError):
        raise ToolInputError(f"value {value!r} is not a number") from None
    result = amount * METERS[from_unit] / METERS[to_unit]
    return str(result)  # exact: "3500" or "127/50"


@register_family("unit_conversion")
def unit_conversion(rng, difficulty):
    """How many <b> are in <value> <a>? The solution is one call of the convert tool."""
    a, b = rng.sample(sorted(METERS), 2)
    value = str(rng.randrange(2, 10 ** (1 + difficulty)))
    question = f"How many {b} are in {value} {a}? Give the exact value (a fraction if needed)."
    return question, convert(value, a, b), [("convert", {"value": value, "from_unit": a, "to_unit": b})]


register_tool_env("newcomer/UnitConvert-v0", tools=["convert"], format="hermes",
                  problems="procedural:unit_conversion", max_turns=3, max_tool_calls=2)  # fmt: skip

if __name__ == "__main__":
    env = gymnasium.make("newcomer/UnitConvert-v0")
    prompt, info = env.reset(seed=0)
    problem = env.unwrapped.problem  # its solution: the calls a model should make
    call = env.unwrapped.format.write_calls(problem.meta["solution_calls"])
    for action in (call, f"<answer>\\boxed{{{problem.answer}}}</answer>"):
        observation, reward, terminated, truncated, info = env.step(action)
        print(f"model: {action}\nenv:   {observation or '(episode over)'}")
    print(f"reward={reward} answer={info['answer']} gold={info['gold']}")
