"""The Docker backend's container, image and host side against an attacker: the connection dir,
the kernel's uid, rlimits and thread caps, security options in force, the image's provenance, and
what is opened or started on the host is always closed or removed."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from stare_sandbox import DockerSandbox, SandboxConfig, SandboxError, SandboxUnavailable
from stare_sandbox.config import SANDBOX_UIDS
from stare_sandbox.docker import LABEL, NOFILE, docker_client
from tests.conftest import host_problem, require

pytestmark = pytest.mark.docker

REPO = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO / "sandbox" / "image" / "build.sh"
CONFIG = SandboxConfig(tmpfs_mb=64, max_output_chars=2000)


@pytest.fixture(scope="module")
def sb(docker_ready):
    with DockerSandbox(CONFIG) as sandbox:
        yield sandbox


def _dir_bytes(path: Path) -> int:
    return sum(p.lstat().st_size for p in path.iterdir())


def test_writes_into_conn_fail_and_the_host_dir_does_not_grow(sb: DockerSandbox) -> None:
    before = sorted(p.name for p in sb.dir.iterdir()), _dir_bytes(sb.dir)
    attempts = {
        "append": "open('/conn/kernel.json', 'a').write('x' * 2**20)",
        "create": "open('/conn/new', 'w').write('x' * 2**20)",
        "chmod dir": "import os; os.chmod('/conn', 0o777)",
        "chmod socket": "import os; os.chmod('/conn/k-1', 0o777); os.chmod('/conn', 0o777)",
    }
    for name, code in attempts.items():
        result = sb.run(code)
        assert result.error is not None and result.error.type in ("PermissionError", "FileNotFoundError"), (
            name
        )
    assert (sorted(p.name for p in sb.dir.iterdir()), _dir_bytes(sb.dir)) == before
    assert "kernel.json" not in before[0]  # the kernel's own copy is gone once user code can run
    assert sb.run("import os; os._exit(1)").error.type == "KernelDied"  # a restart rewrites and removes it
    assert sb.run("open('/conn/kernel.json', 'a')").error.type in ("PermissionError", "FileNotFoundError")
    assert not (sb.dir / "kernel.json").exists()


def test_rlimits_core_nofile_and_fsize(sb: DockerSandbox) -> None:
    limits = sb.run(
        "import resource as r\n[r.getrlimit(x) for x in (r.RLIMIT_CORE, r.RLIMIT_NOFILE, r.RLIMIT_FSIZE)]"
    )
    fsize = CONFIG.tmpfs_mb * 2**20
    assert limits.stdout == f"[(0, 0), ({NOFILE}, {NOFILE}), ({fsize}, {fsize})]\n"
    sparse = sb.run(
        f"f = open('/work/sparse', 'wb', buffering=0)\nf.seek({fsize})\nf.write(b'x')"
    )  # 1 byte, far out
    assert sparse.error.type == "OSError" and "File too large" in sparse.error.message
    sb.reset()


FILL_PIPE_QUOTA = """
import fcntl, os
held = []
try:
    while True:  # each pipe resized to 1 MiB (256 pages) until the uid's quota refuses
        held.append(os.pipe())
        fcntl.fcntl(held[-1][1], fcntl.F_SETPIPE_SZ, 1 << 20)
except OSError as exc:
    print(exc.errno == 1, len(held) < 1000)
"""
GROW_ONE_PIPE = """
import fcntl, os
r, w = os.pipe()
try:
    print(fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 1 << 20))
except OSError as exc:
    print(exc.strerror)
