"""The held-out entropy bank (research.entropy_bank): sampled once by a fresh run, read again by a
resumed run and by a replay, its teacher-forced entropy logged at each evaluation and equal to a
direct computation from the model's logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from stare_agent.engines.scripted import ScriptedEngine
from stare_agent.models import tiny_model
from stare_research.config import load_research_config
from stare_research.entropy_bank import EntropyBankError, bank_entropy, read_bank
from stare_research.replay import replay
from stare_research.trainer import ResearchTrainer
from tests.stare_agent.train.scripted_training import overrides, scripted_policy, write_problems


@pytest.fixture
def problem_file(tmp_path):
    return write_problems(tmp_path / "problems.jsonl")


def _config(tmp_path: Path, problem_file: Path, steps: int, *extra: str):
    bank = [f"data.eval={problem_file}", "data.eval_limit=2", "data.eval_samples=2", "trainer.eval_every=1"]
    bank += [f"research.entropy_bank={tmp_path / 'bank.jsonl'}", "trainer.save_rollouts=true"]
    return load_research_config(
        None, overrides(str(tmp_path / "run"), str(problem_file), steps) + bank + list(extra)
    )


def _fit(config, resume: bool = False) -> ResearchTrainer:
    model, tokenizer = tiny_model()  # seeded: the same start every time
    trainer = ResearchTrainer(
        config,
        model=model,
        tokenizer=tokenizer,
        engine=ScriptedEngine(tokenizer, scripted_policy()),
        resume=resume,
    )
    trainer.fit()
    return trainer


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _direct_entropy(model, bank) -> float:
    """Each episode alone, unpadded: the mean over mask-1 response tokens of -sum_v p_v log p_v, the
    distribution at position i predicting token i + 1."""
    total, count = 0.0, 0
    with torch.no_grad():
        for t in bank:
            ids = torch.tensor([t.prompt_ids + t.response_ids])
            logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
            H = -(logp.exp() * logp).sum(-1)  # [L]
            for j, m in enumerate(t.loss_mask):
                if m:
                    total += float(H[len(t.prompt_ids) + j - 1])
                    count += 1
    return total / count


def test_a_fresh_run_samples_the_bank_and_logs_its_entropy_at_each_evaluation(tmp_path, problem_file):
    trainer = _fit(_config(tmp_path, problem_file, 2))
    bank = read_bank(tmp_path / "bank.jsonl")
    assert len(bank) == 4  # 2 held-out problems x 2 samples
    assert all(any(t.loss_mask) for t in bank)
    records = _records(tmp_path / "run")
    logged = [r["eval/bank_entropy"] for r in records]
    assert len(logged) == 2 and logged[0] != logged[1]  # lr 1e-3 moves the policy between evaluations
    # the last evaluation's value is the trained policy's entropy on the bank, computed directly
    assert logged[1] == pytest.approx(_direct_entropy(trainer.learner.module, bank), rel=1e-5)
    start, _ = tiny_model()
    assert bank_entropy(start, bank, 0) == pytest.approx(_direct_entropy(start, bank), rel=1e-5)


def test_a_resumed_run_reads_the_same_bank_and_refuses_to_sample_one_after_training(tmp_path, problem_file):
    _fit(_config(tmp_path, problem_file, 1))
    path = tmp_path / "bank.jsonl"
    first = path.read_bytes()
    _fit(_config(tmp_path, problem_file, 2), resume=True)
    assert path.read_bytes() == first
    assert [r["step"] for r in _records(tmp_path / "run") if "eval/bank_entropy" in r] == [1, 2]
    path.unlink()
    with pytest.raises(EntropyBankError, match="this run has trained 2 steps"):
        _fit(_config(tmp_path, problem_file, 3), resume=True)


def test_a_replay_logs_the_runs_bank_entropy_at_the_runs_evaluation_steps(tmp_path, problem_file):
    _fit(_config(tmp_path, problem_file, 2))
    ran = _records(tmp_path / "run")
    model, tokenizer = tiny_model()
    replay(tmp_path / "run", tmp_path / "same", policy=model, tokenizer=tokenizer)
    same = _records(tmp_path / "same")
    # the run's own config on its own batches: the same weights after each step, so the same entropy
    assert [r["eval/bank_entropy"] for r in same] == [r["eval/bank_entropy"] for r in ran]
    model, tokenizer = tiny_model()
    replay(tmp_path / "run", tmp_path / "w3", ["algorithm.W=3.0"], policy=model, tokenizer=tokenizer)
    assert [r["eval/bank_entropy"] for r in _records(tmp_path / "w3")][-1] != ran[-1]["eval/bank_entropy"]


def test_a_replay_reads_the_bank_only_at_the_runs_evaluation_steps_and_the_last(tmp_path, problem_file):
    _fit(_config(tmp_path, problem_file, 3, "trainer.eval_every=2"))
    model, tokenizer = tiny_model()
    replay(tmp_path / "run", tmp_path / "out", policy=model, tokenizer=tokenizer)
    assert [r["step"] for r in _records(tmp_path / "out") if "eval/bank_entropy" in r] == [2, 3]
