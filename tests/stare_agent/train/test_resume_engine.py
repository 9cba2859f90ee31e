"""Resume hands the restored policy to the rollout engine before the first rollout."""

from __future__ import annotations

import copy

import pytest

from stare_agent.config import load_config
from stare_agent.engines import TransformersEngine
from stare_agent.models import tiny_model
from stare_agent.train.trainer import Trainer
from tests.stare_agent.parity_env import PARITY_RUN


class RecordingEngine(TransformersEngine):
    """A transformers engine on its own copy of the policy (as an SGLang server holds its own),
    recording every generation."""

    def __init__(self, model, tokenizer) -> None:
        super().__init__(copy.deepcopy(model), tokenizer)
        self.generations: list[tuple[list[int], list[float]]] = []

    def generate(self, prompts, params, stop):
        out = super().generate(prompts, params, stop)
        self.generations += [(g.token_ids, g.logprobs) for g in out]
        return out


def _run(run_dir, steps: int, resume: bool) -> RecordingEngine:
    config = load_config(
        None,
        [
            *PARITY_RUN,
            f"trainer.steps={steps}",
            "trainer.checkpoint_every=1",
            f"trainer.run_dir={run_dir}",
        ],
    )
    model, tokenizer = tiny_model()
    engine = RecordingEngine(model, tokenizer)
    summary = Trainer(config, model=model, tokenizer=tokenizer, engine=engine, resume=resume).fit()
    assert summary["last"]["skipped"] == 0  # every step updates the weights
    return engine


@pytest.mark.slow  # 13 s: an interrupted and an uninterrupted run, on 2 loaded cores
def test_first_rollout_after_resume_equals_the_uninterrupted_runs(tmp_path):
    whole = _run(tmp_path / "whole", 2, resume=False)
    _run(tmp_path / "broken", 1, resume=False)
    resumed = _run(tmp_path / "broken", 2, resume=True)
    step_2 = whole.generations[-len(resumed.generations) :]
    assert len(whole.generations) > len(resumed.generations) > 0
    # token for token and log-prob for log-prob: the engine samples from the restored policy
    assert resumed.generations == step_2


@pytest.mark.slow  # 15 s: three short scripted runs on 2 loaded cores
def test_a_damaged_last_checkpoint_resumes_from_the_one_before_and_says_so(tmp_path, capsys):
    import json

    _run(tmp_path / "run", 2, resume=False)
    damaged = tmp_path / "run" / "checkpoints" / "step-000002"
    for path in (damaged / "learner").rglob("*"):
        if path.is_file():
            path.write_bytes(path.read_bytes()[:100])  # a copy cut short
    capsys.readouterr()
    _run(tmp_path / "run", 3, resume=True)
    said = capsys.readouterr().out
    assert f"checkpoint {damaged} could not be read (" in said and "): trying step-000001" in said
    assert f"resumed from {tmp_path / 'run' / 'checkpoints' / 'step-000001'} (step 1)" in said
    steps = [
        json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert steps == [1, 2, 3]  # step 2 trained again, logged once
