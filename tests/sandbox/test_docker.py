"""The Docker backend on the real daemon and image: what only it does (CPU limits on a share of a core,
preloads in the warden, resets, hardening, cleanup); the contract it shares with the local backend is
checked in test_backends.py."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import docker
import pytest

from stare_sandbox import DockerSandbox, SandboxClosed, SandboxConfig, SandboxError, make_sandbox
from stare_sandbox.config import PRELOAD_MATH, SANDBOX_UIDS
from stare_sandbox.docker import LABEL
from stare_sandbox.errors import SandboxKilled
from tests.conftest import host_problem, require

pytestmark = pytest.mark.docker


@pytest.fixture(scope="module")
def sb(docker_ready):
    with DockerSandbox(SandboxConfig(max_output_chars=1000)) as sandbox:
        yield sandbox


def test_call_right_after_an_error_runs(sb: DockerSandbox) -> None:
    for i in range(10):  # ipykernel's stop-on-error abort window must not swallow the next call
        assert sb.run("1/0").error.type == "ZeroDivisionError"
        assert sb.run(f"{i} * 2").stdout == f"{i * 2}\n"


BUSY_06 = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.6: pass"


def test_cpu_timeout_counts_the_cpu_the_code_used_not_the_wall_time(docker_ready) -> None:
    # Half a core stands for a machine whose other sandboxes and engine take the rest: every CPU
    # second of the code then takes two seconds of wall time.
    config = SandboxConfig(cpus=0.5, cpu_timeout_s=1.0, timeout_s=30.0)
    with DockerSandbox(config) as sb:
        slept = sb.run("import time\ntime.sleep(1.5)\nprint('slept')")
        assert slept.ok and slept.stdout == "slept\n"
        busy = sb.run(BUSY_06)  # 0.6 CPU seconds in about 1.2 wall seconds: within the budget
        assert busy.ok and busy.duration_s > 1.0 and 0.6 <= busy.cpu_s < 1.0
        walled = sb.run(BUSY_06, timeout=1.0)  # the same code under a 1 s wall-clock limit is cut
        assert walled.timed_out and walled.error.message.startswith("the code timed out after 1 s;")
        sb.run("kept = 'yes'")
        start = time.monotonic()
        looped = sb.run("print('before')\nwhile True: pass")
        assert looped.timed_out and not looped.state_lost and looped.stdout == "before\n"
        assert looped.error.message.startswith("the code timed out after 1 s of CPU time;")
        assert 1.0 <= looped.cpu_s < 1.5 and time.monotonic() - start < 5.0
        assert sb.run("kept").stdout == "'yes'\n"


PRELOADED = "import sys\nprint(sorted(name for name in ('numpy', 'sympy') if name in sys.modules))"


def test_preloaded_modules_are_imported_before_the_first_call_of_every_episode(sb: DockerSandbox) -> None:
    sb.reset()
    assert sb.run(PRELOADED).stdout == "[]\n"  # the default preloads nothing
    with DockerSandbox(SandboxConfig(preload=list(PRELOAD_MATH))) as loaded:
        assert loaded.run(PRELOADED).stdout == "['numpy', 'sympy']\n"
        loaded.reset()  # a fresh fork of the warden, which imported them once
        assert loaded.run(PRELOADED).stdout == "['numpy', 'sympy']\n"


def test_a_preload_module_missing_from_the_image_stops_the_start_with_its_name(docker_ready) -> None:
    with pytest.raises(
        SandboxError, match=r"exit code 75.*cannot preload 'no_such_module'.*sandbox.limits.preload"
    ):
        DockerSandbox(SandboxConfig(preload=["numpy", "no_such_module"]))


def test_soft_and_hard_reset_clear_state(sb: DockerSandbox) -> None:
    sb.run(
        "import os\nv = 1\nopen('/work/f', 'w').write('x')\nopen('/tmp/g', 'w').write('x')\nos.environ['E'] = '1'"
    )
    start = time.monotonic()
    sb.reset()
    assert time.monotonic() - start < 1.0
    assert sb.run("v").error.type == "NameError"
    assert sb.run("import os\nos.listdir('/work'), os.path.exists('/tmp/g'), os.environ.get('E')").stdout == (
        "([], False, None)\n"
    )
    started = sb.container.attrs["State"]["StartedAt"]
    sb.reset()
    sb.container.reload()
    assert sb.container.attrs["State"]["StartedAt"] == started  # the default keeps the container
    sb.run("w = 1")
    sb.reset(hard=True)
    assert sb.run("w").error.type == "NameError"
    sb.container.reload()
    assert sb.container.attrs["State"]["StartedAt"] != started  # hard: a restarted container


def test_container_is_hardened(sb: DockerSandbox) -> None:
    sb.container.reload()
    host = sb.container.attrs["HostConfig"]
    assert host["NetworkMode"] == "none" and host["ReadonlyRootfs"] and not host["Privileged"]
    assert host["CapDrop"] == ["ALL"] and "no-new-privileges" in host["SecurityOpt"]
    assert host["Memory"] == host["MemorySwap"] == 1024 * 2**20
    assert host["PidsLimit"] == 128 and host["NanoCpus"] == 10**9
    uid, gid = map(int, sb.container.attrs["Config"]["User"].split(":"))
    assert uid == gid and uid in SANDBOX_UIDS and uid != os.geteuid()
    mounts = [m["Source"] for m in sb.container.attrs["Mounts"]]
    assert sorted(mounts) == [str(sb.dir / name) for name in ("", "group", "meminfo", "passwd")] and not any(
        "docker.sock" in m for m in mounts
    )
    assert any(option.startswith("seccomp=") for option in host["SecurityOpt"])  # stare_sandbox.seccomp's
    assert "/proc/sys/kernel/random/boot_id" in host["MaskedPaths"]
    # PID 1 is the warden (no init of the image's), and the kernel its child
    result = sb.run("import os\nopen('/proc/1/cmdline').read().split('\\0')[:2], os.getppid(), os.getuid()")
    assert result.stdout == f"(['python3', '-c'], 1, {uid})\n"


def test_close_leaves_no_container_or_temp_dir(docker_ready) -> None:
    sandbox = make_sandbox("docker")
    assert isinstance(sandbox, DockerSandbox)
    cid, folder = sandbox.container.id, sandbox.dir
    sandbox.close()
    sandbox.close()
    client = docker.from_env()
    assert cid not in [c.id for c in client.containers.list(all=True, filters={"label": f"{LABEL}=1"})]
    assert not folder.exists()
    with pytest.raises(SandboxClosed):
        sandbox.run("1")


NON_ROOT_CHILD = """
import os
from stare_sandbox import DockerSandbox
with DockerSandbox(start_timeout=60) as sb:
    print(os.geteuid(), sb.run("6 * 7").stdout.strip(), sb.run("import os; os._exit(1)").error.type,
          sb.run("1 + 1").stdout.strip())