"""


def test_concurrent_sandboxes_share_no_per_user_quota(docker_ready) -> None:
    # Pipe-buffer pages are counted per uid host-wide (fs.pipe-user-pages-soft): sandboxes that
    # shared a uid would let one refuse every other's pipes, a denial and a channel between them.
    with DockerSandbox(CONFIG) as one, DockerSandbox(CONFIG) as two:
        uids = [int(sb.run("import os; os.getuid()").stdout) for sb in (one, two)]
        assert uids[0] != uids[1] and set(uids) <= set(SANDBOX_UIDS)
        assert one.run(FILL_PIPE_QUOTA).stdout == "True True\n"  # its own quota is spent
        assert one.run(GROW_ONE_PIPE).stdout == "Operation not permitted\n"
        assert two.run(GROW_ONE_PIPE).stdout == f"{1 << 20}\n"  # the sibling's is untouched
        user = two.run("import getpass, pwd, os\ngetpass.getuser(), pwd.getpwuid(os.getuid()).pw_dir")
        assert user.stdout == "('sandbox', '/work')\n"


def test_blas_and_openmp_threads_follow_the_cpu_quota(docker_ready) -> None:
    with DockerSandbox(SandboxConfig(cpus=1)) as one, DockerSandbox(SandboxConfig(cpus=1.5)) as two:
        code = "import os\nbefore = len(os.listdir('/proc/self/task'))\nimport numpy\nnumpy.ones((300, 300)) @ numpy.ones((300, 300))\n"
        assert one.run(code + "len(os.listdir('/proc/self/task')) - before").stdout == "0\n"
        assert (
            one.run("os.environ['OMP_NUM_THREADS'], os.environ['OPENBLAS_NUM_THREADS']").stdout
            == "('1', '1')\n"
        )
        assert two.run("import os\nos.environ['OMP_NUM_THREADS']").stdout == "'2'\n"


def test_seccomp_no_new_privileges_and_no_capabilities_inside(sb: DockerSandbox) -> None:
    status = sb.run("print(open('/proc/self/status').read())").stdout
    fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
    assert fields["Seccomp"].strip() == "2" and fields["NoNewPrivs"].strip() == "1"
    for name in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(fields[name], 16) == 0, name


def test_security_relevant_config_is_validated() -> None:
    for bad in ({"network": "host"}, {"network": "container:abc"}, {"user": "0:0"}, {"user": "root"},
                {"user": "61000:0"}, {"runtime": ""}, {"cpu_timeout_s": 0}, {"cpu_timeout_s": -1.0}):  # fmt: skip
        with pytest.raises(ValueError, match="sandbox\\."):
            SandboxConfig(**bad)
    with pytest.raises(ValueError, match=r"sandbox.max_output_chars=2097153 is above what a kernel sends"):
        SandboxConfig(max_output_chars=2**21 + 1)  # the kernel drops a cell's output past 2**21 characters


def test_a_network_other_than_none_is_loud(docker_ready, caplog) -> None:
    with (
        caplog.at_level(logging.WARNING, logger="stare_sandbox.docker"),
        DockerSandbox(SandboxConfig(network="bridge")) as sb,
    ):
        assert "can reach the network" in caplog.text
        assert sb.container.attrs["HostConfig"]["NetworkMode"] == "bridge"


def test_runtime_is_passed_through_and_a_failed_create_leaves_nothing(docker_ready) -> None:
    with DockerSandbox(SandboxConfig(runtime="runc")) as sb:
        assert sb.container.attrs["HostConfig"]["Runtime"] == "runc" and sb.run("1").stdout == "1\n"
    with pytest.raises(SandboxError, match="could not start a sandbox container"):
        DockerSandbox(SandboxConfig(runtime="stare-no-such-runtime"))


def _sandbox_containers(ancestor: str) -> set[str]:
    client = docker_client()
    try:
        found = client.containers.list(all=True, filters={"label": f"{LABEL}=1", "ancestor": ancestor})
        return {c.id for c in found}
    finally:
        client.close()


def test_a_missing_image_is_never_pulled(docker_ready) -> None:
    # A pull would go to the registry at localhost:1 and fail with a connection error instead.
    with pytest.raises(SandboxUnavailable, match="not found: run `stare-agent sandbox build`"):
        DockerSandbox(SandboxConfig(image="localhost:1/stare-no-such-image:0"))


def test_a_container_whose_start_fails_is_removed(docker_ready) -> None:
    client = docker_client()
    archive = io.BytesIO()
    with tarfile.open(fileobj=archive, mode="w") as tar:
        tar.addfile(tarfile.TarInfo("empty"), io.BytesIO(b""))
    subprocess.run(["docker", "import", "-", "stare-test-empty:0"], input=archive.getvalue(), check=True,
                   capture_output=True)  # fmt: skip
    try:
        with pytest.raises(SandboxError, match="could not start a sandbox container"):
            DockerSandbox(SandboxConfig(image="stare-test-empty:0"))  # no python3: start fails
        # only this test makes containers of this image (other tests may run beside it: pytest -n)
        assert _sandbox_containers(ancestor="stare-test-empty:0") == set()
    finally:
        client.images.remove("stare-test-empty:0", force=True)
        client.close()


def test_closing_sandboxes_releases_their_sockets_and_docker_clients(docker_ready) -> None:
    DockerSandbox().close()  # warm: imports and the module-level reaping happen once

    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    start = fds()
    closed = []
    for _ in range(3):
        sandbox = DockerSandbox()
        sandbox.run("1")
        sandbox.close()
        closed.append(sandbox)  # still referenced: nothing is left to the garbage collector
    assert fds() <= start and all(s._driver._context.closed for s in closed)


def test_the_image_has_no_setuid_files_and_records_its_packages(sb: DockerSandbox) -> None:
    code = (
        "import os, stat\nfound = []\n"
        "for top in ('/bin', '/sbin', '/usr', '/etc', '/lib', '/var', '/opt', '/root', '/home', '/srv'):\n"
        "    for folder, _, files in os.walk(top):\n"
        "        for name in files:\n"
        "            try:\n                mode = os.lstat(os.path.join(folder, name)).st_mode\n"
        "            except OSError:\n                continue\n"
        "            if stat.S_ISREG(mode) and mode & (stat.S_ISUID | stat.S_ISGID):\n"
        "                found.append(os.path.join(folder, name))\nfound"
    )
    assert sb.run(code, timeout=60).stdout == "[]\n"
    packages = sb.run(
        "rows = [line.split('\\t') for line in open('/etc/stare-sandbox/packages.txt').read().splitlines()]\n"
        "names = {row[0] for row in rows if len(row) == 3 and row[1]}\n"
        "len(rows) == len(names), sorted({'python3', 'python3-ipykernel', 'python3-numpy', 'tini'} - names)"
    )
    assert packages.stdout == "(True, [])\n"


FAKE_DEBOOTSTRAP = """#!/bin/sh
echo "$@" > "$STARE_FAKE_ARGS"
exit 1
"""


def test_the_image_build_checks_signatures_and_fails_closed(tmp_path) -> None:
    require("host", host_problem())  # build.sh runs as root only
    fake = tmp_path / "bin" / "debootstrap"
    fake.parent.mkdir()
    fake.write_text(FAKE_DEBOOTSTRAP)
    fake.chmod(0o755)
    args = tmp_path / "args"
    env = {**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}", "STARE_FAKE_ARGS": str(args)}
    missing = subprocess.run(["bash", str(BUILD_SCRIPT), "stare-test-never:0"], capture_output=True, text=True,
                             env={**env, "STARE_DEBIAN_KEYRING": str(tmp_path / "none.gpg")}, timeout=60)  # fmt: skip
    assert missing.returncode == 2 and "keyring" in missing.stderr and not args.exists()
    keyring = tmp_path / "keyring.gpg"
    keyring.write_bytes(b"not empty")
    run = subprocess.run(["bash", str(BUILD_SCRIPT), "stare-test-never:0"], capture_output=True, text=True,
                         env={**env, "STARE_DEBIAN_KEYRING": str(keyring)}, timeout=60)  # fmt: skip
    assert run.returncode == 1 and "debootstrap failed" in run.stderr
    assert args.read_text().split()[:2] == ["--force-check-gpg", f"--keyring={keyring}"]


HOST_USER_1000 = """
import os
from stare_sandbox import DockerSandbox, SandboxConfig, SandboxUnavailable
with DockerSandbox(start_timeout=60) as sb:
    chmod = sb.run("import os\\nos.chmod('/conn', 0o777)")
    print(os.geteuid(), sb.run("os.getuid()").stdout.strip(), chmod.error and chmod.error.type,
          sb.run("import os; os._exit(1)").error.type, sb.run("1 + 1").stdout.strip())
