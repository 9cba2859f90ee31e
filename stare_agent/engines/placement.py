"""Where a GPU rollout engine runs, and how it gets the learner's weights (``env.placement``).

Each learner rank starts its own engine (``start_engine``). ``colocated``: on the rank's own GPU
(``cuda:LOCAL_RANK``), with ``memory_fraction`` of its memory, optionally asleep while the learner
updates; ``separate``: on GPUs of its own, ``engine_gpus[r * tp : (r + 1) * tp]`` for local rank ``r``.
What each engine is given, written against the engines' documented APIs:

- vLLM (its worker process): ``CUDA_VISIBLE_DEVICES`` = the engine's GPUs, ``gpu_memory_utilization``,
  ``tensor_parallel_size`` (with the ``mp`` executor above 1), ``enable_sleep_mode`` for
  ``sleep(level=1)`` / ``wake_up()``, and ``weight_transfer_config={"backend": "nccl"}`` for NCCL sync
  (``init_weight_transfer_engine``, then per update ``start_weight_update``, ``update_weights`` with the
  names, dtypes and shapes, ``finish_weight_update``; the learner opens rank 0 of the group with
  ``vllm.distributed.weight_transfer.nccl_common.trainer_init`` and broadcasts each tensor).
- SGLang (in process): ``base_gpu_id`` = the first of the engine's GPUs (SGLang takes ``tp_size``
  consecutive ones), ``mem_fraction_static``, ``tp_size``, ``enable_memory_saver`` for
  ``release_memory_occupation`` / ``resume_memory_occupation``; NCCL sync with
  ``init_weights_update_group`` and ``update_weights_from_distributed`` while the learner broadcasts
  over a process group of its own (rank 0; the engine's TP ranks are 1..tp).

Nothing here imports torch or an engine at import time: the config validates with it.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from stare_agent.errors import StareError

SEPARATE_MEMORY_FRACTION = 0.85
"""``memory_fraction`` of a separate engine when none is given: the GPU is the engine's alone."""
SYNC_GROUP = "stare_weight_sync"
"""The name of the NCCL group between a learner rank and its engine (SGLang's ``group_name``)."""


class PlacementError(StareError, ValueError):
    """The engine cannot be placed as ``env.placement`` asks on this machine (the fix is in the message)."""


def placement_problem(section: Any) -> str | None:
    """What is wrong with an ``env.placement`` section, in one line with the fix, or None.

    >>> from types import SimpleNamespace as S
    >>> placement_problem(S(mode="separate", memory_fraction=None, sleep_between_steps=False,
    ...     engine_gpus=[], tensor_parallel_size=1, weight_sync="auto"))[:60]
    'env.placement.mode=separate needs the GPUs that generate: se'
    """
    s = section
    gpus = list(s.engine_gpus)
    if s.memory_fraction is not None and not 0 < s.memory_fraction <= 1:
        return (
            f"env.placement.memory_fraction={s.memory_fraction} must be in (0, 1]: e.g. 0.5 colocated, "
            "0.85 separate, or null for the default"
        )
    if s.tensor_parallel_size < 1:
        return f"env.placement.tensor_parallel_size={s.tensor_parallel_size} must be >= 1: GPUs per engine"
    if any(g < 0 for g in gpus) or len(set(gpus)) != len(gpus):
        return f"env.placement.engine_gpus={gpus} must list distinct GPU ordinals >= 0, e.g. [4, 5, 6, 7]"
    if s.mode == "colocated":
        if gpus:
            return (
                f"env.placement.engine_gpus={gpus} is for mode=separate: set env.placement.mode=separate, "
                "or engine_gpus=[] to share each learner rank's GPU"
            )
        if s.tensor_parallel_size > 1:
            return (
                f"env.placement.tensor_parallel_size={s.tensor_parallel_size} with mode=colocated would "
                "spread one rank's engine over other ranks' GPUs: use mode=separate with engine_gpus for "
                "tensor parallel engines, or tensor_parallel_size=1"
            )
        if s.weight_sync == "nccl":
            return (
                "env.placement.weight_sync=nccl needs the engine on other GPUs than its learner (NCCL "
                "refuses two ranks on one GPU): use mode=separate, or weight_sync=tensor (or auto)"
            )
        return None
    if not gpus:
        return (
            "env.placement.mode=separate needs the GPUs that generate: set env.placement.engine_gpus, "
            "e.g. [4, 5, 6, 7] for 4 learner ranks on GPUs 0-3 of each node"
        )
    if s.sleep_between_steps:
        return (
            "env.placement.sleep_between_steps frees memory for a learner on the same GPU, and with "
            "mode=separate there is none: set sleep_between_steps=false"
        )
    if len(gpus) % s.tensor_parallel_size:
        return (
            f"env.placement.engine_gpus has {len(gpus)} GPUs, not a multiple of tensor_parallel_size="
            f"{s.tensor_parallel_size}: list tensor_parallel_size GPUs per learner rank of a node"
        )
    return None


