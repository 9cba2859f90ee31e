"""The settings an evaluation records: a model directory's hash, the problems' hash, the engine."""

from __future__ import annotations

import hashlib
import os
import sys
import types

from stare_agent.provenance import engine_settings, machine, model_settings, problems_sha256
from stare_envs.problems import Problem


def test_a_model_directory_is_hashed_by_file_names_and_contents(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"\x00\x01")
    expected = hashlib.sha256(b"config.json\x002\x00{}" + b"model.safetensors\x002\x00\x00\x01").hexdigest()
    settings = model_settings(str(tmp_path))
    assert settings == {
        "name_or_path": str(tmp_path),
        "path": str(tmp_path.resolve()),
        "sha256": expected,
        "sha256_of": "file names and contents",
    }
    (tmp_path / "model.safetensors").write_bytes(b"\x00\x02")  # other weights, another hash
    assert model_settings(str(tmp_path))["sha256"] != expected
    # a hub id that is not in the local cache: no revision, and nothing is downloaded
    assert model_settings("nobody/no-such-model") == {
        "name_or_path": "nobody/no-such-model",
        "revision": None,
    }


def test_problems_hash_covers_ids_statements_answers_and_order():
    a, b = Problem("p1", "1 + 1?", "2"), Problem("p2", "2 + 2?", "4")
    assert problems_sha256([a, b]) == problems_sha256([Problem("p1", "1 + 1?", "2"), b])
    assert (
        len(
            {
                problems_sha256([a, b]),
                problems_sha256([b, a]),
                problems_sha256([a, Problem("p2", "2 + 2?", "5")]),
            }
        )
        == 3
    )


def test_engine_settings_name_the_in_process_model_dtype_and_device():
    from stare_agent.engines import TransformersEngine
    from stare_agent.models import tiny_model

    model, tokenizer = tiny_model()
    assert engine_settings(TransformersEngine(model, tokenizer)) == {
        "kind": "TransformersEngine",
        "dtype": "float32",
        "device": "cpu",
        "autocast_dtype": None,
    }


def test_the_machine_line_names_cores_bf16_the_isa_cap_and_gpus(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # no torch: its import fails, fast
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    line = machine()
    assert f", {os.cpu_count()} cores, " in line
    assert "bf16" in line.lower() and "ONEDNN_MAX_CPU_ISA" not in line
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert machine().endswith(", ONEDNN_MAX_CPU_ISA=AVX2")
    names = ["NVIDIA H100", "NVIDIA H100"]
    cuda = types.SimpleNamespace(
        is_available=lambda: True, device_count=lambda: len(names), get_device_name=names.__getitem__
    )
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    assert machine().endswith(", ONEDNN_MAX_CPU_ISA=AVX2, 2 x NVIDIA H100")
