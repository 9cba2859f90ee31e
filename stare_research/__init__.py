"""stare-agent's research instruments: what STARE does to entropy, measured from above the product.

- ``study``: GRPO-ds against STARE and its ablations over seeds (``stare-agent study``).
- ``replay``: a learner variant trained on the batches a run saved (``stare-agent replay``).
- ``lab``: a tabular and a tiny-transformer policy on synthetic tasks (``python -m stare_research.lab``).
- ``entropy_response``: the one-step entropy response of an update, token subset by subset.
- ``entropy_effect``: each token's first-order entropy change, and the mechanism metrics.
- ``entropy_bank``: the held-out entropy bank, the policy's entropy on fixed tokens.
- ``config``, ``trainer``, ``diagnostics``: this project's variants (the gate on the whole draw, L+
  restricted to entropy raisers) and instruments on the product's trainer, through its one
  diagnostics hook (``stare_agent.train.diagnostics``).

The product never imports this package: its CLI verbs come in through the ``stare_agent.commands``
entry points. ``pip install 'stare-agent[research]'``; docs: the Research section of the site.
"""
