"""The Docker sandbox of this working tree against an earlier revision's, side by side in one run.

A change to the sandbox's isolation must keep its speed. This runs the same measurements on the
sandbox package of two versions, each in a fresh process (the baseline from a ``git worktree``
of ``--baseline``, with the image its own config names), alternating the two round by round so
that load from other processes on this shared machine falls on both alike:

- warm round trip of ``x = 1`` on a started sandbox (p50, p99);
- the reset between episodes (``reset()``, the default), wall time p50;
- throughput of a ``SandboxPool`` of 4 with 8 caller threads, each leasing a sandbox for an
  episode of 3 short statements (lease, health check and reset included).

Targets (issue 26): warm p50 <= 10 ms, pool >= 150 executions/s at 3 calls per episode. Prints a
table of medians over rounds and the ratio of this tree to the baseline.

Usage: python benchmarks/sandbox_versions.py [--baseline REV] [--rounds N] [--seconds S]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MEASURE = r"""
import json, os, statistics, sys, threading, time
sys.path[:0] = [LINKS, ROOT]
import stare_sandbox
from stare_sandbox import DockerSandbox, SandboxPool
# The tree's own package, not the editable install's (which maps stare_sandbox to this checkout).
assert os.path.realpath(stare_sandbox.__file__).startswith(os.path.realpath(ROOT)), stare_sandbox.__file__

out = {}
with DockerSandbox() as sb:
    for _ in range(20):
        sb.run("x = 1")
    warm = []
    for _ in range(CALLS):
        t0 = time.perf_counter()
        assert sb.run("x = 1").ok
        warm.append((time.perf_counter() - t0) * 1e3)
    resets = []
    for _ in range(RESETS):
        sb.run("x = 1")
        t0 = time.perf_counter()
        sb.reset()
        resets.append((time.perf_counter() - t0) * 1e3)
warm.sort()
out["warm p50 ms"] = statistics.median(warm)
out["warm p99 ms"] = warm[round(0.99 * (len(warm) - 1))]
out["reset p50 ms"] = statistics.median(resets)
with SandboxPool(4, backend="docker") as pool:
    done = [0]
    lock = threading.Lock()
    stop = time.monotonic() + SECONDS

    def caller():
        while time.monotonic() < stop:
            with pool.lease() as leased:
                for _ in range(3):
                    assert leased.run("x = 1").ok
            with lock:
                done[0] += 3

    threads = [threading.Thread(target=caller) for _ in range(8)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out["pool exec/s"] = done[0] / (time.monotonic() - t0)
print("RESULT " + json.dumps(out))
"""


def import_links(root: Path, into: Path) -> Path:
    """``into`` with a link ``stare_sandbox`` to ``root``'s sandbox folder (the import name of the folder
    since it was mapped; an older tree imports it as ``sandbox``, found from ``root`` itself)."""
    into.mkdir(parents=True, exist_ok=True)
    link = into / "stare_sandbox"
    if not link.exists():
        link.symlink_to(root / "sandbox", target_is_directory=True)
    return into


def measure(root: Path, calls: int, resets: int, seconds: float) -> dict[str, float]:
    links = import_links(root, Path(tempfile.gettempdir()) / f"stare-links-{abs(hash(str(root)))}")
    code = (
        MEASURE.replace("LINKS", repr(str(links)))
        .replace("ROOT", repr(str(root)))
        .replace("CALLS", str(calls))
        .replace("RESETS", str(resets))
        .replace("SECONDS", str(seconds))
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"measuring {root} failed:\n{done.stderr[-2000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default="HEAD", help="git revision to compare with (default HEAD)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--resets", type=int, default=30)
    parser.add_argument("--seconds", type=float, default=8.0)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="stare-baseline-") as tmp:
        worktree = Path(tmp) / "tree"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(worktree), args.baseline],
            check=True, capture_output=True,
        )  # fmt: skip
        try:
            rev = subprocess.run(
                ["git", "-C", str(worktree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
            ).stdout.strip()
            versions = {f"baseline {args.baseline} ({rev})": worktree, "this tree": ROOT}
            results: dict[str, list[dict[str, float]]] = {name: [] for name in versions}
            for round_ in range(args.rounds):
                for name, root in versions.items():
                    results[name].append(measure(root, args.calls, args.resets, args.seconds))
                    print(f"round {round_ + 1}/{args.rounds} {name}: {results[name][-1]}", file=sys.stderr)
        finally:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(worktree)], check=False
            )
    names = list(versions)
    metrics = list(results[names[0]][0])
    from stare_agent.provenance import machine

    print(
        f"\nDocker sandbox, {machine()}, "
        f"load {os.getloadavg()[0]:.1f}; medians of {args.rounds} alternating rounds"
    )
    print(f"{'':16s} " + " ".join(f"{n:>26s}" for n in names) + f" {'ratio':>7s}")
    for metric in metrics:
        values = [statistics.median(r[metric] for r in results[n]) for n in names]
        print(f"{metric:16s} " + " ".join(f"{v:26.2f}" for v in values) + f" {values[1] / values[0]:7.2f}")


if __name__ == "__main__":
    main()