@dataclass(frozen=True)
class EnginePlacement:
    """One rank's engine as placed: its GPUs (None: no CUDA, the engine's own default device),
    memory fraction, tensor-parallel size, whether it sleeps during updates, and its weight sync."""

    gpus: tuple[int, ...] | None = None
    memory_fraction: float | None = None
    tensor_parallel_size: int = 1
    sleep: bool = False
    weight_sync: str = "tensor"

    def describe(self) -> str:
        """A short phrase for the line that says which engine started."""
        if self.gpus is None:
            return "no GPU"
        where = "GPU" + ("s " if len(self.gpus) > 1 else " ") + ",".join(map(str, self.gpus))
        parts = [where, f"{self.memory_fraction:g} of memory"]
        if self.tensor_parallel_size > 1:
            parts.append(f"TP {self.tensor_parallel_size}")
        if self.sleep:
            parts.append("asleep during updates")
        parts.append(f"{self.weight_sync} weight sync")
        return ", ".join(parts)


def place_engine(
    section: Any,
    *,
    vllm_memory_fraction: float,
    local_rank: int | None = None,
    local_world_size: int | None = None,
    cuda_devices: int | None = None,
    max_staleness: int = 0,
) -> EnginePlacement:
    """This rank's :class:`EnginePlacement` for ``env.placement`` (``section``).

    ``local_rank`` / ``local_world_size`` default to ``$LOCAL_RANK`` / ``$LOCAL_WORLD_SIZE`` (1 when
    unset); ``cuda_devices`` to ``torch.cuda.device_count()``; ``vllm_memory_fraction`` is
    ``env.vllm.gpu_memory_utilization`` (a colocated engine's share when ``memory_fraction`` is null).

    Raises:
        PlacementError: separate placement without CUDA GPUs, engine GPUs that do not exist, overlap
            the learner ranks' or do not match the node's ranks, or sleep with asynchronous rollouts.
    """
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if local_world_size is None:
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if cuda_devices is None:
        import torch

        cuda_devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    tp = section.tensor_parallel_size
    separate = section.mode == "separate"
    sync = section.weight_sync if section.weight_sync != "auto" else ("nccl" if separate else "tensor")
    if section.sleep_between_steps and max_staleness:
        raise PlacementError(
            f"env.placement.sleep_between_steps puts the engine to sleep during the update, but "
            f"trainer.max_staleness={max_staleness} generates then: set one of them to false / 0"
        )
    if not separate:
        if cuda_devices == 0:
            if section.sleep_between_steps:
                raise PlacementError(
                    "env.placement.sleep_between_steps frees GPU memory and there is no CUDA GPU here: "
                    "set env.placement.sleep_between_steps=false on a CPU"
                )
            return EnginePlacement(weight_sync="tensor")
        fraction = section.memory_fraction if section.memory_fraction is not None else vllm_memory_fraction
        return EnginePlacement((local_rank,), fraction, 1, section.sleep_between_steps, sync)
    gpus = list(section.engine_gpus)
    if cuda_devices == 0:
        raise PlacementError(
            f"env.placement.mode=separate gives the engine GPUs {gpus}, but no CUDA GPU is visible: "
            "run on a GPU machine, or use env.placement.mode=colocated"
        )
    missing = [g for g in gpus if g >= cuda_devices]
    if missing:
        raise PlacementError(
            f"env.placement.engine_gpus names GPUs {missing}, but this node has {cuda_devices} "
            f"(0-{cuda_devices - 1}): list GPUs that exist, and do not narrow CUDA_VISIBLE_DEVICES"
        )
    taken = sorted(set(gpus) & set(range(local_world_size)))
    if taken:
        raise PlacementError(
            f"env.placement.engine_gpus {taken} are learner GPUs (this node's {local_world_size} ranks "
            f"use 0-{local_world_size - 1}): give the engines GPUs from {local_world_size} up"
        )
    if len(gpus) != local_world_size * tp:
        raise PlacementError(
            f"env.placement.engine_gpus lists {len(gpus)} GPUs for {local_world_size} learner ranks on this "
            f"node x tensor_parallel_size {tp}: list {local_world_size * tp}, or change nproc_per_node"
        )
    mine = tuple(gpus[local_rank * tp : (local_rank + 1) * tp])
    fraction = section.memory_fraction if section.memory_fraction is not None else SEPARATE_MEMORY_FRACTION
    return EnginePlacement(mine, fraction, tp, False, sync)


