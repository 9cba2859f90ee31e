"""Names that mean one thing: "engine" is a rollout engine (never the DeepSpeed-wrapped model, which
is ``Learner.ds_model``), and "group" is a GRPO group (a torch.distributed group is ``process_group``)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from stare_agent.algorithms import stare

ROOT = Path(__file__).resolve().parents[2]


def test_the_deepspeed_model_is_not_called_an_engine():
    source = (ROOT / "stare_agent" / "train" / "learner.py").read_text()
    assert "self.ds_model, _, _, self.scheduler = deepspeed.initialize(" in source
    assert not re.search(r"\bengine\s*=|self\.engine\b", source)


def test_process_groups_are_called_process_group():
    for function in (stare.entropy_gate, stare.stare_weights):
        parameters = inspect.signature(function).parameters
        assert "process_group" in parameters and "group" not in parameters, function.__name__
