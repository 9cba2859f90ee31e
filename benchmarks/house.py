"""House measurements of the tree, side by side with a baseline revision (checked out with `git worktree add`
into a temporary folder, removed after):

- README.md lines;
- files (*.py) per folder: stare_agent/'s top level and each package of sandbox, envs, stare_agent,
  stare_integrations;
- import circles among the project's modules (sandbox, envs, stare_agent, stare_integrations): every
  `import`/`from ... import` in a module, function-level ones included, `if TYPE_CHECKING:` blocks
  excluded; `from a import b` is an edge to a.b where that is a module, else to a. Circles are the strongly
  connected components of that graph with more than one module (or a module importing itself), and cycles
  the elementary cycles within them;
- the longest function (lines, `def` to its last line) in the trainer (stare_agent/train/trainer.py, or
  stare_agent/trainer.py in older trees) and in sandbox/kernel.py;
- the config walk: how many project modules are imported when `stare-agent train` (default config) reaches
  Trainer.__init__ (a subprocess of the tree's own code, stopped there);
- `make test-fast`'s wall time (median of --repeats; the target's recipe with this checkout's .venv), where\n  the tree's Makefile has that target.

Usage: python benchmarks/house.py [--baseline 95b041c] [--skip-tests] [--repeats 1]
"""

from __future__ import annotations

import argparse
import ast
import itertools
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import networkx as nx

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("sandbox", "envs", "stare_agent", "stare_integrations")
CYCLE_CAP = 100_000  # elementary cycles counted at most (a dense tangle has exponentially many)

# Run inside the measured tree (cwd and sys.path[0] = the tree): the project modules loaded when
# `stare-agent train` enters Trainer.__init__.
WALK = """
import os, sys
sys.path.insert(0, os.getcwd())
PACKAGES = {packages!r}

def hook(frame, event, arg):
    code = frame.f_code
    if event == "call" and code.co_name == "__init__" and code.co_filename.endswith("trainer.py"):
        owner = frame.f_locals.get("self")
        if type(owner).__name__ == "Trainer":
            mods = sorted(m for m in sys.modules if m.split(".")[0] in PACKAGES)
            print(len(mods), " ".join(mods), flush=True)
            os._exit(0)

sys.setprofile(hook)
from stare_agent.cli import main
main(["train"])
print("never reached Trainer.__init__", flush=True)
os._exit(1)
"""


def module_name(tree: Path, path: Path) -> str:
    parts = list(path.relative_to(tree).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules(tree: Path) -> dict[str, Path]:
    return {
        module_name(tree, path): path
        for package in PACKAGES
        if (tree / package).is_dir()
        for path in sorted((tree / package).rglob("*.py"))
    }


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(node: ast.AST):
    """Every Import/ImportFrom under node, at any depth, skipping `if TYPE_CHECKING:` bodies."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child):
            for other in child.orelse:
                yield from _imports_of(other)
            continue
        yield from _imports_of(child)


def _imports_of(node: ast.AST):
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node
    yield from _imports(node)


def import_graph(tree: Path) -> nx.DiGraph:
    """module -> project module it imports (function-level imports included, TYPE_CHECKING excluded)."""
    modules = project_modules(tree)
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in _imports(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = name.split(".") if is_package else name.split(".")[:-1]
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for target in targets:
                while target and target not in modules:  # `import a.b.c` of a non-module attribute
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph.add_edge(name, target)
    return graph


def import_circles(tree: Path) -> tuple[list[list[str]], int]:
    """The circles (sorted module lists) and the number of elementary cycles (at most CYCLE_CAP)."""
    graph = import_graph(tree)
    circles = sorted(sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1)
    cycles = 0
    for cycles, _ in enumerate(nx.simple_cycles(graph), 1):  # noqa: B007
        if cycles >= CYCLE_CAP:
            break
    return circles, cycles


def longest_function(path: Path) -> str:
    if not path.exists():
        return "n/a"
    best = max(
        (
            (node.end_lineno - node.lineno + 1, node.name)
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        ),
        default=(0, "-"),
    )
    return f"{best[0]} ({best[1]})"


def files_per_folder(tree: Path) -> dict[str, int]:
    counts = {"stare_agent/ (top level)": len(list((tree / "stare_agent").glob("*.py")))}
    for package in PACKAGES:
        for init in sorted((tree / package).rglob("__init__.py")):
            folder = init.parent
            if folder == tree / "stare_agent":
                continue
            counts[f"{folder.relative_to(tree)}/"] = len(list(folder.glob("*.py")))
    return counts


def config_walk(tree: Path) -> str:
    python = REPO / ".venv" / "bin" / "python"
    run = subprocess.run(
        [str(python if python.exists() else sys.executable), "-c", WALK.format(packages=PACKAGES)],
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=600,
    )
    first = (run.stdout.strip().splitlines() or [""])[0].split()
    if run.returncode != 0 or not first or not first[0].isdigit():
        return f"error: {(run.stderr.strip().splitlines() or ['?'])[-1]}"
    return first[0]


def time_test_fast(tree: Path, repeats: int) -> str:
    """The recipe of the tree's `test-fast` target (its `setup` prerequisite left out: no install into the
    shared .venv), run in the tree with this checkout's .venv."""
    makefile = (tree / "Makefile").read_text(encoding="utf-8") if (tree / "Makefile").exists() else ""
    if "\ntest-fast:" not in makefile:
        return "n/a (no target)"
    lines = makefile.split("\ntest-fast:", 1)[1].splitlines()[1:]
    recipe = " && ".join(line.strip() for line in itertools.takewhile(lambda x: x.startswith("\t"), lines))
    recipe = recipe.replace(".venv/bin/", f"{REPO / '.venv' / 'bin'}/")
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run = subprocess.run(["bash", "-c", recipe], cwd=tree, capture_output=True, text=True)
        times.append(time.perf_counter() - start)
    summary = (run.stdout.strip().splitlines() or ["?"])[-1].strip("= ")
    return f"{statistics.median(times):.0f} s (median of {repeats}; last: {summary})"


