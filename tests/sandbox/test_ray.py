"""The Ray fleet (``sandbox.backend: ray``) on a real multi-node Ray cluster of this machine
(``ray.cluster_utils.Cluster``: a head without sandboxes and sandbox nodes, each with its own
resources) and real Docker: placement, the lease cap and the creation-rate limit under a burst,
hostile code through the fleet, and the faults (an actor killed mid-call, a node killed
mid-episode, a node that joins later). Every node talks over the loopback only."""

from __future__ import annotations

import itertools
import os
import threading
import time

import pytest

from stare_sandbox import SandboxConfig
from stare_sandbox.ray_fleet import FleetCoordinator, RayFleetConfig, RaySandbox, RaySandboxFleet, SandboxLost

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.timeout(600)]

NAMESPACE = "stare-test-fleet"
LIMITS = SandboxConfig(memory_mb=512, tmpfs_mb=64, pids_limit=64, max_output_chars=2000, timeout_s=10)
NODE = {"num_cpus": 1, "object_store_memory": 80 * 2**20, "resources": {"stare_sandbox": 1}}
FLEET = RayFleetConfig(
    namespace=NAMESPACE,
    sandboxes_per_node=2,
    max_leases=3,
    creations_per_s=2.0,
    creation_burst=2,
    lease_timeout_s=60.0,
    call_margin_s=20.0,
    refresh_s=0.5,
    start_timeout_s=240.0,
)


def test_no_ray_cluster_is_one_line_with_the_fix(ray_ready, monkeypatch) -> None:
    import ray

    from stare_sandbox import SandboxUnavailable

    def no_cluster(**kwargs):
        raise ConnectionError("Could not find any running Ray instance.")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", no_cluster)
    with pytest.raises(SandboxUnavailable) as failure:
        RaySandboxFleet(RayFleetConfig())
    message = str(failure.value)
    assert message.startswith("no Ray cluster at sandbox.ray.address='auto' (Could not find any running Ray")
    assert "ray start --address ... --resources '{\"stare_sandbox\": 1}'" in message and "\n" not in message


def test_the_ray_doctor_without_a_cluster_is_one_line_with_the_fix(ray_ready, monkeypatch, capsys) -> None:
    import ray

    from stare_agent.cli import main

    def no_cluster(**kwargs):
        raise ConnectionError(
            "Could not find any running Ray instance.\nPlease specify the one to connect to."
        )

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", no_cluster)
    assert main(["sandbox", "doctor", "--backend", "ray"]) == 1
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith(
        "[FAIL] ray cluster: no Ray cluster at 'auto' (Could not find any running Ray instance.): start one"
    )
    assert "--resources '{\"stare_sandbox\": 1}'" in line and line.endswith("or pass --address HOST:PORT")


@pytest.fixture(scope="module")
def cluster(ray_ready, docker_ready):
    """A head node (no sandboxes) and two sandbox nodes, all on 127.0.0.1, and this process joined."""
    import ray
    from ray.cluster_utils import Cluster

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # every node on 127.0.0.1, not the host's address
    cluster = Cluster(
        initialize_head=True,
        connect=False,
        head_node_args={
            "num_cpus": 1,
            "object_store_memory": 80 * 2**20,
            "include_dashboard": False,
            # a lost node is declared dead within about 10 s, not Ray's default 30 s; not faster, as a
            # node of a loaded machine may miss a few heartbeats and would be declared dead alive
            "_system_config": {"health_check_period_ms": 1000, "health_check_failure_threshold": 10},
        },
    )
    try:
        for _ in range(2):
            cluster.add_node(**NODE)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, namespace=NAMESPACE, logging_level="WARNING")
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        os.environ.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
        from stare_sandbox.docker import reap_orphans

        reap_orphans()  # containers of hosts that were killed (their owner process is gone)


@pytest.fixture(scope="module")
def fleet(cluster):
    fleet = RaySandboxFleet(FLEET, LIMITS, min_hosts=2)
    try:
        yield fleet
    finally:
        fleet.shutdown_fleet()
        fleet.close()


def _ready_hosts(fleet: RaySandboxFleet) -> set[str]:
    return {h.node_id for h in fleet.stats().hosts if h.ready}


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g} s: {what}")
        time.sleep(0.25)


