"""LoRA adapters (peft) for SFT and RL on CPU: real peft, real DeepSpeed, the tiny Llama with the real
SmolLM2 tokenizer (and one step of the embedded SmolLM2-135M)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from stare_agent.config import load_config
from stare_agent.engines import TransformersEngine
from stare_agent.models import ModelLoadError, tiny_model
from stare_agent.train.learner import ADAPTER_DIRNAME, Learner
from stare_envs.engine import SamplingParams
from stare_envs.trajectory import Trajectory, TrajectoryBuilder
from tests.conftest import require, require_module
from tests.stare_agent.parity_env import PARITY_RUN

peft = require_module("train", "peft", "pip install 'stare-agent[train]'")

LORA = ["model.lora.r=4", "model.lora.alpha=8", "deepspeed.precision=fp32", "optim.weight_decay=0.0"]


def _trajectory(seed: int, prompt: int = 5, response: int = 8) -> Trajectory:
    g = torch.Generator().manual_seed(seed)
    b = TrajectoryBuilder(torch.randint(100, 5000, (prompt,), generator=g).tolist())
    b.append(torch.randint(100, 5000, (response,), generator=g).tolist(), 1, [-1.0] * response)
    return b.build(reward=1.0)


def _split(named) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(base, adapter) tensors of a LoRA-adapted model, cloned."""
    base, adapter = {}, {}
    for name, p in named:
        (adapter if ".lora_" in name else base)[name] = p.detach().clone()
    return base, adapter


def _logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].float()


def test_rl_step_trains_only_adapters_and_the_engine_samples_the_updated_policy(tmp_path):
    model, tokenizer = tiny_model(seed=0)
    learner = Learner.from_config(model, tokenizer, load_config(None, [*LORA, "optim.lr=1e-2"]))
    assert learner.lora is not None and learner.module is model  # adapters injected into the model itself
    base0, adapter0 = _split(learner.module.named_parameters())
    assert adapter0 and all(".lora_" in n for n, p in learner.module.named_parameters() if p.requires_grad)
    engine = TransformersEngine(learner.module, tokenizer)  # the trainer's in-process engine
    prompt = list(_trajectory(0).prompt_ids)
    params = SamplingParams(temperature=1.0, max_new_tokens=6, seed=3)

    def sampled() -> tuple[Trajectory, list[float]]:
        (g,) = engine.generate([prompt], params)
        b = TrajectoryBuilder(prompt)
        b.append(g.token_ids, 1, g.logprobs)
        return b.build(reward=1.0), g.logprobs

    before, before_lp = sampled()
    batch = [_trajectory(i) for i in range(3)]
    metrics = learner.update(batch, [1.0, -1.0, 0.5])
    assert metrics["skipped"] == 0.0 and math.isfinite(metrics["grad_norm"])

    base1, adapter1 = _split(learner.module.named_parameters())
    for name, p in base1.items():
        assert torch.equal(p, base0[name]), f"base weight {name} changed"
    assert any(not torch.equal(p, adapter0[name]) for name, p in adapter1.items())

    # the engine samples from the updated policy: its log-probs are the learner's scores of its tokens
    after, after_lp = sampled()
    n = len(after_lp)
    scored, _ = learner.compute_logprobs_and_entropy([after])
    torch.testing.assert_close(scored[0, -n:], torch.tensor(after_lp), atol=1e-5, rtol=1e-5)
    old_scores, _ = learner.compute_logprobs_and_entropy([before])
    assert not torch.allclose(old_scores[0, -n:], torch.tensor(before_lp), atol=1e-6)  # the policy moved

    # an engine holding its own plain copy of the base model gets the merged weights: same policy
    plain, _ = tiny_model(seed=0)
    merged = dict(learner.named_weights())
    assert set(merged) == {n for n, _ in plain.named_parameters()}
    own = TransformersEngine(plain, tokenizer)
    own.update_weights(merged)
    (g,) = own.generate([prompt], params)
    assert g.token_ids == list(after.response_ids)
    torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(after_lp), atol=1e-5, rtol=1e-5)

    # export: the merged model in HF format, the adapters in PEFT format; both reload to the same logits
    out = learner.export_hf(tmp_path / "hf")
    ids = list(batch[0].input_ids)
    learner.module.eval()
    expected = _logits(learner.module, ids)
    learner.module.train()
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    torch.testing.assert_close(_logits(reloaded, ids), expected, atol=1e-5, rtol=1e-5)
    adapter_dir = out / ADAPTER_DIRNAME
    assert json.loads((adapter_dir / "adapter_config.json").read_text())["r"] == 4
    saved = load_file(adapter_dir / "adapter_model.safetensors")
    assert saved and all(".lora_" in k for k in saved)
    fresh, _ = tiny_model(seed=0)
    with_adapter = peft.PeftModel.from_pretrained(fresh, adapter_dir).eval()
    torch.testing.assert_close(_logits(with_adapter, ids), expected, atol=1e-5, rtol=1e-5)


