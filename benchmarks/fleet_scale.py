"""The Ray sandbox fleet at scale, simulated on this machine: a baseline revision beside this tree.

Each case runs in a process of its own, once with the fleet code of ``--baseline`` (``git archive``
of its ``sandbox/`` tree, first on ``PYTHONPATH`` of the process and of every Ray worker it
starts) and once with this tree. It starts a local Ray cluster (``ray.cluster_utils.Cluster``: a
head without sandboxes and N sandbox nodes on 127.0.0.1) whose hosts run the real lease, grant,
return, creation-token and failure paths over cheap stand-in sandboxes (``node_backend: local``
with ``LocalSandbox`` replaced in every worker by :class:`StandIn`: it starts in ``START_S``,
answers a call at once, and holds no kernel), driven by client threads in several processes.

Cases (``--cases``):

- ``ready``: ready time from cold for N nodes of 4 sandboxes at ``--rate`` starts/s (2), burst
  ``--burst`` (1), lease timeout 7 s (so most of the N x 4 tokens come long after 7 s): until every
  host has all its sandboxes, or ``--limit`` (a livelock shows as hosts never all ready), with
  hosts lost and container starts thrown away; "ideal" is (N x 4 - burst) / rate.
- ``load``: W concurrent episodes (512, 1,024, 2,048: 4 processes of W / 4 threads) on 16 nodes of
  8 sandboxes with a cap of 96 (below demand): each leases, makes 3 calls, holds the lease 50 ms,
  gives it back, for ``--seconds``. Lease wait p50/p99, episodes/s, failed leases, the
  coordinator's CPU share and threads (``/proc`` of ``ray::FleetCoordinator``); and the starvation
  probe: the cap held, W waiters queued, one lease freed: seconds to the first grant.
- ``faults``: 8 nodes of 4 sandboxes, 24 episodes running (calls every 50 ms), then in turn the
  coordinator is killed, a host actor is killed, a node is killed: episodes lost, and seconds until
  a new lease is granted again.

Usage: python benchmarks/fleet_scale.py [--baseline REV] [--cases ready,load,faults]
       [--nodes 16,32] [--waiters 512,1024,2048] [--seconds 20]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
START_S = 0.02
"""A stand-in sandbox's start (a real container's is about a second: the rate limit is what counts)."""


# ----------------------------------------------------------------------- the stand-in, in every worker


def install_stand_in() -> None:
    """Ray's ``worker_process_setup_hook``: ``LocalSandbox`` becomes :class:`StandIn` in this worker."""
    import stare_sandbox.local
    from stare_sandbox.base import Sandbox
    from stare_sandbox.result import ExecResult

    class StandIn(Sandbox):
        backend = "local"

        def __init__(self, config: Any = None) -> None:
            super().__init__(config)
            time.sleep(START_S)
            self._alive = True

        def run(self, code: str, timeout: float | None = None) -> ExecResult:
            if code.startswith("sleep "):
                time.sleep(float(code.split()[1]))
            return ExecResult(stdout="ok\n", duration_s=1e-4)

        def reset(self) -> None:
            pass

        def close(self) -> None:
            self._alive = False

        def is_alive(self) -> bool:
            return self._alive

    stare_sandbox.local.LocalSandbox = StandIn  # type: ignore[misc]


# ----------------------------------------------------------------------------- one case, one process


def start_cluster(nodes: int, per_node: int) -> Any:
    from ray.cluster_utils import Cluster

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    cluster = Cluster(
        initialize_head=True,
        connect=False,
        head_node_args={"num_cpus": 0, "include_dashboard": False, "object_store_memory": 80 * 2**20},
    )
    for _ in range(nodes):
        cluster.add_node(num_cpus=0, object_store_memory=80 * 2**20, resources={"stare_sandbox": 1})
    cluster.wait_for_nodes()
    return cluster


def join(address: str) -> None:
    import ray

    ray.init(
        address=address,
        namespace="fleet-scale",
        logging_level="ERROR",
        runtime_env={"worker_process_setup_hook": "fleet_scale.install_stand_in"},
    )


