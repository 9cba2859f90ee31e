"""The method registry: every built-in name loads, a config accepts exactly the registered names, and
a user's own method registered by name trains through the public Trainer with its own selection."""

from __future__ import annotations

import types

import pytest
import torch

from stare_agent.config import ConfigError, load_config
from stare_agent.engines.scripted import ScriptedEngine
from stare_agent.methods import (
    MethodRegistryError,
    make_method,
    method_class,
    method_names,
    register_method,
)
from stare_agent.methods.base import Batch, Method, Selection
from stare_agent.models import tiny_model
from stare_agent.options import METHODS
from stare_agent.train.trainer import Trainer
from tests.stare_agent.train.test_trainer import make_config, problem_file  # noqa: F401


class HalfOnPositive(Method):
    """A user's method: weight 1/2 on every model token of positive advantage, 1 elsewhere."""

    pre_update = True

    def select(self, batch: Batch) -> Selection:
        pre = batch.pre
        weights = torch.where(pre.mask.bool() & (pre.advantages > 0), 0.5, 1.0)
        return Selection(weights, metrics={"half/tokens": float((weights == 0.5).sum())})


def test_every_built_in_method_loads_and_a_config_names_only_registered_ones():
    assert method_names()[:3] == ("grpo", "grpo_ds", "stare")
    for name in method_names():
        cls = method_class(name)
        assert issubclass(cls, Method)
        assert make_method(load_config(None, [f"algorithm.name={name}"]).algorithm).name == name
    # the selectors have a pre-update pass; the closed loop's two read its gate
    assert {n for n in method_names() if method_class(n).gated} == {"stare", "first_order"}
    assert not method_class("grpo_ds").pre_update and method_class("kl_cov").pre_update
    with pytest.raises(
        ConfigError, match=r"algorithm.name='ppo' is not valid: use one of grpo, grpo_ds, stare"
    ):
        load_config(None, ["algorithm.name=ppo"])


def test_registering_again_is_a_no_op_and_another_entry_under_a_taken_name_is_refused():
    register_method("stare", "stare_agent.methods.stare:Stare")  # the same: nothing happens
    with pytest.raises(MethodRegistryError, match=r"method 'stare' is already registered \(stare_agent"):
        register_method("stare", HalfOnPositive)
    register_method("test_broken", "no_such_module:Nothing")
    try:
        with pytest.raises(
            MethodRegistryError, match=r"method 'test_broken': cannot load no_such_module:Nothing"
        ):
            method_class("test_broken")
    finally:
        METHODS.pop("test_broken")


def test_a_users_method_registered_by_name_trains_with_its_own_weights(tmp_path, problem_file):  # noqa: F811
    register_method("test_half_on_positive", HalfOnPositive)
    try:
        config = make_config(
            tmp_path, problem_file, "algorithm.name=test_half_on_positive", "trainer.steps=1"
        )
        model, tokenizer = tiny_model()
        trainer = Trainer(
            config, model=model, tokenizer=tokenizer, engine=ScriptedEngine(tokenizer, _policy())
        )
        assert isinstance(trainer.method, HalfOnPositive)
        seen = []
        update = trainer.learner.update

        def recording(self, trajectories, advantages, weights=None, old_logprobs=None, **kw):
            seen.append(weights)
            return update(trajectories, advantages, weights, old_logprobs, **kw)

        trainer.learner.update = types.MethodType(recording, trainer.learner)
        last = trainer.fit()["last"]
    finally:
        METHODS.pop("test_half_on_positive")
    assert len(seen) == 1 and seen[0] is not None
    assert int((seen[0] == 0.5).sum()) == last["half/tokens"] > 0  # its metric logged with the step


def _policy():
    from tests.stare_agent.train.scripted_training import scripted_policy

    return scripted_policy()
