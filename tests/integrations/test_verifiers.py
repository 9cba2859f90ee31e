"""The verifiers adapter against the installed verifiers: the integrations page's ``vf-eval`` command (verifiers' own
CLI, which loads our module through ``vf.load_environment``) evaluates our environment against a local
OpenAI-compatible server, with real Docker sandboxes.

The server is ``ScriptedOpenAIServer`` (a real HTTP server on 127.0.0.1 speaking the chat-completions
API with tool calls), whose "model" follows a fixed policy: set ``x`` in one call, print it in a second,
answer with what was printed. A random tiny model would call no tool, so it would test neither the
sandbox nor its state; a served real model needs a GPU or minutes per rollout on this CPU.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integrations.helpers import readme_block, require
from tests.integrations.scripted_openai_server import ScriptedOpenAIServer

pytestmark = pytest.mark.docker
REPO = Path(__file__).resolve().parents[2]


def test_readme_vf_eval_scores_our_env_with_stateful_sandboxes(docker_ready, tmp_path):
    require("verifiers")
    command = readme_block("# verifiers: evaluate with vf-eval").splitlines()[1:]
    argv = shlex.split(" ".join(line.rstrip("\\") for line in command))
    assert argv[0] == "OPENAI_API_KEY=EMPTY" and argv[1] == "vf-eval"
    problems = tmp_path / "problems.jsonl"
    rows = [("q1", "What is 17 * 12?", "204"), ("q2", "What is 17 * 12 + 1?", "205")]
    problems.write_text("".join(json.dumps(dict(id=i, problem=p, answer=a)) + "\n" for i, p, a in rows))

    with ScriptedOpenAIServer() as server:
        # The integrations page's command with this test's data, server and size; one sandbox for two rollouts, so
        # the second runs only if the first gave its sandbox back.
        values = {"-a": json.dumps({"data": str(problems), "pool_size": 1}), "-m": "scripted"}
        values |= {"-b": server.base_url, "-n": "2", "-r": "1"}
        args = argv[2:]
        for flag, value in values.items():
            args[args.index(flag) + 1] = value
        vf_eval = Path(sys.executable).parent / "vf-eval"
        env = {**os.environ, "OPENAI_API_KEY": "EMPTY", "PYTHONPATH": str(REPO)}
        done = subprocess.run(
            [vf_eval, *args, "-o", str(tmp_path / "out"), "--disable-tui", "--disable-env-server"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
    assert done.returncode == 0, done.stderr[-3000:]
    [results] = (tmp_path / "out").rglob("results.jsonl")
    metadata = json.loads((results.parent / "metadata.json").read_text())
    assert metadata["env_id"] == "stare_integrations.verifiers_env" and metadata["avg_error"] == 0.0
    records = [json.loads(line) for line in results.read_text().splitlines()]
    outcomes = sorted((r["answer"], r["reward"], r["code_interpreter_calls"]) for r in records)
    assert outcomes == [("204", 1.0, 2.0), ("205", 0.0, 2.0)]  # the checker's verdicts
    tool_outputs = [m["content"] for r in records for m in r["completion"] if m["role"] == "tool"]
    assert tool_outputs.count("204") == 2  # print(x) saw the x of the call before: one kernel per rollout
    assert len(server.requests) == 6
    assert all(r["tools"][0]["function"]["name"] == "code_interpreter" for r in server.requests)
