"""Problems: where they come from (``sources``: files, the hub, the shipped evaluation sets), the
seeded generators of exact-computation problems (``generators``), and how a run picks its training
stream and validation set from them (``selection``).

A ``Problem`` is what an environment needs to run one episode: the problem text and the gold
answer. Generated problems are the embedded default data.

Example:
    >>> [p.id for p in generate_problems("modpow", 2, seed=3, difficulty=2)]
    ['modpow-d2-s3-000000', 'modpow-d2-s3-000001']
"""

from stare_envs.problems.generators import (
    DIFFICULTIES,
    MIXED_FAMILIES,
    PROBLEM_FAMILIES,
    PROCEDURAL_PREFIX,
    generate_problems,
    procedural_family,
    register_family,
)
from stare_envs.problems.selection import (
    ANSWER_FORMAT_WRAPPERS,
    ProblemStream,
    eval_problems,
    plain_problems,
    source_name,
)
from stare_envs.problems.sources import (
    BUILTIN_SETS,
    Problem,
    ProblemSourceError,
    Row,
    builtin_set_path,
    load_problems,
    read_rows,
)

__all__ = [
    "BUILTIN_SETS",
    "MIXED_FAMILIES",
    "PROBLEM_FAMILIES",
    "PROCEDURAL_PREFIX",
    "DIFFICULTIES",
    "Problem",
    "ProblemSourceError",
    "Row",
    "builtin_set_path",
    "generate_problems",
    "load_problems",
    "procedural_family",
    "read_rows",
    "register_family",
    "ProblemStream",
    "eval_problems",
    "plain_problems",
    "source_name",
    "ANSWER_FORMAT_WRAPPERS",
]