def test_sft_with_lora_exports_merged_model_and_adapters(tmp_path):
    from stare_agent.train.sft import sft

    rows = [
        {
            "messages": [
                {"role": "user", "content": f"What is {a} * {b}?"},
                {
                    "role": "assistant",
                    "content": f"<code>\n```python\nprint({a} * {b})\n```\n</code>\n<interpreter>\n{a * b}\n"
                    f"</interpreter>\nSo it is <answer>\\boxed{{{a * b}}}</answer>",
                },
            ]
        }
        for a, b in ((6, 7), (12, 13))
    ]
    data = tmp_path / "traces.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    model, tokenizer = tiny_model(seed=2)
    base0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    cfg = load_config(
        None,
        [
            *LORA,
            f"sft.data={data}",
            "sft.format=retool",
            "sft.batch_size=2",
            "sft.epochs=1",
            "sft.lr=1e-2",
            "sft.warmup_ratio=0.0",
            "deepspeed.micro_batch_tokens=2048",
            "logger.backends=[]",
            f"trainer.run_dir={tmp_path / 'run'}",
        ],
    )
    summary = sft(cfg, model=model, tokenizer=tokenizer)
    assert summary["steps"] == 1 and summary["skipped_steps"] == 0
    base1, adapter1 = _split(model.named_parameters())  # sft wrapped this very model in adapters
    assert {n.replace(".base_layer.", ".") for n in base1} == set(base0)
    for name, p in base1.items():
        assert torch.equal(p, base0[name.replace(".base_layer.", ".")]), f"base weight {name} changed"
    assert any(bool(p.abs().sum() > 0) for n, p in adapter1.items() if ".lora_B." in n)  # B starts at 0

    out = tmp_path / "run" / "sft_model"
    ids = list(range(100, 120))
    model.eval()
    expected = _logits(model, ids)
    merged = AutoModelForCausalLM.from_pretrained(out)  # what RL's model.name_or_path loads
    torch.testing.assert_close(_logits(merged, ids), expected, atol=1e-5, rtol=1e-5)
    fresh, _ = tiny_model(seed=2)
    with_adapter = peft.PeftModel.from_pretrained(fresh, out / ADAPTER_DIRNAME).eval()
    torch.testing.assert_close(_logits(with_adapter, ids), expected, atol=1e-5, rtol=1e-5)
    untrained, _ = tiny_model(seed=2)
    assert not torch.allclose(_logits(untrained, ids), expected, atol=1e-4)  # the adapters did train


def test_lora_checkpoint_round_trip_keeps_only_adapters(tmp_path):
    model, tokenizer = tiny_model(seed=0)
    learner = Learner.from_config(model, tokenizer, load_config(None, [*LORA, "optim.lr=1e-2"]))
    batch = [_trajectory(i) for i in range(2)]
    learner.update(batch, [1.0, -1.0])
    saved = {n: p.detach().clone() for n, p in learner.module.named_parameters()}
    learner.save_checkpoint(tmp_path / "ckpt", client_state={"step": 1})
    learner.update(batch, [1.0, -1.0])
    assert learner.load_checkpoint(tmp_path / "ckpt")["step"] == 1
    for name, p in learner.module.named_parameters():
        assert torch.equal(p, saved[name]), name
    states = list((tmp_path / "ckpt").rglob("*model_states.pt"))
    (module_state,) = [torch.load(f, weights_only=False)["module"] for f in states]
    # the frozen base is not saved again (only the tied LM head is listed, as a shared parameter)
    assert any(".lora_" in k for k in module_state)
    assert not any(".base_layer." in k or "embed_tokens" in k or "norm" in k for k in module_state)


