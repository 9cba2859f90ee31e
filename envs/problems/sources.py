"""Problem sources: files (JSONL, JSON, Parquet, the verl schema), Hugging Face hub datasets and the
evaluation sets shipped with this package.

A ``Problem`` is what an environment needs to run one episode: the problem text and the gold
answer.
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stare_envs.errors import EnvError

FAMILY_NAMES: set[str] = {"mixed"}
"""The procedural families' names (``stare_envs.problems.generators`` adds each one it registers), for
the "did you mean" of a source that is none of them."""


class ProblemSourceError(EnvError, ValueError):
    """A problem source cannot be read. The message names the file (and line) and the fix."""


@dataclass(frozen=True)
class Problem:
    """One problem: the text shown to the model and the gold answer it is checked against.

    Attributes:
        id: Unique within its source (``aime2024-I-01``, ``multiplication-d2-s0-000017``).
        problem: The problem statement (plain text / LaTeX).
        answer: The gold answer as a string (integers as decimal strings).
        source: Where it came from (file name, ``data_source`` of verl rows, ``generated:<family>``).
        meta: Anything else (verl ``extra_info``, generator family/difficulty, ``solution_code``).
    """

    id: str
    problem: str
    answer: str
    source: str = ""
    meta: dict[str, Any] = field(default_factory=dict, hash=False)


# --------------------------------------------------------------------------------------------------
# Files and the hub
# --------------------------------------------------------------------------------------------------

BUILTIN_SETS = ("aime2024", "aime2025", "amc23", "math500")
"""Evaluation sets shipped inside this package (``envs/data/<name>.jsonl``), loadable by these short
names; their sources and licences are in ``envs/data/SOURCES.md``. Training sets are not shipped."""

_DATA_DIR = Path(__file__).resolve().parent.parent / "data"


def builtin_set_path(name: str) -> Path:
    """The file of a shipped evaluation set.

    Example:
        >>> builtin_set_path("aime2024").name
        'aime2024.jsonl'

    Raises:
        ProblemSourceError: ``name`` is not one of ``BUILTIN_SETS``, or the installation lacks the file.
    """
    if name not in BUILTIN_SETS:
        raise ProblemSourceError(f"unknown built-in set {name!r}: use one of {', '.join(BUILTIN_SETS)}")
    path = _DATA_DIR / f"{name}.jsonl"
    if not path.is_file():
        raise ProblemSourceError(
            f"{path}: the built-in set {name!r} is missing from this installation: reinstall stare-agent"
        )
    return path


_PROBLEM_KEYS = ("problem", "question", "prompt", "messages")  # flat, ReTool, verl, chat-style
_ANSWER_KEYS = ("answer", "ground_truth", "gt", "final_answer")
_FILE_SUFFIXES = (".jsonl", ".json", ".parquet")


def load_problems(source: str | os.PathLike[str], *, limit: int | None = None) -> list[Problem]:
    """Loads problems from a file or a Hugging Face hub dataset.

    Files: ``.jsonl`` (one object per line), ``.json`` (a list of objects) and ``.parquet``. Each row
    needs a problem and an answer, found under these names:

    - flat: ``id``, ``problem`` (or ``question``), ``answer`` (or ``gt``, ``final_answer``);
    - verl: ``prompt`` (a chat list, whose last user message is the problem, or a string),
      ``reward_model.ground_truth``, ``data_source`` (becomes ``source``), ``extra_info`` (kept in
      ``meta``; its ``index`` or ``id`` becomes the id);
    - chat: ``messages`` (the last user message is the problem).

    Rows without an id get ``<file stem>-<row index>``; other fields are kept in ``meta``.
    A short name of ``BUILTIN_SETS`` (``aime2024``, ``aime2025``, ``amc23``, ``math500``) that is not
    an existing file loads the set shipped with this package. Anything else that is not an existing
    path and looks like ``owner/name`` (optionally ``owner/name:split``, default split ``train``) is
    loaded with the ``datasets`` package.

    Args:
        source: A path, a built-in set name, or a hub dataset name.
        limit: Read at most this many problems.

    Raises:
        ProblemSourceError: Missing file, unknown format, malformed row (named by file and line),
            or a hub dataset that cannot be loaded (e.g. no network, ``datasets`` not installed).
    """
    if limit is not None and limit < 0:
        raise ProblemSourceError(f"limit must be >= 0 or None, got {limit}")
    rows = read_rows(source)
    path = Path(source)
    stem = path.stem if path.is_file() else Path(str(source).replace("/", "__")).stem
    problems: list[Problem] = []
    for where, index, row in rows:
        if limit is not None and len(problems) >= limit:
            break
        problems.append(_row_to_problem(row, where=where, default_id=f"{stem}-{index:06d}"))
    return problems


Row = tuple[str, int, Any]
"""One row of a source: (location for error messages, such as ``file.jsonl:3``; row index; the row)."""


def read_rows(source: str | os.PathLike[str]) -> Iterator[Row]:
    """The rows of a ``.jsonl``, ``.json`` (a list) or ``.parquet`` file, a built-in set, or a hub dataset.

    The one reader of problem files and SFT data: a short name of ``BUILTIN_SETS`` that is not an
    existing file is the set shipped with this package; anything else that is not a path and looks
    like ``owner/name`` (optionally ``owner/name:split``, default ``train``) is loaded with the
    ``datasets`` package (the ``hub`` extra). The source is resolved when called (a missing file
    raises here); rows are read lazily.

    Example:
        >>> where, index, row = next(read_rows("aime2024"))
        >>> where.endswith("aime2024.jsonl:1"), index, sorted(row)[:2]
        (True, 0, ['answer', 'id'])

    Raises:
        ProblemSourceError: Missing file, unknown file type, invalid JSON (named by file and line), or
            a hub dataset that cannot be loaded (no network, ``datasets`` not installed).
    """
    path = Path(source)
    if not path.is_file() and isinstance(source, str) and source in BUILTIN_SETS:
        path = builtin_set_path(source)
    if path.is_file():
        return _read_rows(path)
    text = str(source)
    if (
        isinstance(source, os.PathLike)
        or text.endswith(_FILE_SUFFIXES)
        or path.exists()
        or text.startswith((".", "/", "~"))
    ):
        raise ProblemSourceError(
            f"{path}: no such file: check the path (relative paths start at {Path.cwd()}) "
            "or pass a Hugging Face dataset name such as 'owner/name'"
        )
    if text.count("/") == 1 and " " not in text:
        return _read_hub(text)
    close = difflib.get_close_matches(text.removeprefix("procedural:"), [*BUILTIN_SETS, *FAMILY_NAMES], n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise ProblemSourceError(
        f"{source!r} is neither an existing file nor a hub name: {hint}pass a .jsonl, .json or .parquet path, "
        f"a Hugging Face dataset name such as 'owner/name', a built-in set ({', '.join(BUILTIN_SETS)}) or "
        f"a procedural family ({', '.join(sorted(FAMILY_NAMES))})"
    )


def _read_rows(path: Path) -> Iterator[Row]:
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return _read_jsonl(path)
    if suffix == ".json":
        return _read_json(path)
    if suffix == ".parquet":
        return _read_parquet(path)
    raise ProblemSourceError(f"{path}: unknown file type {suffix!r}: use .jsonl, .json or .parquet")


def _read_jsonl(path: Path) -> Iterator[Row]:
    index = 0
    with path.open(encoding="utf-8") as lines:
        for line_number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ProblemSourceError(
                    f"{path}:{line_number}: invalid JSON ({exc.msg}): fix or remove the line"
                ) from None
            yield f"{path}:{line_number}", index, row
            index += 1


def _read_json(path: Path) -> Iterator[Row]:
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ProblemSourceError(f"{path}:{exc.lineno}: invalid JSON ({exc.msg}): fix the file") from None
    if not isinstance(rows, list):
        raise ProblemSourceError(f"{path}: expected a JSON list of objects: use a list, or JSONL")
    for index, row in enumerate(rows):
        yield f"{path}: item {index}", index, row


def _read_parquet(path: Path) -> Iterator[Row]:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for unreadable files
        raise ProblemSourceError(f"{path}: not a readable Parquet file ({exc}): check the file") from None
    index = 0
    for batch in parquet.iter_batches(batch_size=1024):
        for row in batch.to_pylist():
            yield f"{path}: row {index}", index, row
            index += 1


def _read_hub(name: str) -> Iterator[Row]:
    repo, _, split = name.partition(":")
    split = split or "train"
    try:
        import datasets
    except ImportError:
        raise ProblemSourceError(
            f"{name!r} looks like a Hugging Face dataset but `datasets` is not installed: "
            "pip install 'stare-agent[hub]', or pass a local .jsonl/.parquet file"
        ) from None
    try:
        dataset = datasets.load_dataset(repo, split=split)
    except Exception as exc:  # noqa: BLE001 - network, auth and missing-split errors alike
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise ProblemSourceError(
            f"cannot load Hugging Face dataset {repo!r} (split {split!r}): {type(exc).__name__}: "
            f"{first_line[:200]}: check the name and your network, or download it and pass a local file"
        ) from None
    return ((f"{name}: row {index}", index, row) for index, row in enumerate(dataset))


def _last_user_message(messages: list[Any], where: str) -> str:
    for message in reversed(messages):
        if isinstance(message, Mapping) and message.get("role") == "user":
            return str(message.get("content", ""))
    raise ProblemSourceError(f"{where}: the chat prompt has no user message: add one with role 'user'")


def _row_to_problem(row: Any, *, where: str, default_id: str) -> Problem:
    if not isinstance(row, Mapping):
        raise ProblemSourceError(f"{where}: expected an object, got {type(row).__name__}: fix the row")
    row = dict(row)
    problem = next((row.pop(key) for key in _PROBLEM_KEYS if row.get(key) is not None), None)
    if isinstance(problem, list):
        problem = _last_user_message(problem, where)
    if not isinstance(problem, str) or not problem.strip():
        raise ProblemSourceError(
            f"{where}: no problem text (looked for {', '.join(_PROBLEM_KEYS)}): add one of these fields"
        )
    reward_model = row.pop("reward_model", None)
    answer = next((row.pop(key) for key in _ANSWER_KEYS if row.get(key) is not None), None)
    if answer is None and isinstance(reward_model, Mapping):
        answer = reward_model.get("ground_truth")
    if isinstance(answer, bool) or not isinstance(answer, str | int | float) or str(answer).strip() == "":
        raise ProblemSourceError(
            f"{where}: no answer (looked for {', '.join(_ANSWER_KEYS)}, reward_model.ground_truth) "
            f"or it is not a string/number (got {type(answer).__name__}): add the gold answer"
        )
    extra_info = row.get("extra_info") if isinstance(row.get("extra_info"), Mapping) else {}
    row_id = row.pop("id", None)
    if row_id is None:
        row_id = extra_info.get("id", extra_info.get("index"))
    source = row.pop("data_source", None) or row.pop("source", None) or ""
    return Problem(
        id=str(row_id) if row_id is not None else default_id,
        problem=problem,
        answer=str(answer).strip(),
        source=str(source),
        meta=row,
    )
