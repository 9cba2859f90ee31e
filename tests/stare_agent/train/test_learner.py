"""The DeepSpeed learner on CPU (real DeepSpeed, gloo, the tiny Llama with the real SmolLM2 tokenizer).

The learner under test uses AdamW with betas (0, 0) and eps = lr = 1e3, so one step moves every
parameter by ``-lr * g / (|g| + eps) = -g / (1 + |g| / 1e3)``, i.e. by minus its gradient to within
0.1% for the gradients here: parameter deltas then show the gradient itself, scale included.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from stare_agent.algorithms.logprobs import causal_lm_logprobs_and_entropy, shared_prompt_logprobs_and_entropy
from stare_agent.algorithms.losses import policy_loss
from stare_agent.config import OptimConfig, load_config
from stare_agent.methods import make_method
from stare_agent.models import tiny_model
from stare_agent.train.batch import collate
from stare_agent.train.learner import Learner, lr_scheduler
from stare_envs.trajectory import Trajectory, TrajectoryBuilder

LINEAR_ADAM = [
    "optim.lr=1000.0",
    "optim.eps=1000.0",
    "optim.betas=[0.0,0.0]",
    "optim.weight_decay=0.0",
    "optim.grad_clip=0.0",
    "deepspeed.micro_batch_tokens=100000",
    "deepspeed.precision=fp32",
]


def _trajectory(
    seed: int, prompt: int, first: int, tool: int, last: int, trailing_tool: int = 0
) -> Trajectory:
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(100, 5000, (n,), generator=g).tolist()  # noqa: E731
    b = TrajectoryBuilder(ids(prompt))
    b.append(ids(first), 1, [-1.0] * first)
    b.append(ids(tool), 0)
    b.append(ids(last), 1, [-1.0] * last)
    if trailing_tool:
        b.append(ids(trailing_tool), 0)
    return b.build(reward=1.0)


@pytest.fixture(scope="module")
def batch() -> list[Trajectory]:
    shapes = [(4, 6, 3, 2), (7, 3, 5, 4), (3, 9, 2, 1), (6, 2, 4, 6), (5, 5, 1, 3)]
    return [_trajectory(i, *s) for i, s in enumerate(shapes)]


@pytest.fixture(scope="module")
def learner() -> Learner:
    model, tokenizer = tiny_model(seed=0)
    return Learner.from_config(model, tokenizer, load_config(None, LINEAR_ADAM))


def _params(learner: Learner) -> dict[str, torch.Tensor]:
    return {name: p.clone() for name, p in learner.named_weights()}  # whole tensors under ZeRO-3 too


def _restore(learner: Learner, params: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, p in learner.module.named_parameters():
            p.copy_(params[name])


def _reference_gradient(batch, advantages, weights) -> dict[str, torch.Tensor]:
    """The gradient of the token-mean loss of the WHOLE batch, by plain autograd on a fresh copy."""
    model, tokenizer = tiny_model(seed=0)
    model.train()
    full = collate(batch, tokenizer.pad_token_id, advantages=advantages)
    logp, _ = causal_lm_logprobs_and_entropy(model, full["input_ids"], full["attention_mask"])
    loss, _ = policy_loss(logp, logp.detach(), full["advantages"], full["response_mask"], weights)
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def _reference_entropy(batch) -> float:
    """The gate's Hbar of the WHOLE batch: the mean entropy of its mask-1 tokens, by a plain forward."""
    model, tokenizer = tiny_model(seed=0)
    full = collate(batch, tokenizer.pad_token_id)
    with torch.no_grad():
        _, entropy = causal_lm_logprobs_and_entropy(model, full["input_ids"], full["attention_mask"])
    return float(entropy[full["response_mask"].bool()].double().mean())


def test_split_update_equals_one_big_batch(learner, batch):
    advantages = [1.0, -0.5, 0.25, -1.5, 0.75]
    L = max(t.num_tokens for t in batch)
    weights = 0.9 + 0.2 * torch.rand(len(batch), L - 1, generator=torch.Generator().manual_seed(3))
    reference = _reference_gradient(batch, advantages, weights)
    start = _params(learner)

    learner.ds_config.micro_batch_tokens = 100_000
    assert len(learner.micro_batches(batch)) == 1
    whole = learner.update(batch, advantages, weights)
    delta_whole = {k: v - start[k] for k, v in _params(learner).items()}
    _restore(learner, start)

    learner.ds_config.micro_batch_tokens = 40  # padded budget: several micro-batches
    split = learner.micro_batches(batch)
    assert len(split) >= 3
    parts = learner.update(batch, advantages, weights)
    delta_split = {k: v - start[k] for k, v in _params(learner).items()}
    _restore(learner, start)
    learner.ds_config.micro_batch_tokens = 100_000

    assert whole["skipped"] == parts["skipped"] == 0.0
    assert parts["micro_batches"] == len(split)
    assert whole["tokens"] == parts["tokens"] == sum(t.num_sampled_tokens for t in batch)
    assert parts["loss"] == pytest.approx(whole["loss"], abs=1e-6)
    # the pre-update entropy from the update's own forward: GRPO-ds logs it without a log-prob pass
    assert whole["entropy"] == pytest.approx(_reference_entropy(batch), rel=1e-5)
    assert parts["entropy"] == pytest.approx(whole["entropy"], rel=1e-6)
    assert parts["grad_norm"] == pytest.approx(whole["grad_norm"], rel=1e-4)
    changed = sum(int((d != 0).sum()) for d in delta_whole.values())
    assert changed > 0.5 * sum(d.numel() for d in delta_whole.values())  # the update moved the weights
    for name, g in reference.items():
        scale = float(g.abs().max()) + 1e-12
        # delta = -g / (1 + |g| / 1e3): the same gradient, whole or split, equal to plain autograd's.
        torch.testing.assert_close(
            delta_split[name], delta_whole[name], atol=1e-5 * scale + 2.4e-7, rtol=0
        )  # + fp32 ulp of weights ~1
        torch.testing.assert_close(-delta_whole[name], g, atol=2e-3 * scale + 2.4e-7, rtol=2e-3)


