"""SGLangEngine: output conversion and weight bucketing everywhere; the real engine on a CUDA GPU.

The GPU tests need SGLang and a CUDA GPU (``benchmarks/gpu_check.sh`` installs SGLang and runs them);
elsewhere they are skipped with the reason.
"""

from __future__ import annotations

import importlib.util
import time

import pytest
import torch

from stare_agent.engines.sglang_engine import (
    SGLangEngine,
    SGLangUnavailableError,
    sglang_sampling_params,
    to_generation,
    weight_buckets,
)
from stare_envs.engine import RolloutError, SamplingParams
from tests.conftest import require

HAS_SGLANG = importlib.util.find_spec("sglang") is not None
HAS_CUDA = torch.cuda.is_available()


def sglang_output(entries, finish):
    """A dict shaped like one of ``sglang.Engine.generate(..., return_logprob=True)``'s outputs."""
    return {"text": "", "meta_info": {"output_token_logprobs": entries, "finish_reason": finish}}


def test_to_generation_reads_tokens_logprobs_and_finish_reasons():
    entries = [(-0.5, 11, None), (-1.25, 12, None), (-0.0, 2, None)]
    eos = to_generation(sglang_output(entries, {"type": "stop", "matched": 2}), frozenset({2}))
    assert (eos.token_ids, eos.logprobs, eos.finish_reason) == ([11, 12, 2], [-0.5, -1.25, -0.0], "eos")
    stop = to_generation(sglang_output(entries[:2], {"type": "stop", "matched": "```"}))
    assert (stop.token_ids, stop.finish_reason) == ([11, 12], "stop")
    length = to_generation(sglang_output(entries[:2], {"type": "length", "length": 2}))
    assert length.finish_reason == "length"
    # a matched stop token that is not one of our EOS ids counts as a stop
    assert (
        to_generation(sglang_output(entries, {"type": "stop", "matched": 2}), frozenset({7})).finish_reason
        == "stop"
    )


def test_to_generation_refuses_aborts_and_missing_logprobs():
    with pytest.raises(RolloutError, match="SGLang aborted a request: out of memory"):
        to_generation(sglang_output([], {"type": "abort", "message": "out of memory"}))
    with pytest.raises(RolloutError, match="return_logprob=True"):
        to_generation({"meta_info": {"finish_reason": {"type": "length"}}})


def test_sampling_params_map_to_sglang_names():
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=None, max_new_tokens=33, seed=1)
    assert sglang_sampling_params(params, ["```output", ""]) == {
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": -1,
        "max_new_tokens": 33,
        "stop": ["```output"],
        "no_stop_trim": True,
        "skip_special_tokens": False,
    }
    assert sglang_sampling_params(SamplingParams(top_k=20), [])["top_k"] == 20


