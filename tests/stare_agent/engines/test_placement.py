"""env.placement: the config's checks, each rank's engine GPUs, the arguments vLLM and SGLang get, the
NCCL weight sync's calls, and sleep/wake around the update; the real vLLM worker (CPU) with them.

What needs GPUs (CUDA_VISIBLE_DEVICES, sleep mode, the NCCL group) is checked here through the
arguments built and the calls made on recording fakes; ``benchmarks/gpu_check.sh`` runs a placed
engine on a GPU machine.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from stare_agent.config import ConfigError, load_config
from stare_agent.engines import placement as placement_module
from stare_agent.engines import sglang_engine, start_engine
from stare_agent.engines.placement import (
    EnginePlacement,
    NcclWeightSync,
    PlacementError,
    place_engine,
    sglang_arguments,
    vllm_arguments,
)
from stare_agent.engines.vllm_engine import VLLMEngine

SLOW_FIXTURES = ("vllm_engine",)


def _placement(*overrides: str):
    return load_config(None, [f"env.placement.{o}" for o in overrides]).env.placement


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("mode=separate",), "mode=separate needs the GPUs that generate: set env.placement.engine_gpus"),
        (("memory_fraction=0",), r"memory_fraction=0.0 must be in \(0, 1\]"),
        (("memory_fraction=1.5",), r"memory_fraction=1.5 must be in \(0, 1\]"),
        (("engine_gpus=[4]",), "is for mode=separate: set env.placement.mode=separate"),
        (("tensor_parallel_size=2",), "with mode=colocated would spread"),
        (("tensor_parallel_size=0",), "must be >= 1"),
        (("weight_sync=nccl",), "NCCL refuses two ranks on one GPU"),
        (("mode=separate", "engine_gpus=[4,5,6]", "tensor_parallel_size=2"), "not a multiple of"),
        (("mode=separate", "engine_gpus=[4,4]"), "distinct GPU ordinals"),
        (("mode=separate", "engine_gpus=[4]", "sleep_between_steps=true"), "set sleep_between_steps=false"),
        (("mode=apart",), "is not valid: use one of colocated, separate"),
        (("weight_sync=ipc",), "is not valid: use one of auto, tensor, nccl"),
    ],
)
def test_bad_combinations_are_refused_in_one_line_with_the_fix(overrides, message):
    with pytest.raises(ConfigError, match=message) as info:
        _placement(*overrides)
    assert "\n" not in str(info.value)


def test_defaults_and_good_layouts_load():
    default = _placement()
    assert (default.mode, default.memory_fraction, default.sleep_between_steps) == ("colocated", None, False)
    assert (default.engine_gpus, default.tensor_parallel_size, default.weight_sync) == ([], 1, "auto")
    separate = _placement("mode=separate", "engine_gpus=[2,3,4,5,6,7]", "tensor_parallel_size=3")
    assert separate.engine_gpus == [2, 3, 4, 5, 6, 7]
    assert _placement("memory_fraction=1", "sleep_between_steps=true").memory_fraction == 1.0


def test_colocated_engines_take_their_ranks_gpu_and_a_share_of_it():
    placed = place_engine(
        _placement(), vllm_memory_fraction=0.4, local_rank=3, local_world_size=8, cuda_devices=8
    )
    assert placed == EnginePlacement((3,), 0.4, 1, False, "tensor")
    asleep = place_engine(_placement("memory_fraction=0.5", "sleep_between_steps=true"), vllm_memory_fraction=0.4,
                          local_rank=0, local_world_size=8, cuda_devices=8)  # fmt: skip
    assert asleep == EnginePlacement((0,), 0.5, 1, True, "tensor")
    assert "asleep during updates" in asleep.describe()
    # no CUDA: the engine's own device (vLLM on the CPU), nothing placed
    assert place_engine(_placement(), vllm_memory_fraction=0.4, cuda_devices=0) == EnginePlacement()


def test_separate_engines_split_the_nodes_engine_gpus_among_its_ranks():
    section = _placement("mode=separate", "engine_gpus=[4,5,6,7]")
    gpus = [
        place_engine(section, vllm_memory_fraction=0.4, local_rank=r, local_world_size=4, cuda_devices=8).gpus
        for r in range(4)
    ]
    assert gpus == [(4,), (5,), (6,), (7,)]
    tp = _placement(
        "mode=separate", "engine_gpus=[2,3,4,5,6,7]", "tensor_parallel_size=3", "weight_sync=tensor"
    )
    placed = place_engine(tp, vllm_memory_fraction=0.4, local_rank=1, local_world_size=2, cuda_devices=8)
    assert placed == EnginePlacement((5, 6, 7), 0.85, 3, False, "tensor")


@pytest.mark.parametrize(
    ("overrides", "where", "message"),
    [
        (("mode=separate", "engine_gpus=[4,5,6,7]"), {"cuda_devices": 0}, "no CUDA GPU is visible"),
        (
            ("mode=separate", "engine_gpus=[8,9,10,11]"),
            {},
            r"names GPUs \[8, 9, 10, 11\], but this node has 8",
        ),
        (("mode=separate", "engine_gpus=[2,3,4,5]"), {}, r"\[2, 3\] are learner GPUs"),
        (("mode=separate", "engine_gpus=[4,5]"), {}, "lists 2 GPUs for 4 learner ranks"),
        (("sleep_between_steps=true",), {"cuda_devices": 0}, "no CUDA GPU here"),
        (("sleep_between_steps=true",), {"max_staleness": 1}, "trainer.max_staleness=1 generates then"),
    ],
)
def test_placements_this_machine_cannot_meet_are_refused(overrides, where, message):
    kwargs = {"local_rank": 0, "local_world_size": 4, "cuda_devices": 8, **where}
    with pytest.raises(PlacementError, match=message):
        place_engine(_placement(*overrides), vllm_memory_fraction=0.4, **kwargs)


def test_vllm_gets_its_gpus_memory_tensor_parallelism_sleep_mode_and_nccl_transfer():
    kwargs, env = vllm_arguments(EnginePlacement((4, 5), 0.85, 2, False, "nccl"))
    assert env == {"CUDA_VISIBLE_DEVICES": "4,5"}
    assert kwargs == {
        "tensor_parallel_size": 2,
        "gpu_memory_utilization": 0.85,
        "distributed_executor_backend": "mp",
        "weight_transfer_config": {"backend": "nccl"},
    }
    kwargs, env = vllm_arguments(EnginePlacement((1,), 0.5, 1, True, "tensor"))
    assert env == {"CUDA_VISIBLE_DEVICES": "1"}
    assert kwargs == {"tensor_parallel_size": 1, "gpu_memory_utilization": 0.5, "enable_sleep_mode": True}
    assert vllm_arguments(EnginePlacement()) == ({"tensor_parallel_size": 1}, {})  # a CPU: as before


def test_sglang_gets_base_gpu_memory_fraction_tp_and_memory_saver():
    assert sglang_arguments(EnginePlacement((6, 7), 0.85, 2, False, "nccl")) == {
        "tp_size": 2,
        "base_gpu_id": 6,
        "mem_fraction_static": 0.85,
    }
    assert sglang_arguments(EnginePlacement((0,), 0.5, 1, True, "tensor"))["enable_memory_saver"] is True
    with pytest.raises(PlacementError, match="consecutive GPUs from base_gpu_id"):
        sglang_arguments(EnginePlacement((4, 6), 0.85, 2, False, "nccl"))


class RecordingGroup:
    def __init__(self, log):
        self.log = log

    def broadcast(self, tensor):
        self.log.append(("broadcast", tensor.dtype, tuple(tensor.shape)))


def test_nccl_sync_opens_the_group_once_then_broadcasts_in_the_order_it_announced():
    log = []
    sync = NcclWeightSync(
        receive=lambda meta: log.append(("receive", meta)),
        open_group=lambda: log.append(("open",)) or RecordingGroup(log),
        join=lambda: log.append(("join",)),
        dtype=torch.bfloat16,
    )
    weights = {"a.weight": torch.ones(2, 3), "b.bias": torch.zeros(4)}
    sync.send(weights)
    sync.send(weights.items())
    assert sorted(log[:2]) == [("join",), ("open",)] and ("open",) not in log[2:]
    receives = [entry for entry in log if entry[0] == "receive"]
    assert receives[0][1] == {"names": ["a.weight", "b.bias"], "dtype_names": ["bfloat16", "bfloat16"],
                              "shapes": [[2, 3], [4]]}  # fmt: skip
    assert [e for e in log if e[0] == "broadcast"] == [("broadcast", torch.bfloat16, (2, 3)),
                                                       ("broadcast", torch.bfloat16, (4,))] * 2  # fmt: skip


def test_nccl_sync_raises_the_engines_refusal():
    def refuse(meta):
        raise RuntimeError("engine refused")

    sync = NcclWeightSync(refuse, lambda: RecordingGroup([]), lambda: None)
    with pytest.raises(RuntimeError, match="engine refused"):
        sync.send({"w": torch.ones(1)})


def test_vllm_engine_sends_nccl_updates_through_its_worker(monkeypatch):
    """The worker calls (init, then one update per sync) and vLLM's trainer group, on a recording fake."""
    from concurrent.futures import Future

    calls, log = [], []
    engine = object.__new__(VLLMEngine)
    engine.info = {"dtype": "bfloat16"}

    def request(method, call, *args, **kwargs):
        calls.append((method, call))
        done: Future = Future()
        done.set_result(0.1)
        return done

    engine._request = request
    monkeypatch.setattr(
        placement_module, "vllm_trainer_group", lambda port, world, device: RecordingGroup(log)
    )
    engine.use_nccl_weight_sync(2, None)
    engine.update_weights({"w": torch.ones(3)})
    (init_method, init), (update_method, update) = calls
    assert init_method == "weight_transfer_init" and update_method == "weight_transfer_update"
    assert init["init_info"]["rank_offset"] == 1 and init["init_info"]["world_size"] == 3
    assert init["init_info"]["packed"] is False and init["init_info"]["master_address"] == "127.0.0.1"
    assert update == {"update_info": {"names": ["w"], "dtype_names": ["bfloat16"], "shapes": [[3]]}}
    assert log == [("broadcast", torch.bfloat16, (3,))]
    assert engine.last_sync_parts.keys() == {"broadcast_s"}


