"""Output written to the file descriptors 1 and 2: where it lands, and what reading it costs.

Runs, on each backend, two kinds of kernel side by side in one run, in alternating rounds:

- ``streams`` (the default): the boot cell ``sandbox/cells/streams.py`` reads the descriptors'
  pipes in the cell itself, before each write and flush and at the cell's end;
- ``baseline``: ipykernel's own reader thread (the boot without that cell; before it, the boot
  also chunked big writes, which does not change these numbers).

For each: the share of cells whose output is exact (each prints, writes 120,000 bytes to fd 1, two
pipe-fulls, prints again and shows a value: the cell's own output whole and in order, nothing of it
in the next cell), with and without two busy processes in the sandbox competing for its CPU; a
UTF-8 character split between reads followed by 200,000 bytes (exact, and whether it hung to the
timeout); C's ``printf`` in its own cell; and the cost: the warm round trip of ``x = 1``, a cell
printing 20,000 lines, and (Docker) the reset, whose new kernel runs the boot. Medians of
``--rounds`` samples; the ratio is streams / baseline.

Usage: python benchmarks/sandbox_output.py [--rounds 30] [--backends docker,local]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from collections.abc import Iterator

import stare_sandbox.docker
import stare_sandbox.kernel
from stare_sandbox import SandboxConfig, make_sandbox
from stare_sandbox.base import Sandbox

PIPE_FULLS = """import os
print("before")
n = os.write(1, b"".join(b"%05d\\n" % k for k in range(20000)))
print("after")
n"""
PIPE_FULLS_WANT = "before\n" + "".join(f"{k:05d}\n" for k in range(20000)) + "after\n120000\n"
HOGS = "import subprocess, sys\nhogs = [subprocess.Popen([sys.executable, '-c', 'while True: pass']) for _ in range(2)]"
UNHOG = "for h in hogs: h.kill()"
SPLIT = "import os\nn = os.write(1, ('a' + 'é' * 5000 + '\\n').encode())"
FLOOD = "n = os.write(1, b'y' * 200_000)"
PRINTS = "for i in range(20000): print(i)"


@contextlib.contextmanager
def kind(name: str) -> Iterator[None]:
    """Boot the kernels started inside with (``streams``) or without (``baseline``) the streams cell."""
    boot = stare_sandbox.kernel.KERNEL_BOOT
    if name == "baseline":
        without = boot.replace(f"\n{stare_sandbox.kernel.STREAMS}", "")
        assert without != boot
        stare_sandbox.kernel.KERNEL_BOOT = stare_sandbox.docker.KERNEL_BOOT = without
    try:
        yield
    finally:
        stare_sandbox.kernel.KERNEL_BOOT = stare_sandbox.docker.KERNEL_BOOT = boot


def timed(sb: Sandbox, code: str) -> float:
    t0 = time.perf_counter()
    result = sb.run(code)
    if not result.ok:
        raise RuntimeError(f"{code[:40]!r} failed: {result.error}")
    return (time.perf_counter() - t0) * 1e3


def exact_share(sb: Sandbox, n: int) -> float:
    good = 0
    for _ in range(n):
        good += sb.run(PIPE_FULLS).stdout == PIPE_FULLS_WANT and sb.run("print('next')").stdout == "next\n"
    return good / n


def measure(backend: str, rounds: int) -> dict[str, dict[str, float]]:
    config = SandboxConfig(max_output_chars=300_000, timeout_s=10)
    rows: dict[str, dict[str, list[float]]] = {"streams": {}, "baseline": {}}
    sandboxes = {}
    for name in rows:
        with kind(name):
            sandboxes[name] = make_sandbox(backend, config)
    try:
        for name, sb in sandboxes.items():  # correctness, once each
            r = rows[name]
            r["exact cells, idle (share)"] = [exact_share(sb, rounds)]
            sb.run(HOGS)
            r["exact cells, 2 busy processes (share)"] = [exact_share(sb, rounds)]
            sb.run(UNHOG)
            split, flood = sb.run(SPLIT), sb.run(FLOOD)
            r["split character + 200 KB exact (1 = yes)"] = [
                float(split.stdout == "a" + "é" * 5000 + "\n" and flood.stdout == "y" * 200_000)
            ]
            r["200 KB after the split: seconds"] = [flood.duration_s]
            r["printf in its own cell (1 = yes)"] = [
                float(sb.run("import ctypes\nn = ctypes.CDLL(None).printf(b'c\\n')").stdout == "c\n")
            ]
            sb.reset()
        for _ in range(rounds):  # cost, alternating
            for name, sb in sandboxes.items():
                r = rows[name]
                r.setdefault("round trip x = 1 (ms)", []).append(timed(sb, "x = 1"))
                r.setdefault("20,000 prints (ms)", []).append(timed(sb, PRINTS))
                if backend == "docker":
                    with kind(name):
                        t0 = time.perf_counter()
                        sb.reset()
                        timed(sb, "x = 1")
                        r.setdefault("reset + first call (ms)", []).append((time.perf_counter() - t0) * 1e3)
    finally:
        for sb in sandboxes.values():
            sb.close()
    return {name: {k: statistics.median(v) for k, v in r.items()} for name, r in rows.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--backends", default="docker,local")
    args = parser.parse_args()
    print(f"# {os.uname().machine}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}")
    for backend in args.backends.split(","):
        result = measure(backend, args.rounds)
        print(f"\n## {backend} ({args.rounds} rounds)\n")
        print("| measure | streams | baseline | ratio |\n|---|---:|---:|---:|")
        for key, value in result["streams"].items():
            base = result["baseline"][key]
            ratio = f"{value / base:.2f}" if base else "-"
            print(f"| {key} | {value:.3f} | {base:.3f} | {ratio} |")


if __name__ == "__main__":
    main()