def test_nan_or_inf_step_is_skipped_and_params_unchanged(learner, batch, caplog):
    start = _params(learner)
    L = max(t.num_tokens for t in batch)
    weights = torch.ones(len(batch), L - 1)
    weights[1, 8] = float("nan")  # a mask-1 position of trajectory 1 (prompt 7 tokens, then its turn)
    learner.ds_config.micro_batch_tokens = 40
    skipped_before = learner.steps_skipped
    with caplog.at_level("WARNING"):
        metrics = learner.update(batch, [1.0, -0.5, 0.25, -1.5, 0.75], weights)
    assert metrics["skipped"] == 1.0
    assert learner.steps_skipped == skipped_before + 1
    assert "skipped a step" in caplog.text and "lower optim.lr" in caplog.text
    for name, p in _params(learner).items():
        assert torch.equal(p, start[name]), name
    inf = learner.update(batch, [float("inf"), -0.5, 0.25, -1.5, 0.75])
    assert inf["skipped"] == 1.0
    for name, p in _params(learner).items():
        assert torch.equal(p, start[name]), name
    # gradients were dropped, not carried into the next step: a clean step equals a fresh one
    learner.ds_config.micro_batch_tokens = 100_000
    learner.update(batch, [1.0, -0.5, 0.25, -1.5, 0.75])
    after_clean = _params(learner)
    _restore(learner, start)
    learner.update(batch, [1.0, -0.5, 0.25, -1.5, 0.75])
    for name, p in _params(learner).items():
        torch.testing.assert_close(p, after_clean[name], atol=1e-7, rtol=0)
    _restore(learner, start)


def test_sft_loss_ignores_mask0_tokens(learner):
    a = _trajectory(11, 4, 6, 3, 5, trailing_tool=4)
    ids = list(a.response_ids)
    ids[-1] = 7  # the last token is trailing tool output: mask 0, and nothing comes after it
    ids[6] = 9  # inside the tool segment: mask 0, but it is context for the later model tokens
    b_last = Trajectory(
        a.prompt_ids, ids[:6] + list(a.response_ids[6:-1]) + [7], a.loss_mask, a.logprobs, a.turn_spans
    )
    b_mid = Trajectory(
        a.prompt_ids, ids[:7] + list(a.response_ids[7:]), a.loss_mask, a.logprobs, a.turn_spans
    )
    assert a.loss_mask[-1] == 0 and a.loss_mask[6] == 0
    base = learner.sft_loss([a])
    assert learner.sft_loss([b_last]) == base  # its own prediction is masked
    assert learner.sft_loss([b_mid]) != base  # but as context it still matters
    # by hand: the mean of -log p over the 11 mask-1 tokens, from the scored positions
    logp, _ = learner.compute_logprobs_and_entropy([a])
    mask = torch.tensor([0] * (len(a.prompt_ids) - 1) + a.loss_mask, dtype=torch.float32)
    assert base == pytest.approx(float(-(logp[0] * mask).sum() / 11), rel=1e-6)
    start = _params(learner)
    step = learner.sft_step([a])
    assert step["loss"] == pytest.approx(base, rel=1e-5) and step["tokens"] == 11
    _restore(learner, start)


