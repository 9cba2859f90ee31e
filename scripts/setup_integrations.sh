#!/usr/bin/env bash
# The trainers the adapters in stare_integrations are tested against (tests/integrations/), installed into
# .venv without replacing any package the rest of the project uses (torch, transformers, deepspeed,
# omegaconf, packaging). Run by setup_python.sh; idempotent.
#
# - TRL and verifiers install with their dependencies: pip adds packages and replaces none (checked with
#   `pip install --dry-run`).
# - verl pins transformers<5.11, tensordict<=0.10, omegaconf 2.3 (through hydra-core) and pulls ray[default]:
#   it is installed with --no-deps, plus only what its tool, reward and agent-loop modules import (ray,
#   tensordict 0.10 and its small dependencies, codetiming, cachetools, fastapi). hydra-core, with the omegaconf and antlr4 it
#   pins, goes to .venv/verl-overlay (not on .venv's path), which the agent-loop test puts first on
#   PYTHONPATH in its own subprocess.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }

pip install "trl==1.16.0" "verifiers==0.3.1"
pip install "ray==2.60.0" orjson importlib_metadata cloudpickle codetiming cachetools fastapi
pip install --no-deps "verl==0.9.1" "tensordict==0.10.0" "pyvers==0.1.0"
overlay="$VENV/verl-overlay"
if [ ! -d "$overlay/hydra" ]; then
  pip install --no-deps --target "$overlay" "hydra-core==1.3.8" "omegaconf==2.3.1" "antlr4-python3-runtime==4.9.3"
fi
