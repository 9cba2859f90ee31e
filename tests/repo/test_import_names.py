"""A user's own ``envs`` and ``sandbox`` packages (a common layout of RL projects) and ours live side by
side: the folders envs/ and sandbox/ are installed as ``stare_envs`` and ``stare_sandbox``, so neither name
can be shadowed. Run in a real user project: the package folders in the working directory, which Python
puts first on ``sys.path``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

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