def fleet_config(**kw: Any) -> Any:
    from stare_sandbox.ray_fleet import RayFleetConfig

    return RayFleetConfig(address="auto", namespace="fleet-scale", node_backend="local", **kw)


def coordinator_usage() -> tuple[float, int]:
    """CPU seconds and threads of the coordinator's process."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            if not cmd.startswith(b"ray::FleetCoordinator"):
                continue
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
            threads = int(fields[17])
            return cpu, threads
        except OSError:
            continue
    return float("nan"), 0


def case_ready(nodes: int, limit_s: float, rate: float, burst: int) -> dict[str, Any]:
    from stare_sandbox.ray_fleet import RaySandboxFleet

    per_node = 4
    cluster = start_cluster(nodes, per_node)
    join(cluster.address)
    config = fleet_config(
        sandboxes_per_node=per_node, creations_per_s=rate, creation_burst=burst, lease_timeout_s=7.0,
        refresh_s=1.0, start_timeout_s=limit_s,
    )  # fmt: skip
    start = time.monotonic()
    fleet = RaySandboxFleet(config, min_hosts=1)
    first = time.monotonic() - start
    full = None
    while time.monotonic() - start < limit_s:
        stats = fleet.stats()
        if sum(h.capacity for h in stats.hosts if h.ready) >= nodes * per_node:
            full = time.monotonic() - start
            break
        time.sleep(0.5)
    stats = fleet.stats()
    out = {
        "first_s": first,
        "ready_s": full,
        "ready_hosts": sum(h.ready for h in stats.hosts),
        "sandboxes": sum(h.capacity for h in stats.hosts if h.ready),
        "hosts_lost": stats.hosts_lost,
        "creations": len(stats.creations),
        "ideal_s": max(0.0, (nodes * per_node - burst) / rate),
    }
    fleet.shutdown_fleet()
    fleet.close()
    import ray

    ray.shutdown()
    cluster.shutdown()
    return out


LOAD_CLIENT = """
import json, statistics, sys, threading, time
sys.path.insert(0, {bench!r})
import fleet_scale
fleet_scale.join(sys.argv[1])
from stare_sandbox.ray_fleet import RaySandboxFleet
threads, seconds = int(sys.argv[2]), float(sys.argv[3])
fleet = RaySandboxFleet(fleet_scale.fleet_config(sandboxes_per_node=8, max_leases=96, lease_timeout_s=30.0,
                        creations_per_s=50.0, creation_burst=64), min_hosts=1)
waits, failures, episodes = [], [], [0]
lock = threading.Lock()
go = threading.Event()
end = [0.0]
def episode_loop():
    go.wait()
    while time.monotonic() < end[0]:
        t0 = time.monotonic()
        try:
            lease = fleet.acquire(timeout=30.0)
        except Exception as exc:
            with lock: failures.append(type(exc).__name__ + ": " + str(exc)[:120])
            continue
        waited = time.monotonic() - t0
        try:
            for _ in range(3):
                lease.run("x = 1")
            time.sleep(0.05)
        finally:
            lease.close()
        with lock:
            waits.append(waited); episodes[0] += 1
ts = [threading.Thread(target=episode_loop, daemon=True) for _ in range(threads)]
for t in ts: t.start()
print("ready", flush=True)
sys.stdin.readline()
end[0] = time.monotonic() + seconds
go.set()
for t in ts: t.join(seconds + 90)
print(json.dumps({{"waits": waits, "failures": failures, "episodes": episodes[0]}}), flush=True)
fleet.close()
"""

PROBE_CLIENT = """
import json, sys, threading, time
sys.path.insert(0, {bench!r})
import fleet_scale
fleet_scale.join(sys.argv[1])
from stare_sandbox.ray_fleet import RaySandboxFleet
threads = int(sys.argv[2])
fleet = RaySandboxFleet(fleet_scale.fleet_config(sandboxes_per_node=8, max_leases=96, lease_timeout_s=30.0,
                        creations_per_s=50.0, creation_burst=64), min_hosts=1)
