"""Every declared dependency is used: imported by the package, or needed by a library it calls (each
such case named here with the reason). A dependency nobody imports is a cost with no use."""

from __future__ import annotations

import re
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]
IMPORT_NAMES = {"jupyter-client": "jupyter_client", "math-verify": "math_verify"}
# Needed without an import of ours: the library we call imports them.
INDIRECT = {
    "ipykernel": "the sandbox kernel's process runs ipykernel (started with -m, not imported)",
    "sympy": "math_verify checks answers with it; stare_envs.rewards preloads it in the checker's forkserver",
    "accelerate": "transformers needs it to load models with low_cpu_mem_usage / device_map",
    "gguf": "transformers reads the embedded GGUF model with it",
    "safetensors": "transformers' save_pretrained/from_pretrained format",
    "tensorboard": "torch.utils.tensorboard's SummaryWriter (logger.backends: tensorboard)",
}


def _imported(name: str) -> bool:
    pattern = re.compile(rf"^\s*(import|from) {re.escape(name)}\b", re.M)
    sources = [*ROOT.glob("sandbox/**/*.py"), *ROOT.glob("envs/**/*.py"), *ROOT.glob("stare_agent/**/*.py")]
    return any(pattern.search(path.read_text()) for path in sources)


def test_base_and_train_dependencies_are_used():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = project["dependencies"] + project["optional-dependencies"]["train"]
    for requirement in declared:
        name = re.split(r"[<>=\[ ;]", requirement, maxsplit=1)[0]
        if name in INDIRECT:
            continue
        assert _imported(IMPORT_NAMES.get(name, name).replace("-", "_")), (
            f"{name} is declared in pyproject.toml but nothing imports it: drop it, or name why in INDIRECT"
        )
