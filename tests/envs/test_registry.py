"""Gymnasium ids, check_env on each of them, the tool registry, and entry-point plugins."""

from __future__ import annotations

import functools
import subprocess
import sys
import textwrap
import warnings

import gymnasium
import pytest
from gymnasium.utils.env_checker import check_env

import stare_envs
from stare_envs.problems import PROBLEM_FAMILIES
from stare_envs.registry import (
    BENCHMARKS,
    EnvRegistrationError,
    family_env_id,
    load_plugins,
    register_tool_env,
)
from stare_envs.tools import ToolRegistryError, get_tool, list_tools, register_tool, unregister_tool

BUILTIN_IDS = (
    ["stare/CodeInterpreter-v0"]
    + [family_env_id(f) for f in PROBLEM_FAMILIES]
    + [f"stare/{b}-v0" for b in BENCHMARKS]
)


def test_every_builtin_id_is_registered():
    assert "stare/CodeInterpreter-Multiplication-v0" in BUILTIN_IDS
    assert "stare/CodeInterpreter-GcdLcm-v0" in BUILTIN_IDS and "stare/AIME2025-v0" in BUILTIN_IDS
    assert sorted(k for k in gymnasium.registry if k.startswith("stare/")) == sorted(BUILTIN_IDS)


@pytest.mark.parametrize("env_id", BUILTIN_IDS)
def test_check_env_passes(env_id, shared_data):
    # A private local pool that random actions never start (they call no tool). A shared pool
    # cannot go through check_env: spec.make() deep-copies the kwargs, and a pool holds locks.
    env = gymnasium.make(env_id, sandbox_backend="local")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # check_env reports problems as warnings too
        check_env(env.unwrapped)
    assert isinstance(env.unwrapped, stare_envs.CodeInterpreterEnv)
    env.close()


def test_make_passes_kwargs_through(fake_pool):
    env = gymnasium.make("stare/CodeInterpreter-Divisors-v0", pool=fake_pool, format="hermes", max_turns=3)
    prompt, info = env.reset(seed=0)
    assert info["format"] == "hermes" and env.unwrapped.max_turns == 3
    assert info["problem_id"].startswith("divisors-d1-")
    env.close()


def test_benchmark_data_path_argument_env_var_and_error(shared_data, tmp_path, monkeypatch):
    # no episode runs code here: the local backend, named, lets this run where Docker is not (yet) up
    make = functools.partial(gymnasium.make, sandbox_backend="local")
    by_file = make("stare/AIME2025-v0", data_path=shared_data / "aime2025.jsonl")
    by_dir = make("stare/AIME2025-v0", data_path=shared_data)
    assert by_file.reset(seed=0)[1]["problem_id"] == by_dir.reset(seed=0)[1]["problem_id"]
    assert by_file.reset(seed=0)[1]["problem_id"].startswith("aime2025-")
    monkeypatch.setenv("STARE_DATA_DIR", str(shared_data))
    assert len(make("stare/AIME2024-v0").unwrapped.problems) == 30
    with pytest.raises(
        FileNotFoundError, match=r"pass data_path='/path/to/aime2024.jsonl' to gymnasium.make"
    ):
        make("stare/AIME2024-v0", data_path=tmp_path)


def test_register_tool_env_refuses_taken_ids_and_unknown_tools():
    with pytest.raises(
        EnvRegistrationError, match="already registered with other settings .*: bump its version"
    ):
        register_tool_env("stare/CodeInterpreter-v0", tools=["code_interpreter"])
    with pytest.raises(
        ToolRegistryError, match=r"no tool named 'nope': registered tools are \[.*'code_interpreter'"
    ):
        register_tool_env("test/Nope-v0", tools=["nope"])
    assert "test/Nope-v0" not in gymnasium.registry


def test_tool_registry_refuses_duplicates_and_lists_names_on_lookup():
    with pytest.raises(
        ToolRegistryError,
        match=r"tool 'code_interpreter' is already registered \(by stare_envs.tools.CodeInterpreterTool\), another "
        r"definition \(by tests.envs.test_registry.test_tool_registry_.*<lambda>\) cannot take its name",
    ):
        register_tool("code_interpreter", lambda code: code)
    with pytest.raises(
        ToolRegistryError, match=r"no tool named 'calc': registered tools are \['code_interpreter'"
    ):
        get_tool("calc")
    with pytest.raises(ToolRegistryError, match="tool name 'has space' is invalid"):
        register_tool("has space", lambda: None)


