"""Adapters that put our environments, sandboxes and answer checker into other trainers.

- :mod:`stare_integrations.verl_tool`: the stateful code interpreter as a verl tool (``BaseTool``) and
  the answer checker as a verl ``compute_score`` (``pip install 'stare-agent[verl]'``).
- :mod:`stare_integrations.trl_rollout`: a TRL ``GRPOTrainer`` ``rollout_func`` that plays our
  environment's episodes token-exactly, and the reward function that reads their rewards
  (``pip install 'stare-agent[trl]'``).
- :mod:`stare_integrations.verifiers_env`: our environment as a verifiers environment
  (``load_environment``), with our sandbox as its tool and our checker as its rubric
  (``pip install 'stare-agent[verifiers]'``).

A package of its own, above ``stare_envs`` and ``stare_sandbox``: each module imports its trainer, which the base
install does not have, so none of this can live in ``stare_envs`` (whose import must work with the base
install alone) and nothing here is imported by ``import stare_envs``. The verl and verifiers adapters use only
``stare_envs`` and ``stare_sandbox`` (no torch of ours; verl brings its own); the TRL adapter also uses
``stare_agent``'s transformers engine, since TRL trains a transformers model in the same process.
Each module is imported on its own; this package imports none of them.
"""
