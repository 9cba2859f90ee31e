"""Write tests/slow_tests.txt: the tests of `make test-fast`'s selection that took ``--threshold``
seconds or more (setup, call and teardown together) in a pytest ``--durations=0`` log.

    .venv/bin/python -m pytest -q -m "not docker and not slow" --durations=0 tests > /tmp/durations.log
    .venv/bin/python scripts/slow_tests.py /tmp/durations.log

tests/conftest.py marks every test listed there ``slow`` (all its parameters), so that `make test-fast`
stays an inner loop while `make test` runs everything.
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict
from pathlib import Path

LINE = re.compile(r"^(\d+(?:\.\d+)?)s (?:setup|call|teardown)\s+(\S+)$")
OUT = Path(__file__).resolve().parents[1] / "tests" / "slow_tests.txt"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", type=Path)
    parser.add_argument("--threshold", type=float, default=1.5)
    args = parser.parse_args()
    seconds: dict[str, float] = defaultdict(float)
    for line in args.log.read_text().splitlines():
        m = LINE.match(line.strip())
        if m:
            seconds[m.group(2).split("[")[0]] += float(m.group(1))
    slow = {name for name, s in seconds.items() if s >= args.threshold}
    lines = OUT.read_text().splitlines() if OUT.exists() else []
    kept = [line for line in lines if line.startswith("#")]
    listed = {line.strip() for line in lines if line.strip() and not line.startswith("#")}
    # Added to the list, never replacing it: the tests listed already were not in the log's selection.
    OUT.write_text("\n".join([*kept, *sorted(listed | slow)]) + "\n")
    print(f"{len(slow - listed)} tests at {args.threshold:g} s or more added -> {OUT}")


if __name__ == "__main__":
    main()
