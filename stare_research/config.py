"""The research section of a run's config: this project's instruments and variants, not the paper's.

A research run's config is a :class:`ResearchRunConfig`, the product's ``RunConfig`` with one more
section, ``research``, loaded by :func:`load_research_config` (the product's ``load_config`` with this
schema) and saved beside the run like any config. The product's ``stare-agent train`` refuses the
section with its cause and fix; ``stare-agent study`` and ``stare-agent replay`` read it.

Example:
    >>> config = load_research_config(None, ["research.gate_batch=drawn"])
    >>> (config.research.gate_batch, config.research.L_plus_rule, config.algorithm.W)
    ('drawn', 'top_k', 1.1)
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, cast, get_args

from stare_agent.config import ConfigError, RunConfig, load_config

GateBatch = Literal["kept", "drawn"]
LPlusRule = Literal["top_k", "top_k_raising", "random"]
LMinusRule = Literal["top_k", "random"]
GATE_BATCHES: tuple[str, ...] = get_args(GateBatch)
L_PLUS_RULES: tuple[str, ...] = get_args(LPlusRule)
L_MINUS_RULES: tuple[str, ...] = get_args(LMinusRule)


@dataclass
class ResearchSection:
    """This project's research variants and instruments (``stare_research.trainer.ResearchTrainer``).

    Attributes:
        entropy_bank: A held-out entropy bank (``stare_research.entropy_bank``): a JSONL file of episodes
            sampled once from the starting policy on the held-out problems (``data.eval``,
            ``data.eval_limit`` x ``data.eval_samples``, at ``env.temperature`` / ``env.top_p``); each
            held-out evaluation logs ``eval/bank_entropy``, the current policy's teacher-forced mean
            entropy on the bank's model tokens (float32). A fresh run samples the file when it does not
            exist; a resumed run, a replay and every run of a study read the same one. "": no bank.
        gate_batch: The tokens whose mean entropy STARE's gate reads: ``kept``, the groups dynamic
            sampling kept (the paper's definition), or ``drawn``, every group drawn this step before
            dynamic sampling drops the all-equal ones (once most prompts are solved the kept groups'
            entropy drifts far above the policy's; costs a log-prob pass over the dropped groups too).
        L_plus_rule: ``top_k``: L+ is the top P of T+ by surprisal (the paper); ``top_k_raising``: of
            those, only the tokens whose reinforcement raises entropy at first order (at low entropy
            the top 10 % by count reach into common tokens whose reinforcement lowers it); ``random``:
            L+'s placebo, W on as many tokens of T+ drawn uniformly at random in each selection block
            (one draw per step, seeded as ``L_minus_rule=random``'s), so a difference from STARE is the
            surprisal selection's. Needs STARE in the ``micro_batch`` scope.
        L_minus_rule: ``top_k``: C2's L- is the top P of T- by surprisal (the paper); ``random``: the
            placebo, M on as many tokens of T- drawn uniformly at random in each selection block
            (``stare_research.placebo``; one draw per step, seeded by ``trainer.seed`` and the step), so a
            difference from C2 is the surprisal selection's. Needs STARE-C2 in the ``micro_batch`` scope.
        mechanism_metrics: Log the first-order mechanism metrics every step with a pre-update pass
            (``stare/L_plus_raising``, ``stare/mass_weight``, ``stare/dH_first_order``, ...;
            ``entropy_control/dH_first_order`` for KL-Cov, Clip-Cov and forking tokens): two more
            reductions over the vocabulary in that pass.
    """

    entropy_bank: str = ""
    gate_batch: str = "kept"
    L_plus_rule: str = "top_k"
    L_minus_rule: str = "top_k"
    mechanism_metrics: bool = True

    def __post_init__(self) -> None:
        rules = (("gate_batch", GATE_BATCHES), ("L_plus_rule", L_PLUS_RULES), ("L_minus_rule", L_MINUS_RULES))
        for name, valid in rules:
            value = getattr(self, name)
            if value not in valid:
                raise ConfigError(f"research.{name}={value!r} is not valid: use one of {', '.join(valid)}")


@dataclass
class ResearchRunConfig(RunConfig):
    """A run of the research floor: the product's sections and ``research``."""

    research: ResearchSection = field(default_factory=ResearchSection)

    def __post_init__(self) -> None:
        alg = self.algorithm
        if self.research.L_plus_rule == "random" and (alg.name, alg.scope) != ("stare", "micro_batch"):
            raise ConfigError(
                f"research.L_plus_rule=random is STARE's L+ placebo, but the run is algorithm.name={alg.name} "
                f"scope={alg.scope}: set algorithm.name=stare algorithm.scope=micro_batch"
            )
        if self.research.L_minus_rule == "random" and (alg.name, alg.variant, alg.scope) != (
            "stare",
            "C2",
            "micro_batch",
        ):
            raise ConfigError(
                f"research.L_minus_rule=random is C2's placebo, but the run is algorithm.name={alg.name} "
                f"variant={alg.variant} scope={alg.scope}: set algorithm.name=stare algorithm.variant=C2 "
                "algorithm.scope=micro_batch"
            )


def load_research_config(
    path: str | os.PathLike[str] | None = None, overrides: Sequence[str] = ()
) -> ResearchRunConfig:
    """``stare_agent.config.load_config`` with the ``research`` section (same errors)."""
    return cast(ResearchRunConfig, load_config(path, overrides, schema=ResearchRunConfig))
