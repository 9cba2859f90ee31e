"""Recipes built from the training floor: the quickstart, the paired STARE / GRPO-ds study, its
plots, and the dynamics lab (a tabular policy through the project's own algorithm functions)."""
