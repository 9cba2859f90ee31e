"""What produced a result: the model and its hash or revision, the problems and their hash, the engine
and its version and dtype, package versions. Written into an evaluation's ``summary.json``, so that a
number can be traced to its inputs and a rerun can be checked against it."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from stare_envs.problems import Problem

# Above this many bytes of model files, the model hash covers file names and sizes only (a full read
# of a 70B checkpoint would take minutes); the settings say which.
MODEL_HASH_MAX_BYTES = 8 << 30


def package_versions() -> dict[str, str | None]:
    """Versions of this package and of the libraries that decide what a model samples."""
    versions: dict[str, str | None] = {}
    for name in ("stare-agent", "torch", "transformers"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def machine() -> str:
    """One line on the machine a measurement ran on: the CPU model, the cores, whether the CPU computes
    bf16 natively (its AVX-512 BF16 and AMX flags), ``ONEDNN_MAX_CPU_ISA`` when set, and the CUDA GPUs
    when this process's torch sees any (torch is not imported for it); e.g. ``AMD EPYC, 2 cores, AVX-512 BF16``."""
    model, flags = "", set[str]()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name") and not model:
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    if "avx512_bf16" in flags:
        bf16 = "AVX-512 BF16" + (" + AMX" if "amx_bf16" in flags else "")
    else:
        bf16 = "AMX BF16" if "amx_bf16" in flags else "no native bf16"
    parts = [
        model or platform.processor() or platform.machine() or "unknown CPU",
        f"{os.cpu_count()} cores",
        bf16,
    ]
    if os.environ.get("ONEDNN_MAX_CPU_ISA"):
        parts.append(f"ONEDNN_MAX_CPU_ISA={os.environ['ONEDNN_MAX_CPU_ISA']}")
    torch = sys.modules.get(
        "torch"
    )  # a process that runs no torch (the sandbox's benchmarks) has no GPU to name
    if torch is not None and torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        parts += [f"{names.count(n)} x {n}" if names.count(n) > 1 else n for n in dict.fromkeys(names)]
    return ", ".join(parts)


def run_record(**fields: Any) -> dict[str, Any]:
    """Where and how a run or an evaluation was made: the command line, the start (UTC), the package
    versions and the git commit of this package's checkout (None when installed from a wheel), with
    ``fields`` (e.g. the sandbox backend the pool resolved)."""
    import datetime
    import subprocess
    import sys

    try:
        commit = (
            subprocess.run(
                ["git", "rev-parse", "HEAD"],
                cwd=Path(__file__).parent,
                capture_output=True,
                text=True,
                timeout=5,
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {
        "command": sys.argv,
        "started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": package_versions(),
        "git_commit": commit,
        **fields,
    }


def problems_sha256(problems: Sequence[Problem]) -> str:
    """SHA-256 of the problems in order (id, statement, gold answer): two evaluations with the same hash
    asked the same questions."""
    digest = hashlib.sha256()
    for p in problems:
        digest.update(json.dumps([p.id, p.problem, p.answer]).encode() + b"\n")
    return digest.hexdigest()


def model_settings(name_or_path: str) -> dict[str, Any]:
    """``name_or_path``, the local directory it resolves to, and its identity: the SHA-256 of a local
    directory's files (names and contents; names and sizes above ``MODEL_HASH_MAX_BYTES``), or the
    commit of a Hugging Face hub model in the local cache (``None`` when it is not cached here, e.g. a
    model behind ``--engine openai``)."""
    from stare_agent.models import EMBEDDED_PREFIX, resolve_policy_path

    out: dict[str, Any] = {"name_or_path": name_or_path}
    embedded = name_or_path.startswith(EMBEDDED_PREFIX)  # only it is resolved: nothing goes to the hub
    path = Path(resolve_policy_path(name_or_path) if embedded else name_or_path).expanduser()
    if path.is_dir():
        out["path"] = str(path.resolve())
        out.update(_directory_sha256(path))
        return out
    out["revision"] = _hub_revision(name_or_path)
    return out


def engine_settings(engine: Any) -> dict[str, Any]:
    """The engine's kind and what decides its samples: version, dtype, device, server."""
    out: dict[str, Any] = {"kind": type(engine).__name__}
    info = getattr(engine, "info", None)
    if isinstance(info, dict):  # the vLLM worker's: vllm_version, dtype, max_model_len
        out.update({k: v for k, v in info.items() if k in ("vllm_version", "dtype", "max_model_len")})
    model = getattr(engine, "model", None)
    if model is not None and hasattr(model, "parameters"):  # an in-process torch model (transformers engine)
        parameter = next(model.parameters())
        out["dtype"] = str(parameter.dtype).removeprefix("torch.")
        out["device"] = str(parameter.device)
        autocast = getattr(engine, "autocast_dtype", None)
        out["autocast_dtype"] = str(autocast).removeprefix("torch.") if autocast is not None else None
    elif isinstance(model, str):  # a served model (OpenAI-compatible engine)
        out["served_model"] = model
    if isinstance(getattr(engine, "base_url", None), str):
        out["base_url"] = engine.base_url
    return out


def _directory_sha256(path: Path) -> dict[str, Any]:
    files = sorted(f for f in path.iterdir() if f.is_file())
    total = sum(f.stat().st_size for f in files)
    digest = hashlib.sha256()
    contents = total <= MODEL_HASH_MAX_BYTES
    for f in files:
        digest.update(f"{f.name}\0{f.stat().st_size}\0".encode())
        if contents:
            with open(f, "rb") as handle:
                while block := handle.read(1 << 20):
                    digest.update(block)
    return {
        "sha256": digest.hexdigest(),
        "sha256_of": "file names and contents" if contents else "file names and sizes",
    }


def _hub_revision(name: str) -> str | None:
    """The commit of a hub model's snapshot in the local cache, or None."""
    if os.path.isabs(name) or name.count("/") != 1:
        return None
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    found = try_to_load_from_cache(name, "config.json")
    return Path(found).parent.name if isinstance(found, str) else None


__all__ = ["engine_settings", "machine", "model_settings", "package_versions", "problems_sha256"]
