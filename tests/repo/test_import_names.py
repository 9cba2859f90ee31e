"""A user's own ``envs`` and ``sandbox`` packages (a common layout of RL projects) and ours live side by
side: the folders envs/ and sandbox/ are installed as ``stare_envs`` and ``stare_sandbox``, so neither name
can be shadowed. Run in a real user project: the package folders in the working directory, which Python
puts first on ``sys.path``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

USER_PROJECT_SCRIPT = textwrap.dedent(
    """
    import envs, sandbox  # the user's own
    assert (envs.OWNER, sandbox.OWNER) == ("user", "user"), "the user's packages are theirs"

    import gymnasium
    import stare_envs
    from stare_envs.registry import make_tool_env
    from stare_sandbox import SandboxPool

    env = make_tool_env("stare/CodeInterpreter-v0", sandbox_backend="local")
    assert isinstance(env, stare_envs.ToolEnv), type(env)
    env.close()
    assert gymnasium.spec("stare/AIME2024-v0").id == "stare/AIME2024-v0"
    assert SandboxPool.__module__ == "stare_sandbox.pool"
    import envs as again  # the user's again
    assert again is envs and not hasattr(envs, "ToolEnv")
    print("ok")
    """
)


def test_a_user_project_with_its_own_envs_and_sandbox_packages_uses_both(tmp_path):
    for name in ("envs", "sandbox"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text('OWNER = "user"\n')
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the repository is not on the path
    done = subprocess.run(
        [sys.executable, "-c", USER_PROJECT_SCRIPT],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_a_package_imported_from_another_checkout_stops_the_run(tmp_path):
    """Two checkouts sharing one venv: the editable mapping of the first serves ``stare_envs`` to the
    second's tests. The run stops before any test with one line naming the package, its path and the fix."""
    import subprocess
    import sys

    other = tmp_path / "other-checkout"
    (other / "stare_envs").mkdir(parents=True)
    (other / "stare_envs" / "__init__.py").write_text("")
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); from tests.conftest import foreign_packages; "
        "print(foreign_packages())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(other)],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parents[2],
        check=True,
    ).stdout
    assert f"stare_envs ({other / 'stare_envs'})" in out
    assert "stare_agent" not in out  # the others come from this checkout
