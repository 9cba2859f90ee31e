#!/usr/bin/env bash
# `stare-agent paper-run` from a clone, with .venv's Python (or PYTHON=/path/to/python): the paper's
# headline run on one 8-GPU node, cold-start SFT of Qwen2.5-7B on ReTool's traces, then STARE-O1 for
# 2,000 steps at 64 prompts x 8 samples (and GRPO-ds / STARE-C2 with --arms), each under torchrun on
# this node's GPUs; the recipe, its needs and its flags: docs/scaling.md ("The paper's run"),
# `stare-agent paper-run --help`.
#   bash scripts/launch_paper_run.sh --dry-run                      # the commands, nothing run
#   bash scripts/launch_paper_run.sh --arms stare-o1 grpo-ds stare-c2
#   bash scripts/launch_paper_run.sh --resume                       # after an interruption
# Runs from the repository root (the run directories go to runs/ unless --runs says otherwise).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
exec "$PY" -m stare_agent.cli paper-run "$@"