def test_leases_spread_over_nodes_and_results_round_trip(fleet: RaySandboxFleet) -> None:
    leases = [fleet.acquire() for _ in range(2)]
    try:
        nodes = [lease.inner.node_id for lease in leases]
        assert len(set(nodes)) == 2, nodes  # one per node: the emptier host takes the next lease
        assert all(isinstance(lease.inner, RaySandbox) for lease in leases)
        first = leases[0]
        assert first.run("x = 6").ok
        result = first.run("print(x * 7)\nimport sys; sys.stderr.write('warn')\n1 / 0")
        assert result.stdout == "42\n" and result.stderr == "warn"
        assert result.error is not None and result.error.type == "ZeroDivisionError"
        assert "division by zero" in result.error.traceback
        assert result.duration_s > 0 and result.peak_memory_bytes is not None
        assert leases[1].run("'x' in dir()").stdout == "False\n"  # another episode's sandbox
    finally:
        for lease in leases:
            lease.close()
    with fleet.lease() as again:  # a reset sandbox: the last episode's names are gone
        assert again.run("'x' in dir()").stdout == "False\n"


def test_the_coordinator_lives_on_the_node_that_built_the_fleet(fleet: RaySandboxFleet) -> None:
    """Not on a Docker node: a sandbox node that dies (or misses its heartbeats under load) costs
    its own leases, never the coordinator and with it every episode of the fleet."""
    import ray

    node = fleet.stats().coordinator_node
    alive = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
    sandbox_nodes = {i for i, resources in alive.items() if resources.get("stare_sandbox")}
    assert len(sandbox_nodes) >= 2 and node in alive and node not in sandbox_nodes


def test_hostile_code_through_the_fleet(fleet: RaySandboxFleet) -> None:
    with fleet.lease() as sb:
        start = time.monotonic()
        result = sb.run("y = 5\nwhile True: pass", timeout=1)
        assert result.timed_out and not result.state_lost and time.monotonic() - start < 1 + 2 + 1
        assert sb.run("y").stdout == "5\n"  # a timeout keeps the state

        result = sb.run("print('x' * 10**7)\nimport sys\nsys.stderr.write('y' * 10**6)")
        assert result.truncated and len(result.stdout) < 2100 and len(result.stderr) < 2100

        result = sb.run("b = bytearray(2 * 1024**3)")
        assert result.error is not None and result.error.type in ("KernelDied", "MemoryError")
        assert result.state_lost == (result.error.type == "KernelDied")

        result = sb.run("import os; os.kill(os.getpid(), 9)")
        assert result.error is not None and result.error.type == "KernelDied" and result.state_lost
        assert sb.tainted  # replaced, not reset, when it goes back
        assert sb.run("6 * 7").stdout == "42\n"  # the host's sandbox came back with a fresh kernel


FORK_BOMB = (
    "import os, time\nn = 0\ntry:\n    for _ in range(10000):\n        if os.fork() == 0:\n"
    "            time.sleep(60)\n            os._exit(0)\n        n += 1\n"
    "except OSError as e:\n    print('blocked', type(e).__name__)\nn"
)
DISK_FILL = (
    "n = 0\ntry:\n    with open('/work/fill', 'wb') as f:\n        while True:\n"
    "            f.write(b'x' * 2**20); f.flush(); n += 1\nexcept OSError as e:\n    print(e.errno, n)"
)
CLEAN = "import os\nprint(sum(p.isdigit() for p in os.listdir('/proc')), os.listdir('/work'))"


def test_a_fork_bomb_and_a_disk_fill_are_contained_and_the_host_serves_clean_sandboxes(
    fleet: RaySandboxFleet,
) -> None:
    """The pids and tmpfs limits hold on a fleet host: each call returns an ``ExecResult`` (not an
    infrastructure error), and the next lease on that host is a clean, working sandbox."""
    _wait(lambda: fleet.stats().leased == 0, 30, "no lease held")
    with fleet.lease() as sb:
        node = sb.inner.node_id
        bomb = sb.run(FORK_BOMB, timeout=20)
        assert bomb.ok and bomb.stdout.startswith("blocked"), bomb
        assert int(bomb.stdout.split()[-1]) < LIMITS.pids_limit
        fill = sb.run(DISK_FILL, timeout=20)
        assert fill.ok, fill
        errno_, megabytes = map(int, fill.stdout.split())
        assert errno_ in (27, 28) and megabytes <= LIMITS.tmpfs_mb  # EFBIG (RLIMIT_FSIZE) or ENOSPC
    _wait(lambda: fleet.stats().leased == 0, 30, "the lease given back")
    leases = [fleet.acquire(), fleet.acquire()]  # one on each host: the emptier host takes the next
    try:
        (again,) = [lease for lease in leases if lease.inner.node_id == node]
        # the warden (PID 1) and the kernel, an empty /work; and it works
        assert again.run(CLEAN).stdout == "2 []\n"
        assert again.run("open('/work/f', 'w').write('ok')").stdout == "2\n"
    finally:
        for lease in leases:
            lease.close()