# ---------------------------------------------------------------------- the engines' arguments


def vllm_arguments(placement: EnginePlacement) -> tuple[dict[str, Any], dict[str, str]]:
    """``(vllm.LLM keyword arguments, worker environment)`` for a placed vLLM engine.

    >>> kwargs, env = vllm_arguments(EnginePlacement((4, 5), 0.85, 2, False, "nccl"))
    >>> env, kwargs["tensor_parallel_size"], kwargs["distributed_executor_backend"]
    ({'CUDA_VISIBLE_DEVICES': '4,5'}, 2, 'mp')
    """
    kwargs: dict[str, Any] = {"tensor_parallel_size": placement.tensor_parallel_size}
    env: dict[str, str] = {}
    if placement.gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, placement.gpus))
        kwargs["gpu_memory_utilization"] = placement.memory_fraction
    if placement.tensor_parallel_size > 1:
        kwargs["distributed_executor_backend"] = "mp"  # the "uni" executor holds one GPU
    if placement.sleep:
        kwargs["enable_sleep_mode"] = True
    if placement.weight_sync == "nccl":
        kwargs["weight_transfer_config"] = {"backend": "nccl"}
    return kwargs, env


def sglang_arguments(placement: EnginePlacement) -> dict[str, Any]:
    """``sglang.Engine`` keyword arguments for a placed SGLang engine.

    Raises:
        PlacementError: tensor-parallel GPUs that are not consecutive (SGLang takes ``tp_size`` GPUs
            from ``base_gpu_id`` on).

    >>> sglang_arguments(EnginePlacement((2,), 0.5, 1, True, "tensor"))
    {'tp_size': 1, 'base_gpu_id': 2, 'mem_fraction_static': 0.5, 'enable_memory_saver': True}
    """
    kwargs: dict[str, Any] = {"tp_size": placement.tensor_parallel_size}
    if placement.gpus is not None:
        first = placement.gpus[0]
        if list(placement.gpus) != list(range(first, first + len(placement.gpus))):
            raise PlacementError(
                f"SGLang takes tp_size consecutive GPUs from base_gpu_id, but this rank's engine GPUs are "
                f"{list(placement.gpus)}: order env.placement.engine_gpus so each rank's are consecutive"
            )
        kwargs["base_gpu_id"] = first
        kwargs["mem_fraction_static"] = placement.memory_fraction
    if placement.sleep:
        kwargs["enable_memory_saver"] = True  # release_memory_occupation / resume_memory_occupation
    return kwargs


# ---------------------------------------------------------------------- NCCL weight sync


