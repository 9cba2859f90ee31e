"""A third-party tool-call format: registered by a decorator or an entry point, then usable by name
everywhere a built-in one is (get_format, the env, the config); names are unique and listed on error."""

from __future__ import annotations

import importlib.metadata

import pytest

import stare_envs.registry
from stare_envs.code_interpreter import CodeInterpreterEnv
from stare_envs.formats import (
    FORMATS,
    FormatRegistryError,
    ReToolFormat,
    get_format,
    register_format,
    unregister_format,
)
from stare_envs.problems import Problem


class DemoFormat(ReToolFormat):
    """ReTool's tags under another name and system prompt: enough to show the registry at work."""

    name = "demo"

    def system_prompt(self, tools):
        return "Write Python in <code> blocks; answer as \\boxed{}."


@pytest.fixture
def demo_from_entry_point(monkeypatch):
    point = importlib.metadata.EntryPoint(
        name="demo", value=f"{__name__}:DemoFormat", group=stare_envs.registry.FORMAT_GROUP
    )
    original = importlib.metadata.entry_points

    def entry_points(*, group):
        return [point] if group == stare_envs.registry.FORMAT_GROUP else []

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    try:
        assert stare_envs.registry.load_plugins(reload=True) == [f"{stare_envs.registry.FORMAT_GROUP}:demo"]
    finally:
        monkeypatch.setattr(importlib.metadata, "entry_points", original)
    yield
    unregister_format("demo")


def test_an_entry_point_format_is_usable_by_name_everywhere(demo_from_entry_point):
    from stare_agent.config import load_config

    assert isinstance(get_format("demo"), DemoFormat)
    assert load_config(None, ["env.format=demo"]).env.format == "demo"
    env = CodeInterpreterEnv([Problem("p", "1+1?", "2")], format="demo", sandbox_backend="local")
    try:
        _, info = env.reset(seed=0)
        assert info["format"] == "demo"
        assert info["messages"][0]["content"] == DemoFormat().system_prompt([])
    finally:
        env.close()


def test_names_are_unique_and_listed():
    with pytest.raises(
        FormatRegistryError, match=r"^tool format 'retool' is already registered \(ReToolFormat\)"
    ):
        register_format(type("Other", (ReToolFormat,), {"name": "retool"}))
    with pytest.raises(FormatRegistryError, match="is not a ToolFormat subclass with a name"):
        register_format(dict)  # type: ignore[arg-type]
    with pytest.raises(
        KeyError,
        match=r"^Unknown tool format 'xml': use one of \['deepseek_v3', 'hermes', 'llama3_json', 'qwen3', 'retool'\]$",
    ):
        get_format("xml")
    register_format(DemoFormat)
    try:
        assert sorted(FORMATS) == ["deepseek_v3", "demo", "hermes", "llama3_json", "qwen3", "retool"]
    finally:
        unregister_format("demo")
    assert "demo" not in FORMATS
