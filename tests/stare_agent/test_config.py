"""Typed run config: paper defaults, YAML + dotted overrides, exact one-line errors, saved configs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stare_agent.algorithms.losses import policy_loss
from stare_agent.algorithms.stare import AdaptiveController, stare_weights
from stare_agent.config import (
    ConfigError,
    RunConfig,
    cpu_has_bf16,
    load_config,
    precision_line,
    resolve_precision,
)

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _controller(**fields: float) -> AdaptiveController:
    """A controller with the paper's schedule and ``fields`` changed."""
    return AdaptiveController(
        **{"W": 1.1, "M": 0.9, "H_tgt": 0.3, "alpha": 0.01, "W_max": 1.5, "M_min": 0.5, **fields}
    )


def test_loading_every_config_imports_no_torch():
    """The config validates itself with stare_agent.options, the torch-free floor under the algorithms:
    a launcher, a sweep tool or the slim install reads configs without loading torch."""
    script = (
        "import sys, pathlib\n"
        "from stare_agent.config import load_config\n"
        f"for path in sorted(pathlib.Path({str(CONFIGS)!r}).glob('*.yaml')):\n"
        "    load_config(path)\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'deepspeed') if m in sys.modules)\n"
        "print('loaded', heavy)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "loaded []", done.stdout


def test_defaults_are_the_papers():
    c = load_config()
    assert (c.optim.lr, c.data.prompts_per_step, c.data.samples_per_prompt) == (1e-6, 64, 8)
    assert (c.algorithm.eps_low, c.algorithm.eps_high, c.algorithm.clip_c) == (0.2, 0.28, 10.0)
    assert (c.algorithm.W, c.algorithm.M, c.algorithm.P, c.algorithm.H_tgt) == (1.1, 0.9, 0.1, 0.3)
    assert (c.algorithm.variant, c.algorithm.loss_agg, c.optim.grad_clip) == ("O1", "token-mean", 1.0)
    assert (c.algorithm.alpha, c.algorithm.W_max, c.algorithm.M_min, c.algorithm.adaptive) == (
        0.01,
        1.5,
        0.5,
        False,
    )
    assert c.data.max_sampling_batches == 10 and c.data.dynamic_sampling


def test_file_then_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "algorithm:\n  W: 1.3\n  variant: C2\ntrainer:\n  steps: 5\nsandbox:\n  limits:\n    memory_mb: 512\n"
    )
    c = load_config(path, ["algorithm.W=1.2", "sandbox.limits.timeout_s=3"])
    assert (c.algorithm.W, c.algorithm.variant, c.trainer.steps) == (1.2, "C2", 5)
    assert (c.sandbox.limits.memory_mb, c.sandbox.limits.timeout_s) == (512, 3.0)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["algorithm.Wx=1.2"],
            "unknown config key 'algorithm.Wx' in the overrides: valid keys of algorithm are name, variant, scope, "
            "P, W, M, H_tgt, gate, adaptive, alpha, W_max, M_min, eps_low, eps_high, "
            "clip_c, loss_agg, entropy_coef, kl_cov_k, kl_cov_coef, clip_cov_r, clip_cov_lb, clip_cov_ub, "
            "forking_rho, steer_w_min, steer_w_max, stapo_tau_p, stapo_q, entroadv_alpha, entroadv_kappa, "
            "adaptive_entropy_target, adaptive_entropy_delta, adaptive_entropy_init, adaptive_entropy_max, "
            "first_order_lambda_max, void_turn_filter, overlong_filter, rollout_correction, ppo_mini_batch_size, "
            "ppo_epochs, selection",
        ),
        (
            ["trainr.steps=3"],
            "unknown config key 'trainr' in the overrides: valid keys of the top level are model, sandbox, env, "
            "algorithm, data, optim, deepspeed, trainer, sft, logger",
        ),
        (
            ["trainer.steps=many"],
            "config key 'trainer.steps' in the overrides: Value 'many' of type 'str' could not be converted to "
            "Integer; expected int",
        ),
        (["algorithm.W=0.5"], "algorithm: STARE W=0.5 must be >= 1 (it amplifies L+): e.g. W=1.1"),
        (
            ["algorithm.name=ppo"],
            "algorithm.name='ppo' is not valid: use one of grpo, grpo_ds, stare, kl_cov, clip_cov, entropy_bonus, "
            "forking_tokens, steer, stapo, entroadv, adaptive_entropy, first_order",
        ),
        (["deepspeed.zero_stage=4"], "deepspeed.zero_stage=4 is not valid: use one of 0, 1, 2, 3"),
        (
            ["data.samples_per_prompt=1"],
            "data.samples_per_prompt=1: GRPO needs a group of >= 2 samples per prompt (the paper: 8)",
        ),
        (["algorithm.W"], "override 'algorithm.W' is not key=value: write e.g. algorithm.W=1.2"),
    ],
)
def test_bad_overrides_give_one_line(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert str(info.value) == message
    assert "\n" not in str(info.value)


def test_unknown_key_in_file_and_missing_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("optim:\n  learning_rate: 1e-5\n")
    with pytest.raises(
        ConfigError, match=r"unknown config key 'optim.learning_rate' in .*bad.yaml: valid keys"
    ):
        load_config(path)
    with pytest.raises(ConfigError, match="config file .*nope.yaml not found: pass an existing YAML file"):
        load_config(tmp_path / "nope.yaml")


def test_save_round_trip(tmp_path):
    c = load_config(None, ["algorithm.variant=C2", "env.system_prompt=null", "optim.betas=[0.8,0.9]"])
    path = c.save(tmp_path / "run")
    assert path == tmp_path / "run" / "config.yaml"
    again = load_config(path)
    assert again == c and isinstance(again, RunConfig)


def test_precision_resolution_never_runs_emulated_bf16():
    # (requested, device, native bf16 on the CPU) -> what runs
    table = {
        ("auto", "cuda", False): "bf16",
        ("bf16", "cuda", False): "bf16",
        ("bf16-autocast", "cuda", False): "bf16-autocast",
        ("fp32", "cuda", True): "fp32",
        ("auto", "cpu", True): "fp32",
        ("auto", "cpu", False): "fp32",
        ("bf16-autocast", "cpu", True): "bf16-autocast",
        ("bf16-autocast", "cpu", False): "fp32",  # emulated bf16: 15x slower than fp32
        ("fp32", "cpu", True): "fp32",
    }
    for (requested, device, native), expected in table.items():
        assert resolve_precision(requested, device, native_bf16=native) == expected, (
            requested,
            device,
            native,
        )
    assert precision_line("bf16-autocast", "fp32", "cpu") == (
        "precision: fp32 (deepspeed.precision=bf16-autocast; this CPU has no native bf16 (AVX-512 BF16 or AMX), "
        "where bf16 runs emulated, about 15x slower)"
    )


def test_a_onednn_isa_cap_below_bf16_counts_as_a_cpu_without_it(monkeypatch):
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert not cpu_has_bf16()
    assert resolve_precision("bf16-autocast", "cpu") == "fp32"
    with pytest.raises(
        ConfigError, match="deepspeed.precision=bf16 needs a GPU: use deepspeed.precision=bf16-autocast, fp32"
    ):
        resolve_precision("bf16", "cpu")


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_shipped_configs_load(name):
    c = load_config(CONFIGS / name)
    if name.startswith(("stare_", "grpo_ds_", "sft_")):
        assert "qwen2.5" in c.model.name_or_path.lower()
        assert (c.deepspeed.zero_stage, c.deepspeed.precision) == (3, "bf16")
        assert (c.env.max_turns, c.env.max_response_tokens) == (16, 16384)
        assert (c.data.prompts_per_step, c.data.samples_per_prompt) == (64, 8)
    if name.startswith("stare_c2"):
        assert (c.algorithm.name, c.algorithm.variant) == ("stare", "C2")
    if name.startswith("grpo_ds"):
        assert c.algorithm.name == "grpo_ds"
    if name == "quickstart.yaml":
        assert c.model.name_or_path == "embedded:smollm2-135m-instruct"
        # runs on a CPU: fp32, or bf16 autocast (the quickstart falls back to fp32 without native bf16)
        assert c.deepspeed.precision in ("auto", "fp32", "bf16-autocast") and c.data.prompts_per_step <= 8


def _tensors():
    return (torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2))