@pytest.mark.parametrize("response_only", [True, False])
def test_logprobs_match_plain_forward_and_ignore_padding(learner, batch, response_only):
    learner.ds_config.micro_batch_tokens = 40
    learner.ds_config.score_response_only = response_only
    try:
        logp, entropy = learner.compute_logprobs_and_entropy(batch)
    finally:
        learner.ds_config.micro_batch_tokens = 100_000
        learner.ds_config.score_response_only = True
    model = copy.deepcopy(learner.module).eval()
    for i, t in enumerate(batch):
        ids = torch.tensor([t.input_ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, :-1].float()
        expected = torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0]
        p = torch.softmax(logits, -1)
        expected_entropy = -(p * torch.log(p)).sum(-1)
        n = t.num_tokens - 1
        # scored: every position, or (the default) only the mask-1 ones; 0 elsewhere
        scored = torch.ones(n, dtype=torch.bool)
        if response_only:
            scored = torch.tensor([0] * (len(t.prompt_ids) - 1) + list(t.loss_mask), dtype=torch.bool)
            assert 0 < int(scored.sum()) < n
        torch.testing.assert_close(logp[i, :n][scored], expected[scored], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(entropy[i, :n][scored], expected_entropy[scored], atol=1e-4, rtol=1e-4)
        assert torch.all(logp[i, :n][~scored] == 0) and torch.all(entropy[i, :n][~scored] == 0)
        assert torch.all(logp[i, n:] == 0) and torch.all(entropy[i, n:] == 0)


def _grouped(batch: list[Trajectory]) -> list[Trajectory]:
    """The batch plus two GRPO-like groups: three samples of one prompt, two of another."""
    out = list(batch)
    for seed, prompt, shapes in ((20, 6, [(4, 3, 2), (2, 0, 0), (5, 2, 3)]), (30, 4, [(3, 1, 6), (6, 0, 0)])):
        for k, (first, tool, last) in enumerate(shapes):
            t = _trajectory(seed + k, prompt, first, tool, last)
            out.append(Trajectory(_trajectory(seed, prompt, 1, 0, 0).prompt_ids, *astuple_rest(t)))
    return out


def astuple_rest(t: Trajectory) -> tuple:
    return t.response_ids, t.loss_mask, t.logprobs, t.turn_spans


@pytest.mark.parametrize("step", ["update", "sft_step", "logprobs"])
def test_fast_learner_path_takes_the_same_step_as_the_old_one(learner, batch, step, monkeypatch):
    """deepspeed.score_response_only, bucket_by_length and share_prompts (the defaults) change the work,
    not the results: the parameters after one step (and the scores) equal those of the old path (whole
    sequences scored, micro-batches in batch order, every prompt run per trajectory) to float rounding,
    on a batch split into several micro-batches both ways, with two groups that share a prompt."""
    batch = _grouped(batch)
    advantages = [1.0, -0.5, 0.25, -1.5, 0.75, 1.0, -1.0, 0.5, -0.5, 0.5]
    L = max(t.num_tokens for t in batch)
    weights = 0.9 + 0.2 * torch.rand(len(batch), L - 1, generator=torch.Generator().manual_seed(5))
    start = _params(learner)
    ds = learner.ds_config
    ds.micro_batch_tokens = 40

    mask = collate(batch, learner.pad_id)["response_mask"].bool()
    shared_rows: list[int] = []  # rows of the micro-batches that ran their prompt once

    def spy(model, input_ids, *args, **kwargs):
        shared_rows.append(input_ids.shape[0])
        return shared_prompt_logprobs_and_entropy(model, input_ids, *args, **kwargs)

    monkeypatch.setattr("stare_agent.algorithms.logprobs.shared_prompt_logprobs_and_entropy", spy)

    def one_step(fast: bool) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
        ds.score_response_only = ds.bucket_by_length = ds.share_prompts = fast
        try:
            if step == "logprobs":
                logp, entropy = learner.compute_logprobs_and_entropy(batch)
                return {"skipped": 0.0, "tokens": 0.0, "loss": 1.0, "grad_norm": 1.0}, {
                    "logp": logp[mask],
                    "entropy": entropy[mask],
                }
            if step == "update":
                metrics = learner.update(batch, advantages, weights)
            else:
                metrics = learner.sft_step(batch)
            return metrics, {k: v - start[k] for k, v in _params(learner).items()}
        finally:
            _restore(learner, start)
            ds.score_response_only = ds.bucket_by_length = ds.share_prompts = True

    try:
        old, delta_old = one_step(False)
        split = learner.compute_batches(batch)
        assert split != learner.micro_batches(batch)  # the split differs
        assert sorted(i for m in split for i in m) == list(range(len(batch)))
        assert [7, 5] in split and [8, 9] in split  # a group's samples run their prompt once, longest first
        assert not shared_rows
        new, delta_new = one_step(True)
        assert sorted(shared_rows) == [2, 2]
    finally:
        ds.micro_batch_tokens = 100_000
    assert old["skipped"] == new["skipped"] == 0.0 and old["tokens"] == new["tokens"]
    assert new["loss"] == pytest.approx(old["loss"], rel=1e-5)
    assert new["grad_norm"] == pytest.approx(old["grad_norm"], rel=1e-4)
    assert sum(int((d != 0).sum()) for d in delta_old.values()) > 0  # the step moved the weights
    for name, d in delta_old.items():
        scale = float(d.abs().max()) + 1e-12
        torch.testing.assert_close(delta_new[name], d, atol=1e-5 * scale + 2.4e-7, rtol=0, msg=name)


def test_a_group_cut_to_spare_padding_takes_the_same_step(learner, monkeypatch):
    """A GRPO group whose one long sample would pad the others runs it in a micro-batch of its own
    (bucket_by_length, MICRO_BATCH_OVERHEAD); the update equals the one with the group whole."""
    import stare_agent.train.batch as batch_module

    prompt = _trajectory(60, 5, 1, 0, 0).prompt_ids
    shapes = [(30, 4, 20), (2, 0, 1), (3, 0, 0), (2, 1, 1)]
    group = [Trajectory(prompt, *astuple_rest(_trajectory(61 + k, 5, *s))) for k, s in enumerate(shapes)]
    advantages = [1.0, -0.5, 0.25, -0.75]
    start = _params(learner)

    def one_step(overhead: int) -> tuple[list[list[int]], dict[str, float], dict[str, torch.Tensor]]:
        monkeypatch.setattr(batch_module, "MICRO_BATCH_OVERHEAD", overhead)
        try:
            split = learner.compute_batches(group)
            metrics = learner.update(group, advantages)
            return split, metrics, {k: v - start[k] for k, v in _params(learner).items()}
        finally:
            _restore(learner, start)

    default = batch_module.MICRO_BATCH_OVERHEAD
    whole_split, whole, delta_whole = one_step(10_000)  # a micro-batch costs more than any padding
    cut_split, cut, delta_cut = one_step(default)
    assert whole_split == [[0, 3, 1, 2]]  # longest first, ties in batch order
    # 5 + 4 x 54 + 64 = 285 padded-token units together; 59 + 64 + (5 + 3 x 4 + 64) = 204 cut
    assert cut_split == [[0], [3, 1, 2]]  # the 59-token sample alone; the others are 8-9 tokens
    assert cut["tokens"] == whole["tokens"] and cut["loss"] == pytest.approx(whole["loss"], rel=1e-5)
    for name, d in delta_whole.items():
        scale = float(d.abs().max()) + 1e-12
        torch.testing.assert_close(delta_cut[name], d, atol=1e-5 * scale + 2.4e-7, rtol=0, msg=name)


def test_sft_traces_of_different_problems_run_their_common_system_prompt_once(learner, monkeypatch):
    """SFT traces (and other prompts) share the chat template's system prompt: with share_prompts a
    micro-batch runs that common prefix once, not only a whole prompt its rows share, and the step
    equals the one that runs every row whole, to float rounding."""
    g = torch.Generator().manual_seed(7)
    system = torch.randint(100, 5000, (24,), generator=g).tolist()
    batch = [
        Trajectory(system + t.prompt_ids, *astuple_rest(t))
        for t in (_trajectory(40 + i, 3 + i, 4, 2, 3) for i in range(4))
    ]
    assert len({tuple(t.prompt_ids) for t in batch}) == 4  # four problems
    prefixes: list[int] = []

    def spy(model, input_ids, attention_mask, prompt_length, *args, **kwargs):
        prefixes.append(prompt_length)
        return shared_prompt_logprobs_and_entropy(
            model, input_ids, attention_mask, prompt_length, *args, **kwargs
        )

    monkeypatch.setattr("stare_agent.algorithms.logprobs.shared_prompt_logprobs_and_entropy", spy)
    start = _params(learner)
    ds = learner.ds_config

    def one_step(share: bool) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
        ds.share_prompts = share
        try:
            metrics = learner.sft_step(batch)
            return metrics, {k: v - start[k] for k, v in _params(learner).items()}
        finally:
            _restore(learner, start)
            ds.share_prompts = True

    old, delta_old = one_step(False)
    assert prefixes == []
    new, delta_new = one_step(True)
    assert prefixes == [24]  # the system prompt, once for the four rows
    assert new["loss"] == pytest.approx(old["loss"], rel=1e-5)
    assert sum(int((d != 0).sum()) for d in delta_old.values()) > 0
    for name, d in delta_old.items():
        scale = float(d.abs().max()) + 1e-12
        torch.testing.assert_close(delta_new[name], d, atol=1e-5 * scale + 2.4e-7, rtol=0, msg=name)


def test_checkpoint_round_trip(learner, batch, tmp_path):
    start = _params(learner)
    learner.update(batch, [1.0, -1.0, 0.5, -0.5, 0.25])
    saved = _params(learner)
    applied = learner.steps_applied
    learner.save_checkpoint(tmp_path / "ckpt", client_state={"step": 7})
    learner.update(batch, [1.0, -1.0, 0.5, -0.5, 0.25])
    assert any(not torch.equal(p, saved[n]) for n, p in _params(learner).items())
    client = learner.load_checkpoint(tmp_path / "ckpt")
    assert client["step"] == 7 and learner.steps_applied == applied
    for name, p in _params(learner).items():
        assert torch.equal(p, saved[name]), name
    with pytest.raises(FileNotFoundError, match="pass a directory written by Learner.save_checkpoint"):
        learner.load_checkpoint(tmp_path / "nothing")
    _restore(learner, start)


def test_export_hf_loads_with_from_pretrained(learner, tmp_path):
    out = learner.export_hf(tmp_path / "hf")
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.chat_template == learner.tokenizer.chat_template
    ours = learner.state_dict()
    for name, tensor in reloaded.state_dict().items():
        assert torch.equal(tensor, ours[name]), name
    names = dict(learner.named_weights())
    assert set(names) == {n for n, _ in learner.module.named_parameters()}


def _lrs(
    schedule: str, steps: int, *, warmup: int = 2, total: int = 6, min_ratio: float = 0.1
) -> list[float]:
    """The multipliers of optimizer steps 0 .. steps-1 of ``lr_scheduler`` (lr 1, so lr == multiplier)."""
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=1.0)
    optim = OptimConfig(lr=1.0, warmup_steps=warmup, schedule=schedule, min_lr_ratio=min_ratio)
    scheduler = lr_scheduler(opt, optim, total)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    return out