got, failures, leases = [], [], []
lock = threading.Lock()
def wait_one():
    try:
        lease = fleet.acquire(timeout=25.0)
        with lock: got.append(time.time()); leases.append(lease)
    except Exception as exc:
        with lock: failures.append(type(exc).__name__ + ": " + str(exc)[:160])
ts = [threading.Thread(target=wait_one, daemon=True) for _ in range(threads)]
print("ready", flush=True)
sys.stdin.readline()
for t in ts: t.start()
for t in ts: t.join(60)
print(json.dumps({{"got": got, "failures": failures}}), flush=True)
for lease in leases: lease.close()
fleet.close()
"""


def _clients(script: str, address: str, procs: int, *args: str) -> list[subprocess.Popen[str]]:
    code = script.format(bench=str(BENCH))
    return [
        subprocess.Popen(
            [sys.executable, "-c", code, address, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=os.environ.copy(),
        )  # fmt: skip
        for _ in range(procs)
    ]


def _ready(procs: list[subprocess.Popen[str]]) -> None:
    for proc in procs:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError(f"a client did not start: {line!r}")


def _results(procs: list[subprocess.Popen[str]], timeout: float) -> list[dict[str, Any]]:
    out = []
    for proc in procs:
        try:
            text, _ = proc.communicate(timeout=timeout)
            out.append(json.loads(text.strip().splitlines()[-1]))
        except Exception as exc:  # noqa: BLE001 - a client that died counts as its failures
            proc.kill()
            out.append({"waits": [], "failures": [f"client died: {exc}"], "episodes": 0, "got": []})
    return out


def case_load(waiters: list[int], seconds: float) -> dict[str, Any]:
    from stare_sandbox.ray_fleet import RaySandboxFleet

    cluster = start_cluster(16, 8)
    join(cluster.address)
    main = RaySandboxFleet(
        fleet_config(
            sandboxes_per_node=8, max_leases=96, lease_timeout_s=30.0, creations_per_s=50.0, creation_burst=64
        ),
        min_hosts=16,
    )
    while main.stats().size < 128:
        time.sleep(0.5)
    out: dict[str, Any] = {}
    for w in waiters:
        try:
            out.update(_load_level(main, cluster.address, w, seconds))
        except Exception as exc:  # noqa: BLE001 - a level that breaks is reported, the next one runs
            out[f"load{w}"] = {"failure": f"the level failed: {type(exc).__name__}: {str(exc)[:200]}"}
        _settle(main)
    main.shutdown_fleet()
    main.close()
    import ray

    ray.shutdown()
    cluster.shutdown()
    return out


def _load_level(main: Any, address: str, w: int, seconds: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    procs = _clients(LOAD_CLIENT, address, 4, str(w // 4), str(seconds))
    _ready(procs)
    cpu0, _ = coordinator_usage()
    t0 = time.monotonic()
    threads_seen = []
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
    while time.monotonic() - t0 < seconds:
        time.sleep(1.0)
        threads_seen.append(coordinator_usage()[1])
    results = _results(procs, seconds + 120)
    cpu1, _ = coordinator_usage()
    waits = sorted(x for r in results for x in r["waits"])
    failures = [f for r in results for f in r["failures"]]
    out[f"load{w}"] = {
        "p50_ms": 1e3 * statistics.median(waits) if waits else None,
        "p99_ms": 1e3 * waits[int(0.99 * (len(waits) - 1))] if waits else None,
        "episodes_per_s": sum(r["episodes"] for r in results) / seconds,
        "failed": len(failures),
        "failure": failures[0] if failures else "",
        "coord_cpu": (cpu1 - cpu0) / (time.monotonic() - t0),
        "coord_threads": max(threads_seen, default=0),
    }
    _settle(main)
    # the starvation probe: the cap held by this process, w waiters queued, one lease freed
    held: list[Any] = []
    try:
        for _ in range(96):
            held.append(main.acquire(timeout=30))
    except Exception:
        for lease in held:
            lease.close()
        raise
    procs = _clients(PROBE_CLIENT, address, 4, str(w // 4))
    _ready(procs)
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
    time.sleep(8.0)
    freed = time.time()
    held.pop().close()
    results = _results(procs, 120)
    got = sorted(t for r in results for t in r["got"])
    failures = [f for r in results for f in r["failures"]]
    out[f"probe{w}"] = {
        "first_after_free_s": got[0] - freed if got else None,
        "granted": len(got),
        "failed": len(failures),
        "truthful": sum("96 leased of a cap of 96" in f for f in failures),
        "failure": failures[0] if failures else "",
    }
    for lease in held:
        lease.close()
    return out


def _settle(fleet: Any) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if fleet.stats().leased == 0:
                return
        time.sleep(0.5)


class Episodes:
    """``n`` threads playing 1 s episodes (20 calls, 50 ms apart) on ``fleet`` until ``stop()``:
    what finished, what was lost and how, and when each lease was asked for and how long it took."""

    def __init__(self, fleet: Any, n: int) -> None:
        self.fleet, self._stop = fleet, threading.Event()
        self.lost: list[str] = []
        self.finished = 0
        self.leases: list[tuple[float, float, bool]] = []  # (asked at, waited, granted)
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(n)]
        for t in self._threads:
            t.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            asked = time.monotonic()
            try:
                lease = self.fleet.acquire(timeout=20)
            except Exception as exc:  # noqa: BLE001 - counted
                with self._lock:
                    self.leases.append((asked, time.monotonic() - asked, False))
                    self.lost.append(f"acquire: {type(exc).__name__}")
                time.sleep(0.5)
                continue
            with self._lock:
                self.leases.append((asked, time.monotonic() - asked, True))
            try:
                for _ in range(20):
                    lease.run("x = 1")
                    time.sleep(0.05)
                with self._lock:
                    self.finished += 1
            except Exception as exc:  # noqa: BLE001 - an episode lost mid-way
                with self._lock:
                    self.lost.append(f"run: {type(exc).__name__}")
            finally:
                with contextlib.suppress(Exception):
                    lease.close()

    def worst_wait(self, since: float, until: float) -> float | None:
        """The longest wait of a lease granted among those asked for in ``[since, until)``."""
        with self._lock:
            waits = [w for asked, w, granted in self.leases if granted and since <= asked < until]
        return max(waits) if waits else None

    def summary(self) -> dict[str, Any]:
        with self._lock:
            return {
                "lost": len(self.lost),
                "lost_kinds": sorted(set(self.lost))[:3],
                "finished": self.finished,
            }

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)


def case_faults() -> dict[str, Any]:
    """Each fault in turn, 24 episodes running: what was lost, the longest lease wait among leases
    asked for in the 15 s after it, and the fleet's hosts before and after."""
    import ray

    from stare_sandbox.ray_fleet import COORDINATOR_NAME, RaySandboxFleet

    cluster = start_cluster(8, 4)
    join(cluster.address)
    fleet = RaySandboxFleet(
        fleet_config(sandboxes_per_node=4, lease_timeout_s=20.0, call_margin_s=5.0, refresh_s=0.5),
        min_hosts=8,
    )
    while fleet.stats().size < 32:
        time.sleep(0.5)
    out: dict[str, Any] = {}
    for fault in ("coordinator", "host", "node"):
        episodes = Episodes(fleet, 24)
        time.sleep(3.0)
        before = fleet.stats()
        t0 = time.monotonic()
        if fault == "coordinator":
            ray.kill(ray.get_actor(COORDINATOR_NAME, namespace="fleet-scale"), no_restart=False)
        elif fault == "host":
            lease = fleet.acquire(timeout=20)
            ray.kill(lease.inner._host)
            lease.close()
        else:
            victim = next(n for n in cluster.worker_nodes if n is not cluster.head_node)
            cluster.remove_node(victim, allow_graceful=False)
        time.sleep(15.0)
        episodes.stop()
        after = None
        with contextlib.suppress(Exception):
            after = fleet.stats()
        out[fault] = {
            **episodes.summary(),
            "worst_wait_s": episodes.worst_wait(t0, t0 + 15.0),
            "hosts_before": len(before.hosts),
            "hosts_after": len(after.hosts) if after else None,
            "hosts_lost": (after.hosts_lost - before.hosts_lost) if after else None,
            "adopted": getattr(after, "adopted", None) if after else None,
        }
        if after is None:
            break  # the baseline's fleet does not come back: the later faults have nothing to hit
        time.sleep(5.0)
    with contextlib.suppress(Exception):
        fleet.shutdown_fleet()
        fleet.close()
    ray.shutdown()
    cluster.shutdown()
    return out


