"""Sandbox latency: warm round trips, pool throughput and cold starts, against two baselines.

Measures, in one run on this machine:

- warm round trip of a trivial statement (``x = 1``) on a started Docker sandbox and a started
  local sandbox, beside the two ways other RL projects run code: a fresh ``python -c`` subprocess
  per call, and ``docker exec <container> python3 -c`` per call on a container of our image;
- the reset between episodes on one Docker sandbox: the default (a fresh kernel process from the
  container's warden, with /work, /tmp, /dev/shm and IPC emptied) beside the other way to get a
  clean interpreter, restarting the container (``reset(hard=True)``): wall time and the CPU the
  container used per reset;
- throughput of a ``SandboxPool`` of 4 with 8 concurrent callers, each leasing a sandbox for an
  episode of short statements (so lease, health check and the reset are included);
- cold start: a new sandbox until its kernel has answered a first call;
- preloading numpy and sympy (``sandbox.limits.preload``) against none (the default): an episode's
  first call ``import numpy, sympy`` (wall time and the container's CPU), the reset before it, a
  container's memory once started, and its cold start.

Targets (issues 2 and 11): Docker warm p50 <= 10 ms and >= 5x faster than the fresh subprocess;
pool throughput >= 150 executions/s at 3 calls per episode, with the fresh-kernel reset.
The machine is often shared: the load average is printed with each table.

Usage: python benchmarks/sandbox_latency.py [--quick] [--backends docker,local]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from stare_sandbox import Sandbox, make_sandbox, resolve_backend
from stare_sandbox.config import DEFAULT_IMAGE, PRELOAD_MATH, Backend
from stare_sandbox.pool import PoolStats, SandboxPool

STATEMENT = "x = 1"


@dataclass
class Row:
    name: str
    samples_ms: list[float]

    @property
    def p50(self) -> float:
        return statistics.median(self.samples_ms)

    @property
    def p99(self) -> float:
        ordered = sorted(self.samples_ms)
        return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


class Contender:
    """One way to run ``STATEMENT``: ``call()`` runs it once; ``per_round`` calls per round."""

    def __init__(self, name: str, call: Callable[[], object], per_round: int) -> None:
        self.name, self.call, self.per_round = name, call, per_round
        self.row = Row(name, [])


def interleaved(contenders: list[Contender], rounds: int) -> list[Row]:
    """Time every contender in alternating rounds, so that load from other processes on this
    shared machine falls on all of them alike (the ratios are what matter)."""
    for contender in contenders:  # warm-up, untimed
        for _ in range(max(2, contender.per_round // 5)):
            contender.call()
    for _ in range(rounds):
        for contender in contenders:
            for _ in range(contender.per_round):
                t0 = time.perf_counter()
                contender.call()
                contender.row.samples_ms.append((time.perf_counter() - t0) * 1e3)
    return [c.row for c in contenders]


def sandbox_call(sb: Sandbox) -> Callable[[], None]:
    def call() -> None:
        result = sb.run(STATEMENT)
        if not result.ok:
            raise RuntimeError(f"{sb.backend} sandbox failed on {STATEMENT!r}: {result}")

    return call


def fresh_subprocess_call() -> None:
    """What many RL code tools do: a new interpreter per call, output captured."""
    subprocess.run([sys.executable, "-c", STATEMENT], check=True, capture_output=True)


@contextlib.contextmanager
def exec_container() -> Iterator[Callable[[], None]]:
    """``docker exec <c> python3 -c`` per call, on a container of our image (network none)."""
    docker = shutil.which("docker")
    if docker is None:
        raise RuntimeError("docker CLI not found: install docker.io or pass --backends local")
    container = subprocess.run(
        [docker, "run", "-d", "--rm", "--network", "none", "--label", "org.stare-agent.sandbox=1",
         DEFAULT_IMAGE, "sleep", "infinity"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip

    def call() -> None:
        subprocess.run(
            [docker, "exec", container, "python3", "-c", STATEMENT], check=True, capture_output=True
        )

    try:
        yield call
    finally:
        subprocess.run([docker, "rm", "-f", container], check=False, capture_output=True)


def reset_costs(n: int) -> list[tuple[str, Row, float]]:
    """(name, wall time per reset, container CPU ms per reset) of the default reset and of a
    container restart, on one Docker sandbox; each reset follows an episode of one call."""
    from stare_sandbox import DockerSandbox

    rows = []
    with DockerSandbox() as sb:
        meter = sb._host.usage if sb._host is not None else None
        for name, hard, count in (
            ("fresh kernel from the warden (default)", False, n),
            ("baseline: restart the container", True, max(2, n // 10)),
        ):
            samples, cpu = [], 0.0
            for _ in range(count):
                sb.run(STATEMENT)
                before = meter.cpu_seconds() if meter is not None else None
                t0 = time.perf_counter()
                sb.reset(hard=hard)
                samples.append((time.perf_counter() - t0) * 1e3)
                after = meter.cpu_seconds() if meter is not None else None
                if before is not None and after is not None and not hard:
                    cpu += after - before
            rows.append((name, Row(name, samples), cpu / count * 1e3 if not hard else float("nan")))
    return rows


def cold_start(backend: Backend, n: int) -> Row:
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        sb = make_sandbox(backend, None)
        try:
            sb.run("1")
            samples.append((time.perf_counter() - t0) * 1e3)
        finally:
            sb.close()
    return Row(f"{backend} cold start (to first result)", samples)


PRELOAD_CALL = "import numpy, sympy\nx = sympy.Symbol('x')"


def preload_costs(n: int) -> list[tuple[str, Row, Row, float, float, float]]:
    """(name, first call wall ms, reset wall ms, first call container CPU ms, container memory MB
    after start, cold start ms) with numpy and sympy preloaded and with none, one Docker sandbox each,
    in alternating episodes (reset, then ``PRELOAD_CALL``)."""
    from stare_sandbox import DockerSandbox, SandboxConfig
    from stare_sandbox.usage import cgroup_dir

    def memory_mb(sb: DockerSandbox) -> float:
        folder = cgroup_dir(sb._host.init_pid, "memory") if sb._host is not None else None
        for name in ("memory.current", "memory.usage_in_bytes"):
            if folder is not None and (folder / name).exists():
                return int((folder / name).read_text()) / 2**20
        return float("nan")

    configs = {
        "preload numpy, sympy": SandboxConfig(preload=list(PRELOAD_MATH)),
        "baseline: no preload (default)": SandboxConfig(),
    }
    sandboxes, cold, memory = {}, {}, {}
    with contextlib.ExitStack() as stack:
        for name, config in configs.items():
            t0 = time.perf_counter()
            sb = stack.enter_context(DockerSandbox(config))
            sb.run("1")
            cold[name] = (time.perf_counter() - t0) * 1e3
            memory[name] = memory_mb(sb)
            sandboxes[name] = sb
        calls = {name: Row(name, []) for name in configs}
        resets = {name: Row(name, []) for name in configs}
        cpu = dict.fromkeys(configs, 0.0)
        for _ in range(n):
            for name, sb in sandboxes.items():
                t0 = time.perf_counter()
                sb.reset()
                resets[name].samples_ms.append((time.perf_counter() - t0) * 1e3)
                meter = sb._host.usage if sb._host is not None else None
                before = meter.cpu_seconds() if meter is not None else None
                t0 = time.perf_counter()
                result = sb.run(PRELOAD_CALL)
                calls[name].samples_ms.append((time.perf_counter() - t0) * 1e3)
                after = meter.cpu_seconds() if meter is not None else None
                if not result.ok:
                    raise RuntimeError(f"{name}: {PRELOAD_CALL!r} failed: {result}")
                cpu[name] += (after - before) if before is not None and after is not None else float("nan")
    return [
        (name, calls[name], resets[name], cpu[name] / n * 1e3, memory[name], cold[name]) for name in configs
    ]


@dataclass
class Throughput:
    rate: float  # executions per second, all callers together
    per_call: Row  # latency of one run() under contention
    lease_wait: Row  # time in acquire(): waiting for a free, reset sandbox plus its health check
    stats: PoolStats
    cpu_ms_per_run: float  # CPU of this process and of the pool's containers, per execution (NaN: unknown)


def pool_throughput(
    backend: Backend, size: int, callers: int, seconds: float, episode_len: int, preload: bool = False
) -> Throughput:
    """``callers`` threads share a pool of ``size``; each leases a sandbox per episode of
    ``episode_len`` short statements, for ``seconds``; with no preload (the default) or numpy and sympy."""
    from stare_sandbox import SandboxConfig

    config = SandboxConfig(preload=list(PRELOAD_MATH) if preload else [])
    with SandboxPool(size, backend=backend, config=config) as pool:
        meters = _container_meters(pool)
        cpu_before = time.process_time() + _sum(m.cpu_seconds() for m in meters)
        stop = time.monotonic() + seconds
        calls: list[list[float]] = [[] for _ in range(callers)]
        waits: list[list[float]] = [[] for _ in range(callers)]
        failures: list[str] = []

        def caller(mine: list[float], waited: list[float]) -> None:
            while time.monotonic() < stop:
                t0 = time.perf_counter()
                with pool.lease(timeout=60) as sb:
                    waited.append((time.perf_counter() - t0) * 1e3)
                    for i in range(episode_len):
                        t0 = time.perf_counter()
                        result = sb.run(f"x = {i}")
                        mine.append((time.perf_counter() - t0) * 1e3)
                        if not result.ok:
                            failures.append(repr(result))

        t0 = time.monotonic()
        threads = [threading.Thread(target=caller, args=(calls[i], waits[i])) for i in range(callers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        elapsed = time.monotonic() - t0
        cpu_used = time.process_time() + _sum(m.cpu_seconds() for m in meters) - cpu_before
        stats = pool.stats()
        if failures:
            raise RuntimeError(f"{len(failures)} pool executions failed, first: {failures[0]}")
    per_call = Row("per call", [s for mine in calls for s in mine])
    lease_wait = Row("lease wait", [s for mine in waits for s in mine])
    runs = len(per_call.samples_ms)
    cpu_ms = cpu_used / runs * 1e3 if runs and meters else float("nan")
    return Throughput(runs / elapsed, per_call, lease_wait, stats, cpu_ms)


def _container_meters(pool: SandboxPool) -> list:
    """The CPU meters of every container of a Docker pool (the same containers all along: the
    reset keeps them); empty for the local backend (its CPU per execution is not reported)."""
    if pool.backend != "docker":
        return []
    leases = [pool.acquire() for _ in range(pool.size)]
    meters = [m for m in (lease.inner._host.usage for lease in leases) if m is not None]
    for lease in leases:
        pool.release(lease)
    return meters


def _sum(values) -> float:
    return sum(v for v in values if v is not None)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples (about 30 s in all)")
    parser.add_argument("--backends", default="docker,local", help="comma-separated: docker,local")
    args = parser.parse_args(argv)
    backends: list[Backend] = []
    for name in filter(None, args.backends.split(",")):
        if name not in ("docker", "local"):
            parser.error(f"unknown backend {name!r}: use docker and/or local")
        backends.append(resolve_backend(name))
    # Calls per round of each contender, rounds, cold starts, seconds of pool throughput.
    n_warm, n_sub, n_exec = 50, 5, 2
    rounds, n_cold, seconds, n_reset = (4, 2, 4.0, 10) if args.quick else (10, 5, 8.0, 40)
    episode_lens = [3] if args.quick else [3, 10]

    with contextlib.ExitStack() as stack:
        contenders = [
            Contender(f"{b} sandbox, warm", sandbox_call(stack.enter_context(make_sandbox(b))), n_warm)
            for b in backends
        ]
        baseline = Contender("baseline: fresh `python -c`", fresh_subprocess_call, n_sub)
        contenders.append(baseline)
        if "docker" in backends:
            exec_call = stack.enter_context(exec_container())
            contenders.append(Contender("baseline: `docker exec python3 -c`", exec_call, n_exec))
        rows = interleaved(contenders, rounds)

    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(
        f"\nWarm round trip of {STATEMENT!r} (python {sys.version.split()[0]}, {_cpus()} CPUs, load {load})"
    )
    print(f"{'':40s} {'n':>5s} {'p50 ms':>9s} {'p99 ms':>9s} {'fresh-subprocess p50 / p50':>27s}")
    for row in rows:
        ratio = baseline.row.p50 / row.p50
        print(f"{row.name:40s} {len(row.samples_ms):5d} {row.p50:9.2f} {row.p99:9.2f} {ratio:26.1f}x")

    if "docker" in backends:
        print(f"\nReset between episodes, one Docker sandbox (load {_load()})")
        print(f"{'':40s} {'n':>5s} {'p50 ms':>9s} {'p99 ms':>9s} {'container CPU ms':>17s}")
        for name, row, cpu_ms in reset_costs(n_reset):
            cpu = "" if cpu_ms != cpu_ms else f"{cpu_ms:.1f}"  # NaN: not measured (counters restart)
            print(f"{name:40s} {len(row.samples_ms):5d} {row.p50:9.1f} {row.p99:9.1f} {cpu:>17s}")

    print(f"\nPool throughput: pool of 4, 8 caller threads, one lease per episode, {seconds:g} s each")
    header = f"{'':40s} {'exec/s':>7s} {'run p50':>8s} {'run p99':>8s} {'lease p50':>10s} {'lease p99':>10s}"
    print(f"{header} {'resets':>7s} {'replaced':>8s} {'CPU ms/exec':>11s} {'exec/s per idle core':>21s}")
    rates = {}
    for backend in backends:
        runs = [(n, False) for n in episode_lens] + ([(episode_lens[0], True)] if backend == "docker" else [])
        for episode_len, preload in runs:
            t = pool_throughput(
                backend, size=4, callers=8, seconds=seconds, episode_len=episode_len, preload=preload
            )
            if not preload:
                rates[backend, episode_len] = t.rate
            name = f"{backend}, {episode_len} runs/episode" + (", numpy+sympy preloaded" if preload else "")
            print(
                f"{name:40s} {t.rate:7.0f} {t.per_call.p50:8.2f} {t.per_call.p99:8.2f} "
                f"{t.lease_wait.p50:10.2f} {t.lease_wait.p99:10.2f} {t.stats.resets:7d} {t.stats.replaced:8d} "
                f"{t.cpu_ms_per_run:11.1f} {1e3 / t.cpu_ms_per_run:21.0f}"
            )
    print("(times in ms; lease = acquire: waiting for a free, reset sandbox plus its health check;")
    print(" CPU = this process and the pool's containers, resets included: exec/s per idle core is")
    print(" what the work costs, whatever else runs on the machine)")
    print(f"(load average after: {_load()})")

    if "docker" in backends:
        print(
            f"\nAn episode's first call {PRELOAD_CALL.splitlines()[0]!r}, one Docker sandbox each (load {_load()})"
        )
        print(
            f"{'':32s} {'n':>4s} {'call p50 ms':>12s} {'call CPU ms':>12s} {'reset p50 ms':>13s}"
            f" {'memory MB':>10s} {'cold start ms':>14s}"
        )
        for name, call, reset, cpu_ms, mem, cold in preload_costs(n_reset):
            print(
                f"{name:32s} {len(call.samples_ms):4d} {call.p50:12.1f} {cpu_ms:12.1f} {reset.p50:13.1f}"
                f" {mem:10.0f} {cold:14.0f}"
            )

    print("\nCold start (new sandbox until its first result)")
    print(f"{'':40s} {'n':>5s} {'p50 ms':>9s} {'p99 ms':>9s}")
    for backend in backends:
        row = cold_start(backend, n_cold)
        print(f"{row.name:40s} {len(row.samples_ms):5d} {row.p50:9.0f} {row.p99:9.0f}")

    if "docker" in backends:
        docker_p50 = rows[backends.index("docker")].p50
        checks = [
            (f"docker warm p50 {docker_p50:.2f} ms <= 10 ms", docker_p50 <= 10),
            (f"docker warm {baseline.row.p50 / docker_p50:.1f}x faster than fresh subprocess >= 5x",
             baseline.row.p50 / docker_p50 >= 5),
            (f"docker pool {rates['docker', 3]:.0f} exec/s (3 runs/episode) >= 150", rates["docker", 3] >= 150),
        ]  # fmt: skip
        print("\nTargets")
        for text, met in checks:
            print(f"  {'met   ' if met else 'MISSED'}  {text}")


def _load() -> str:
    return ", ".join(f"{x:.1f}" for x in os.getloadavg())


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 0


if __name__ == "__main__":
    main()
