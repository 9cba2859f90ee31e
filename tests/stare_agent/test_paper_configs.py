"""The paper-scale configs train on what they claim: DAPO-Math-17k once per problem, with the
environment's own prompt (not the hub copy's "Answer: $Answer" instruction)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stare_agent.config import load_config
from stare_agent.resources import make_env
from stare_envs.problems import ANSWER_FORMAT_WRAPPERS, ProblemStream, load_problems

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
RL_CONFIGS = (
    "grpo_ds_retool_qwen2.5_7b.yaml",
    "stare_o1_retool_qwen2.5_7b.yaml",
    "stare_c2_retool_qwen2.5_7b.yaml",
)
PREFIX, SUFFIX = ANSWER_FORMAT_WRAPPERS[0]


def hub_copy(problems, path: Path, repeats: int) -> Path:
    """Rows as BytedTsinghua-SIA/DAPO-Math-17k has them: verl schema, DAPO's prompt, each problem repeated."""
    with path.open("w") as f:
        for r in range(repeats):
            for i, p in enumerate(problems):
                row = {
                    "data_source": "math_dapo",
                    "prompt": [{"role": "user", "content": PREFIX + p.problem + SUFFIX}],
                    "ability": "MATH",
                    "reward_model": {"ground_truth": p.answer, "style": "rule-lighteval/MATH_v2"},
                    "extra_info": {"index": f"{i}-{r}"},
                }
                f.write(json.dumps(row) + "\n")
    return path


@pytest.mark.parametrize("name", RL_CONFIGS)
def test_paper_config_reads_each_dapo_problem_once_with_the_envs_prompt(name, tmp_path, shared_data):
    config = load_config(CONFIGS / name)
    assert config.data.train == "BytedTsinghua-SIA/DAPO-Math-17k" and config.data.dedupe
    assert "Answer:" not in f"{config.env.system_prompt}{config.env.prompt_template}"

    source = load_problems(shared_data / "dapo_math_17k.jsonl", limit=200)
    rows = hub_copy(source, tmp_path / "dapo_hub_copy.jsonl", repeats=3)
    stream = ProblemStream(str(rows), seed=0, difficulty=config.data.difficulty, dedupe=config.data.dedupe)
    assert [p.problem for p in stream.problems] == list(dict.fromkeys(p.problem for p in source))
    assert [p.answer for p in stream.problems[:3]] == [p.answer for p in source[:3]]
    assert stream.counts == {"rows": 600, "unwrapped": 600, "duplicates": 600 - len(stream.problems)}

    with make_env(config.env, sandbox_backend="local") as env:
        prompt, info = env.reset(options={"problem": stream.problems[0]})
    assert prompt == source[0].problem  # the problem alone, as the env's template renders it
    system = info["messages"][0]["content"]
    assert "<answer>" in system and "\\boxed" in system and "Answer: $Answer" not in system


def test_shared_dapo_file_is_deduplicated_on_load(shared_data):
    path = shared_data / "dapo_math_17k.jsonl"
    texts = [json.loads(line)["problem"] for line in path.read_text().splitlines()]
    stream = ProblemStream(str(path), seed=0)
    assert len(stream.problems) == len(set(t.strip() for t in texts)) < len(texts)
    assert stream.counts == {
        "rows": len(texts),
        "unwrapped": 0,
        "duplicates": len(texts) - len(stream.problems),
    }
    kept = ProblemStream(str(path), seed=0, dedupe=False)
    assert len(kept.problems) == len(texts)
