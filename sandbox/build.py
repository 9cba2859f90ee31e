"""Build the sandbox image from Debian packages (``image/build.sh``) and check that it exists."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from stare_sandbox.config import DEFAULT_IMAGE
from stare_sandbox.docker import docker_client
from stare_sandbox.errors import SandboxError, SandboxUnavailable

BUILD_SCRIPT = Path(__file__).with_name("image") / "build.sh"


def image_exists(tag: str = DEFAULT_IMAGE) -> bool:
    """True when the Docker daemon answers and has ``tag``."""
    try:
        client = docker_client(timeout=5)
        try:
            client.images.get(tag)
        finally:
            client.close()
    except Exception:  # noqa: BLE001 - no daemon or no image
        return False
    return True


def build_image(tag: str = DEFAULT_IMAGE, *, force: bool = False) -> str:
    """Build ``tag`` with ``image/build.sh`` (debootstrap + ``docker import``) unless it exists.

    Installs nothing itself. Returns the tag.

    Raises:
        SandboxUnavailable: no daemon, no debootstrap, or not root (the message names the fix).
        SandboxError: the build script failed (its last output lines are in the message).
    """
    docker_client(timeout=10).close()  # the daemon answers
    if not force and image_exists(tag):
        return tag
    if shutil.which("debootstrap") is None:
        raise SandboxUnavailable("debootstrap not found: apt-get install -y debootstrap, then rebuild")
    if os.geteuid() != 0:
        raise SandboxUnavailable(
            "building the sandbox image needs root (debootstrap + chroot): rerun with sudo"
        )
    proc = subprocess.run(["bash", str(BUILD_SCRIPT), tag], capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise SandboxError(f"building {tag} failed (exit {proc.returncode}):\n{tail}")
    return tag