def case_gcs(storage: str) -> dict[str, Any]:
    """The head's GCS killed mid-step, 12 episodes running: with Ray's default in-memory GCS
    (``memory``: the cluster's state is gone; Ray ends this driver after
    ``RAY_gcs_rpc_server_reconnect_timeout_s``, set to 30 s here), or with Ray's GCS fault tolerance
    (``rocksdb``: its embedded store on disk; the GCS is started again 10 s later). Prints a line a
    second, as Ray may end this process without a goodbye."""
    import ray

    from stare_sandbox.ray_fleet import RaySandboxFleet

    os.environ["RAY_gcs_rpc_server_reconnect_timeout_s"] = "30"
    if storage == "rocksdb":
        os.environ["RAY_gcs_storage"] = "rocksdb"
        os.environ["RAY_gcs_storage_path"] = tempfile.mkdtemp(prefix="gcs-")
    cluster = start_cluster(4, 4)
    join(cluster.address)
    fleet = RaySandboxFleet(
        fleet_config(sandboxes_per_node=4, lease_timeout_s=20.0, call_margin_s=5.0), min_hosts=4
    )
    while fleet.stats().size < 16:
        time.sleep(0.5)
    episodes = Episodes(fleet, 12)
    time.sleep(3.0)
    hosts = len(fleet.stats().hosts)
    t0 = time.monotonic()
    cluster.head_node.kill_gcs_server()
    restarted = None
    probes = {"outage": [0, 0], "after": [0, 0]}  # [granted, failed] while the GCS is down / back
    out: dict[str, Any] = {}
    while time.monotonic() - t0 < 45:  # past Ray's 30 s: a driver without the GCS is ended by then
        if storage == "rocksdb" and restarted is None and time.monotonic() - t0 > 10:
            cluster.head_node.start_gcs_server()
            restarted = time.monotonic() - t0
        phase = "after" if restarted is not None else "outage"
        try:
            probe = fleet.acquire(timeout=3)
            probe.run("x = 1")
            probe.close()
            probes[phase][0] += 1
        except Exception:  # noqa: BLE001 - counted
            probes[phase][1] += 1
        out = {
            "storage": storage, "since_kill_s": time.monotonic() - t0, **episodes.summary(),
            "gcs_restarted_s": restarted, "probes": probes, "hosts_before": hosts,
        }  # fmt: skip
        print(json.dumps(out), flush=True)
        time.sleep(1.0)
    episodes.stop()
    with contextlib.suppress(Exception):
        stats = fleet.stats()
        out.update(hosts_after=len(stats.hosts), hosts_lost=stats.hosts_lost)
    with contextlib.suppress(Exception):
        fleet.shutdown_fleet()
        fleet.close()
    with contextlib.suppress(Exception):
        ray.shutdown()
        cluster.shutdown()
    return out