def test_lr_schedule_from_transformers_by_hand():
    """W = 2 warmup steps, T = 6, min_lr_ratio r = 0.1. After warmup all three give the values of the
    former hand-written schedule (1; 1 - 0.9 * (s - 2) / 4; 0.1 + 0.45 * (1 + cos(pi * (s - 2) / 4)));
    transformers' warmup is s / W (from 0) where the former one was (s + 1) / W."""
    assert _lrs("constant", 4) == [0.0, 0.5, 1.0, 1.0]
    assert _lrs("linear", 10) == pytest.approx([0.0, 0.5, 1.0, 0.775, 0.55, 0.325, 0.1, 0.1, 0.1, 0.1])
    c = math.cos(math.pi / 4)
    assert _lrs("cosine", 7) == pytest.approx(
        [0.0, 0.5, 1.0, 0.1 + 0.45 * (1 + c), 0.55, 0.1 + 0.45 * (1 - c), 0.1]
    )
    assert _lrs("linear", 3, min_ratio=1.0) == [0.0, 0.5, 1.0]  # no decay: constant after warmup
    assert _lrs("linear", 4, warmup=0, total=2, min_ratio=0.0) == pytest.approx([1.0, 0.5, 0.0, 0.0])


def test_learner_steps_the_transformers_schedule(batch):
    model, tokenizer = tiny_model(seed=0)
    overrides = [*LINEAR_ADAM, "optim.warmup_steps=2", "optim.schedule=linear", "trainer.steps=4"]
    learner = Learner.from_config(model, tokenizer, load_config(None, overrides))
    lrs = [learner.sft_step(batch[:2])["lr"] for _ in range(3)]
    # the step's metric is the lr after its scheduler step: 1e3 * [1/2, 1, 1 - (3 - 2) / 2]
    assert lrs == pytest.approx([500.0, 1000.0, 500.0])


