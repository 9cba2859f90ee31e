"""The package as a user gets it: a wheel built from this tree, installed into fresh virtual environments
outside the repository.

- The wheel ships the four evaluation sets with their provenance, and keeps torch, transformers and
  deepspeed behind the ``train`` extra.
- The slim install (the wheel with its base dependencies, resolved by pip) has no torch; in it
  ``import stare_envs, stare_sandbox`` works and a built-in environment plays a whole episode through the rollout
  runner, with the (torch-free) ``ScriptedEngine`` and a pure-Python tokenizer.
- The full install runs ``gymnasium.make("stare/AIME2024-v0")`` and ``stare-agent eval --data aime2024``
  from a directory with no ../shared. Its heavy packages (torch, transformers, deepspeed) are borrowed from
  the repository's .venv through a ``.pth`` path entry, which adds that folder to ``sys.path`` after the
  new venv's own site-packages without running its ``.pth`` files (so the editable install of this
  checkout stays inactive); the test asserts that ``stare_agent``, ``stare_envs`` and ``stare_sandbox`` are the wheel's.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

from stare_envs.problems import BUILTIN_SETS

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "deepspeed")
NOT_IN_THE_WHEEL = (".git", ".venv", "runs", "build", "dist", "tests", "benchmarks", "*.egg-info")
NOT_IN_THE_WHEEL += ("__pycache__", ".*_cache", ".hypothesis", ".cache", ".venv-*")  # .venv-vllm: GBs


def run(*cmd: str | Path, cwd: Path, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    """Run outside the repository, without the variables that would point back into it."""
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "STARE_DATA_DIR", "VIRTUAL_ENV")}
    done = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=timeout, env={**clean, **env}
    )
    assert done.returncode == 0, f"{cmd}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel of this tree, built from a copy (setuptools' build/ would otherwise keep stale files)."""
    source = tmp_path_factory.mktemp("source") / "stare-agent"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(*NOT_IN_THE_WHEEL))
    out = tmp_path_factory.mktemp("wheel")
    run(
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "-q",
        "--no-deps",
        "--no-build-isolation",
        "-w",
        out,
        source,
        cwd=out,
    )
    [built] = out.glob("stare_agent-*.whl")
    return built


def new_venv(path: Path) -> Path:
    """A fresh venv without pip (the repository's pip installs into it with --python); its python."""
    run(sys.executable, "-m", "venv", "--without-pip", path, cwd=path.parent)
    return path / "bin" / "python"


