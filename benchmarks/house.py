"""House measurements of the tree, side by side with a baseline revision (checked out with `git worktree add`
into a temporary folder, removed after):

- README.md lines, and the share of its characters in its Results section;
- files (*.py) per folder: stare_agent/'s top level and each package of the tree (read from its
  pyproject.toml: the import names of its folders, e.g. sandbox/ installed as stare_sandbox);
- import circles among the project's modules: every `import`/`from ... import` in a module,
  function-level ones included; `from a import b` is an edge to a.b where that is a module, else to a.
  Circles are the strongly connected components of that graph with more than one module (or a module
  importing itself), and cycles the elementary cycles within them; counted twice, without and with the
  imports under `if TYPE_CHECKING:`;
- `load_config` of the default config: project and all modules it imports, and whether torch is one;
- Sphinx roles (``:func:`...``` and the like) in the packages' docstrings, which the docs site must turn
  into links;
- the longest function (lines, `def` to its last line) in the trainer (stare_agent/train/trainer.py, or
  stare_agent/trainer.py in older trees) and in sandbox/kernel.py;
- the config walk: how many project modules are imported when `stare-agent train` (default config) reaches
  Trainer.__init__ (a subprocess of the tree's own code, stopped there);
- `make test-fast`'s wall time (median of --repeats; the target's recipe with this checkout's .venv), where\n  the tree's Makefile has that target.

Usage: python benchmarks/house.py [--baseline cf57e4c] [--skip-tests] [--repeats 1]
"""

from __future__ import annotations

import argparse
import ast
import itertools
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import networkx as nx

REPO = Path(__file__).resolve().parents[1]
OLD_PACKAGES = {
    "sandbox": "sandbox",
    "envs": "envs",
    "stare_agent": "stare_agent",
    "stare_integrations": "stare_integrations",
}
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