# ------------------------------------------------------------------ two ranks (gloo, torchrun)


def _two_rank_worker(out_dir: str, zero_stage: int) -> None:
    """Run by each torchrun rank: rank 0 gets trajectories 0-2, rank 1 gets 3-4 (uneven micro-batch counts)."""
    import torch.distributed as dist

    model, tokenizer = tiny_model(seed=0)
    overrides = [*LINEAR_ADAM, f"deepspeed.zero_stage={zero_stage}", "deepspeed.micro_batch_tokens=40"]
    learner = Learner.from_config(model, tokenizer, load_config(None, overrides))
    shapes = [(4, 6, 3, 2), (7, 3, 5, 4), (3, 9, 2, 1), (6, 2, 4, 6), (5, 5, 1, 3)]
    everything = [_trajectory(i, *s) for i, s in enumerate(shapes)]
    advantages = [1.0, -0.5, 0.25, -1.5, 0.75]
    mine = slice(0, 3) if dist.get_rank() == 0 else slice(3, 5)
    start = _params(learner)
    metrics = learner.update(everything[mine], advantages[mine])
    after = _params(learner)
    L = max(t.num_tokens for t in everything[mine])
    weights = torch.ones(len(everything[mine]), L - 1)
    if dist.get_rank() == 1:
        weights[0, 5] = float("nan")  # a mask-1 column of trajectory 3, on one rank only: every rank skips
    skipped = learner.update(everything[mine], advantages[mine], weights)
    unchanged = all(torch.equal(p, after[n]) for n, p in _params(learner).items())
    torch.save(
        {
            "delta": {k: v - start[k] for k, v in after.items()},
            "metrics": metrics,
            "skipped": skipped["skipped"],
            "unchanged": unchanged,
            "micro_batches": len(learner.micro_batches(everything[mine])),
        },
        f"{out_dir}/rank{dist.get_rank()}.pt",
    )


