"""Which backend runs a sandbox: ``resolve_backend`` (``"auto"`` is Docker or an error, never the local
backend behind the user's back), ``docker_available``, and ``make_sandbox`` for one sandbox outside a
pool."""

from __future__ import annotations

from stare_sandbox.base import Sandbox
from stare_sandbox.config import BACKENDS, DEFAULT_IMAGE, Backend, SandboxConfig
from stare_sandbox.docker import DockerSandbox, docker_client
from stare_sandbox.errors import SandboxUnavailable
from stare_sandbox.local import LocalSandbox


def docker_available(image: str = DEFAULT_IMAGE) -> bool:
    """True when a Docker daemon answers and ``image`` is present."""
    return docker_problem(image) is None


def docker_problem(image: str = DEFAULT_IMAGE) -> str | None:
    """None when a Docker daemon answers and ``image`` is present, else why not, in a few words."""
    try:
        client = docker_client(timeout=5)
    except Exception as exc:  # noqa: BLE001 - any failure means "not usable"
        return f"no Docker daemon answers ({type(exc).__name__})"
    try:
        client.images.get(image)
    except Exception:  # noqa: BLE001
        return f"the sandbox image {image} is missing"
    finally:
        client.close()
    return None


def resolve_backend(backend: str, config: SandboxConfig | None = None, *, build: bool = False) -> Backend:
    """The concrete backend for ``backend``, one of :data:`BACKENDS`: ``"auto"`` is ``"docker"`` when
    a daemon answers and the image is present; the others are themselves. ``"auto"`` never becomes
    ``"local"``: model code runs in a local process (weaker isolation, under the host's uid) only where
    the user asked for it by name. Resolve once per run (``SandboxPool`` does): a Docker hiccup later on
    must be an error, never model code started on the host instead.

    Args:
        backend: A :data:`Backend` (a config's free string is checked here).
        config: Its ``image`` is the one ``"auto"`` looks for.
        build: For ``"auto"``, build the image where a daemon answers but lacks it (once, about 2
            minutes).

    Raises:
        ValueError: unknown ``backend``.
        SandboxUnavailable: ``"auto"`` where Docker is not usable: the line says why and how to choose
            the local backend.
    """
    for name in BACKENDS:
        if backend == name and name != "auto":
            return name
    if backend != "auto":
        raise ValueError(
            f"unknown sandbox backend {backend!r}: use 'auto', 'docker' or 'local' (or 'ray' for a fleet)"
        )
    image = (config or SandboxConfig()).image
    problem = docker_problem(image)
    if problem is None or (build and _build_missing_image(image)):
        return "docker"
    raise SandboxUnavailable(
        f"sandbox backend auto: Docker is not usable here ({problem}): start the daemon and build the image "
        "(`stare-agent sandbox doctor` says what is missing), or run model code in a local process, whose "
        "isolation is weaker, by asking for it: sandbox.backend=local (ToolEnv: sandbox_backend='local')"
    )


def _build_missing_image(image: str) -> bool:
    """Build ``image`` when a daemon answers and lacks it; whether it is there now (a failure is printed)."""
    from stare_sandbox.build import build_image, image_exists

    try:
        client = docker_client(timeout=5)
        try:
            client.ping()
        finally:
            client.close()
    except Exception:  # noqa: BLE001 - any failure means "no daemon here"
        return False
    if image_exists(image):
        return False  # there, yet docker_available said no: not usable, building would not help
    print(f"building the sandbox image {image} (once, about 2 minutes)")
    try:
        build_image(image)
    except Exception as exc:  # noqa: BLE001 - fall back, loudly
        print(f"could not build the sandbox image {image} ({exc})")
        return False
    return True


def make_sandbox(backend: Backend = "auto", config: SandboxConfig | None = None) -> Sandbox:
    """A started sandbox. ``"auto"`` is Docker when a daemon answers and the image is present (see
    ``resolve_backend``); ``"local"`` is a local kernel process, which says on stderr that its isolation
    is weaker.

    Raises:
        ValueError: unknown ``backend``, or ``"ray"`` (a fleet: ``open_pool``).
        SandboxUnavailable: Docker was asked for (``"docker"``, or ``"auto"``) and cannot be used (the
            message says why).
    """
    config = config or SandboxConfig()
    resolved = resolve_backend(backend, config)
    if resolved == "ray":
        raise ValueError(
            "make_sandbox starts one sandbox here: use 'auto', 'docker' or 'local' (ray: open_pool)"
        )
    return DockerSandbox(config) if resolved == "docker" else LocalSandbox(config)