def free_port() -> int:
    """A TCP port free on this host now (the NCCL rendezvous of a learner rank and its engine)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tensor_metadata(tensors: Sequence[tuple[str, Any]]) -> dict[str, list[Any]]:
    """``names``, ``dtype_names`` and ``shapes`` of ``(name, tensor)`` pairs, in order: what an engine
    needs to receive a broadcast of them."""
    return {
        "names": [name for name, _ in tensors],
        "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in tensors],
        "shapes": [list(t.shape) for _, t in tensors],
    }


class NcclWeightSync:
    """The learner rank's end of an NCCL group with its engine's GPUs: rank 0, which broadcasts.

    Args:
        receive: starts the engine's side of one update, given the tensors' ``names``,
            ``dtype_names`` and ``shapes``, and returns a waitable (``.result()``) or None when it
            blocked until done (it is then run in a thread); the broadcast runs meanwhile.
        open_group: opens rank 0 of the group and returns an object with ``broadcast(tensor)``
            (called once, the first time, while the engine joins through ``join``).
        join: starts the engine's side of the group's rendezvous; returns a waitable or None, as
            ``receive``.
        dtype: the dtype the engine holds its weights in (tensors are cast to it); None: as they are.
        device: the CUDA device the tensors are broadcast from (the learner's).
    """

    def __init__(
        self,
        receive: Callable[[dict[str, list[Any]]], Any],
        open_group: Callable[[], Any],
        join: Callable[[], Any],
        *,
        dtype: Any = None,
        device: Any = None,
    ) -> None:
        self._receive, self._open_group, self._join = receive, open_group, join
        self.dtype, self.device = dtype, device
        self._group: Any = None

    def send(self, named_tensors: Iterable[tuple[str, Any]] | Mapping[str, Any]) -> None:
        """Broadcast the tensors, in the engine's dtype, while the engine receives and loads them."""
        if self._group is None:
            self._group = _concurrently(self._join, self._open_group)
        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        tensors = [(name, self._ready(t)) for name, t in items]
        meta = tensor_metadata(tensors)

        def broadcast() -> None:
            for _, tensor in tensors:
                self._group.broadcast(tensor)

        _concurrently(lambda: self._receive(meta), broadcast)

    def _ready(self, tensor: Any) -> Any:
        out = tensor.detach()
        if self.device is not None or self.dtype is not None:
            out = out.to(device=self.device or out.device, dtype=self.dtype or out.dtype)
        return out.contiguous()


def _concurrently(remote: Callable[[], Any], local: Callable[[], Any]) -> Any:
    """Start ``remote`` (the engine's side), run ``local`` (ours), then wait for ``remote``; both sides
    meet inside the same NCCL calls. Returns what ``local`` returned."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["waitable"] = remote()
        except BaseException as exc:  # noqa: BLE001 - raised below, in the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=run, name="engine-weight-sync", daemon=True)
    thread.start()
    out = local()
    thread.join()
    if "error" in box:
        raise box["error"]
    waitable = box.get("waitable")
    if waitable is not None and hasattr(waitable, "result"):
        waitable.result()
    return out


def vllm_trainer_group(master_port: int, world_size: int, device: Any) -> Any:
    """Rank 0 of vLLM's NCCL weight-transfer group, as an object with ``broadcast(tensor)``
    (``vllm.distributed.weight_transfer.nccl_common.trainer_init``; needs vLLM in the learner's Python)."""
    import torch

    try:
        from vllm.distributed.weight_transfer.nccl_common import trainer_init
    except ImportError as exc:
        raise PlacementError(
            f"env.placement.weight_sync=nccl with vLLM needs vLLM in the learner's Python too ({exc}): "
            "pip install 'stare-agent[vllm]' there, or set env.placement.weight_sync=tensor"
        ) from exc
    torch.cuda.set_device(device)
    comm = trainer_init({"master_address": "127.0.0.1", "master_port": master_port, "world_size": world_size})

    class Group:
        def broadcast(self, tensor: Any) -> None:
            comm.broadcast(tensor, src=0, stream=torch.cuda.current_stream())

    return Group()


def torch_trainer_group(master_port: int, world_size: int, device: Any) -> Any:
    """Rank 0 of a torch NCCL process group of its own beside the learner's (SGLang's
    ``init_custom_process_group``, the helper its engine joins with), as an object with ``broadcast``."""
    import torch
    import torch.distributed as dist

    try:
        from sglang.srt.utils import init_custom_process_group
    except ImportError:
        try:
            from sglang.srt.utils.common import init_custom_process_group
        except ImportError as exc:
            raise PlacementError(
                f"SGLang's init_custom_process_group was not found ({exc}): update SGLang, or set "
                "env.placement.weight_sync=tensor"
            ) from exc
    torch.cuda.set_device(device)
    group = init_custom_process_group(
        backend="nccl",
        init_method=f"tcp://127.0.0.1:{master_port}",
        world_size=world_size,
        rank=0,
        group_name=SYNC_GROUP,
    )

    class Group:
        def broadcast(self, tensor: Any) -> None:
            dist.broadcast(tensor, src=0, group=group)

    return Group()
