"""The RL loop end to end on CPU: tiny random model, real DeepSpeed, real sandboxes, scripted rollouts
whose rewards are known, so that every group has reward variance."""

from __future__ import annotations

import itertools
import json
import re

import pytest
import torch

from stare_agent.config import load_config
from stare_agent.engines.scripted import ScriptedEngine
from stare_agent.models import tiny_model
from stare_agent.trainer import ProblemStream, Trainer, latest_checkpoint

PROBLEMS = [
    {"id": f"add-{a}-{b}", "problem": f"What is {a} + {b}?", "answer": str(a + b)}
    for a, b in [(2, 3), (10, 7), (40, 2), (6, 6), (9, 1), (8, 5)]
]


def scripted_policy():
    """Turn 0 runs code, which is right on even episodes and off by one on odd ones; turn 1 boxes
    what the interpreter printed (so the episode's state lives in its own context)."""
    episodes = itertools.count()

    def turn(prompt_text: str, turn_index: int) -> str:
        if turn_index == 0:
            a, b = map(int, re.findall(r"What is (\d+) \+ (\d+)\?", prompt_text)[-1])
            extra = " + 1" if next(episodes) % 2 else ""
            return f"Let me compute.\n<code>\n```python\nprint({a} + {b}{extra})\n```\n</code>"
        printed = re.findall(r"<interpreter>\s*(\d+)", prompt_text)[-1]
        return f"The interpreter says so.\n<answer>\\boxed{{{printed}}}</answer>"

    return turn


@pytest.fixture
def problem_file(tmp_path):
    path = tmp_path / "problems.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS))
    return path


def make_config(tmp_path, problem_file, *extra):
    return load_config(
        None,
        [
            f"data.train={problem_file}",
            "data.prompts_per_step=2",
            "data.samples_per_prompt=2",
            "data.max_sampling_batches=2",
            "env.max_turns=3",
            "env.max_response_tokens=256",
            "sandbox.backend=local",
            "sandbox.pool_size=2",
            "optim.lr=1e-3",
            "trainer.steps=2",
            "trainer.checkpoint_every=1",
            f"trainer.run_dir={tmp_path / 'run'}",
            "deepspeed.micro_batch_tokens=512",
            "algorithm.H_tgt=100.0",  # a random model's entropy (~10.8 nats) is below it: the gate is on
            *extra,
        ],
    )


def test_problem_stream_is_reproducible_and_resumable(problem_file):
    a = ProblemStream(str(problem_file), seed=3)
    first = [p.id for p in a.take(9)]
    b = ProblemStream(str(problem_file), seed=3)
    b.position = 4
    assert [p.id for p in b.take(5)] == first[4:]
    assert sorted(first[:6]) == sorted(p["id"] for p in PROBLEMS)  # one epoch is a permutation
    fam = ProblemStream("multiplication", seed=0)
    assert [p.id for p in fam.take(3)] == [p.id for p in ProblemStream("multiplication", seed=0).take(3)]


def test_two_stare_steps_update_weights_log_and_checkpoint(tmp_path, problem_file):
    config = make_config(tmp_path, problem_file)
    model, tokenizer = tiny_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = Trainer(
        config, model=model, tokenizer=tokenizer, engine=ScriptedEngine(tokenizer, scripted_policy())
    )
    summary = trainer.fit()
    assert summary["steps"] == 2
    after = trainer.learner.module.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)

    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        # the script is right on every other episode: each group of 2 has rewards {0, 1}
        assert r["reward_mean"] == pytest.approx(0.5)
        assert r["tool_calls_per_episode"] == pytest.approx(1.0)
        assert r["kept_groups"] == 2 and r["gate_on"] == 1 and r["skipped"] == 0
        # P = 0.1 of the T+ tokens get W: a positive, small fraction of all model tokens
        assert 0 < r["frac_reweighted"] < 0.2
    last = latest_checkpoint(tmp_path / "run")
    assert last is not None and last.name == "step-000002"
    state = json.loads((last / "trainer_state.json").read_text())
    assert state["step"] == 2 and state["data_position"] == 4
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(last / "hf")
    assert torch.equal(reloaded.state_dict()["lm_head.weight"], after["lm_head.weight"])
    assert (tmp_path / "run" / "config.yaml").is_file()