def pip_install(python: Path, *args: str | Path) -> None:
    pip = (sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-compile")
    run(*pip, *args, cwd=python.parent, timeout=600)


def test_wheel_ships_the_eval_sets_and_keeps_the_trainer_behind_an_extra(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        [metadata] = [n for n in names if n.endswith(".dist-info/METADATA")]
        requirements = [
            line.removeprefix("Requires-Dist: ")
            for line in archive.read(metadata).decode().splitlines()
            if line.startswith("Requires-Dist: ")
        ]
    shipped = {f"stare_envs/data/{name}.jsonl" for name in BUILTIN_SETS}
    shipped |= {
        "stare_envs/data/SOURCES.md",
        "stare_envs/data/LICENSES/Apache-2.0.txt",
        "stare_envs/data/LICENSES/MIT.txt",
    }
    assert shipped <= names
    assert {"stare_envs/registry.py", "stare_sandbox/image/build.sh", "stare_agent/cli.py"} <= names
    assert not [n for n in names if n.startswith(("tests/", "benchmarks/"))]
    for package in HEAVY:
        [requirement] = [r for r in requirements if r.startswith(package)]
        assert 'extra == "train"' in requirement, requirement
    base = {re.split(r"[<>=!~ ]", r)[0] for r in requirements if "extra ==" not in r}
    assert {"gymnasium", "docker", "jupyter-client", "ipykernel", "math-verify"} <= base
    assert not base & {*HEAVY, "accelerate", "omegaconf", "matplotlib", "tensorboard"}, base


SLIM_EPISODE = textwrap.dedent(
    r'''
    import importlib.util, subprocess, sys
    from pathlib import Path

    for heavy in HEAVY:
        assert importlib.util.find_spec(heavy) is None, f"{heavy} is installed"
    import gymnasium

    import stare_agent, stare_envs, stare_sandbox
    from stare_envs.rollout import RolloutRunner
    from stare_agent.engines.scripted import ScriptedEngine  # needs no torch

    for module in (stare_envs, stare_sandbox, stare_agent):
        assert Path(module.__file__).is_relative_to(sys.prefix), module.__file__

    EOS = 0x110000  # one past the last code point


    class CodePointTokenizer:
        """One token per character; a ChatML-style template."""

        eos_token_id = EOS

        def encode(self, text, **kwargs):
            return [ord(c) for c in text]

        def decode(self, ids, **kwargs):
            return "".join("<|im_end|>" if i == EOS else chr(i) for i in ids)

        def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False, **kwargs):
            text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
            return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


    env = gymnasium.make("stare/AIME2024-v0", sandbox_backend="local", max_turns=3)
    tokenizer = CodePointTokenizer()
    # run code, then answer with what it printed
    script = ["Let me compute.\n<code>\n```python\nprint(17 * 12)\n```\n</code>", "<answer>\\boxed{204}</answer>"]
    runner = RolloutRunner(tokenizer, ScriptedEngine(tokenizer, [script]), max_response_tokens=1024)
    [trajectory] = runner.run([env.unwrapped], seeds=0, options=[{"problem_index": 0}])
    env.close()
    info = trajectory.info
    assert (info["problem_id"], trajectory.reward, info["num_turns"]) == ("aime2024-I-01", 1.0, 2), info
    inserted = "".join(chr(t) for t, m in zip(trajectory.response_ids, trajectory.loss_mask) if m == 0)
    assert "<interpreter>\n204" in inserted, inserted  # the sandbox really ran the code
    assert "torch" not in sys.modules

    cli = subprocess.run([Path(sys.executable).parent / "stare-agent", "eval", "--data", "aime2024"],
                         capture_output=True, text=True)
    assert cli.returncode == 2 and "pip install 'stare-agent[train]'" in cli.stderr, cli.stderr
    print("slim ok")
    '''
).replace("HEAVY", repr(HEAVY))


@pytest.mark.slow
def test_slim_install_plays_an_episode_without_torch(wheel, tmp_path):
    python = new_venv(tmp_path / "slim")
    pip_install(python, wheel)  # the base dependencies only, resolved by pip
    script = tmp_path / "episode.py"
    script.write_text(SLIM_EPISODE)
    done = run(python, script, cwd=tmp_path, timeout=120)
    assert "slim ok" in done.stdout


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from stare_agent.models import tiny_model

    path = tmp_path_factory.mktemp("tiny")
    model, tokenizer = tiny_model()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.slow
def test_installed_wheel_evaluates_aime_2024_outside_the_repository(wheel, model_dir, tmp_path):
    python = new_venv(tmp_path / "full")
    pip_install(python, "--no-deps", wheel)
    site_packages = Path(
        run(
            python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=tmp_path
        ).stdout.strip()
    )
    (site_packages / "zz_repo_venv_packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    work = tmp_path / "work"
    for name in ("envs", "sandbox"):  # a user project's own packages of these names
        (work / name).mkdir(parents=True)
        (work / name / "__init__.py").write_text('OWNER = "user"\n')
    check = textwrap.dedent(
        """
        import sys
        from pathlib import Path
        import gymnasium, stare_agent, stare_agent.cli, stare_envs, stare_sandbox
        for module in (stare_envs, stare_sandbox, stare_agent, stare_agent.cli):
            assert Path(module.__file__).is_relative_to(sys.prefix), module.__file__
        import envs, sandbox  # the user's own, beside ours
        assert (envs.OWNER, sandbox.OWNER) == ("user", "user")
        for name in ("AIME2024", "AIME2025", "AMC23", "MATH500"):
            env = gymnasium.make(f"stare/{name}-v0", sandbox_backend="local")
            print(name, len(env.unwrapped.problems), env.reset(seed=0)[1]["problem_id"] != "")
            env.close()
        """
    )
    made = run(python, "-c", check, cwd=work).stdout.split()
    assert made == "AIME2024 30 True AIME2025 30 True AMC23 40 True MATH500 500 True".split()
    done = run(
        python.parent / "stare-agent", "eval", "--data", "aime2024", "--model", model_dir, "--limit", "1",
        "--samples", "1", "--max-response-tokens", "16", "--max-turns", "1", "--backend", "local",
        "--out", work / "eval", cwd=work,
    )  # fmt: skip
    assert "avg@1" in done.stdout
    [row] = [json.loads(line) for line in (work / "eval" / "results.jsonl").read_text().splitlines()]
    assert row["problem_id"] == "aime2024-I-01"


@pytest.mark.parametrize("name", ["stare_o1", "stare_c2", "grpo_ds"])
def test_paper_configs_validate_on_the_shipped_aime_set_offline(name, monkeypatch):
    from stare_agent.config import load_config
    from stare_envs.problems import eval_problems

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = load_config(REPO / "configs" / f"{name}_retool_qwen2.5_7b.yaml")
    problems = eval_problems(config.data.eval, seed=0, difficulty=1, limit=None)
    assert [len(problems), problems[0].id] == [30, "aime2024-I-01"]
