"""The project's own docs (docs/) agree with the code, and nothing a user gets points outside the repository.

- docs/configuration.md is exactly what ``stare_agent.config_reference`` generates from the config
  dataclasses, whose docstrings document every field once;
- docs/algorithm.md names only config fields, defaults, functions and classes that exist;
- the table of the paper's settings (docs/paper-settings.md) names only real config fields;
- the site (mkdocs.yml) builds with ``mkdocs build --strict``: no dead link, no page missing from nav;
- the README's links into docs/ name pages that exist;
- no product file, doc or config refers to ../shared (a wheel user or a fresh clone has none).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from stare_agent.config import RunConfig
from stare_agent.config_reference import attribute_docs, render, sections, yaml_value
from stare_research.config import ResearchRunConfig

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
REGENERATE = "make docs (python -m stare_agent.config_reference > docs/configuration.md)"
SECTIONS = tuple(f.name for f in dataclasses.fields(RunConfig))
FIELD = re.compile(rf"^({'|'.join(SECTIONS)})\.[A-Za-z_][\w.]*$")
PYTHON_NAME = re.compile(r"^(stare_agent|envs|sandbox)(\.\w+)+$")


def config_default(dotted: str) -> object:
    """The default of a config field such as ``algorithm.W``; KeyError if there is no such field."""
    value: object = ResearchRunConfig()  # the product's sections and research
    for part in dotted.split("."):
        if not dataclasses.is_dataclass(value) or part not in {f.name for f in dataclasses.fields(value)}:
            raise KeyError(dotted)
        value = getattr(value, part)
    return value


def code_spans(text: str) -> list[str]:
    return re.findall(r"(?<!`)`([^`\n]+)`(?!`)", text)


def test_configuration_reference_is_the_generated_one():
    page = (DOCS / "configuration.md").read_text(encoding="utf-8")
    assert page == render(), f"docs/configuration.md is out of date: run `{REGENERATE}`"


def test_configuration_reference_covers_every_section_and_field():
    page = (DOCS / "configuration.md").read_text(encoding="utf-8")
    listed = sections()
    assert [name for name, _ in listed if "." not in name] == list(SECTIONS)
    for dotted, cls in listed:
        assert f"\n## `{dotted}`\n" in page
        for f in dataclasses.fields(cls):
            assert f"| `{dotted}.{f.name}` |" in page, f"{dotted}.{f.name}"
    assert "| `sandbox.limits.memory_mb` | `int` | `1024` |" in page
    assert "| `algorithm.H_tgt` | `float` | `0.3` | Target entropy;" in page


def test_attribute_docs_reads_google_style_attributes():
    class Section:
        """Summary.

        Attributes:
            first: One line.
            second: Two
                lines.

        Example:
            not: an attribute
        """

    assert attribute_docs(Section) == {"first": "One line.", "second": "Two lines."}


def test_table_cells_are_markdown():
    from stare_agent.config_reference import _cell

    assert _cell("see :class:`LoRAConfig`, ``r = 0`` or :func:`~stare_envs.problems.load_problems`") == (
        "see `LoRAConfig`, `r = 0` or `stare_envs.problems.load_problems`"
    )
    assert (
        _cell("``str | None``, fenced ```` ```output ```` blocks")
        == "`str \\| None`, fenced ```` ```output ```` blocks"
    )


def test_an_undocumented_field_or_a_documented_ghost_is_an_error(monkeypatch):
    from stare_agent import config

    monkeypatch.setattr(
        config.TrainerConfig, "__doc__", "The RL loop.\n\nAttributes:\n    steps: Steps.\n    ghost: Gone.\n"
    )
    with pytest.raises(
        ValueError,
        match=r"TrainerConfig \(trainer\): fields without a description \['checkpoint_every'.*descriptions of no field \['ghost'\]",
    ):
        render()


def test_algorithm_page_names_real_fields_functions_and_defaults():
    page = (DOCS / "algorithm.md").read_text(encoding="utf-8")
    spans = code_spans(page)
    fields = {s.split("=")[0] for s in spans if FIELD.match(s.split("=")[0])}
    assert {"algorithm.W", "algorithm.H_tgt", "algorithm.scope", "data.prompts_per_step"} <= fields
    for field in fields:
        config_default(field)  # KeyError names a field that does not exist
    names = [s for s in spans if PYTHON_NAME.match(s)]
    assert "stare_agent.algorithms.stare.stare_weights" in names
    for name in names:
        parts = name.split(".")
        for cut in range(len(parts), 0, -1):  # the longest importable module, then attributes
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
            except ModuleNotFoundError:
                continue
            for attribute in parts[cut:]:
                obj = getattr(obj, attribute)  # AttributeError names what does not exist
            break
        else:
            raise AssertionError(f"{name} is not importable")


def test_hyperparameter_table_defaults_are_the_config_defaults():
    page = (DOCS / "algorithm.md").read_text(encoding="utf-8")
    table = page.split("## The paper's hyperparameters and their config fields")[1].split("\n## ")[0]
    rows = re.findall(r"^\| [^|]+ \| `([\w.]+)` \| `([^`]+)` \|$", table, re.M)
    assert len(rows) >= 25
    wrong = [(f, d, yaml_value(config_default(f))) for f, d in rows if yaml_value(config_default(f)) != d]
    assert not wrong, f"(field, documented default, actual default): {wrong}"
    assert {f for f, _ in rows} >= {
        f"algorithm.{name}" for name in ("P", "W", "M", "H_tgt", "eps_low", "clip_c")
    }


def test_table_of_the_paper_settings_names_real_fields():
    page = (DOCS / "paper-settings.md").read_text(encoding="utf-8")
    table = page.split("## The paper's settings")[1].split("\n## ")[0]
    fields = [s for s in code_spans(table) if FIELD.match(s)]
    assert len(fields) >= 15
    for field in fields:
        config_default(field)


def test_the_site_builds_strictly(tmp_path):
    """``mkdocs build --strict`` (what ``make docs`` runs): a dead link, a missing anchor, a page left out of
    the nav or an API page whose object does not resolve fails here, not on a reader."""
    # mkdocs and mkdocstrings-python are in the dev extra, as ruff and pytest are: never skipped.
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    warnings = [line for line in done.stderr.splitlines() if "WARNING" in line or "ERROR" in line]
    assert done.returncode == 0, "\n".join(warnings) or done.stderr[-3000:]
    assert (tmp_path / "site" / "index.html").is_file()
    # the docstrings' Sphinx roles became cross-references (scripts/griffe_docstrings.py): none is left
    # as raw text, and the contracts page links to the objects it names
    raw = re.compile(r":(?:func|class|meth|data|mod|attr|exc|obj):`")
    pages = sorted((tmp_path / "site").rglob("*.html"))
    assert not [p.relative_to(tmp_path) for p in pages if raw.search(p.read_text(encoding="utf-8"))]
    contracts = (tmp_path / "site" / "api" / "index.html").read_text(encoding="utf-8")
    for name in (
        "Engine",
        "SamplingParams",
        "Generation",
        "Trajectory",
        "RolloutRunner",
        "load_policy",
        "make_tool_env",
    ):
        assert f'id="{name}"' in contracts or f"{name}</code>" in contracts, name


def test_a_role_the_docs_cannot_render_fails_the_build():
    import griffe

    spec = importlib.util.spec_from_file_location(
        "griffe_docstrings", REPO / "scripts" / "griffe_docstrings.py"
    )
    assert spec is not None and spec.loader is not None
    extensions = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(extensions)
    SphinxRoles = extensions.SphinxRoles

    module = griffe.Module("stare_envs")
    module.docstring = griffe.Docstring("See :func:`make_tool_env` and :py:gadget:`x`.", parent=module)
    with pytest.raises(ValueError, match="a Sphinx role the docs cannot render"):
        SphinxRoles().on_package(pkg=module)
    module.docstring = griffe.Docstring(
        "See :class:`~torch.Tensor` and :func:`stare_envs.registry.make_tool_env`."
    )
    SphinxRoles().on_package(pkg=module)
    assert module.docstring.value == (
        "See `Tensor` and [`stare_envs.registry.make_tool_env()`][stare_envs.registry.make_tool_env]."
    )


def test_readme_links_into_the_docs_exist():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert readme.startswith("# stare-agent\n\n```bash\nmake quickstart ")
    links = re.findall(r"\]\((docs/[^)#]+)(?:#[^)]*)?\)", readme)
    assert len(links) >= 20
    missing = sorted({link for link in links if not (REPO / link).is_file()})
    assert not missing, missing
    nav = (REPO / "mkdocs.yml").read_text(encoding="utf-8")
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert not [p for p in pages if p not in nav], "every docs page is in mkdocs.yml's nav"


PRODUCT = [
    "sandbox",
    "envs",
    "stare_agent",
    "stare_integrations",
    "examples",
    "configs",
    "scripts",
    "docs",
    "README.md",
    "Makefile",
    "mkdocs.yml",
]


def test_no_product_file_refers_to_the_shared_folder():
    """A wheel user or a fresh clone has no ../shared: product code, docs and configs never point there."""
    pattern = re.compile(
        r"\.\./shared|/shared/(data|STARE|ARCHITECTURE|STYLE)|\"shared\" / \"data\"|parents\[\d\] / \"shared\""
    )
    offenders = []
    for root in PRODUCT:
        path = REPO / root
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
        for file in files:
            if "__pycache__" in file.parts or file.suffix in {".pyc", ".jsonl"}:
                continue
            for number, line in enumerate(file.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
                if pattern.search(line):
                    offenders.append(f"{file.relative_to(REPO)}:{number}: {line.strip()[:100]}")
    assert not offenders, "\n".join(offenders)


def test_the_checkpoint_the_guides_evaluate_is_the_one_the_quickstart_writes():
    """The README's and docs/evaluation.md's eval command names the quickstart's last checkpoint
    (step-<trainer.steps>); it named step-000003 while the quickstart wrote step-000002."""

    from stare_agent.config import load_config

    steps = load_config(REPO / "configs" / "quickstart.yaml").trainer.steps
    for page in (REPO / "README.md", REPO / "docs" / "evaluation.md"):
        named = re.findall(r"runs/quickstart/checkpoints/step-(\d+)", page.read_text(encoding="utf-8"))
        assert named and {int(n) for n in named} == {steps}, (page.name, named, steps)