def test_class_tool_with_sandbox_and_inferred_schema(fake_pool):
    @register_tool("counter_demo", needs_sandbox=True)
    class Counter:
        """Count calls and run code in the episode's sandbox."""

        def __init__(self, sandbox, start: int = 0) -> None:
            self.sandbox, self.count = sandbox, start

        def __call__(self, step: int, note: str = "") -> str:
            self.count += step
            return self.sandbox.run(f"print({self.count})").stdout

    try:
        spec = get_tool("counter_demo")
        assert spec.description == "Count calls and run code in the episode's sandbox."
        assert spec.parameters == {
            "type": "object",
            "properties": {"step": {"type": "integer"}, "note": {"type": "string"}},
            "required": ["step"],
            "additionalProperties": False,
        }
        with pytest.raises(ValueError, match="needs a sandbox: bind it with sandbox="):
            spec.bind()
        with fake_pool.lease() as sandbox:
            tool = spec.bind(sandbox, start=10)
            assert [tool({"step": 1}).text, tool({"step": 5}).text] == ["11\n", "16\n"]
            assert (
                tool({"step": "5"}).text == "counter_demo: argument 'step' must be a JSON integer, got str."
            )
        assert "counter_demo" in list_tools()
    finally:
        unregister_tool("counter_demo")


PLUGIN = '''
from stare_envs.tools import register_tool
from stare_envs.registry import register_tool_env

@register_tool("shout_plugin_demo")
def shout(text: str) -> str:
    """Upper-case the text."""
    return text.upper()

def register_envs():
    register_tool_env("plugin/Shout-v0", tools=["shout_plugin_demo"], problems="multiplication")
'''


def test_entry_point_plugins_register_tools_and_envs(tmp_path, monkeypatch):
    (tmp_path / "shout_plugin_demo.py").write_text(PLUGIN)
    dist = tmp_path / "shout_plugin_demo-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: shout-plugin-demo\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        textwrap.dedent("""\
        [stare_agent.tools]
        shout = shout_plugin_demo:shout
        [stare_agent.envs]
        shout = shout_plugin_demo:register_envs
        broken = shout_plugin_demo:missing_function
        """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        with pytest.warns(
            RuntimeWarning, match=r"plugin 'broken' \(shout_plugin_demo:missing_function.*fix or uninstall"
        ):
            loaded = load_plugins(reload=True)
        assert loaded == ["stare_agent.tools:shout", "stare_agent.envs:shout"]
        assert load_plugins() == []  # loaded once
        env = gymnasium.make("plugin/Shout-v0")
        env.reset(seed=0)
        obs, *_ = env.step(
            '<tool_call>{"name": "shout_plugin_demo", "arguments": {"text": "hi"}}</tool_call>'
        )
        assert obs == "HI"
        env.close()
    finally:
        unregister_tool("shout_plugin_demo")
        gymnasium.registry.pop("plugin/Shout-v0", None)
        sys.modules.pop("shout_plugin_demo", None)


def test_the_contracts_a_trainer_meets_are_at_the_top_level():
    """What another trainer needs of the environments, importable from ``stare_envs`` itself: the engine
    contract, the rollout runner, the trajectory, and the env factories; no torch with them."""
    import subprocess
    import sys

    names = ["Engine", "SamplingParams", "Generation", "RolloutRunner", "Trajectory", "TrajectoryBuilder"]
    names += ["make_tool_env", "make_tool_envs", "register_tool_env", "ToolEnv"]
    code = f"import sys, stare_envs; print(all(n in stare_envs.__all__ and hasattr(stare_envs, n) for n in {names!r}), 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "False"]


GUIDE_SNIPPET = '''
import gymnasium

from stare_envs import register_tool, register_tool_env


@register_tool("double_{tag}")
def double(x: int) -> int:
    """Twice x."""
    return 2 * x


register_tool_env("guide/Double{tag}-v0", tools=["double_{tag}"], format="hermes", problems="multiplication")
env = gymnasium.make("guide/Double{tag}-v0")
'''


def _run_script(folder, text: str) -> subprocess.CompletedProcess:
    """``text`` run as the script ``my_tools.py`` from ``folder`` (so that it can import itself)."""
    script = folder / "my_tools.py"
    script.write_text(text)
    return subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=folder
    )


def test_a_module_registered_as_a_script_and_imported_by_name_registers_once(tmp_path):
    """The guide's snippet run as a script that then imports itself by name (what `module:id` in a
    config does when the module is also the running script): the same definitions again are no-ops."""
    main = "\nimport my_tools\n\nif __name__ == '__main__':\n    print('registered once')\n"
    done = _run_script(tmp_path, GUIDE_SNIPPET.format(tag="a") + main)
    assert done.returncode == 0 and done.stdout.strip() == "registered once", done.stderr


def test_another_definition_under_a_taken_name_is_refused_naming_both(tmp_path):
    other = "\n@register_tool('double_b')\ndef double(x: int) -> int:\n    return x + x\n"
    done = _run_script(tmp_path, GUIDE_SNIPPET.format(tag="b") + other)
    assert done.returncode == 1
    assert (
        "tool 'double_b' is already registered (by __main__.double), another definition (by __main__.double)"
        in (done.stderr)
    )
    again = "\nregister_tool_env('guide/Doublec-v0', tools=['double_c'], format='hermes', max_turns=3)\n"
    done = _run_script(tmp_path, GUIDE_SNIPPET.format(tag="c") + again)
    assert "'guide/Doublec-v0' is already registered with other settings" in done.stderr
