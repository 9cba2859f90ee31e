"""GRPO-ds, the baseline: every token of the batch trains with its group's advantage, weight 1.

    A_i = (r_i - mean_group r) / (std_group r + 1e-6),  broadcast to the episode's model tokens

(``algorithms.advantages.grpo_advantages``); dynamic sampling (the "-ds") is ``data.dynamic_sampling``.
``grpo`` is the same method under the name the field uses beside the others.
"""

from stare_agent.methods.base import Method


class GRPO(Method):
    """No selection, no bonus: the dual-clip token-mean loss alone."""