"""


def test_a_non_root_host_user_other_than_the_kernels_uid_connects(docker_ready) -> None:
    require("host", host_problem(tools=("setpriv",)))
    require("docker", None if Path("/var/run/docker.sock").exists() else "no local Docker socket")
    docker_gid = os.stat("/var/run/docker.sock").st_gid
    child = subprocess.run(
        ["setpriv", "--reuid=4242", "--regid=4242", f"--groups={docker_gid}", sys.executable, "-c", NON_ROOT_CHILD],
        cwd="/tmp", env={"PYTHONPATH": str(Path(__file__).resolve().parents[2]), "HOME": "/tmp", "PATH": os.environ["PATH"]},
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert child.stdout.split() == ["4242", "42", "KernelDied", "2"], child.stderr[-2000:]


@pytest.mark.docker
def test_containers_of_a_killed_owner_are_reaped(docker_ready, tmp_path):
    """SIGKILL leaves no chance to clean up; the next process that starts a sandbox removes them."""
    import signal

    from stare_sandbox.docker import OWNER_LABEL, docker_client, reap_orphans
    from tests.sandbox.helpers_processes import start_sandbox_owner

    child, written = start_sandbox_owner(
        "DockerSandbox", "sb.container.id + ' ' + str(sb.dir)", tmp_path / "ready"
    )
    container_id, conn_dir = written.split()
    client = docker_client()
    assert client.containers.get(container_id).labels[OWNER_LABEL].split(":")[4] == str(child.pid)
    reap_orphans(client)
    assert client.containers.list(all=True, filters={"id": container_id})  # its owner is alive: kept
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert reap_orphans(client) >= 1
    assert not client.containers.list(all=True, filters={"id": container_id})
    assert not os.path.exists(conn_dir)


@pytest.mark.docker
def test_a_container_removed_mid_call_is_a_sandbox_error_never_the_docker_sdks(docker_ready) -> None:
    """What the code does comes back as an ExecResult; the infrastructure failing under it (the container
    removed by someone else) is a SandboxError, which pools and envs know, never docker's NotFound."""
    import threading

    import docker

    with DockerSandbox(SandboxConfig(timeout_s=10)) as sb:
        sb.run("1 + 1")
        container = sb.container.id
        threading.Timer(1.0, lambda: docker.from_env().containers.get(container).remove(force=True)).start()
        with pytest.raises(SandboxKilled, match=r"ended from outside while code ran \(container removed\)"):
            sb.run("import time; time.sleep(5)", timeout=8)