@pytest.mark.slow  # 26 s each: two torch.distributed ranks, on 2 loaded cores
@pytest.mark.parametrize("zero_stage", [2, 3])
def test_two_ranks_take_the_whole_batch_gradient(zero_stage, batch, tmp_path):
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1"]
    command += [f"--master_port={port}"]
    command += [__file__, str(tmp_path), str(zero_stage)]
    done = subprocess.run(command, env=env, cwd=repo, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert ranks[0]["micro_batches"] != ranks[1]["micro_batches"]  # uneven: zero-weight repeats pair them up
    reference = _reference_gradient(batch, [1.0, -0.5, 0.25, -1.5, 0.75], None)
    for name, g in reference.items():
        scale = float(g.abs().max()) + 1e-12
        torch.testing.assert_close(ranks[0]["delta"][name], ranks[1]["delta"][name], atol=0, rtol=0)
        torch.testing.assert_close(-ranks[0]["delta"][name], g, atol=2e-3 * scale + 2.4e-7, rtol=2e-3)
    assert ranks[0]["metrics"]["tokens"] == sum(t.num_sampled_tokens for t in batch)
    # entropy and clip fractions are token means over both ranks' tokens: the same on each rank
    assert ranks[0]["metrics"] == ranks[1]["metrics"]
    assert ranks[0]["metrics"]["entropy"] == pytest.approx(_reference_entropy(batch), rel=1e-5)
    assert [r["skipped"] for r in ranks] == [1.0, 1.0] and all(r["unchanged"] for r in ranks)


@pytest.mark.gpu
def test_bf16_zero3_on_gpu(batch, tmp_path):
    """On a GPU: bf16 weights, ZeRO-3, one update moves the weights and the export loads."""
    model, tokenizer = tiny_model(seed=0)
    overrides = ["deepspeed.zero_stage=3", "deepspeed.precision=bf16", "optim.lr=1e-3"]
    learner = Learner.from_config(model, tokenizer, load_config(None, overrides))
    start = _params(learner)
    assert all(t.dtype == torch.bfloat16 for t in start.values())
    metrics = learner.update(batch, [1.0, -0.5, 0.25, -1.5, 0.75])
    assert metrics["skipped"] == 0.0 and math.isfinite(metrics["grad_norm"])
    assert any(not torch.equal(p, start[n]) for n, p in _params(learner).items())
    reloaded = AutoModelForCausalLM.from_pretrained(learner.export_hf(tmp_path / "hf"))
    assert reloaded.model.embed_tokens.weight.shape == start["model.embed_tokens.weight"].shape


if __name__ == "__main__":  # torchrun entry point of test_two_ranks_take_the_whole_batch_gradient
    import sys

    _two_rank_worker(sys.argv[1], int(sys.argv[2]))


def test_bf16_autocast_on_cpu_keeps_fp32_weights_and_tracks_fp32_scores(batch, monkeypatch, capsys):
    """`deepspeed.precision=bf16-autocast`: fp32 master weights, bf16 forward passes (on a CPU with
    native bf16; taken as one here, so that the test runs the bf16 path on any CPU)."""
    import stare_agent.config

    monkeypatch.setattr(stare_agent.config, "cpu_has_bf16", lambda: True)
    model, tokenizer = tiny_model(seed=0)
    fp32_logp = causal_lm_logprobs_and_entropy(model, *_ids_and_mask(batch, tokenizer))[0]
    learner = Learner.from_config(
        model, tokenizer, load_config(None, [*LINEAR_ADAM, "deepspeed.precision=bf16-autocast"])
    )
    assert learner.precision == "bf16-autocast"
    assert "precision: bf16-autocast (deepspeed.precision=bf16-autocast; this CPU computes bf16 natively" in (
        capsys.readouterr().out
    )
    logp, _ = learner.compute_logprobs_and_entropy(batch)
    mask = collate(batch, learner.pad_id)["response_mask"].bool()  # the scored positions
    # bf16 activations: close to the fp32 scores, not equal
    assert torch.allclose(logp[mask], fp32_logp.detach()[mask], atol=0.1)
    assert not torch.equal(logp[mask], fp32_logp.detach()[mask])
    before = {k: v.clone() for k, v in learner.module.state_dict().items()}
    metrics = learner.update(batch, [1.0, -1.0, 0.5, -0.5, 1.0])
    assert metrics["skipped"] == 0 and math.isfinite(metrics["loss"])
    after = learner.module.state_dict()
    assert all(v.dtype == torch.float32 for v in after.values())
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_bf16_autocast_on_a_cpu_without_native_bf16_runs_fp32_and_says_so(monkeypatch, capsys):
    """Emulated bf16 ran an RL step 15x slower than fp32: where oneDNN may not use AVX-512 BF16 or AMX
    (here capped below them, as on a CPU that lacks them), the learner computes in fp32, says so in one
    line."""
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    model, tokenizer = tiny_model(seed=0)
    learner = Learner.from_config(
        model, tokenizer, load_config(None, [*LINEAR_ADAM, "deepspeed.precision=bf16-autocast"])
    )
    assert learner.precision == "fp32"
    assert (
        capsys.readouterr().out.count(
            "precision: fp32 (deepspeed.precision=bf16-autocast; this CPU has no native bf16 (AVX-512 BF16 or AMX)"
        )
        == 1
    )


def _ids_and_mask(batch, tokenizer):
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    b = collate(batch, pad)
    return b["input_ids"], b["attention_mask"]


def test_rollout_correction_weights_each_token_by_learner_over_sampler(learner, batch):
    # An engine whose log-probs are the learner's own shifted by +0.3 nats on every model-written
    # token: every ratio pi_old / mu is exp(-0.3), under the cap, so token-level truncated IS
    # scales the whole gradient by exp(-0.3) (the mismatch metrics read 0.3), and "none" is the
    # update without the argument, bit for bit.
    advantages = [1.0, -0.5, 0.25, -1.5, 0.75]
    logp, _ = learner.compute_logprobs_and_entropy(batch)
    n_prompt = [len(t.prompt_ids) for t in batch]
    shifted = []
    for t, lp, n in zip(batch, logp, n_prompt, strict=True):
        # Trajectory.logprobs holds one value per response token, aligned with the loss mask;
        # column n - 1 + i of the learner's [B, L-1] log-probs scores response token i
        values = [float(lp[n - 1 + i]) + 0.3 if m else 0.0 for i, m in enumerate(t.loss_mask)]
        shifted.append(dataclasses.replace(t, logprobs=values))
    start = _params(learner)

    plain = learner.update(shifted, advantages)
    delta_plain = {k: v - start[k] for k, v in _params(learner).items()}
    _restore(learner, start)
    none = learner.update(shifted, advantages, rollout_correction="none")
    delta_off = {k: v - start[k] for k, v in _params(learner).items()}
    _restore(learner, start)
    tis = learner.update(shifted, advantages, rollout_correction="token_tis")
    delta_tis = {k: v - start[k] for k, v in _params(learner).items()}
    _restore(learner, start)

    for name in delta_plain:
        assert torch.equal(delta_off[name], delta_plain[name])
        scale = float(delta_plain[name].abs().max()) + 1e-12
        torch.testing.assert_close(
            delta_tis[name], math.exp(-0.3) * delta_plain[name], atol=3e-3 * scale + 2.4e-7, rtol=3e-3
        )
    assert plain["mismatch/abs_logp_mean"] == pytest.approx(0.3, abs=1e-5)
    assert plain["mismatch/abs_logp_max"] == pytest.approx(0.3, abs=1e-5)
    assert plain["mismatch/kl"] == pytest.approx(math.exp(-0.3) - 1 + 0.3, abs=1e-5)
    assert tis["rollout_correction/weight_mean"] == pytest.approx(math.exp(-0.3), abs=1e-5)
    assert tis["rollout_correction/capped_frac"] == 0.0
    assert "rollout_correction/weight_mean" not in plain and none["loss"] == plain["loss"]


def test_entropy_bonus_is_minus_beta_times_the_token_mean_entropy(batch):
    """algorithm.name=entropy_bonus's coefficient, zero advantages: the loss is -beta * the token-mean entropy of the
    model's tokens over the whole batch (split into micro-batches), and so is the step's gradient."""
    cfg = load_config(
        None,
        [*LINEAR_ADAM, "algorithm.name=entropy_bonus", "algorithm.entropy_coef=0.5"],
    )
    cfg.deepspeed.micro_batch_tokens = 40
    model, tokenizer = tiny_model(seed=0)
    learner = Learner.from_config(model, tokenizer, cfg)
    assert len(learner.micro_batches(batch)) >= 3
    start = _params(learner)
    out = learner.update(batch, [0.0] * len(batch), entropy_coef=make_method(cfg.algorithm).entropy_coef())

    reference, _ = tiny_model(seed=0)
    reference.train()
    full = collate(batch, tokenizer.pad_token_id)
    log_p = reference(input_ids=full["input_ids"], attention_mask=full["attention_mask"]).logits[:, :-1]
    log_p = log_p.float().log_softmax(-1)
    H = -(log_p.exp() * log_p).sum(-1)
    loss = -0.5 * H[full["response_mask"].bool()].mean()
    loss.backward()
    assert out["loss"] == pytest.approx(float(loss.detach()), rel=1e-5)
    for name, p in reference.named_parameters():
        delta = _params(learner)[name] - start[name]
        scale = float(p.grad.abs().max()) + 1e-12
        torch.testing.assert_close(-delta, p.grad, atol=2e-3 * scale + 2.4e-7, rtol=2e-3)


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
@pytest.mark.parametrize(
    ("lr", "warmup", "total", "min_ratio"), [(1e-6, 0, 20, 0.1), (3e-4, 3, 7, 0.0), (1e-5, 5, 5, 0.5)]
)
def test_lr_schedule_equals_transformers_get_scheduler_at_every_step(schedule, lr, warmup, total, min_ratio):
    """lr_scheduler writes transformers' schedules itself (importing them costs a process seconds):
    the same learning rate, bit for bit, at every step, past T too."""
    from transformers import get_scheduler

    def lrs(make) -> list[float]:
        opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=lr)
        scheduler = make(opt)
        out = []
        for _ in range(total + 4):
            out.append(opt.param_groups[0]["lr"])
            opt.step()
            scheduler.step()
        return out

    optim = OptimConfig(lr=lr, warmup_steps=warmup, schedule=schedule, min_lr_ratio=min_ratio)
    if schedule == "constant":
        theirs = lambda opt: get_scheduler("constant_with_warmup", opt, num_warmup_steps=warmup)  # noqa: E731
    elif schedule == "linear":
        kwargs = {"lr_end": lr * min_ratio, "power": 1.0}
        theirs = lambda opt: get_scheduler(  # noqa: E731
            "polynomial", opt, num_warmup_steps=warmup, num_training_steps=max(total, warmup + 1),
            scheduler_specific_kwargs=kwargs,
        )  # fmt: skip
    else:
        theirs = lambda opt: get_scheduler(  # noqa: E731
            "cosine_with_min_lr", opt, num_warmup_steps=warmup, num_training_steps=total,
            scheduler_specific_kwargs={"min_lr_rate": min_ratio},
        )  # fmt: skip
    assert lrs(lambda opt: lr_scheduler(opt, optim, total)) == lrs(theirs)


