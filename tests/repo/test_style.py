"""House rules that a reviewer would otherwise check by hand."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.packages import PACKAGES, modules

REPO = Path(__file__).resolve().parents[2]
CODE = [
    "sandbox",
    "envs",
    "stare_agent",
    "stare_integrations",
    "stare_research",
    "tests",
    "benchmarks",
    "examples",
    "scripts",
]


def test_imports_go_one_way_and_lower_layers_never_import_torch():
    """stare_agent -> stare_envs -> stare_sandbox; the two lower layers have no torch (users of other
    trainers)."""
    rules = {
        "stare_sandbox": ("torch", "stare_envs", "stare_agent"),
        "stare_envs": ("torch", "stare_agent"),
    }
    bad = []
    for package, forbidden in rules.items():
        for path in PACKAGES[package].rglob("*.py"):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                m = re.match(r"\s*(?:from|import)\s+([\w.]+)", line)
                if m and m.group(1).split(".")[0] in forbidden:
                    bad.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    assert not bad, "\n".join(bad)


def test_no_code_imports_the_folder_names():
    """sandbox/ and envs/ are imported as stare_sandbox and stare_envs only: the folder names are what a
    user's own packages are called, and an import of them works here (the repository is on sys.path)
    but not from the wheel. A test that plays a user's project imports the user's packages on a line
    that says so (``# the user's``)."""
    pattern = re.compile(r"^\s*(?:from\s+(?:sandbox|envs)(?:\.[\w.]+)?\s+import|import\s+(?:sandbox|envs)\b)")
    bad = [
        f"{path.relative_to(REPO)}:{n}: {line.strip()}"
        for folder in CODE
        for path in (REPO / folder).rglob("*.py")
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if pattern.match(line) and "# the user's" not in line
    ]
    assert not bad, "\n".join(bad)


def _imports(node: ast.AST, top: bool = True):
    """(imported module, at module level) for every import under node. An import under
    ``if TYPE_CHECKING:`` counts, as not at module level: a type-only import still ties two modules
    into one circle for a reader, for mypy and for the docs."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import):
            yield from ((alias.name, top) for alias in child.names)
        elif isinstance(child, ast.ImportFrom):
            yield from ((f"{child.module}.{alias.name}", top) for alias in child.names)
        else:
            type_only = isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test)
            inner = (
                top
                and not type_only
                and not isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            )
            yield from _imports(child, inner)


def _import_graph() -> dict[str, dict[str, bool]]:
    """module -> {project module it imports: at module level}; `from a import b` counts as a.b where that
    is a module, else a (the project uses absolute imports only: ruff's TID252)."""
    paths = modules()
    graph: dict[str, dict[str, bool]] = {}
    for name, path in paths.items():
        edges = graph.setdefault(name, {})
        for target, top in _imports(ast.parse(path.read_text(encoding="utf-8"))):
            while target and target not in paths:
                target = target.rpartition(".")[0]
            if target and target != name:
                edges[target] = edges.get(target, False) or top
    return graph


# Import edges that still close a circle, each to be cut (and then deleted here): none.
PENDING_CIRCLE_EDGES: list[tuple[str, str]] = []


def test_no_import_circles_among_the_projects_modules():
    """No module imports, even inside a function, a module that leads back to it (a package's __init__
    included): each layer and package stands on the ones below it."""
    graph = _import_graph()
    for module, target in PENDING_CIRCLE_EDGES:
        assert target in graph[module], (
            f"{module} no longer imports {target}: delete it from PENDING_CIRCLE_EDGES"
        )
        del graph[module][target]
    circles, done = [], set()

    def visit(module: str, path: list[str]) -> None:
        for target in sorted(graph[module]):
            if target in path:
                circles.append(" -> ".join([*path[path.index(target) :], target]))
            elif target not in done:
                visit(target, [*path, target])
        done.add(module)

    for module in sorted(graph):
        if module not in done:
            visit(module, [module])
    assert not circles, "\n".join(circles)


def test_the_product_never_imports_the_research_floor():
    """stare_research stands above the product: it registers its CLI verbs through entry points and
    reads runs through the trainer's diagnostics hook, so no product module imports it, even lazily."""
    bad = [
        f"{module} imports {target}"
        for module, edges in _import_graph().items()
        if not module.startswith("stare_research")
        for target in edges
        if target.startswith("stare_research")
    ]
    assert not bad, "\n".join(bad)


def test_the_floors_import_downward():
    """stare_agent's shared top-level modules import stare_agent.recipes only lazily (the CLI's
    subcommands), stare_agent.train never. envs/problems and envs/registry import no stare_agent:
    test_imports_go_one_way_and_lower_layers_never_import_torch (all of envs)."""
    graph = _import_graph()
    shared = ["config", "evaluation", "metrics", "models", "errors", "intervals", "provenance"]
    bad = [
        f"{module} imports {target} at module level"
        for module in [f"stare_agent.{m}" for m in [*shared, "config_reference", "cli"]]
        for target, top in graph[module].items()
        if top and target.startswith("stare_agent.recipes")
    ]
    bad += [
        f"{module} imports {target}"
        for module, edges in graph.items()
        if module.startswith("stare_agent.train")
        for target in edges
        if target.startswith("stare_agent.recipes")
    ]
    assert not bad, "\n".join(bad)
