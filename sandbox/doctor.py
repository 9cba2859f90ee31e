"""``stare-agent sandbox doctor``: check each thing the sandboxes need, one line of cause and fix each."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

from sandbox.config import SANDBOX_UID, SandboxConfig
from sandbox.errors import SandboxError


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
                os.chown(path, SANDBOX_UID, SANDBOX_UID)
    except OSError as exc:
        return Check(
            "ipc dir", False, f"cannot create or hand over a temp dir in /tmp ({exc}): make /tmp writable"
        )
    return Check("ipc dir", True, "/tmp is writable for the kernel's socket files")


def diagnose(config: SandboxConfig | None = None) -> list[Check]:
    """Run the checks in order; later Docker checks are skipped when an earlier one fails."""
    from sandbox.docker import DockerSandbox, docker_client
    from sandbox.local import LocalSandbox

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