def test_a_training_process_does_not_import_peft_or_transformers_trainer_utils():
    """They cost every `stare-agent train` launch seconds (peft is only for LoRA, imported then)."""
    import subprocess
    import sys

    code = (
        "import sys, torch\n"
        "from stare_agent.train.trainer import Trainer\n"
        "from stare_agent.train.learner import lr_scheduler\n"
        "from stare_agent.config import OptimConfig\n"
        "from stare_agent.train.checkpoints import seed_all\n"
        "seed_all(0)\n"
        "lr_scheduler(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), OptimConfig(), 10)\n"
        "print(sorted(m for m in ('peft', 'transformers.trainer_utils', 'transformers.optimization') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


def _engine_shifted(learner, batch, shifts):
    """``batch`` with engine log-probs equal to the learner's plus ``shifts[i]`` nats on every model
    token of trajectory i (so each token's ratio pi_old / mu is exp(-shift))."""
    logp, _ = learner.compute_logprobs_and_entropy(batch)
    out = []
    for t, lp, shift in zip(batch, logp, shifts, strict=True):
        n = len(t.prompt_ids)
        values = [float(lp[n - 1 + i]) + shift if m else 0.0 for i, m in enumerate(t.loss_mask)]
        out.append(dataclasses.replace(t, logprobs=values))
    return out


def test_sequences_rejected_are_counted_over_micro_batches_and_the_l_plus_weight_is_its_mean(
    learner, batch, monkeypatch
):
    # seq_mis keeps a sequence whose ratio exp(sum_t log ratio) is in [0.5, 2]. Trajectories 0 and 3
    # are shifted by 0.3 nats on each of their >= 5 model tokens: ratio <= exp(-1.5) = 0.22, out;
    # the others are not shifted: ratio 1, in. In micro-batches of about one trajectory each, the
    # step's count is 2 of 5 sequences, summed (not a token-weighted mean of per-micro-batch counts).
    shifted = _engine_shifted(learner, batch, [0.3, 0.0, 0.0, 0.3, 0.0])
    advantages = [1.0, -0.5, 0.25, -1.5, 0.75]
    start = _params(learner)
    monkeypatch.setattr(learner.ds_config, "micro_batch_tokens", 30)
    try:
        out = learner.update(shifted, advantages, rollout_correction="seq_mis")
        assert out["micro_batches"] >= 4
        assert out["rollout_correction/seq_rejected"] == 2.0
        assert out["rollout_correction/seq_rejected_frac"] == pytest.approx(2 / 5)
        _restore(learner, start)
        # STARE's weights on every model token of trajectories 0 and 1 (L+): token TIS gives
        # exp(-0.3) on trajectory 0's tokens and 1 on trajectory 1's, so their mean on L+ is the
        # token-weighted mean of the two.
        B, L = len(batch), max(t.num_tokens for t in batch)
        mask = collate(batch, 0)["response_mask"]
        weights = torch.ones(B, L - 1)
        weights[:2] = torch.where(mask[:2].bool(), 1.1, 1.0)
        n0, n1 = int(mask[0].sum()), int(mask[1].sum())
        tis = learner.update(
            shifted, advantages, weights, rollout_correction="token_tis", L_plus=weights > 1.0
        )
        expected = (n0 * math.exp(-0.3) + n1) / (n0 + n1)
        assert tis["rollout_correction/weight_mean_L_plus"] == pytest.approx(expected, abs=1e-5)
    finally:
        _restore(learner, start)


def test_a_model_handed_in_with_gradients_does_not_train_on_them(batch):
    """A model whose parameters still hold the gradient of its last backward (an SFT loop of the
    caller's) starts the learner with none: a step whose advantages are all 0 leaves every weight."""
    model, tokenizer = tiny_model(seed=0)
    ids = torch.tensor([batch[0].input_ids])
    model(ids, labels=ids).loss.backward()  # .grad populated, as a caller's training leaves it
    learner = Learner.from_config(model, tokenizer, load_config(None, ["optim.weight_decay=0.0"]))
    start = _params(learner)
    learner.update(batch, [0.0] * len(batch))
    assert all(torch.equal(start[k], v) for k, v in _params(learner).items())
