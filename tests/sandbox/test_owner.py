"""Orphan reaping: only sandboxes of owners that are certainly gone are removed, and only the
project's own temp dirs, whatever a container's labels and mounts say."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from stare_sandbox.owner import owner_gone, owner_id, reap_local_dirs
from tests.conftest import host_problem, require
from tests.sandbox.helpers_processes import start_sandbox_owner

NEW_PID_NAMESPACE = ("unshare", "--pid", "--fork", "--kill-child", "--mount-proc")
"""A child owner in its own PID namespace (same host name, same boot): its pids mean nothing here."""


NO_CHILD_REAPING = "import stare_sandbox.docker, stare_sandbox.local; stare_sandbox.docker._reaped = stare_sandbox.local._reaped = True"
"""The child owner does not reap others' sandboxes itself: only the test process's reaper is judged."""


def a_dead_owner() -> str:
    """The owner id of a process that has exited (and was waited for)."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        owner = owner_id(child.pid)
    finally:
        child.kill()
        child.wait()
    return owner


def test_owner_ids_are_judged_only_when_provably_gone():
    assert not owner_gone(owner_id())  # this process is alive
    dead = a_dead_owner()
    assert owner_gone(dead)
    boot, pidns = dead.split(":")[1:3]
    assert not owner_gone(dead.replace(boot, "another-machine-or-boot"))
    assert not owner_gone(dead.replace(f":{pidns}:", ":4026531999:"))  # another PID namespace
    host_pid_start = f"{os.uname().nodename}:{dead.split(':')[4]}:{dead.split(':')[5]}"
    assert not owner_gone(host_pid_start)  # the old host:pid:start format is never judged
    assert not owner_gone("") and not owner_gone("garbage")


def test_local_dirs_of_a_live_owner_in_another_pid_namespace_survive(tmp_path):
    require("host", host_problem(tools=("unshare",)))
    child, sandbox_dir = start_sandbox_owner(
        "LocalSandbox", "str(sb.dir)", tmp_path / "ready", prefix=NEW_PID_NAMESPACE, setup=NO_CHILD_REAPING
    )
    try:
        reap_local_dirs()
        assert os.path.isdir(sandbox_dir), "a live owner's sandbox dir was removed"
    finally:
        child.send_signal(signal.SIGKILL)  # unshare --kill-child takes the owner down with it
        child.wait()
        shutil.rmtree(sandbox_dir, ignore_errors=True)


@pytest.mark.docker
def test_containers_of_a_live_owner_in_another_pid_namespace_survive(docker_ready, tmp_path):
    """Same host name, same boot, but the owner's pid is from another PID namespace: a reaper that
    looked that pid up in its own /proc would find nothing (or another process) and remove it."""
    require("host", host_problem(tools=("unshare",)))
    from stare_sandbox.docker import docker_client, reap_orphans

    child, written = start_sandbox_owner(
        "DockerSandbox",
        "sb.container.id + ' ' + str(sb.dir)",
        tmp_path / "ready",
        prefix=NEW_PID_NAMESPACE,
        setup=NO_CHILD_REAPING,
    )
    container_id, conn_dir = written.split()
    client = docker_client()
    try:
        reap_orphans(client)
        assert client.containers.list(all=True, filters={"id": container_id}), (
            "a live owner's container was removed"
        )
        assert os.path.isdir(conn_dir)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
        for container in client.containers.list(all=True, filters={"id": container_id}):
            container.remove(force=True)
        shutil.rmtree(conn_dir, ignore_errors=True)


@pytest.mark.docker
def test_reaping_removes_only_the_projects_own_temp_dirs(docker_ready, tmp_path):
    """A container with our labels and a dead owner is removed, but a bind-mounted directory
    outside the project's temp dirs stays, even when it is named like one."""
    from stare_sandbox.config import DEFAULT_IMAGE
    from stare_sandbox.docker import CONN_DIR, LABEL, OWNER_LABEL, docker_client, reap_orphans

    precious = tmp_path / "stare-precious"
    precious.mkdir()
    (precious / "data.txt").write_text("keep me")
    client = docker_client()
    container = client.containers.create(
        DEFAULT_IMAGE,
        ["true"],
        labels={LABEL: "1", OWNER_LABEL: a_dead_owner()},
        volumes={str(precious): {"bind": CONN_DIR, "mode": "ro"}},
        network_mode="none",
    )
    try:
        assert reap_orphans(client) >= 1
        assert not client.containers.list(all=True, filters={"id": container.id})
        assert (precious / "data.txt").read_text() == "keep me"
    finally:
        for leftover in client.containers.list(all=True, filters={"id": container.id}):
            leftover.remove(force=True)


def test_local_reaping_skips_dirs_of_other_users_and_outside_the_temp_root(tmp_path):
    dead = a_dead_owner()
    outside = tmp_path / "stare-outside"  # right name, wrong place
    outside.mkdir()
    (outside / "owner").write_text(dead)
    assert reap_local_dirs(tmp_path) == 0 and outside.is_dir()
    mine = Path("/tmp") / f"stare-test-{os.getpid()}"
    mine.mkdir()
    (mine / "owner").write_text(dead)
    try:
        assert reap_local_dirs() >= 1 and not mine.exists()  # the reaper does work on its own dirs
    finally:
        shutil.rmtree(mine, ignore_errors=True)


@pytest.mark.docker
def test_reaping_survives_containers_removed_while_it_runs(docker_ready):
    """Another owner's pool removes its containers while a new pool starts and reaps: a container
    gone between the listing and a later look at it must not fail the new pool's start."""
    from stare_sandbox.config import DEFAULT_IMAGE
    from stare_sandbox.docker import LABEL, OWNER_LABEL, docker_client, reap_orphans

    client = docker_client()
    # one of a live owner (this process) and one of a dead owner: both vanish right after the list
    containers = [
        client.containers.create(
            DEFAULT_IMAGE, ["true"], labels={LABEL: "1", OWNER_LABEL: owner}, network_mode="none"
        )
        for owner in (owner_id(), a_dead_owner())
    ]
    ids = {c.id for c in containers}
    api = client.api
    listed = api.containers

    def list_then_vanish(*args, **kwargs):
        entries = listed(*args, **kwargs)
        for c in containers:
            api.remove_container(c.id, force=True)  # what the other owner's close() does meanwhile
        return entries

    api.containers = list_then_vanish
    try:
        reap_orphans(client)  # before: docker.errors.NotFound from inspecting a vanished container
    finally:
        api.containers = listed
        for leftover in client.containers.list(all=True, filters={"label": LABEL}):
            if leftover.id in ids:
                leftover.remove(force=True)