@pytest.mark.parametrize(
    "overrides, direct",
    [
        (["algorithm.eps_low=1.5"], lambda: policy_loss(*_tensors(), eps_low=1.5)),
        (["algorithm.clip_c=1"], lambda: policy_loss(*_tensors(), clip_c=1.0)),
        (["algorithm.loss_agg=sum"], lambda: policy_loss(*_tensors(), agg="sum")),
        (["algorithm.variant=O3"], lambda: stare_weights(*_tensors()[1:], gate_on=True, variant="O3")),
        (["algorithm.scope=batch"], lambda: stare_weights(*_tensors()[1:], gate_on=True, scope="batch")),
        (["algorithm.adaptive=true", "algorithm.W_max=1.0"], lambda: _controller(W=1.1, W_max=1.0)),
        (["algorithm.adaptive=true", "algorithm.M_min=0.95"], lambda: _controller(M=0.9, M_min=0.95)),
    ],
)
def test_algorithm_rules_are_stated_once(overrides, direct):
    """The config refuses exactly what the algorithm modules refuse, with their words."""
    with pytest.raises(ValueError) as rule:
        direct()
    with pytest.raises(ConfigError) as configured:
        load_config(None, overrides)
    assert str(configured.value) == f"algorithm: {rule.value}"


def test_sandbox_preload_is_a_list_of_module_names() -> None:
    assert load_config(None).sandbox.limits.preload == []
    assert load_config(None, ["sandbox.limits.preload=[numpy,sympy]"]).sandbox.limits.preload == [
        "numpy",
        "sympy",
    ]
    assert load_config(None, ["sandbox.limits.preload=[scipy.special]"]).sandbox.limits.preload == [
        "scipy.special"
    ]
    for bad in ("sandbox.limits.preload=['os; import x']", "sandbox.limits.preload=['']"):
        with pytest.raises(ConfigError, match=r"^sandbox.preload must be a list of module names"):
            load_config(None, [bad])


