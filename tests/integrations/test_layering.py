"""Where the adapters sit: ``stare_integrations`` imports the layers below it, and nothing below imports
it; the verl and verifiers adapters use only ``stare_envs`` and ``stare_sandbox`` (no torch or ``stare_agent`` of
ours), so a verl or verifiers user needs neither our trainer nor its packages."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
IMPORT = re.compile(r"\s*(?:from|import)\s+([\w.]+)")


def imported(path: Path) -> list[tuple[int, str]]:
    found = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        match = IMPORT.match(line)
        if match:
            found.append((number, match.group(1).split(".")[0]))
    return found


def test_no_lower_layer_imports_the_adapters():
    bad = [
        f"{path.relative_to(REPO)}:{n}"
        for package in ("sandbox", "envs", "stare_agent")
        for path in (REPO / package).rglob("*.py")
        for n, top in imported(path)
        if top == "stare_integrations"
    ]
    assert not bad, bad


def test_verl_and_verifiers_adapters_need_no_torch_or_trainer_of_ours():
    for name in ("__init__", "verl_tool", "verifiers_env"):
        tops = {top for _, top in imported(REPO / "stare_integrations" / f"{name}.py")}
        assert not tops & {"torch", "transformers", "deepspeed", "stare_agent"}, (name, tops)
    # The TRL adapter imports stare_agent's engine only when TRL calls it without an engine of its own.
    trl_tops = {top for _, top in imported(REPO / "stare_integrations" / "trl_rollout.py")}
    assert "torch" not in trl_tops
