"""Register a new tool environment (a sympy calculator) and play it. Run: python examples/register_tool_env.py"""

import re

import gymnasium
import sympy

from stare_envs import ToolInputError, register_tool, register_tool_env

ALLOWED = {"sqrt", "factorial", "binomial", "gcd", "lcm", "Mod", "log", "exp", "pi", "E", "isprime"}


@register_tool("calculator", model_errors=(sympy.SympifyError, TypeError, ValueError))
def calculator(expression: str) -> str:
    """Evaluate a math expression exactly with sympy, e.g. "binomial(40, 20) * 3**5"."""
    if not set(re.findall(r"[A-Za-z_]\w*", expression)) <= ALLOWED:  # sympify evals: allow math only
        raise ToolInputError(f"only numbers, + - * / ** ( ) and {sorted(ALLOWED)} are allowed")
    return str(sympy.sympify(expression))


register_tool_env("demo/Calculator-v0", tools=["calculator"], format="hermes", problems="multiplication")


def policy(observation: str) -> str:
    if "\\times" in observation:  # turn 1: multiply the prompt's numbers; turn 2: box the result
        product = " * ".join(re.findall(r"\d+", observation))
        return f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{product}"}}}}</tool_call>'
    return f"The product is <answer>\\boxed{{{observation.strip()}}}</answer>"


if __name__ == "__main__":
    env = gymnasium.make("demo/Calculator-v0")
    observation, info = env.reset(seed=0)
    done = False
    while not done:
        observation, reward, terminated, truncated, info = env.step(action := policy(observation))
        print(f"model: {action}\nenv:   {observation or '(episode over)'}")
        done = terminated or truncated
    print(f"reward={reward} answer={info['answer']} gold={info['gold']}")
