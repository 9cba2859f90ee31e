"""The research floor's trainer: the product's step with this project's variants and instruments, on the
tiny model with scripted rollouts (tests/stare_agent/train/scripted_training.py)."""

from __future__ import annotations

import pytest

from stare_agent.config import ConfigError, load_config
from stare_agent.engines.scripted import ScriptedEngine
from stare_agent.models import tiny_model
from stare_agent.train.trainer import Trainer
from stare_research.config import load_research_config
from stare_research.trainer import ResearchTrainer
from tests.stare_agent.train.scripted_training import overrides, scripted_policy, write_problems


@pytest.fixture
def problem_file(tmp_path):
    return write_problems(tmp_path / "problems.jsonl")


def _step(trainer_class, config) -> dict:
    model, tokenizer = tiny_model()
    trainer = trainer_class(
        config, model=model, tokenizer=tokenizer, engine=ScriptedEngine(tokenizer, scripted_policy())
    )
    try:
        trainer.step = 1
        return trainer.train_step()
    finally:
        trainer.close()


def test_the_mechanism_metrics_read_the_step_and_change_nothing_in_it(tmp_path, problem_file):
    """The same step through the product's trainer and the research trainer (mechanism metrics on): the
    same gate, selection, loss and entropy; only the research trainer logs the first-order metrics, and
    with the gate on the update's gradient-mass-weighted mean weight lies in [1, W]."""
    extra = ["algorithm.gate=always_on", "algorithm.variant=C2"]
    base = overrides(str(tmp_path / "run"), str(problem_file), 1) + extra
    product = _step(Trainer, load_config(None, base))
    research = _step(
        ResearchTrainer, load_research_config(None, [*base, f"trainer.run_dir={tmp_path / 'r'}"])
    )
    for key in ("gate_on", "stare/L_plus", "stare/L_minus", "frac_reweighted", "loss", "entropy"):
        assert research[key] == pytest.approx(product[key], rel=1e-6), key
    assert 0 <= research["stare/L_plus_raising"] <= 1 and 1 <= research["stare/mass_weight"] <= 1.1
    assert "stare/dH_first_order_L_plus" in research and "stare/mass_weight" not in product


def test_the_gate_on_the_whole_draw_and_the_raising_l_plus(tmp_path, problem_file):
    """research.gate_batch=drawn and research.L_plus_rule=top_k_raising: the scripted policy gives every
    group reward variance, so the draw is the kept batch and the two gates read the same entropy; the
    raising rule keeps only L+ tokens with a negative first-order effect c_t."""
    extra = ["research.gate_batch=drawn", "research.L_plus_rule=top_k_raising"]
    config = load_research_config(None, overrides(str(tmp_path / "run"), str(problem_file), 1) + extra)
    record = _step(ResearchTrainer, config)
    assert record["gate_on"] == 1 and record["entropy"] == pytest.approx(
        record["stare/entropy_kept"], rel=1e-6
    )
    assert record["stare/L_plus_raising"] == 1.0 or record["stare/L_plus"] == 0


def test_the_other_entropy_controls_log_their_first_order_response(tmp_path, problem_file):
    config = load_research_config(
        None, overrides(str(tmp_path / "run"), str(problem_file), 1) + ["algorithm.name=kl_cov"]
    )
    metrics = _step(ResearchTrainer, config)
    assert "entropy_control/dH_first_order" in metrics and "kl_cov/frac_selected" in metrics


def test_the_product_refuses_the_research_section_with_its_cause_and_fix(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("research:\n  gate_batch: drawn\n")
    with pytest.raises(ConfigError, match=r"config key 'research' in .* is read by the research instruments"):
        load_config(path)
    assert load_research_config(path).research.gate_batch == "drawn"
    with pytest.raises(ConfigError, match=r"research.gate_batch='all' is not valid: use one of kept, drawn"):
        load_research_config(None, ["research.gate_batch=all"])


@pytest.mark.parametrize(
    "old,new",
    [
        ("trainer.entropy_bank=b.jsonl", "research.entropy_bank"),
        ("algorithm.gate_batch=drawn", "research.gate_batch"),
    ],
)
def test_a_key_of_a_run_saved_before_the_research_section_names_its_new_name(old, new):
    with pytest.raises(
        ConfigError, match=rf"config key '{old.split('=')[0]}' in the overrides is '{new}' since 0.2.0"
    ):
        load_config(None, [old])
    with pytest.raises(ConfigError, match=rf"is '{new}' since 0.2.0"):
        load_research_config(None, [old])
