"""The commit-msg hook: a commit subject says what changed in at most 72 characters (the results go in
the body). ``python scripts/check_commit_subject.py MESSAGE_FILE``; exit 1 with the cause and the fix."""

from __future__ import annotations

import sys
from pathlib import Path

LIMIT = 72


def subject_problem(message: str) -> str | None:
    """Why the message's subject is refused, or None."""
    lines = [line for line in message.splitlines() if not line.startswith("#")]
    subject = lines[0].strip() if lines else ""
    if not subject:
        return "the commit message has no subject: write what changed on its first line"
    if len(subject) > LIMIT:
        return (
            f"the commit subject has {len(subject)} characters, more than {LIMIT}: say what changed in "
            f"{LIMIT} or fewer and move numbers and results into the body"
        )
    if len(lines) > 1 and lines[1].strip():
        return "the subject's second line is not blank: leave one blank line between subject and body"
    return None


if __name__ == "__main__":
    problem = subject_problem(Path(sys.argv[1]).read_text(encoding="utf-8"))
    if problem:
        print(f"commit-msg: {problem}", file=sys.stderr)
    sys.exit(1 if problem else 0)
