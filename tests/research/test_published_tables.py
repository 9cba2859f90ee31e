"""Every table docs/research/ publishes reprints from the CSV it ships, by the command the page names,
or is listed below as having no shipped data, with the reason (issue 44, item 1)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.adam_lever import tables_of_csv
from benchmarks.closed_loop_replay import tables_of_csv as replay_tables
from benchmarks.entropy_response import tables_of_csv as one_step_tables
from benchmarks.multi_step_response import tables_of_csv as multi_step_tables
from stare_research.study import tables_from_csv
from stare_research.tables import closed_loop_table, paired_table, read_runs

DOCS = Path(__file__).resolve().parents[2] / "docs" / "research"
PLACEBO_PAIRS = (("stare-c2", "grpo-ds"), ("stare-c2", "stare-c2-placebo"), ("stare-c2-placebo", "grpo-ds"))

# (page, shipped CSV, the function behind the command the page names:
#  `stare-agent study --tables-of CSV` and `python -m stare_research.tables CSV`)
REPRINTED = (
    ("study.md", "study.csv", tables_from_csv),
    ("study.md", "closed_loop.csv", closed_loop_table),
    ("study.md", "closed_loop_sft48.csv", closed_loop_table),
    ("study.md", "closed_loop_sft48_x2.csv", closed_loop_table),
    # `python benchmarks/adam_lever.py --from-csv CSV`
    ("study.md", "adam_lever_sft48.csv", tables_of_csv),
    # `python benchmarks/entropy_response.py --from-csv CSV` (the one-step response at the recreated start)
    ("study.md", "entropy_response_sft48.csv", one_step_tables),
    # the placebo closed loop: `python -m stare_research.tables CSV --paired ...` (the page's command)
    ("study.md", "closed_loop_placebo.csv", closed_loop_table),
    ("study.md", "closed_loop_placebo.csv", lambda path: paired_table(path, PLACEBO_PAIRS)),
    # both arms with more tokens a step, regenerated: `python -m stare_research.tables CSV --paired stare-c2 grpo-ds`
    ("study.md", "closed_loop_sft48_x2b.csv", closed_loop_table),
    ("study.md", "closed_loop_sft48_x2b.csv", lambda path: paired_table(path, (("stare-c2", "grpo-ds"),))),
    # `python benchmarks/multi_step_response.py --from-csv CSV` (4 optimizer steps a batch)
    ("study.md", "multi_step_sft48.csv", multi_step_tables),
    ("study.md", "multi_step_clipcov.csv", multi_step_tables),  # Clip-Cov at r 1 % and 5 %, another start
    # `python benchmarks/closed_loop_replay.py --from-csv CSV` (L+'s placebo in the paired replay)
    ("study.md", "replay_placebo.csv", replay_tables),
    ("study.md", "replay_4steps.csv", replay_tables),  # KL-Cov over 30 replayed steps at 4 a batch
)

# Tables with no shipped data: (page, header row) -> (how many such tables, why).
NO_SHIPPED_DATA = {
    ("study.md", "| instrument | scale | what it measured | reading |"): (
        1,
        "the overview: a summary of the sections' numbers, not a table of data",
    ),
    ("study.md", "| W | measured dH_bank | first-order prediction | measured / predicted |"): (
        1,
        "one-step response on the embedded model: its records (--out /tmp/er_full2) are not shipped",
    ),
    (
        "study.md",
        "| P | L+ | random T+ (same size) | bottom-P of T+ | oracle | L- | L+ minus random (paired) |",
    ): (
        1,
        "one-step response on the embedded model: its records are not shipped",
    ),
    ("study.md", "| step size (norm of one Adam step of) | batch | W = 1 | W = 2 | W = 4 |"): (
        1,
        "first-order validation: runs/entropy_response_closed_loop*/ is not shipped",
    ),
    ("study.md", "| subset | mean ± 95 % | median | batches > 0 |"): (
        1,
        "one-step response at the first start: runs/entropy_response_closed_loop/ is not shipped",
    ),
    (
        "study.md",
        "| method | dH_bank minus GRPO-ds (mean ± 95 %) | median | batches above GRPO-ds | selection cost (x the step) |",
    ): (1, "one-step response at the first start: runs/entropy_response_closed_loop/ is not shipped"),
    ("study.md", "| subset (P = 0.1) | mean ± 95 % (23 batches) | median | batches > 0 |"): (
        1,
        "one-step response at the second start: runs/entropy_response_sft48/ is not shipped",
    ),
    ("study.md", "| method | dH_bank minus GRPO-ds (mean ± 95 %) | median | batches above GRPO-ds |"): (
        1,
        "one-step response at the second start: runs/entropy_response_sft48/ is not shipped",
    ),
    (
        "study.md",
        "| method | bank entropy, last 2 evals | minus GRPO-ds's replay | bank entropy at steps 5, 10, 15, 20, 25, 30 "
        "| sampled-token entropy, first 5 / last 5 steps | gate on | s/step (median) |",
    ): (1, "paired replay: runs/closed_loop/replay/ is not shipped"),
}
NO_SHIPPED_DATA_PREFIXES = {
    # the field's controls side by side, assembled from every instrument's output
    ("study.md", "| method | lab mod7 H | lab drift H |"): (
        1,
        "assembled from the lab, one-step and replay outputs",
    ),
    # every lab table: runs/lab*, runs/lab31*, runs/lab-transformer* are not shipped (seeded: the
    # commands lab.md names regenerate them)
    ("lab.md", "| variant | policy H (last 10 %) | kept-batch H |"): (6, "the lab's records are not shipped"),
    ("lab.md", "| variant | mod7 policy H (last 10 %) | mod7 reward |"): (
        1,
        "the lab's records are not shipped",
    ),
    # `--table-only`'s first table (the token-weighting methods, runs/lab-tw; the target sweep, runs/lab-target)
    ("lab.md", "| variant | mod7 H | mod7 reward |"): (5, "the lab's records are not shipped"),
    # `--table-only`'s target sweep of each task (runs/lab-target)
    ("lab.md", "| method (the estimator it reads) | H_tgt 0.15 |"): (8, "the lab's records are not shipped"),
}


def published_tables(page: str) -> list[list[str]]:
    """The markdown tables of a page: a header row, its |---| row and the rows under them."""
    lines = (DOCS / page).read_text(encoding="utf-8").splitlines()
    tables, i = [], 0
    while i < len(lines):
        if lines[i].startswith("|") and i + 1 < len(lines) and lines[i + 1].startswith("|---"):
            j = i + 2
            while j < len(lines) and lines[j].startswith("|"):
                j += 1
            tables.append(lines[i:j])
            i = j
        else:
            i += 1
    return tables


def reprinted_tables(page: str) -> list[list[str]]:
    out = []
    for doc, csv_name, function in REPRINTED:
        if doc == page:
            out += [t.splitlines() for t in function(DOCS / csv_name).split("\n\n") if t.startswith("|")]
    return out


@pytest.mark.parametrize(("page", "csv_name", "function"), REPRINTED, ids=[r[1] for r in REPRINTED])
def test_each_shipped_csv_reprints_its_published_tables(page, csv_name, function):
    text = (DOCS / page).read_text(encoding="utf-8")
    printed = function(DOCS / csv_name)
    for block in printed.strip().split("\n\n"):
        assert block.strip() in text, f"{page} does not print, as {csv_name} gives it now:\n{block[:400]}"


@pytest.mark.parametrize("page", sorted(p.name for p in DOCS.glob("*.md")))
def test_every_published_table_is_reprinted_or_listed_without_data(page):
    reprinted = reprinted_tables(page)
    seen: dict[tuple[str, str], int] = {}
    for table in published_tables(page):
        header = table[0].strip()
        exact = (page, header)
        prefix = next(
            (key for key in NO_SHIPPED_DATA_PREFIXES if key[0] == page and header.startswith(key[1])), None
        )
        if exact in NO_SHIPPED_DATA or prefix is not None:
            key = exact if exact in NO_SHIPPED_DATA else prefix
            assert key is not None
            seen[key] = seen.get(key, 0) + 1
            continue
        assert table in reprinted, (
            f"{page}: a table neither reprinted from a shipped CSV nor listed:\n{header[:200]}"
        )
    expected = {k: n for k, (n, _) in {**NO_SHIPPED_DATA, **NO_SHIPPED_DATA_PREFIXES}.items() if k[0] == page}
    assert seen == expected, "the list of tables without shipped data is stale"


def test_the_csv_that_lacks_grpo_ds_says_so():
    """closed_loop_sft48_x2.csv holds STARE-C2 alone: the page must say its GRPO-ds numbers are not
    recomputable (until the arm is regenerated and shipped)."""
    variants = {variant for variant, _ in read_runs(DOCS / "closed_loop_sft48_x2.csv")}
    text = (DOCS / "study.md").read_text(encoding="utf-8")
    if "grpo-ds" not in variants:
        assert (
            "the GRPO-ds arm's rows were not\nkept" in text or "the GRPO-ds arm's rows were not kept" in text
        )
        assert "not recomputable" in text