def packages(tree: Path) -> dict[str, str]:
    """Import name -> folder of each top-level package of ``tree`` (pyproject's package-dir), or the
    folder names of a tree from before the import names."""
    import tomllib

    setuptools = tomllib.loads((tree / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    if not isinstance(setuptools.get("packages"), list):  # packages.find: the folder names
        return OLD_PACKAGES
    mapping = setuptools.get("package-dir", {})
    tops = dict.fromkeys(name.split(".")[0] for name in setuptools["packages"])
    return {top: mapping.get(top, top) for top in tops}


def project_modules(tree: Path) -> dict[str, Path]:
    modules = {}
    for top, folder in packages(tree).items():
        for path in sorted((tree / folder).rglob("*.py")):
            parts = [top, *path.relative_to(tree / folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(node: ast.AST, type_only: bool):
    """Every Import/ImportFrom under node, at any depth; `if TYPE_CHECKING:` bodies only with ``type_only``."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child) and not type_only:
            for other in child.orelse:
                yield from _imports_of(other, type_only)
            continue
        yield from _imports_of(child, type_only)


def _imports_of(node: ast.AST, type_only: bool):
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node
    yield from _imports(node, type_only)


def import_graph(tree: Path, type_only: bool = False) -> nx.DiGraph:
    """module -> project module it imports (function-level imports included; TYPE_CHECKING ones with
    ``type_only``)."""
    modules = project_modules(tree)
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in _imports(ast.parse(path.read_text(encoding="utf-8"), str(path)), type_only):
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


def import_circles(tree: Path, type_only: bool = False) -> tuple[list[list[str]], int]:
    """The circles (sorted module lists) and the number of elementary cycles (at most CYCLE_CAP)."""
    graph = import_graph(tree, type_only)
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


def class_size(path: Path, name: str) -> str:
    """Lines and methods of class ``name`` in ``path``."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ClassDef) and node.name == name:
            methods = [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
            return f"{node.end_lineno - node.lineno + 1} lines, {len(methods)} methods"
    return "n/a"


def largest_modules(tree: Path, count: int = 3) -> str:
    sizes = sorted(
        (
            (len(p.read_text(encoding="utf-8").splitlines()), str(p.relative_to(tree)))
            for p in project_modules(tree).values()
        ),
        reverse=True,
    )
    return ", ".join(f"{path} {lines}" for lines, path in sizes[:count])


def files_per_folder(tree: Path) -> dict[str, int]:
    counts = {"stare_agent/ (top level)": len(list((tree / "stare_agent").glob("*.py")))}
    for package in packages(tree).values():
        for init in sorted((tree / package).rglob("__init__.py")):
            folder = init.parent
            if folder == tree / "stare_agent":
                continue
            counts[f"{folder.relative_to(tree)}/"] = len(list(folder.glob("*.py")))
    return counts


def config_walk(tree: Path) -> str:
    python = REPO / ".venv" / "bin" / "python"
    run = subprocess.run(
        [
            str(python if python.exists() else sys.executable),
            "-c",
            WALK.format(packages=tuple(packages(tree))),
        ],
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=600,
    )
    first = (run.stdout.strip().splitlines() or [""])[0].split()
    if run.returncode != 0 or not first or not first[0].isdigit():
        return f"error: {(run.stderr.strip().splitlines() or ['?'])[-1]}"
    return first[0]


LOAD_CONFIG = """
import os, sys, time
sys.path.insert(0, os.getcwd())
start = time.perf_counter()
from stare_agent.config import load_config
load_config(None)
print(len(sys.modules), "torch" in sys.modules, round(time.perf_counter() - start, 2))
"""


def config_load(tree: Path) -> str:
    """Modules loaded by ``load_config()`` (all, not only the project's), whether torch is one, seconds."""
    python = REPO / ".venv" / "bin" / "python"
    run = subprocess.run(
        [str(python), "-c", LOAD_CONFIG], cwd=tree, capture_output=True, text=True, timeout=300
    )
    if run.returncode != 0:
        return f"error: {(run.stderr.strip().splitlines() or ['?'])[-1]}"
    modules, torch, seconds = run.stdout.split()
    return f"{modules} modules, torch {'loaded' if torch == 'True' else 'not loaded'}, {seconds} s"


ROLE = re.compile(r":(?:func|class|meth|data|mod|attr|exc|obj):`")


def sphinx_roles(tree: Path) -> str:
    return str(sum(len(ROLE.findall(p.read_text(encoding="utf-8"))) for p in project_modules(tree).values()))


def results_share(tree: Path) -> str:
    readme = (tree / "README.md").read_text(encoding="utf-8")
    if "## Results" not in readme:
        return "-"
    section = readme.split("## Results", 1)[1].split("\n## ", 1)[0]
    return f"{100 * len(section) / len(readme):.0f} %"


def time_test_fast(tree: Path, repeats: int) -> str:
    """The recipe of the tree's `test-fast` target (its `setup` prerequisite left out: no install into the
    shared .venv), run in the tree with this checkout's .venv."""
    makefile = (tree / "Makefile").read_text(encoding="utf-8") if (tree / "Makefile").exists() else ""
    if "\ntest-fast:" not in makefile:
        return "n/a (no target)"
    lines = makefile.split("\ntest-fast:", 1)[1].splitlines()[1:]
    recipe = " && ".join(line.strip() for line in itertools.takewhile(lambda x: x.startswith("\t"), lines))
    recipe = recipe.replace(".venv/bin/", f"{REPO / '.venv' / 'bin'}/")
    for name, value in re.findall(r"^(\w+)\s*\??=\s*(\S+)\s*$", makefile, re.M):  # the Makefile's variables
        recipe = recipe.replace(f"$({name})", value)
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
    typed_circles, typed_cycles = import_circles(tree, type_only=True)
    rows = {
        "README.md lines": str(len((tree / "README.md").read_text(encoding="utf-8").splitlines())),
        "README.md Results section (share of characters)": results_share(tree),
        **{f"files in {k}": str(v) for k, v in files_per_folder(tree).items()},
        "import circles (modules in them)": f"{len(circles)} ({sum(map(len, circles))})",
        "import cycles (elementary)": f"{cycles}{'+' if cycles >= CYCLE_CAP else ''}",
        "import circles, type-only imports counted (modules)": f"{len(typed_circles)} ({sum(map(len, typed_circles))})",
        "load_config(): modules, torch, time": config_load(tree),
        "Sphinx roles in docstrings": sphinx_roles(tree),
        "longest function, the trainer": f"{longest_function(trainer)} {trainer.relative_to(tree)}",
        "class Trainer": class_size(trainer, "Trainer"),
        "largest modules (lines)": largest_modules(tree),
        "longest function, sandbox/kernel.py": longest_function(tree / "sandbox" / "kernel.py"),
        "config walk: project modules at Trainer.__init__": config_walk(tree),
        "make test-fast": "skipped" if skip_tests else time_test_fast(tree, repeats),
    }
    for n, circle in enumerate(typed_circles, 1):
        rows[f"circle {n} (type-only imports counted)"] = " ".join(circle)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default="cf57e4c", help="git revision to compare with")
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