class FakeSGLang:
    """An ``sglang`` module whose ``Engine`` records its arguments and calls."""

    def __init__(self):
        self.engines = []
        outer = self

        class Engine:
            def __init__(self, **kwargs):
                self.kwargs, self.calls = kwargs, []
                outer.engines.append(self)

            def __getattr__(self, name):
                return lambda **kw: self.calls.append((name, kw)) or (True, "")

        self.Engine = Engine


def _cuda(monkeypatch, count=8):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_start_engine_places_sglang_and_syncs_it_over_nccl(monkeypatch):
    fake = FakeSGLang()
    monkeypatch.setattr(sglang_engine, "import_sglang", lambda: fake)
    _cuda(monkeypatch)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    log = []
    monkeypatch.setattr(
        placement_module, "torch_trainer_group", lambda port, world, device: RecordingGroup(log)
    )
    config = load_config(None, ["env.engine=sglang", "env.placement.mode=separate",
                                "env.placement.engine_gpus=[2,3,4,5]", "env.placement.tensor_parallel_size=2"])  # fmt: skip
    description, engine = start_engine(config, None, None)
    assert description == "sglang (GPUs 4,5, 0.85 of memory, TP 2, nccl weight sync)"
    assert fake.engines[0].kwargs == {"model_path": "embedded:smollm2-135m-instruct", "tp_size": 2,
                                      "base_gpu_id": 4, "mem_fraction_static": 0.85}  # fmt: skip
    assert engine._nccl.device == torch.device("cuda", 1)  # the learner rank's GPU broadcasts
    engine._nccl.device = None  # no CUDA here: broadcast from where the tensor is
    engine.update_weights({"w": torch.ones(2)})
    names = [name for name, _ in fake.engines[0].calls]
    assert names == ["init_weights_update_group", "update_weights_from_distributed"]
    init, update = (kw for _, kw in fake.engines[0].calls)
    assert (init["rank_offset"], init["world_size"], init["backend"]) == (1, 3, "nccl")
    assert update == {"names": ["w"], "dtypes": ["float32"], "shapes": [[2]], "group_name": "stare_weight_sync",
                      "flush_cache": True}  # fmt: skip
    assert log == [("broadcast", torch.float32, (2,))]


