"""``stare-agent sandbox doctor``: check each thing the sandboxes need, one line of cause and fix each."""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import tempfile
from dataclasses import dataclass

from stare_sandbox.config import SANDBOX_UIDS, SandboxConfig
from stare_sandbox.errors import SandboxError


@dataclass(frozen=True)
class Check:
    """One diagnosis: ``message`` is ``"cause: fix"`` when not ``ok``, a short fact otherwise."""

    name: str
    ok: bool
    message: str


def _check_ipc_dir() -> Check:
    try:
        with tempfile.TemporaryDirectory(prefix="stare-", dir="/tmp") as path:
            if os.geteuid() == 0:
                os.chown(path, SANDBOX_UIDS[0], SANDBOX_UIDS[0])
    except OSError as exc:
        return Check(
            "ipc dir", False, f"cannot create or hand over a temp dir in /tmp ({exc}): make /tmp writable"
        )
    return Check("ipc dir", True, "/tmp is writable for the kernel's socket files")


def diagnose(config: SandboxConfig | None = None) -> list[Check]:
    """Run the checks in order; later Docker checks are skipped when an earlier one fails."""
    from stare_sandbox.docker import DockerSandbox, docker_client
    from stare_sandbox.local import LocalSandbox

    config = config or SandboxConfig()
    checks = [_check_ipc_dir()]
    try:
        client = docker_client(timeout=5)
        checks.append(Check("docker daemon", True, f"Docker {client.version().get('Version', '?')} answers"))
        try:
            client.images.get(config.image)
            checks.append(Check("sandbox image", True, f"{config.image} is present"))
        except Exception:  # noqa: BLE001
            checks.append(
                Check(
                    "sandbox image", False, f"image {config.image} missing: run `stare-agent sandbox build`"
                )
            )
    except SandboxError as exc:
        checks.append(Check("docker daemon", False, str(exc)))
    if all(c.ok for c in checks):
        checks.append(_check_backend("docker sandbox", lambda: DockerSandbox(config)))
    checks.append(_check_backend("local sandbox", lambda: LocalSandbox(config)))
    return checks


def _check_backend(name: str, make) -> Check:
    try:
        with make() as sandbox:
            result = sandbox.run("1 + 1", timeout=30)
    except SandboxError as exc:
        return Check(name, False, str(exc))
    if result.stdout.strip() != "2":
        return Check(
            name,
            False,
            f"`1 + 1` gave {result!r}: rebuild the image with `stare-agent sandbox build --force`",
        )
    return Check(name, True, f"runs `1 + 1` in {result.duration_s * 1000:.0f} ms")


