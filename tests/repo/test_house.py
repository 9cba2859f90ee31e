"""The house's shape, held by tests so that drift fails CI the day it happens: size budgets for every
module, class and function of the product, the Trainer a loop over a method it never names, and the
research floor on the product's declared hooks only."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PRODUCT = ["sandbox", "envs", "stare_agent", "stare_integrations", "stare_research"]
MODULE_LINES, CLASS_LINES, FUNCTION_LINES = 900, 600, 80
OVER_BUDGET = {
    # What was over its budget when the budgets were set, at its size then: each may shrink, never
    # grow; split one and take it off this list.
    "stare_agent/algorithms/rollout_correction.py:correction_weights": 118,
    "stare_agent/algorithms/stare.py:stare_weights": 104,
    "stare_agent/cli.py:build_parser": 198,
    "stare_agent/config.py": 1225,
    "stare_agent/engines/__init__.py:start_engine": 101,
    "stare_agent/engines/vllm_engine.py:VLLMEngine.__init__": 81,
    "stare_agent/evaluation.py:evaluate": 99,
    "stare_agent/evaluation.py:_evaluate": 85,
    "stare_agent/recipes/quickstart.py:_run": 106,
    "stare_agent/train/learner.py:Learner": 670,
    "stare_agent/train/learner.py:Learner.update": 123,
    "stare_agent/train/sft.py:_sft": 104,
    "envs/tool_env.py:ToolEnv.__init__": 82,
    "sandbox/doctor.py:diagnose_ray": 128,
    "sandbox/warden.py:prepare_kernel": 89,
    "stare_research/lab.py:_update": 85,
}


def _sizes() -> dict[str, tuple[int, int]]:
    """Every product module, class and function (qualified within its module) -> (lines, budget)."""
    out: dict[str, tuple[int, int]] = {}
    for package in PRODUCT:
        for path in sorted((REPO / package).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            source = path.read_text()
            out[rel] = (len(source.splitlines()), MODULE_LINES)
            _visit(ast.parse(source), f"{rel}:", out)
    return out


def _visit(node: ast.AST, prefix: str, out: dict[str, tuple[int, int]]) -> None:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            budget = CLASS_LINES if isinstance(child, ast.ClassDef) else FUNCTION_LINES
            assert child.end_lineno is not None
            out[f"{prefix}{child.name}"] = (child.end_lineno - child.lineno + 1, budget)
            _visit(child, f"{prefix}{child.name}.", out)


def test_every_module_class_and_function_keeps_its_size_budget():
    sizes = _sizes()
    over = [
        f"{name}: {lines} lines, over its budget of {OVER_BUDGET.get(name, budget)}: split it"
        for name, (lines, budget) in sizes.items()
        if lines > OVER_BUDGET.get(name, budget)
    ]
    assert not over, "\n".join(over)
    gone = [name for name in OVER_BUDGET if name not in sizes or sizes[name][0] <= sizes[name][1]]
    assert not gone, f"back within budget or gone: take them off OVER_BUDGET: {gone}"


def test_the_trainer_is_a_loop_over_a_method_it_never_names():
    """No comparison with an algorithm's name anywhere in stare_agent/train (each method is a class in
    stare_agent/methods); the Trainer at most 600 lines, none of its methods over 60."""
    named = []
    for path in sorted((REPO / "stare_agent/train").glob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\b(alg|algorithm|cfg|config\.algorithm)\.name\s*(==|!=|\bin\b)", line):
                named.append(f"{path.name}:{n}: {line.strip()}")
    assert not named, "\n".join(named)
    sizes = _sizes()
    trainer = "stare_agent/train/trainer.py:Trainer"
    assert sizes[trainer][0] <= 600
    long = {k: v[0] for k, v in sizes.items() if k.startswith(f"{trainer}.") and v[0] > 60}
    assert not long, long


def test_the_research_trainer_overrides_no_private_method():
    """The research floor changes a run only through the product's declared hooks (``method=``,
    ``diagnostics=``), never by overriding the Trainer's private steps."""
    tree = ast.parse((REPO / "stare_research/trainer.py").read_text())
    research = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ResearchTrainer")
    private = [
        f.name
        for f in research.body
        if isinstance(f, ast.FunctionDef) and f.name.startswith("_") and f.name != "__init__"
    ]
    assert not private, private


README_BYTES, RESULTS_WORDS = 10_000, 120
# Words about how the project was made, not what it does: they belong in CHANGELOG.md.
PROCESS_WORDS = re.compile(
    r"\bissues? ?#?\d+|\bplayed\b|\brelease before\b|\breleases ago\b|\breported\b|\bthe tree before\b"
    r"|\bhardening pass\b|\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b",
    re.IGNORECASE,
)


def test_the_front_page_is_read_in_two_minutes():
    """README: at most 10 KB, its results one paragraph of at most 120 words (and a figure), and no
    words about how the project was made (issue numbers, commit hashes, "played", "reported")."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(text.encode()) <= README_BYTES, (
        f"README.md is {len(text.encode())} bytes (budget {README_BYTES})"
    )
    results = text.split("## Results", 1)[1].split("\n## ", 1)[0].strip()
    paragraphs = [p for p in results.split("\n\n") if p.strip() and not p.startswith("![")]
    assert len(paragraphs) == 1 and len(paragraphs[0].split()) <= RESULTS_WORDS, paragraphs
    assert "![" in results  # one figure
    found = [m.group() for m in PROCESS_WORDS.finditer(text)]
    assert not found, found


# The guides (not the research pages, which keep their plans' history for now) name no issue or release.
GUIDE_PROCESS_WORDS = re.compile(
    r"\bissues? ?#?\d+|\brelease before\b|\breleases ago\b|\bthe tree before\b|\bhardening pass\b|issue's",
    re.IGNORECASE,
)


def test_the_guides_speak_about_the_project_not_its_history():
    found = [
        f"{page.relative_to(REPO)}: {m.group()}"
        for page in sorted((REPO / "docs").glob("*.md"))
        for m in GUIDE_PROCESS_WORDS.finditer(page.read_text(encoding="utf-8"))
    ]
    assert not found, found