def test_sglang_sleeps_and_wakes_with_memory_occupation_calls(monkeypatch):
    fake = FakeSGLang()
    monkeypatch.setattr(sglang_engine, "import_sglang", lambda: fake)
    _cuda(monkeypatch)
    monkeypatch.setenv("LOCAL_RANK", "0")
    config = load_config(None, ["env.engine=sglang", "env.placement.sleep_between_steps=true",
                                "env.placement.memory_fraction=0.5"])  # fmt: skip
    _, engine = start_engine(config, None, None)
    assert fake.engines[0].kwargs["enable_memory_saver"] is True and engine.placement.sleep
    engine.sleep()
    engine.wake_up()
    assert [name for name, _ in fake.engines[0].calls] == [
        "release_memory_occupation",
        "resume_memory_occupation",
    ]


def test_separate_placement_refuses_the_transformers_engine():
    config = load_config(None, ["env.engine=transformers", "env.placement.mode=separate",
                                "env.placement.engine_gpus=[1]"])  # fmt: skip
    with pytest.raises(PlacementError, match="use env.engine=vllm or sglang"):
        start_engine(config, object(), None)


def test_the_rollout_engine_sleeps_after_rollouts_and_wakes_for_the_sync():
    from stare_agent.train.rollout_engine import RolloutEngine

    class Engine:
        placement = EnginePlacement((0,), 0.5, 1, True, "tensor")

        def __init__(self):
            self.calls = []

        def sleep(self):
            self.calls.append("sleep")

        def wake_up(self):
            self.calls.append("wake_up")

        def update_weights(self, named):
            self.calls.append("update_weights")

        def generate(self, prompts, params, stop=()):
            return []

    engine = Engine()
    learner = SimpleNamespace(module=object(), named_weights=lambda: iter([("w", torch.ones(1))]))
    held = RolloutEngine(load_config(None, []), learner, None, engine=engine)
    held.sleep()
    held.sleep()  # asleep already: once
    held.sync(1)
    held.publish(1)
    held.sleep()
    held.publish(2)  # a skipped step: no sync, still woken
    assert engine.calls == ["sleep", "wake_up", "update_weights", "sleep", "wake_up"]
    engine.placement = EnginePlacement((0,), 0.5, 1, False, "tensor")
    held.sleep()
    assert engine.calls[-1] == "wake_up"  # not asked to sleep: untouched