def test_bad_target_modules_give_one_line():
    model, tokenizer = tiny_model(seed=0)
    cfg = load_config(None, [*LORA, "model.lora.target_modules=[no_such_proj]"])
    with pytest.raises(ModelLoadError, match=r"model.lora.target_modules=\['no_such_proj'\] does not fit"):
        Learner.from_config(model, tokenizer, cfg)


@pytest.mark.slow  # ~15 s idle; about 70 s on 2 loaded cores (a 135M forward/backward, a 0.5 GB export)
def test_embedded_smollm2_one_lora_step_reloads(tmp_path):
    """One RL step with LoRA on the embedded SmolLM2-135M: only adapters move; the adapter reloads."""
    from stare_agent.models import load_policy

    try:
        model, tokenizer = load_policy()
    except ModelLoadError as exc:
        require("embedded", str(exc))
        raise
    learner = Learner.from_config(model, tokenizer, load_config(None, [*LORA, "optim.lr=1e-3"]))
    base0, adapter0 = _split(learner.module.named_parameters())
    batch = [_trajectory(i, prompt=6, response=10) for i in range(2)]
    assert learner.update(batch, [1.0, -1.0])["skipped"] == 0.0
    base1, adapter1 = _split(learner.module.named_parameters())
    assert all(torch.equal(p, base0[n]) for n, p in base1.items())
    assert any(not torch.equal(p, adapter0[n]) for n, p in adapter1.items())
    out = learner.export_hf(tmp_path / "hf")
    ids = list(batch[0].input_ids)
    learner.module.eval()
    expected = _logits(learner.module, ids)
    fresh, _ = load_policy()
    with_adapter = peft.PeftModel.from_pretrained(fresh, out / ADAPTER_DIRNAME).eval()
    torch.testing.assert_close(_logits(with_adapter, ids), expected, atol=1e-4, rtol=1e-4)


def _rl_config(run_dir, steps: int):
    return load_config(
        None,
        [
            *LORA,
            *PARITY_RUN,
            "logger.backends=[]",
            f"trainer.steps={steps}",
            "trainer.checkpoint_every=0",
            f"trainer.run_dir={run_dir}",
        ],
    )


@pytest.mark.slow  # 16 s: RL steps with LoRA and a merged export, on 2 loaded cores
def test_rl_trainer_with_lora_syncs_merged_weights_and_checkpoints_adapters(tmp_path):
    """The trainer's in-process engine samples through the adapters (no sync needed); an engine on
    its own plain copy of the base model (as an SGLang server holds) receives the merged weights."""
    from stare_agent.train.trainer import Trainer

    model, tokenizer = tiny_model(seed=0)
    trainer = Trainer(_rl_config(tmp_path / "shared", 1), model=model, tokenizer=tokenizer)
    assert trainer.engine.model is trainer.learner.module
    base0, adapter0 = _split(trainer.learner.module.named_parameters())
    summary = trainer.fit()
    assert summary["last"]["skipped"] == 0
    base1, adapter1 = _split(trainer.learner.module.named_parameters())
    assert all(torch.equal(p, base0[n]) for n, p in base1.items())
    assert any(not torch.equal(p, adapter0[n]) for n, p in adapter1.items())
    (checkpoint,) = (tmp_path / "shared" / "checkpoints").iterdir()
    assert (checkpoint / "hf" / ADAPTER_DIRNAME / "adapter_model.safetensors").is_file()

    model, tokenizer = tiny_model(seed=0)
    own = TransformersEngine(tiny_model(seed=0)[0], tokenizer)  # its own plain copy of the base model
    trainer = Trainer(_rl_config(tmp_path / "own", 1), model=model, tokenizer=tokenizer, engine=own)
    assert trainer.fit()["last"]["skipped"] == 0
    merged = trainer.learner.state_dict()
    for name, p in own.model.named_parameters():
        torch.testing.assert_close(p.detach(), merged[name], atol=0, rtol=0)