class FakeSGLang:
    """Stands in for ``sglang.Engine``: records each request's ``sampling_seed`` by its prompt; every
    episode writes a stray ``</code>`` first (a parse error, so the episode goes on), then an answer."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.seeds: dict[tuple[int, ...], int] = {}  # prompt ids -> seed: one entry per episode turn

    def generate(self, input_ids, sampling_params, return_logprob, rid):
        assert return_logprob and isinstance(sampling_params, list) and len(rid) == len(input_ids)
        outputs = []
        for ids, params in zip(input_ids, sampling_params, strict=True):
            second_turn = self.tokenizer.decode(ids).endswith("</interpreter>\n")
            tokens = self.tokenizer.encode(
                "\\boxed{1}" if second_turn else "x </code>", add_special_tokens=False
            )
            if second_turn:
                tokens.append(self.tokenizer.eos_token_id)
                finish = {"type": "stop", "matched": self.tokenizer.eos_token_id}
            else:
                finish = {"type": "stop", "matched": "</code>"}
            self.seeds[tuple(ids)] = params["sampling_seed"]
            outputs.append(sglang_output([(-0.5, t, None) for t in tokens], finish))
        return outputs


def test_seeded_requests_get_one_stream_per_episode_and_turn_in_any_batch():
    """The runner's per-episode, per-turn seeds reach SGLang: no two (episode, turn) share a
    ``sampling_seed`` (``seed + i`` made prompt i + 1 at turn 0 share prompt i's stream at turn 1),
    and an episode gets the same seeds whether it is played alone or in a batch of three."""
    from stare_envs.code_interpreter import CodeInterpreterEnv
    from stare_envs.problems import Problem
    from stare_envs.rollout import RolloutRunner
    from tests.helpers_tokenizers import smollm2_tokenizer

    tokenizer = smollm2_tokenizer()
    problems = [Problem(f"p{i}", f"What is {i} + 1?", str(i + 1)) for i in range(3)]

    def play(batches: list[list[int]]) -> dict[tuple[int, ...], int]:
        engine = _fake_engine(FakeSGLang(tokenizer))
        runner = RolloutRunner(tokenizer, engine, max_response_tokens=64, sampling=SamplingParams(seed=100))
        for batch in batches:
            envs = [CodeInterpreterEnv(problems, format="retool", sandbox_backend="local") for _ in batch]
            trajectories = runner.run(
                envs, options=[{"problem_index": i} for i in batch], episode_keys=[f"p{i}/0" for i in batch]
            )
            assert [t.info["num_turns"] for t in trajectories] == [2] * len(batch)
            for env in envs:
                env.close()
        return engine.engine.seeds

    together = play([[0, 1, 2]])
    assert len(together) == 6 and len(set(together.values())) == 6  # 3 episodes x 2 turns: 6 streams
    assert play([[0], [1], [2]]) == together


class InterruptibleSGLang:
    """Stands in for ``sglang.Engine`` (no SGLang server runs here): ``generate`` decodes one token per
    10 ms on its event loop until ``max_new_tokens`` or until the tokenizer manager's
    ``abort_request(rid)`` (scheduled with ``loop.call_soon_threadsafe``, as SGLang's loop runs on the
    calling thread) aborts the request; it records every rid, abort and callback thread."""

    def __init__(self) -> None:
        import queue
        import threading

        self.callbacks: queue.Queue = queue.Queue()
        self.rids: list[list[str]] = []
        self.aborts: list[str] = []
        self.threads: set[str] = set()
        self.started = threading.Event()
        engine = self

        class Loop:
            def call_soon_threadsafe(self, callback, *args):
                engine.callbacks.put((callback, args))

        class Manager:
            def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
                assert not abort_all and rid
                engine.aborts.append(rid)
                engine.threads.add(threading.current_thread().name)

        self.loop, self.tokenizer_manager = Loop(), Manager()

    def generate(self, input_ids, sampling_params, return_logprob, rid):
        import queue
        import time

        assert return_logprob and len(rid) == len(input_ids) and len(set(rid)) == len(rid)
        self.rids.append(list(rid))
        self.started.set()
        limit = sampling_params["max_new_tokens"]
        tokens: dict[str, list[int]] = {r: [] for r in rid}
        done: dict[str, dict] = {}
        while len(done) < len(rid):
            try:
                while True:  # the loop runs the callbacks scheduled on it
                    callback, args = self.callbacks.get_nowait()
                    callback(*args)
            except queue.Empty:
                pass
            for r in rid:
                if r in done:
                    continue
                if r in self.aborts:
                    done[r] = {
                        "type": "abort",
                        "message": "Abort before prefill" if not tokens[r] else "abort",
                    }
                elif len(tokens[r]) == limit:
                    done[r] = {"type": "length", "length": limit}
                else:
                    tokens[r].append(100 + len(tokens[r]))
            time.sleep(0.01)
        return [
            {"meta_info": {"id": r, "finish_reason": done[r],
                           "output_token_logprobs": [(-0.25, t, None) for t in tokens[r]]}}
            for r in rid
        ]  # fmt: skip


def _fake_engine(fake) -> SGLangEngine:
    engine = object.__new__(SGLangEngine)  # no sglang here: the fake stands in for sglang.Engine
    engine.eos_token_ids, engine.sampling_overrides, engine.engine = None, {}, fake
    engine._init_interrupts()
    return engine


def test_an_interrupt_aborts_the_requests_in_flight_by_rid_on_the_engines_loop():
    from concurrent.futures import ThreadPoolExecutor

    fake = InterruptibleSGLang()
    engine = _fake_engine(fake)
    engine.interrupt()  # nothing in flight: nothing to abort, nothing scheduled for a later call
    assert fake.callbacks.empty() and fake.aborts == []
    with ThreadPoolExecutor(1, thread_name_prefix="rollouts") as pool:
        long = pool.submit(engine.generate, [[1, 2], [3]], SamplingParams(max_new_tokens=100_000))
        assert fake.started.wait(10)
        time.sleep(0.1)
        engine.interrupt()
        engine.interrupt()  # twice: each request is aborted once
        cut = long.result(timeout=10)
    assert [g.finish_reason for g in cut] == ["abort", "abort"]
    assert all(0 < len(g.token_ids) < 100_000 and g.logprobs == [-0.25] * len(g.token_ids) for g in cut)
    assert sorted(fake.aborts) == sorted(fake.rids[0])  # the call's own rids, not abort_all
    assert fake.threads == {"rollouts_0"}  # on the thread that runs generate (SGLang's loop)
    # A later call runs whole, and an abort nobody asked for is still an error.
    (whole,) = engine.generate([[1, 2]], SamplingParams(max_new_tokens=5))
    assert (whole.finish_reason, whole.token_ids) == ("length", [100, 101, 102, 103, 104])
    assert not set(fake.rids[1]) & set(fake.aborts)
    with pytest.raises(RolloutError, match="SGLang aborted a request: out of memory"):
        to_generation(sglang_output([], {"type": "abort", "message": "out of memory"}))
    # interrupted before SGLang scheduled it: no tokens (and maybe no log-prob list)
    empty = to_generation({"meta_info": {"finish_reason": {"type": "abort"}}}, interrupted=True)
    assert (empty.token_ids, empty.finish_reason) == ([], "abort")


def test_weight_buckets_bound_bytes_and_keep_order():
    tensors = [
        ("a", torch.zeros(10)),  # 40 bytes
        ("b", torch.zeros(10)),  # 40
        ("c", torch.zeros(30)),  # 120: larger than the bucket, travels alone
        ("d", torch.zeros(5)),  # 20
        ("e", torch.zeros(10, dtype=torch.bfloat16)),  # 20
    ]
    buckets = list(weight_buckets(tensors, bucket_bytes=100))
    assert [[name for name, _ in bucket] for bucket in buckets] == [["a", "b"], ["c"], ["d", "e"]]
    assert list(weight_buckets([], 100)) == []


def test_missing_sglang_names_the_fix(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "sglang", None)  # SGLang missing, installed here or not
    with pytest.raises(
        SGLangUnavailableError, match=r"pip install 'stare-agent\[sglang\]' on a machine with a CUDA GPU"
    ):
        SGLangEngine("/nonexistent")


if not HAS_SGLANG:
    GPU_SKIP = "SGLang not installed: pip install 'stare-agent[sglang]' (benchmarks/gpu_check.sh does it)"
elif not HAS_CUDA:
    GPU_SKIP = "no CUDA GPU on this machine"
else:
    GPU_SKIP = ""


@pytest.fixture(scope="module")
def sglang_setup():
    """The embedded model in SGLang (float32) and in transformers on the GPU, for every GPU test.

    Skips when SGLang or a CUDA GPU is missing, or fails then when STARE_REQUIRE names gpu (gpu_check.sh).
    """
    require("gpu", GPU_SKIP or None)
    from stare_agent.models import embedded_model_path, load_policy

    path = embedded_model_path()
    model, tokenizer = load_policy(path, device="cuda")
    engine = SGLangEngine(
        str(path), dtype="float32", mem_fraction_static=0.3, enable_deterministic_inference=True
    )
    yield engine, model, tokenizer
    engine.close()


def chat(tokenizer, text):
    messages = [{"role": "user", "content": text}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)


@pytest.mark.gpu
def test_sglang_logprobs_match_a_transformers_forward(sglang_setup):
    engine, model, tokenizer = sglang_setup
    prompts = [chat(tokenizer, "What is 2+2?"), chat(tokenizer, "Name a prime number larger than 10.")]
    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=24, seed=0)
    for prompt, out in zip(prompts, engine.generate(prompts, params, []), strict=True):
        assert len(out.token_ids) == len(out.logprobs) > 0
        ids = torch.tensor([prompt + out.token_ids], device="cuda")
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
        expected = torch.log_softmax(logits, -1)[
            torch.arange(len(out.token_ids)), torch.tensor(out.token_ids)
        ]
        assert torch.allclose(torch.tensor(out.logprobs), expected.cpu(), atol=2e-2)


@pytest.mark.gpu
def test_sglang_eos_and_stop_strings(sglang_setup):
    engine, _model, tokenizer = sglang_setup
    greedy = SamplingParams(temperature=0.0, max_new_tokens=64)
    out = engine.generate([chat(tokenizer, "What is 2+2? Answer in one sentence.")], greedy, [])[0]
    assert out.finish_reason == "eos" and out.token_ids[-1] == tokenizer.eos_token_id
    text = tokenizer.decode(out.token_ids)
    stop = text[len(text) // 3 : len(text) // 3 + 3]
    stopped = engine.generate([chat(tokenizer, "What is 2+2? Answer in one sentence.")], greedy, [stop])[0]
    assert stopped.finish_reason == "stop"
    assert stop in tokenizer.decode(stopped.token_ids)
    assert stop not in tokenizer.decode(stopped.token_ids[:-1])
    assert stopped.token_ids == out.token_ids[: len(stopped.token_ids)]


@pytest.mark.gpu
def test_sglang_update_weights_in_buckets_round_trips(sglang_setup):
    engine, model, tokenizer = sglang_setup
    prompt = [chat(tokenizer, "Write a haiku about the sea.")]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=16)
    before = engine.generate(prompt, greedy, [])[0].token_ids
    original = {name: p.detach().clone() for name, p in model.named_parameters()}
    engine.bucket_bytes = 64 * 1024**2  # several buckets for a 540 MB model
    engine.update_weights((name, torch.randn_like(p) * 0.02) for name, p in original.items())
    assert engine.generate(prompt, greedy, [])[0].token_ids != before
    engine.update_weights(original.items())
    assert engine.generate(prompt, greedy, [])[0].token_ids == before
