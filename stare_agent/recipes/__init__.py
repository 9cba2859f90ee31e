"""Recipes built from the training floor: the quickstart, the paired STARE / GRPO-ds study, its
plots, the dynamics lab (a tabular policy through the project's own algorithm functions), and the
launcher of the paper's 8-GPU run (``paper_run``)."""