@pytest.mark.docker
def test_a_kernel_the_warden_could_not_prepare_still_boots_or_fails_to_start(
    docker_ready, monkeypatch
) -> None:
    """When the warden cannot prepare kernels (an image whose ipykernel is not 6), each kernel starts
    from scratch: it still runs the boot (seeded random, per-cell descriptor output), and a boot that
    fails there is a start error as well. Played by a warden whose version check always fails."""
    import stare_sandbox.docker
    from stare_sandbox.docker import KERNEL_COMMAND

    check = "if ipykernel.version_info[0] != 6:"
    assert check in KERNEL_COMMAND[2]
    unprepared = (*KERNEL_COMMAND[:2], KERNEL_COMMAND[2].replace(check, "if True:"))
    with DockerSandbox(SandboxConfig()) as sb:
        expected = sb.run("import random, os; print(random.random())").stdout
    monkeypatch.setattr(stare_sandbox.docker, "KERNEL_COMMAND", unprepared)
    with DockerSandbox(SandboxConfig()) as sb:
        result = sb.run("import random, os; print(random.random()); _ = os.write(1, b'fd\\n')")
        assert result.stdout == expected + "fd\n"  # the boot's seed and descriptor output, as prepared
        assert "could not prepare kernels" in sb.container.logs(stderr=True, stdout=False).decode()
    monkeypatch.setattr(
        stare_sandbox.docker, "KERNEL_BOOT", stare_sandbox.docker.KERNEL_BOOT + "\nraise OSError('no')"
    )
    with pytest.raises(SandboxError, match=r"boot code failed: OSError: no"):
        with DockerSandbox(SandboxConfig()) as sb:
            sb.run("1")


def test_a_container_caught_between_the_kill_and_the_removal_of_docker_rm_is_removed() -> None:
    """`docker rm -f` marks the container ``removing``, kills it, then removes it: read between the two
    it has exit code 137 like a `docker kill`, and it is a removal (CI once read it so and said
    "exit code 137"). The state is the one the daemon gave, polled during a real `docker rm -f`."""
    from stare_sandbox.docker import _ContainerKernel

    class Removing:
        id = "c8de8948f236"
        attrs = {
            "State": {
                "Status": "removing",
                "Running": False,
                "OOMKilled": False,
                "Dead": False,
                "Pid": 0,
                "ExitCode": 137,
                "StartedAt": "2026-12-05T10:06:20.1Z",
            }
        }

        def reload(self) -> None:
            pass

        def logs(self, **_: object) -> bytes:
            return b""

    host = _ContainerKernel(Removing(), 512, Path("/nonexistent"), {}, 0)
    assert host.death_cause() == "container removed"
    assert host.killed_from_outside()
    Removing.attrs["State"].update(Status="exited")  # the same end without the removal: a kill
    assert host.death_cause() == "exit code 137 (signal 9)"
    assert host.killed_from_outside()


@pytest.mark.docker
@pytest.mark.parametrize("verb", ["kill", "stop"])
def test_a_container_killed_from_outside_mid_call_is_the_infrastructures_never_the_codes(
    docker_ready, verb
) -> None:
    """`docker kill` (SIGKILL to the warden: exit 137, as when the code SIGKILLs its own kernel) and `docker
    stop` (SIGTERM: exit 0, as when the code calls os._exit(0)) mid-call raise SandboxKilled, a SandboxError:
    never a KernelDied result that would count as the model's crash. Each comes after the code's own crash
    of the same exit code in the same container (its log says so: only this run's lines count). Every
    later call says the same until a reset brings up a new kernel."""
    import threading

    own_end = {"kill": "import os; os.kill(os.getpid(), 9)", "stop": "import os; os._exit(0)"}[verb]
    with DockerSandbox(SandboxConfig(timeout_s=10)) as sb:
        crashed = sb.run(own_end)
        assert crashed.error.type == "KernelDied" and crashed.state_lost
        assert (
            f"warden: the kernel exited with status {137 if verb == 'kill' else 0}" in crashed.error.message
        )
        sb.run("x = 1")
        outside = ["docker", verb, *(["-t", "5"] if verb == "stop" else []), sb.container.id]
        threading.Timer(1.0, lambda: subprocess.run(outside, capture_output=True, check=True)).start()
        with pytest.raises(
            SandboxKilled, match=r"^the sandbox was ended from outside while code ran \(exit code"
        ):
            sb.run("import time; time.sleep(8)")
        with pytest.raises(SandboxKilled):
            sb.run("1 + 1")
        sb.reset(hard=True)
        assert sb.run("6 * 7").stdout == "42\n"