try:
    DockerSandbox(SandboxConfig(user="1000:1000"))
except SandboxUnavailable as exc:
    print("refused" if "this host user's uid 1000" in str(exc) else exc)
"""


def test_a_host_user_with_uid_1000_keeps_the_connection_dir_locked(docker_ready) -> None:
    require("host", host_problem(tools=("setpriv",)))
    require("docker", None if Path("/var/run/docker.sock").exists() else "no local Docker socket")
    docker_gid = os.stat("/var/run/docker.sock").st_gid
    child = subprocess.run(
        ["setpriv", "--reuid=1000", "--regid=1000", f"--groups={docker_gid}", sys.executable, "-c", HOST_USER_1000],
        cwd="/tmp", env={"PYTHONPATH": str(REPO), "HOME": "/tmp", "PATH": os.environ["PATH"]},
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    said = child.stdout.split()
    assert said[:1] + said[2:] == ["1000", "PermissionError", "KernelDied", "2", "refused"], (
        child.stdout + child.stderr[-2000:]
    )
    assert int(said[1]) in SANDBOX_UIDS


def test_availability_checks_answer_and_close_their_clients(docker_ready) -> None:
    from stare_sandbox import docker_available
    from stare_sandbox.build import image_exists

    assert docker_available() and image_exists() and not image_exists("stare-no-such-image:0")