def test_the_rl_demo_is_the_quickstart_with_room_for_rl():
    """configs/rl_demo.yaml differs from the quickstart's config in exactly the fields that give RL
    room (a lighter cold start, 8 samples a prompt, 16 steps at lr 1e-5, 200 held-out problems) and
    draw its learning curve (50 of them every 4 steps)."""
    import dataclasses

    def flat(obj, prefix=""):
        out = {}
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            key = f"{prefix}{f.name}"
            out.update(flat(value, f"{key}.") if dataclasses.is_dataclass(value) else {key: value})
        return out

    quick, demo = flat(load_config(CONFIGS / "quickstart.yaml")), flat(load_config(CONFIGS / "rl_demo.yaml"))
    assert {k: (quick[k], demo[k]) for k in quick if quick[k] != demo[k]} == {
        "data.eval_limit": (40, 200),
        "data.samples_per_prompt": (4, 8),
        "data.prompts_per_draw": (8, 5),
        "optim.lr": (1e-6, 1e-5),
        "trainer.steps": (2, 16),
        "trainer.checkpoint_every": (2, 16),
        "trainer.eval_every": (0, 4),
        "trainer.eval_every_limit": (None, 50),
        "trainer.run_dir": ("runs/quickstart", "runs/rl_demo"),
        "sft.procedural_rows": (112, 80),
    }


def test_the_periodic_evaluation_takes_the_first_eval_every_limit_problems():
    """trainer.eval_every_limit lowers data.eval_limit for the evaluations every eval_every steps only,
    never raises it; a limit below 1 is refused in one line."""
    from stare_agent.resources import periodic_eval_config

    cfg = load_config(CONFIGS / "rl_demo.yaml")
    assert (cfg.data.eval_limit, periodic_eval_config(cfg).data.eval_limit) == (200, 50)
    cfg = load_config(CONFIGS / "rl_demo.yaml", ["trainer.eval_every_limit=500"])
    assert periodic_eval_config(cfg).data.eval_limit == 200
    cfg = load_config(CONFIGS / "rl_demo.yaml", ["data.eval_limit=null"])
    assert periodic_eval_config(cfg).data.eval_limit == 50
    with pytest.raises(ConfigError, match=r"trainer.eval_every_limit >= 1 or null; got 16, 4, 0"):
        load_config(CONFIGS / "rl_demo.yaml", ["trainer.eval_every_limit=0"])