def run_case(case: str, args: argparse.Namespace) -> dict[str, Any]:
    import stare_sandbox.ray_fleet.coordinator as coordinator

    where = str(Path(coordinator.__file__).resolve())
    if case.startswith("ready"):
        out = case_ready(int(case[5:]), args.limit, args.rate, args.burst)
    elif case == "load":
        out = case_load([int(w) for w in args.waiters.split(",")], args.seconds)
    elif case.startswith("gcs-"):
        out = case_gcs(case[4:])
    else:
        out = case_faults()
    out["code"] = where
    return out


# ----------------------------------------------------------------------------------------- the table


def baseline_tree(rev: str, into: Path) -> Path:
    archive = subprocess.run(
        ["git", "archive", rev, "sandbox"], cwd=REPO, capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    (into / "stare_sandbox").symlink_to(into / "sandbox")
    return into


def spawn(case: str, pythonpath: str, args: argparse.Namespace, label: str) -> dict[str, Any]:
    """Run ``case`` in a process of its own; its last JSON line (a case that Ray ended early leaves its
    progress), with ``exit`` when it did not exit 0. Its stderr is kept in the temp directory."""
    env = dict(os.environ, PYTHONPATH=pythonpath, RAY_DEDUP_LOGS="0")
    cmd = [sys.executable, __file__, "--one", case, "--waiters", args.waiters, "--seconds", str(args.seconds),
           "--limit", str(args.limit), "--rate", str(args.rate), "--burst", str(args.burst)]  # fmt: skip
    ray_cli = str(Path(sys.executable).parent / "ray")
    log = Path(tempfile.gettempdir()) / f"fleet_scale-{case}-{label}.stderr"
    try:
        with log.open("w") as err:
            done = subprocess.run(
                cmd, env=env, stdout=subprocess.PIPE, stderr=err, text=True, timeout=args.case_timeout
            )
    except subprocess.TimeoutExpired:
        subprocess.run([ray_cli, "stop", "--force"], capture_output=True, check=False)
        return {"error": f"over {args.case_timeout} s (stderr: {log})"}
    subprocess.run([ray_cli, "stop", "--force"], capture_output=True, check=False)
    lines = [x for x in done.stdout.splitlines() if x.startswith("{")]
    if not lines:
        tail = [x for x in log.read_text(errors="replace").splitlines() if "Error" in x]
        return {"error": (tail or ["no output"])[-1][:200] + f" (stderr: {log})"}
    out = json.loads(lines[-1])
    if done.returncode != 0:
        out["exit"] = done.returncode
    return out


def fmt(value: Any, unit: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}{unit}"
    return f"{value}{unit}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", default="41513b3")
    parser.add_argument("--cases", default="ready,load,faults,gcs")
    parser.add_argument("--nodes", default="16,32")
    parser.add_argument("--waiters", default="512,1024,2048")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--limit", type=float, default=150.0, help="ready: give up after this many seconds")
    parser.add_argument("--rate", type=float, default=2.0, help="ready: creations_per_s")
    parser.add_argument("--burst", type=int, default=1, help="ready: creation_burst")
    parser.add_argument("--case-timeout", type=float, default=900.0)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_case(args.one, args)), flush=True)
        return
    cases: list[str] = []
    for case in args.cases.split(","):
        if case == "ready":
            cases += [f"ready{n}" for n in args.nodes.split(",")]
        elif case == "gcs":
            cases += ["gcs-memory", "gcs-rocksdb"]
        else:
            cases.append(case)
    base_sha = subprocess.run(["git", "rev-parse", "--short", args.baseline], cwd=REPO, capture_output=True,
                              text=True, check=True).stdout.strip()  # fmt: skip
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    from stare_agent.provenance import machine

    print(f"machine: {machine()}; baseline {base_sha}, "
          f"this tree at {head} (+ its changes)", flush=True)  # fmt: skip
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        base = baseline_tree(args.baseline, Path(tmp))
        for case in cases:
            for label, path in (("baseline", f"{base}:{BENCH}"), ("new", f"{REPO}:{BENCH}")):
                t0 = time.monotonic()
                results[f"{case}/{label}"] = r = spawn(case, path, args, label)
                print(f"  {case} {label}: {time.monotonic() - t0:.0f} s  {json.dumps(r)[:400]}", flush=True)
    report(cases, results)