@pytest.fixture(scope="module")
def vllm_engine():
    from stare_agent.models import load_tokenizer
    from tests.stare_agent.engines.test_vllm_engine import _vllm_python

    config = load_config(None, ["env.engine=vllm", "env.vllm.dtype=float32", "env.vllm.max_model_len=1024",
                                "env.vllm.kv_cache_gib=1", f"env.vllm.python={_vllm_python()}",
                                "env.placement.memory_fraction=0.5"])  # fmt: skip
    description, engine = start_engine(config, None, load_tokenizer("embedded:smollm2-135m-instruct"))
    yield description, engine
    engine.close()


def test_the_cpu_vllm_worker_starts_with_the_placement_arguments_and_answers_sleep_and_wake(vllm_engine):
    from stare_envs.engine import SamplingParams

    description, engine = vllm_engine
    assert engine.placement == EnginePlacement() and "GPU" not in description  # a CPU: nothing placed
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    before = engine.generate([[1, 2, 3, 4]], params)[0].token_ids
    engine.sleep()  # vLLM's CPU worker ignores sleep mode; the calls go through the worker all the same
    engine.wake_up()
    assert engine.generate([[1, 2, 3, 4]], params)[0].token_ids == before


@pytest.mark.gpu
def test_a_colocated_sglang_engine_sleeps_and_wakes_on_a_gpu(monkeypatch):
    """On a GPU (benchmarks/gpu_check.sh): SGLang placed on this rank's GPU with half its memory frees
    it while asleep and samples the same greedy tokens after waking. One GPU: the NCCL path needs two."""
    import importlib.util

    from tests.conftest import require

    require(
        "gpu",
        None if torch.cuda.is_available() and importlib.util.find_spec("sglang") else "no GPU or SGLang",
    )
    from stare_agent.models import load_tokenizer
    from stare_envs.engine import SamplingParams

    monkeypatch.setenv("LOCAL_RANK", "0")
    config = load_config(None, ["env.engine=sglang", "env.placement.memory_fraction=0.5",
                                "env.placement.sleep_between_steps=true"])  # fmt: skip
    description, engine = start_engine(config, None, load_tokenizer("embedded:smollm2-135m-instruct"))
    try:
        assert "GPU 0, 0.5 of memory" in description
        greedy = SamplingParams(temperature=0.0, max_new_tokens=16)
        before = engine.generate([[1, 2, 3, 4]], greedy)[0].token_ids
        free_awake = torch.cuda.mem_get_info()[0]
        engine.sleep()
        assert torch.cuda.mem_get_info()[0] > free_awake  # memory given back
        engine.wake_up()
        assert engine.generate([[1, 2, 3, 4]], greedy)[0].token_ids == before
    finally:
        engine.close()