def diagnose_ray(
    address: str = "auto",
    *,
    namespace: str = "stare-agent",
    node_resource: str = "stare_sandbox",
    wait_s: float = 120.0,
    config: SandboxConfig | None = None,
) -> list[Check]:
    """``stare-agent sandbox doctor --backend ray``: the cluster, its sandbox nodes, whether each
    node's host started (Docker reachable, the image present: what the host found), a ``1 + 1``
    round trip on each ready host with its latency, and the coordinator's node.

    Joins the fleet of ``namespace`` (a run's fleet when one is up: one sandbox of each host is
    leased for a moment; else one sandbox per node, ended again when the doctor leaves).
    """
    import time

    try:
        import ray
    except ImportError:
        return [Check("ray", False, "Ray is not installed: pip install 'stare-agent[ray]'")]
    from stare_sandbox.ray_fleet import RayFleetConfig, RaySandboxFleet

    joined = not ray.is_initialized()
    if joined:
        try:
            ray.init(address=address, namespace=namespace, logging_level=logging.WARNING)
        except ConnectionError as exc:
            why = (str(exc).splitlines() or [type(exc).__name__])[0]
            return [
                Check(
                    "ray cluster",
                    False,
                    f"no Ray cluster at {address!r} ({why}): start one (`ray start --head`, and `ray start "
                    f"--address HEAD_IP:6379 --resources '{{\"{node_resource}\": 1}}'` on the Docker nodes), "
                    "or pass --address HOST:PORT",
                )
            ]
    try:
        alive = [n for n in ray.nodes() if n.get("Alive")]
        checks = [Check("ray cluster", True, f"{len(alive)} nodes alive (Ray {ray.__version__})")]
        nodes = [n for n in alive if n.get("Resources", {}).get(node_resource, 0) > 0]
        if not nodes:
            checks.append(
                Check(
                    "sandbox nodes",
                    False,
                    f"no node has the resource {node_resource!r}: on machines with Docker and the sandbox image, "
                    f"run `ray start --address HEAD_IP:6379 --resources '{{\"{node_resource}\": 1}}'`",
                )
            )
            return checks
        where = {n["NodeID"]: f"{n.get('NodeManagerAddress', '?')} {n['NodeID'][:8]}" for n in alive}
        checks.append(Check("sandbox nodes", True, f"{len(nodes)} with the resource {node_resource!r}"))
        fleet_config = RayFleetConfig(
            address=address,
            namespace=namespace,
            node_resource=node_resource,
            sandboxes_per_node=1,
            start_timeout_s=wait_s,
            lease_timeout_s=30.0,
        )
        try:
            fleet = RaySandboxFleet(fleet_config, config, min_hosts=0)
        except SandboxError as exc:
            checks.append(Check("fleet", False, str(exc)))
            return checks
        try:
            deadline = time.monotonic() + wait_s
            while True:  # until every node's host is ready or failed
                stats = fleet.stats()
                ready = {h.node_id for h in stats.hosts if h.ready}
                failures = dict(stats.failures)
                if all(n["NodeID"] in ready | failures.keys() for n in nodes) or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            images: dict[str, str] = {}
            host_checks: dict[str, int] = {}
            for node in nodes:
                node_id = node["NodeID"]
                name = f"host on {where[node_id]}"
                if node_id in ready:
                    check, image = _check_host(fleet, name, node_id)
                    if image:
                        images[node_id], host_checks[node_id] = image, len(checks)
                    checks.append(check)
                elif node_id in failures:
                    checks.append(
                        Check(
                            name,
                            False,
                            f"did not start: {failures[node_id]} (`stare-agent sandbox doctor` on that node "
                            "says what is missing there)",
                        )
                    )
                else:
                    checks.append(
                        Check(
                            name,
                            False,
                            f"not ready after {wait_s:g} s (starting its warm sandbox): look at that node's "
                            "load and Docker, or wait longer with --timeout",
                        )
                    )
            for node_id, why in image_mismatches(images, (config or SandboxConfig()).image).items():
                checks[host_checks[node_id]] = Check(checks[host_checks[node_id]].name, False, why)
            node = stats.coordinator_node
            sandbox_node = (
                " (a sandbox node: every node has the resource)"
                if node in {n["NodeID"] for n in nodes}
                else ""
            )
            checks.append(
                Check(
                    "coordinator",
                    True,
                    f"on {where.get(node, node[:8])}{sandbox_node}; {stats.clients - 1} clients besides this "
                    f"doctor; {stats.leased} of {stats.max_leases} leased, {stats.waiting} waiting; "
                    f"{stats.hosts_lost} hosts lost, {stats.reclaimed} leases of gone clients taken back"
                    + (f"; restarted, adopted {stats.adopted} hosts" if stats.restarted else ""),
                )
            )
        finally:
            fleet.close()  # the last client to leave ends the fleet it started
        return checks
    finally:
        if joined:
            ray.shutdown()


def _check_host(fleet, name: str, node_id: str) -> tuple[Check, str]:
    """The host's check, and the id of the sandbox image on its node ("" when unknown)."""
    import time

    try:
        with contextlib.closing(fleet.acquire(30.0, node_id=node_id)) as sandbox:
            start = time.perf_counter()
            result = sandbox.run("1 + 1", timeout=30)
            took = time.perf_counter() - start
            image = sandbox.inner.image_id()
    except SandboxError as exc:
        return Check(name, False, f"ready, but a lease or `1 + 1` failed: {exc}"), ""
    if result.stdout.strip() != "2":
        return Check(
            name,
            False,
            f"`1 + 1` gave {result!r}: rebuild the image there with `stare-agent sandbox build --force`",
        ), image
    return Check(
        name,
        True,
        f"ready; `1 + 1` round trip {took * 1000:.1f} ms ({result.duration_s * 1000:.1f} ms in the sandbox)",
    ), image


def image_mismatches(images: dict[str, str], image: str) -> dict[str, str]:
    """``{node_id: why}`` for each node whose sandbox image (``images``: node id -> image id) is not
    the one most nodes have: every node must run the same image, or the same episode would run
    differently by where it landed. A tie names every node of the tie's other images.

    >>> image_mismatches({"a": "sha256:1", "b": "sha256:1", "c": "sha256:2"}, "img:0.3")
    {'c': 'image img:0.3 is sha256:2 here but sha256:1 on 2 other nodes: load the same image on every node (docker save / docker load)'}
    """
    counts = collections.Counter(images.values())
    if len(counts) < 2:
        return {}
    common, n = counts.most_common(1)[0]
    return {
        node_id: f"image {image} is {found[:19]} here but {common[:19]} on {n} other nodes: load the same "
        "image on every node (docker save / docker load)"
        for node_id, found in images.items()
        if found != common
    }