def report(cases: list[str], results: dict[str, dict[str, Any]]) -> None:
    print()
    for case in cases:
        b, n = results[f"{case}/baseline"], results[f"{case}/new"]
        if "error" in b or "error" in n:
            print(f"{case}: baseline {b.get('error', 'ok')} | new {n.get('error', 'ok')}")
        if case.startswith("ready"):
            print(
                f"| {case[5:]} nodes x 4 | first host (s) | all ready (s) | ideal (s) | sandboxes | hosts lost | starts |"
            )
            print("|---|---|---|---|---|---|---|")
            for label, r in (("baseline", b), ("new", n)):
                print(f"| {label} | {fmt(r.get('first_s'))} | {fmt(r.get('ready_s')) if r.get('ready_s') else 'not ready'} | "
                      f"{fmt(r.get('ideal_s'))} | {fmt(r.get('sandboxes'))} | {fmt(r.get('hosts_lost'))} | "
                      f"{fmt(r.get('creations'))} |")  # fmt: skip
        elif case == "load":
            print("| episodes at once | code | lease p50 (ms) | p99 (ms) | episodes/s | failed leases | "
                  "coordinator CPU (cores) | threads | W waiters, 1 freed: first grant after (s) | "
                  "granted / told none (truly: cap full) |")  # fmt: skip
            print("|---|---|---|---|---|---|---|---|---|---|")
            for key in sorted((k for k in n if k.startswith("load")), key=lambda k: int(k[4:])):
                w = key[4:]
                for label, r in (("baseline", b), ("new", n)):
                    load, probe = r.get(key, {}), r.get(f"probe{w}", {})
                    print(f"| {w} | {label} | {fmt(load.get('p50_ms'))} | {fmt(load.get('p99_ms'))} | "
                          f"{fmt(load.get('episodes_per_s'))} | {fmt(load.get('failed'))} | "
                          f"{fmt(load.get('coord_cpu'))} | {fmt(load.get('coord_threads'))} | "
                          f"{fmt(probe.get('first_after_free_s'))} | {fmt(probe.get('granted'))} / "
                          f"{fmt(probe.get('failed'))} ({fmt(probe.get('truthful'))}) |")  # fmt: skip
            for label, r in (("baseline", b), ("new", n)):
                for key, v in r.items():
                    if isinstance(v, dict) and v.get("failure"):
                        print(f"  {label} {key} first failure: {v['failure']}")
        elif case == "faults":
            print("| fault | code | episodes lost | finished | longest lease wait in the 15 s after (s) | "
                  "hosts before -> after | hosts lost | adopted |")  # fmt: skip
            print("|---|---|---|---|---|---|---|---|")
            for fault in ("coordinator", "host", "node"):
                for label, r in (("baseline", b), ("new", n)):
                    f = r.get(fault)
                    if f is None:
                        print(f"| {fault} | {label} | not run (the fleet did not come back) | | | | | |")
                        continue
                    print(f"| {fault} | {label} | {f['lost']} {f['lost_kinds']} | {f['finished']} | "
                          f"{fmt(f['worst_wait_s'])} | {f['hosts_before']} -> {fmt(f['hosts_after'])} | "
                          f"{fmt(f['hosts_lost'])} | {fmt(f.get('adopted'))} |")  # fmt: skip
        else:
            print(f"| GCS killed ({case[4:]}) | episodes lost | finished | GCS back at (s) | "
                  "leases granted / failed, GCS down | after it is back | the driver | hosts before -> after |")  # fmt: skip
            print("|---|---|---|---|---|---|---|---|")
            for label, r in (("baseline", b), ("new", n)):
                driver = f"ended by Ray after {r.get('since_kill_s', 0):.0f} s" if r.get("exit") else "alive"
                print(f"| {label} | {fmt(r.get('lost'))} {r.get('lost_kinds', '')} | {fmt(r.get('finished'))} | "
                      f"{fmt(r.get('gcs_restarted_s'))} | {'/'.join(map(str, r.get('probes', {}).get('outage', [])))} | "
                      f"{'/'.join(map(str, r.get('probes', {}).get('after', []))) or '-'} | {driver} | "
                      f"{fmt(r.get('hosts_before'))} -> {fmt(r.get('hosts_after'))} |")  # fmt: skip
        print()


if __name__ == "__main__":
    main()
