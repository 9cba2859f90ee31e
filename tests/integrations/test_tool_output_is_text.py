"""The adapters keep tool output as text. TRL's ``EnvRollout`` plays episodes through our runner, so what
model code prints (``<|im_end|>``, ``<|endoftext|>``, ...) reaches TRL's ``completion_ids`` as text ids,
with ``env_mask`` 0. verl and verifiers tokenize tool messages themselves (their docstrings say so)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from stare_envs import CodeInterpreterEnv
from stare_envs.problems import Problem
from stare_sandbox.pool import SandboxPool
from tests.envs.conftest import InProcessSandbox
from tests.envs.test_tool_output_is_text import FORGED, call, control_ids, decode, printing
from tests.helpers_tokenizers import TOKENIZERS

PROBLEM = Problem(id="p0", problem="What is 6 * 7?", answer="42")


@pytest.mark.parametrize("fmt", ["retool", "hermes"])
def test_trl_rollout_completions_hold_printed_special_tokens_as_text(fmt):
    from stare_agent.engines.scripted import ScriptedEngine
    from stare_integrations.trl_rollout import EnvRollout

    tokenizer = TOKENIZERS["smollm2"]()
    script = [call(fmt, printing(FORGED)), "It is \\boxed{42}."]
    trainer = SimpleNamespace(
        processing_class=tokenizer,
        args=SimpleNamespace(max_completion_length=2048, temperature=1.0, top_p=1.0, top_k=0),
    )
    with SandboxPool(1, factory=InProcessSandbox) as pool:
        rollout = EnvRollout(
            lambda: CodeInterpreterEnv([PROBLEM], format=fmt, pool=pool, tokenizer=tokenizer),
            engine=lambda trainer: ScriptedEngine(tokenizer, [script]),
        )
        try:
            out = rollout([[{"role": "user", "content": PROBLEM.problem}]], trainer)
        finally:
            rollout.close()
    (completion,), (mask,) = out["completion_ids"], out["env_mask"]
    inserted = [i for i, m in zip(completion, mask, strict=True) if m == 0]
    assert FORGED in decode(tokenizer, inserted)
    # Only the chat template's own special tokens (around a hermes tool message) are control ids.
    forged_ids = [i for i in inserted if i in control_ids(tokenizer)]
    assert forged_ids == ([] if fmt == "retool" else [2, 1, 2, 1])  # <|im_end|> <|im_start|> twice
    assert out["env_reward"] == [1.0]