def test_the_ray_doctor_checks_nodes_hosts_and_the_coordinator(cluster, fleet, capsys) -> None:
    """``stare-agent sandbox doctor --backend ray`` against the cluster: a line per sandbox node's host
    with its round trip, the coordinator's node; a host that cannot start is one line with the fix."""
    from stare_agent.cli import main
    from stare_sandbox.doctor import diagnose_ray

    args = ["--address", cluster.address, "--namespace", NAMESPACE, "--timeout", "60"]
    assert main(["sandbox", "doctor", "--backend", "ray", *args]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("[ok  ] ray cluster: 3 nodes alive")
    assert lines[1] == "[ok  ] sandbox nodes: 2 with the resource 'stare_sandbox'"
    hosts = [line for line in lines if line.startswith("[ok  ] host on ")]
    assert len(hosts) == 2 and all(": ready; `1 + 1` round trip " in line for line in hosts), lines
    assert lines[-1].startswith("[ok  ] coordinator: on ") and "sandbox node" not in lines[-1]
    assert "; 1 clients besides this doctor; 0 of 3 leased, 0 waiting; " in lines[-1], lines[-1]
    assert len(lines) == 5 and fleet.stats().clients == 1  # it left the run's fleet as it found it

    missing = SandboxConfig(image="stare-sandbox:missing")  # a fleet of its own, whose hosts cannot start
    checks = diagnose_ray(cluster.address, namespace="stare-test-doctor", wait_s=60, config=missing)
    failed = [c for c in checks if not c.ok]
    assert [c.name.split()[0] for c in failed] == ["host", "host"], checks
    for check in failed:
        assert "\n" not in check.message
        assert check.message.startswith(
            "did not start: SandboxUnavailable: sandbox image stare-sandbox:missing not found: "
            "run `stare-agent sandbox build`"
        ), check.message


def test_the_lease_cap_and_the_creation_rate_hold_under_a_burst(fleet: RaySandboxFleet) -> None:
    before = fleet.stats()
    errors: list[BaseException] = []

    def episode(i: int) -> None:
        try:
            lease = fleet.acquire(timeout=120)
            try:
                assert lease.run(f"{i} + 1").stdout == f"{i + 1}\n"
                time.sleep(0.3)
            finally:
                fleet.release(lease, broken=i % 2 == 0)  # half of them are replaced: container starts
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=episode, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert not errors, errors
    after = fleet.stats()
    assert after.peak_leased == FLEET.max_leases  # the cap (3) of the 4 sandboxes, reached and held
    assert after.leases - before.leases == 8
    _wait(lambda: fleet.stats().leased == 0, 30, "every lease given back")  # hosts report returns
    _wait(lambda: len(fleet.stats().creations) >= len(before.creations) + 4, 120, "4 replacements started")
    creations = fleet.stats().creations
    for i in range(len(creations)):  # the token bucket: at most burst + rate * span in any window
        for j in range(i + 1, len(creations)):
            span = creations[j] - creations[i]
            assert j - i + 1 <= FLEET.creation_burst + FLEET.creations_per_s * span + 1e-6, (i, j, span)


SECOND_PROCESS = """
import dataclasses, json, sys
from stare_sandbox.errors import PoolExhausted
from stare_sandbox.ray_fleet import RaySandboxFleet
from tests.sandbox.test_ray import FLEET, LIMITS

fleet = RaySandboxFleet(dataclasses.replace(FLEET, address=sys.argv[1]), LIMITS)  # joins Ray itself
out = {"joined": fleet._joined, "clients": fleet.stats().clients}
lease = fleet.acquire(timeout=30)
out["ran"] = lease.run("6 * 7").stdout
try:
    fleet.acquire(timeout=1)
    out["capped"] = False
except PoolExhausted:
    out["capped"] = True
out["leased"] = fleet.stats().leased
fleet.close()  # gives its lease back and leaves Ray: the fleet stays for the first process
print(json.dumps(out))
"""


def test_a_second_process_shares_the_fleet_and_its_lease_cap(cluster, fleet: RaySandboxFleet) -> None:
    """As the ranks of a training run: another process that builds the fleet with the same config
    finds the same coordinator, the cluster-wide cap holds across both, and its close (it joined
    Ray itself) leaves the fleet to this one."""
    import json
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    _wait(lambda: fleet.stats().leased == 0, 30, "no lease held")
    assert fleet.stats().clients == 1
    leases = [fleet.acquire(), fleet.acquire()]  # 2 of the cap of 3
    try:
        done = subprocess.run(
            [sys.executable, "-c", SECOND_PROCESS, cluster.address],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=repo,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        out = json.loads(done.stdout.strip().splitlines()[-1])
        assert out == {"joined": True, "clients": 2, "ran": "42\n", "capped": True, "leased": 3}
        stats = fleet.stats()
        assert stats.clients == 1 and stats.leased == 2  # its lease came back before it left
        assert leases[0].run("1 + 1").stdout == "2\n"  # the fleet goes on for this process
    finally:
        for lease in leases:
            lease.close()
    with fleet.lease() as sb:
        assert sb.run("2 + 2").stdout == "4\n"
    # a process that dies without close counts as left, within seconds (the coordinator notices)
    dies = SECOND_PROCESS.split("out = ")[0] + "import os; os._exit(0)\n"
    done = subprocess.run(
        [sys.executable, "-c", dies, cluster.address], capture_output=True, timeout=120, cwd=repo
    )
    assert done.returncode == 0, done.stderr[-3000:]
    _wait(lambda: fleet.stats().clients == 1, 30, "the dead process's client forgotten")


def test_a_fleet_whose_every_client_died_ends_itself(cluster) -> None:
    """The coordinator is detached (no process owns it): when the only process that used it dies
    without ``close``, it ends itself, its hosts and their containers."""
    import subprocess
    import sys

    import ray

    from stare_sandbox.ray_fleet import COORDINATOR_NAME

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    dies = SECOND_PROCESS.split("out = ")[0].replace(
        "dataclasses.replace(FLEET, ", "dataclasses.replace(FLEET, namespace='stare-test-orphan', "
    )
    dies += "assert fleet.stats().clients == 1\nimport os; os._exit(0)\n"
    done = subprocess.run(
        [sys.executable, "-c", dies, cluster.address], capture_output=True, timeout=120, cwd=repo
    )
    assert done.returncode == 0, done.stderr[-3000:]

    def ended() -> bool:
        try:
            ray.get_actor(COORDINATOR_NAME, namespace="stare-test-orphan")
        except ValueError:
            return True
        return False

    _wait(ended, 30, "the orphaned coordinator ended")

    def left() -> list:
        return [
            a
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == "stare-test-orphan"
        ]

    _wait(lambda: not left(), 30, "its hosts ended")


def test_an_actor_killed_mid_call_fails_the_call_and_its_host_comes_back(fleet: RaySandboxFleet) -> None:
    import ray

    lease = fleet.acquire()
    sandbox = lease.inner
    assert isinstance(sandbox, RaySandbox)
    failure: list[BaseException] = []

    def call() -> None:
        try:
            lease.run("import time; time.sleep(30)", timeout=60)
        except BaseException as exc:  # noqa: BLE001 - asserted below
            failure.append(exc)

    thread = threading.Thread(target=call)
    thread.start()
    time.sleep(1.0)
    start = time.monotonic()
    ray.kill(sandbox._host)
    thread.join(30)
    assert not thread.is_alive(), "the call hung after its host was killed"
    assert len(failure) == 1 and isinstance(failure[0], SandboxLost), failure
    assert "was lost during run" in str(failure[0]) and time.monotonic() - start < 15
    assert lease.tainted
    lease.close()
    with fleet.lease() as sb:  # leasing goes on at once, on the other host
        assert sb.run("1 + 1").stdout == "2\n"
    # the killed host's node is alive: it gets a new host
    _wait(lambda: sandbox.node_id in _ready_hosts(fleet), 120, "a new host on the node of the killed one")
    assert fleet.stats().hosts_lost >= 1


def test_a_lease_connection_needs_the_token_its_host_issued(fleet: RaySandboxFleet) -> None:
    """A lease's calls go on a connection of its own to its host, opened with the token the host
    issued for that lease: another token, or the same token a second time, is refused, and the
    refusal leaves the lease's own connection working."""
    import socket

    import ray

    from stare_sandbox.ray_fleet.wire import TOKEN_BYTES, LeaseConnection, recv_frame

    with fleet.lease() as sb:
        host = sb.inner._host
        ip, port, token = ray.get(host.acquire.remote("test-token-lease", "test-client", 30.0), timeout=60)
        try:
            assert len(token) == TOKEN_BYTES
            wrong = bytes([token[0] ^ 1]) + token[1:]
            with socket.create_connection((ip, port), timeout=10) as raw:
                raw.sendall(wrong)
                assert recv_frame(raw)[0] == "refused"
                assert raw.recv(1) == b""  # and the host closed the connection
            right = LeaseConnection((ip, port), token, 10.0)
            try:
                assert right.call(["run", "6 * 7", None], 30.0)[1][0] == "42\n"  # ExecResult packed
            finally:
                right.close()
            with pytest.raises(PermissionError, match="refused the lease's token"):
                LeaseConnection((ip, port), token, 10.0)  # a token is good for one connection
            assert sb.run("1 + 1").stdout == "2\n"
        finally:
            ray.get(host.release.remote("test-token-lease", False), timeout=60)


def _sleeping_step(env) -> tuple[threading.Thread, list[BaseException]]:
    """A step whose code sleeps 30 s, running on a thread (started 1 s ago); ``failure`` gets what it raised."""
    failure: list[BaseException] = []

    def step() -> None:
        call = '<tool_call>{"name": "code_interpreter", "arguments": {"code": "import time; time.sleep(30)"}}</tool_call>'
        try:
            env.step(call)
        except BaseException as exc:  # noqa: BLE001 - asserted by the caller
            failure.append(exc)

    thread = threading.Thread(target=step)
    thread.start()
    time.sleep(1.0)
    return thread, failure


def test_a_host_process_killed_mid_call_ends_the_episode_not_hangs_it(fleet: RaySandboxFleet) -> None:
    """The host's process dies (SIGKILL, no goodbye) while a call runs on its connection: the step
    raises ``EpisodeInfrastructureError`` (its cause ``SandboxLost``) at once, and the next episode
    is played on a live host."""
    import signal

    import ray

    from stare_envs.tool_env import EpisodeInfrastructureError, ToolEnv

    _wait(lambda: len(_ready_hosts(fleet)) >= 2, 120, "two ready hosts")
    env = ToolEnv("modpow", format="hermes", pool=fleet, max_turns=4)
    try:
        env.reset(seed=0)
        env.step('<tool_call>{"name": "code_interpreter", "arguments": {"code": "z = 1"}}</tool_call>')
        host, node = env._sandbox.inner._host, env._sandbox.inner.node_id
        pid = ray.get(host.__ray_call__.remote(lambda self: os.getpid()), timeout=60)
        thread, failure = _sleeping_step(env)
        start = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        thread.join(30)
        assert not thread.is_alive(), "the step hung after its host's process was killed"
        assert len(failure) == 1 and isinstance(failure[0], EpisodeInfrastructureError), failure
        assert isinstance(failure[0].__cause__, SandboxLost) and time.monotonic() - start < 10
        assert "was lost during run" in str(failure[0].__cause__)
        env.reset(seed=1)  # played again, on a live host
        obs, *_ = env.step(
            '<tool_call>{"name": "code_interpreter", "arguments": {"code": "print(2 + 3)"}}</tool_call>'
        )
        assert "5" in obs
    finally:
        env.close()
    _wait(lambda: node in _ready_hosts(fleet), 120, "a new host on the node of the killed one")


def test_a_node_killed_mid_episode_fails_the_episode_and_a_new_node_takes_leases(cluster, fleet) -> None:
    from stare_envs.tool_env import EpisodeInfrastructureError, ToolEnv

    old = _ready_hosts(fleet)
    _wait(lambda: len(old) == 2 and _ready_hosts(fleet) == old, 60, "two ready hosts")
    for lease in [fleet.acquire(), fleet.acquire()]:  # one on each old host, so both were leased lately
        lease.close()
    node = cluster.add_node(**NODE)  # a node that joins after the fleet started
    # ready from its first sandbox on; equally free (both of its sandboxes up) before the check below
    _wait(
        lambda: len(_ready_hosts(fleet)) == 3 and fleet.stats().size == 6,
        180,
        "a full host on the node that joined",
    )
    (new,) = _ready_hosts(fleet) - old

    env = ToolEnv("modpow", format="hermes", pool=fleet, max_turns=4)
    try:
        env.reset(seed=0)
        env.step('<tool_call>{"name": "code_interpreter", "arguments": {"code": "z = 1"}}</tool_call>')
        assert env._sandbox.inner.node_id == new  # among equally free hosts, the one leased least recently
        thread, failure = _sleeping_step(env)
        start = time.monotonic()
        cluster.remove_node(node, allow_graceful=False)
        thread.join(60)
        assert not thread.is_alive(), "the step hung after its node was killed"
        assert len(failure) == 1 and isinstance(failure[0], EpisodeInfrastructureError), failure
        assert isinstance(failure[0].__cause__, SandboxLost) and time.monotonic() - start < 30
        env.reset(seed=1)  # the episode is played again, on a healthy node
        obs, *_ = env.step(
            '<tool_call>{"name": "code_interpreter", "arguments": {"code": "print(2 + 3)"}}</tool_call>'
        )
        assert "5" in obs and env._sandbox.inner.node_id in old
    finally:
        env.close()
    _wait(lambda: new not in {h.node_id for h in fleet.stats().hosts}, 60, "the dead node's host dropped")


def test_an_evaluation_plays_its_episodes_on_the_fleet(fleet: RaySandboxFleet) -> None:
    """What ``stare-agent eval`` does with ``sandbox.backend=ray``: the fleet is the envs' pool."""
    from stare_agent.engines.scripted import ScriptedEngine
    from stare_agent.evaluation import evaluate
    from stare_envs.problems import Problem
    from tests.helpers_tokenizers import smollm2_tokenizer

    tokenizer = smollm2_tokenizer()
    call = '<tool_call>{"name": "code_interpreter", "arguments": {"code": "print(6 * 7)"}}</tool_call>'
    scripts = [[call, "<answer>\\boxed{42}</answer>"]] * 2
    report = evaluate(
        [Problem("p1", "What is 6 times 7?", "42")],
        engine=ScriptedEngine(tokenizer, scripts),
        tokenizer=tokenizer,
        samples=2,
        batch_size=2,
        env_kwargs={"format": "hermes", "pool": fleet},
        progress=False,
    )
    assert report.metrics["avg@2"] == 1.0 and report.settings["sandbox"]["backend"] == "ray"
    assert (
        report.table()
        .splitlines()[-1]
        .startswith("tool health: 2 calls in 2 episodes (1.0 per episode): 0 raised")
    )


def test_a_training_step_plays_its_episodes_on_the_fleet(fleet: RaySandboxFleet, tmp_path) -> None:
    """``sandbox.backend=ray``: the trainer's episodes lease the fleet's sandboxes (this namespace's
    coordinator, which the trainer joins), and the step logs a healthy tool use."""
    import json
    import math

    from stare_agent.config import load_config
    from stare_agent.engines.scripted import ScriptedEngine
    from stare_agent.models import tiny_model
    from stare_agent.train.trainer import Trainer
    from tests.stare_agent.train.scripted_training import overrides, scripted_policy

    problems = tmp_path / "problems.jsonl"
    problems.write_text(
        "".join(
            json.dumps({"id": f"add-{a}", "problem": f"What is {a} + 2?", "answer": str(a + 2)}) + "\n"
            for a in range(4)
        )
    )
    settings = overrides(str(tmp_path / "run"), str(problems), 1)
    config = load_config(
        None, [*settings, "sandbox.backend=ray", f"sandbox.ray.namespace={NAMESPACE}", "env.format=retool"]
    )
    before = fleet.stats().leases
    model, tokenizer = tiny_model()
    trainer = Trainer(
        config, model=model, tokenizer=tokenizer, engine=ScriptedEngine(tokenizer, scripted_policy())
    )
    try:
        trainer.step = 1
        metrics = trainer.train_step()
        assert type(trainer.rollouts.pool()).__name__ == "RaySandboxFleet"
    finally:
        trainer.close()
    assert fleet.stats().leases - before >= 4
    _wait(lambda: fleet.stats().leased == 0, 30, "every lease given back")
    assert metrics["tools/calls_per_episode"] == 1.0 and metrics["tools/infra_error_fraction"] == 0.0
    assert metrics["failed_episodes"] == 0 and math.isfinite(metrics["loss"])


HOLDS_A_LEASE = """
import dataclasses, sys, time
from stare_sandbox.ray_fleet import RaySandboxFleet
from tests.sandbox.test_ray import FLEET, LIMITS

fleet = RaySandboxFleet(dataclasses.replace(FLEET, address=sys.argv[1], namespace=sys.argv[2]), LIMITS)
lease = fleet.acquire(timeout=60)
assert lease.run("1 + 1").stdout == "2\\n"
print("holding", flush=True)
import os; os._exit(0)  # dies holding it: no release, no close
"""


def test_a_dead_clients_lease_is_taken_back_and_a_long_turn_keeps_its_own(cluster) -> None:
    """A lease is taken back when its client's process is gone (within seconds), never because it
    went without a call: a long model turn keeps its sandbox (issue 43, item 5)."""
    import subprocess
    import sys

    from stare_sandbox import SandboxClosed

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    config = RayFleetConfig(
        namespace="stare-test-reclaim", sandboxes_per_node=1, refresh_s=0.5, call_margin_s=20.0
    )
    fleet = RaySandboxFleet(config, LIMITS, min_hosts=2)
    try:
        kept = fleet.acquire()
        assert kept.run("y = 5").ok
        done = subprocess.run(
            [sys.executable, "-c", HOLDS_A_LEASE, cluster.address, "stare-test-reclaim"],
            capture_output=True, text=True, timeout=120, cwd=repo,
        )  # fmt: skip
        assert done.returncode == 0 and "holding" in done.stdout, done.stderr[-3000:]
        start = time.monotonic()
        _wait(
            lambda: fleet.stats().reclaimed == 1 and fleet.stats().leased == 1,
            30,
            "the dead client's lease taken back",
        )
        assert time.monotonic() - start < 20
        with fleet.lease(timeout=30) as again:  # its slot serves the next episode
            assert again.run("3 * 3").stdout == "9\n"
        time.sleep(25)  # a long model turn of a live client: no call for a while
        assert kept.run("print(y)").stdout == "5\n"  # its sandbox, its state
        assert fleet.stats().reclaimed == 1
        kept.close()
        with pytest.raises(SandboxClosed):
            kept.inner  # noqa: B018 - given back
    finally:
        fleet.shutdown_fleet()
        fleet.close()


def test_thousands_of_waiters_never_starve_the_coordinator(fleet: RaySandboxFleet) -> None:
    """300 leases wait on a full fleet (issue 43, item 1: a threaded coordinator gave its 256 threads
    to them and starved ``returned``): one sandbox freed goes to a waiter within a second, and every
    waiter that gets none is told the truth (every sandbox of the cap leased)."""
    from stare_sandbox.errors import PoolExhausted

    _wait(
        lambda: fleet.stats().leased == 0 and fleet.stats().max_leases == 3, 60, "a fleet with nothing leased"
    )
    held = [fleet.acquire() for _ in range(3)]  # the cap
    got: list[tuple[float, object]] = []
    failed: list[BaseException] = []
    lock = threading.Lock()

    def wait_for_one() -> None:
        try:
            lease = fleet.acquire(timeout=12)
            with lock:
                got.append((time.monotonic(), lease))
        except BaseException as exc:  # noqa: BLE001 - asserted below
            with lock:
                failed.append(exc)

    threads = [threading.Thread(target=wait_for_one) for _ in range(300)]
    for thread in threads:
        thread.start()
    try:
        time.sleep(4.0)
        _wait(lambda: fleet.stats().waiting >= 290, 30, "the waiters queued at the coordinator")
        freed = time.monotonic()
        held.pop().close()
        for thread in threads:
            thread.join(60)
        assert len(got) == 1, (len(got), failed[:3])
        assert got[0][0] - freed < 1.0, got[0][0] - freed
        assert len(failed) == 299 and all(isinstance(e, PoolExhausted) for e in failed), failed[:3]
        assert all("3 leased of a cap of 3" in str(e) for e in failed), str(failed[0])
        held.append(got[0][1])
    finally:
        for lease in held:
            lease.close()
    _wait(lambda: fleet.stats().leased == 0 and fleet.stats().waiting == 0, 30, "every lease given back")


def test_hosts_start_in_turn_without_livelock_on_a_slow_creation_rate(cluster) -> None:
    """Creation tokens are booked in turn (issue 43, item 2: with 4 sandboxes a node, 0.5 tokens/s,
    burst 1 and a 7 s lease timeout, hosts failed their start together and again 10 s later): each
    host takes leases from its first sandbox on, the fleet fills at the creation rate, no container
    start is thrown away and no host is lost. Lease servers listen on the configured ports."""
    config = RayFleetConfig(
        namespace="stare-test-tokens", sandboxes_per_node=4, creations_per_s=0.5, creation_burst=1,
        lease_timeout_s=7.0, call_margin_s=20.0, refresh_s=0.5, start_timeout_s=120.0,
        lease_ports="23100-23109",
    )  # fmt: skip
    start = time.monotonic()
    fleet = RaySandboxFleet(config, LIMITS, min_hosts=2)
    try:
        both = time.monotonic() - start
        assert both < 25, both  # every host's first sandbox comes before anyone's second (~2 s apart)
        _wait(lambda: fleet.stats().size == 8, 60, "8 sandboxes at 0.5 a second")
        stats = fleet.stats()
        assert stats.hosts_lost == 0 and not stats.failures, stats
        assert len(stats.creations) == 8  # none thrown away
        gaps = sorted(stats.creations)
        assert all(b - a >= 2.0 - 0.05 for a, b in itertools.pairwise(gaps)), gaps  # the rate held
        with fleet.lease() as sb:
            assert 23100 <= sb.inner._connection._sock.getpeername()[1] <= 23109
            assert sb.run("2 + 2").stdout == "4\n"
    finally:
        fleet.shutdown_fleet()
        fleet.close()


def test_a_coordinator_that_dies_mid_step_comes_back_with_every_host_and_lease(cluster) -> None:
    """Issue 43, item 3: the hosts outlive their coordinator and its next incarnation (Ray's restart,
    or a new one when it died for good) adopts them with their leases; held leases go on running,
    the client goes on leasing without being built again, nothing is lost or counted twice."""
    import ray

    from stare_sandbox.ray_fleet import COORDINATOR_NAME

    config = RayFleetConfig(
        namespace="stare-test-restart", sandboxes_per_node=2, refresh_s=0.5, call_margin_s=20.0
    )
    fleet = RaySandboxFleet(config, LIMITS, min_hosts=2)
    try:
        hosts = {h.node_id for h in fleet.stats().hosts}
        held = [fleet.acquire(), fleet.acquire()]
        assert held[0].run("z = 7").ok
        for no_restart in (False, True):  # Ray restarts it in place; then it dies for good
            ray.kill(ray.get_actor(COORDINATOR_NAME, namespace="stare-test-restart"), no_restart=no_restart)
            start = time.monotonic()
            assert held[0].run("print(z)").stdout == "7\n"  # a held lease does not need the coordinator

            # ray.kill returns before the actor is gone: a call may still reach the old one, so wait
            # for the next incarnation (each call asks again, with backoff, until one answers)
            def adopted(restart: bool = not no_restart) -> bool:  # Ray's restart; else a new one
                stats = fleet.stats()
                return stats.adopted == 2 and stats.restarted is restart

            _wait(adopted, 20, "the next coordinator adopted both hosts")
            lease = fleet.acquire(timeout=60)
            took = time.monotonic() - start
            assert took < 20, took
            stats = fleet.stats()
            assert {h.node_id for h in stats.hosts} == hosts
            assert stats.leased == 3 and stats.hosts_lost == 0, stats  # the held two, and this one
            lease.close()
            _wait(lambda: fleet.stats().leased == 2, 30, "the new lease given back, counted once")
        assert held[1].run("1 + 1").stdout == "2\n"
        time.sleep(FleetCoordinator.CLIENT_GRACE_S + 3)  # a restarted coordinator learns its clients again
        stats = fleet.stats()
        assert stats.clients == 1 and stats.reclaimed == 0 and stats.leased == 2, stats
        for lease in held:
            lease.close()
        _wait(lambda: fleet.stats().leased == 0, 30, "every lease given back")
    finally:
        fleet.shutdown_fleet()
        fleet.close()


def test_a_call_past_its_deadline_costs_its_sandbox_not_its_host(cluster, fleet: RaySandboxFleet) -> None:
    """A host that does not answer one call in time (here: its process stopped for a few seconds)
    loses that lease's sandbox, not its other leases: the host is dropped only when it stops
    answering the coordinator's pings (issue 43, "Also")."""
    import dataclasses
    import signal

    import ray

    _wait(lambda: len(_ready_hosts(fleet)) == 2 and fleet.stats().leased == 0, 60, "two idle hosts")
    impatient = RaySandboxFleet(dataclasses.replace(FLEET, call_margin_s=0.5), LIMITS)
    try:
        node = sorted(_ready_hosts(fleet))[0]
        first, second = impatient.acquire(node_id=node), impatient.acquire(node_id=node)
        assert second.run("w = 3").ok
        lost = fleet.stats().hosts_lost
        pid = ray.get(first.inner._host.__ray_call__.remote(lambda self: os.getpid()), timeout=60)
        os.kill(pid, signal.SIGSTOP)
        try:
            with pytest.raises(SandboxLost, match="did not answer run"):
                first.run("1", timeout=1)  # waits 1 + 2 (restart grace) + 0.5 s
        finally:
            os.kill(pid, signal.SIGCONT)
        assert second.run("print(w)").stdout == "3\n"  # the host and its other lease go on
        assert fleet.stats().hosts_lost == lost
        first.close()
        second.close()
    finally:
        impatient.close()


def test_the_adapters_sessions_lease_from_the_fleet(fleet: RaySandboxFleet) -> None:
    """verl's tool and verifiers' env (``stare_integrations._sandboxes``) with ``backend="ray"``: a
    session leases a fleet sandbox at its first call and gives it back at its end."""
    from stare_integrations._sandboxes import LeasedTools, ToolSession

    tools = LeasedTools(2, "ray", LIMITS, 30.0, None, fleet=FLEET)
    session = ToolSession()
    try:
        tools.run(session, {"code": "y = 6"})
        assert tools.run(session, {"code": "print(y * 7)"}).text.strip() == "42"  # one stateful sandbox
        assert session.sandbox is not None and isinstance(session.sandbox.inner, RaySandbox)
        tools.end(session)
        _wait(lambda: fleet.stats().leased == 0, 30, "the session's lease given back")
    finally:
        tools.close()