def measure(tree: Path, skip_tests: bool, repeats: int) -> dict[str, str]:
    trainer = tree / "stare_agent" / "train" / "trainer.py"
    if not trainer.exists():
        trainer = tree / "stare_agent" / "trainer.py"
    circles, cycles = import_circles(tree)
    rows = {
        "README.md lines": str(len((tree / "README.md").read_text(encoding="utf-8").splitlines())),
        **{f"files in {k}": str(v) for k, v in files_per_folder(tree).items()},
        "import circles (modules in them)": f"{len(circles)} ({sum(map(len, circles))})",
        "import cycles (elementary)": f"{cycles}{'+' if cycles >= CYCLE_CAP else ''}",
        "longest function, the trainer": f"{longest_function(trainer)} {trainer.relative_to(tree)}",
        "longest function, sandbox/kernel.py": longest_function(tree / "sandbox" / "kernel.py"),
        "config walk: project modules at Trainer.__init__": config_walk(tree),
        "make test-fast": "skipped" if skip_tests else time_test_fast(tree, repeats),
    }
    for n, circle in enumerate(circles, 1):
        rows[f"circle {n}"] = " ".join(circle)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default="95b041c", help="git revision to compare with")
    parser.add_argument("--skip-tests", action="store_true", help="do not time `make test-fast`")
    parser.add_argument("--repeats", type=int, default=1, help="runs of `make test-fast` per tree")
    args = parser.parse_args()

    current = measure(REPO, args.skip_tests, args.repeats)
    temp = Path(tempfile.mkdtemp(prefix="house-"))
    worktree = temp / "baseline"
    subprocess.run(
        ["git", "worktree", "add", "--detach", "-q", str(worktree), args.baseline], cwd=REPO, check=True
    )
    try:
        baseline = measure(worktree, args.skip_tests, args.repeats)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=REPO, check=False)
        shutil.rmtree(temp, ignore_errors=True)

    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    # One row per measure; a folder or circle found in one tree only shows "-" in the other.
    names = list(dict.fromkeys([*current, *baseline]))

    def group(name: str) -> tuple[int, str]:
        prefix = name.split(" ")[0]
        return {"README.md": 0, "files": 1, "circle": 3}.get(prefix, 2), name if prefix == "files" else ""

    names.sort(key=group)
    width = max(map(len, names))
    col = max(24, *(len(v) for v in [*current.values(), *baseline.values()] if len(v) < 60))
    print(
        f"{'':{width}}  {'baseline ' + args.baseline:{col}}  {'current (' + head.stdout.strip() + ' + edits)'}"
    )
    for name in names:
        print(f"{name:{width}}  {baseline.get(name, '-'):{col}}  {current.get(name, '-')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
