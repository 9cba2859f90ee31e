"""The vLLM engine's worker process: holds ``vllm.LLM`` in process and serves the parent's requests.

Started by :class:`stare_agent.engines.vllm_engine.VLLMEngine` as ``<vllm python> vllm_worker.py
SOCKET PARENT_PID`` with the interpreter of a venv that has vLLM (``.venv-vllm``, where our package is
not installed), so this file imports only the standard library, vLLM, torch and safetensors, and no
other module of ours imports it. It connects to the parent's ``multiprocessing.connection`` listener
on the Unix socket ``SOCKET`` (authkey hex in ``$STARE_VLLM_AUTHKEY``), receives the ``vllm.LLM``
keyword arguments, builds the engine and answers ``("ready", info)``. From then on every message is
``(call id, method, kwargs)`` and every answer ``(call id, "ok", result)`` or ``(call id, "error", one-line
message)``; the engine keeps stepping while messages arrive (continuous batching):

- ``submit(requests)``, sent as ``(None, "submit", {"requests": [(call id, prompt, sampling), ...]})``:
  token-id prompts, each with its vLLM ``SamplingParams`` dict (the parent builds it; a
  ``structured_outputs`` dict becomes ``StructuredOutputsParams``), join the running batch together at
  the next engine step; each request is answered under its own call id when it finishes:
  ``(token_ids, logprobs, finish_reason, stop_reason)``. A batch is one message so that the engine
  never steps on part of it: which requests share an engine step changes the float rounding of
  bf16 kernels, so a batch split by the timing of the socket would make seeded tokens differ from
  run to run. Requests stream their tokens (``RequestOutputKind.DELTA``, which changes no sampled
  token or log-prob): the worker keeps each request's tokens and log-probs so far, for ``interrupt``.
- ``interrupt()``: at once, ahead of any call held behind a weight reload, aborts every request in
  flight (``LLMEngine.abort_request``, which gives no output of its own) and answers each with its
  tokens and log-probs so far and finish reason ``"abort"``; answers the number aborted. Requests
  submitted after it are not affected: the socket keeps the order, so with nothing in flight it does
  nothing. It is read between engine steps, so it ends a generation within one step.
- ``reload_weights(path)``: after the requests in flight finish, loads the tensors of the safetensors
  file ``path`` in place (``reload_weights`` of the model runner, checkpoint names), repacks a tied
  output head, and resets the prefix cache, whose KV entries were computed by the old weights.
- ``sleep(level)``, ``wake_up()``, ``weight_transfer_init(init_info)``, ``weight_transfer_update(update_info)``:
  as ``reload_weights``, after the requests in flight (``env.placement``; see ``_placement_call``).
- ``close()``: answers and exits.

It exits when the parent goes away: end of file on the connection, or the parent pid gone (checked
every second, also during a long ``generate``).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import traceback


def _watch_parent(parent_pid: int) -> None:
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(3)  # the parent died: nobody will read our answers


def _build(kwargs: dict) -> tuple[object, dict]:
    import vllm

    llm = vllm.LLM(**kwargs)
    tokenizer = llm.get_tokenizer()
    config = llm.llm_engine.model_config
    info = {
        "vllm_version": vllm.__version__,
        "eos_token_id": tokenizer.eos_token_id,
        "max_model_len": config.max_model_len,
        "dtype": str(config.dtype).removeprefix("torch."),
    }
    return llm, info


def _sampling_params(s: dict):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    if isinstance(s.get("structured_outputs"), dict):  # e.g. {"regex": ...}: constrained decoding
        from vllm.sampling_params import StructuredOutputsParams

        s = {**s, "structured_outputs": StructuredOutputsParams(**s["structured_outputs"])}
    # DELTA: each step's new tokens, kept by the worker (_take), so an interrupted request has its own
    return SamplingParams(**s, output_kind=RequestOutputKind.DELTA)


def _take(out, partial: tuple[list[int], list[float]]) -> None:
    """Append the tokens and log-probs of one step's (DELTA) output of a request to ``partial``."""
    completion = out.outputs[0]
    ids = [int(t) for t in completion.token_ids]
    entries = completion.logprobs or []
    if len(entries) != len(ids):
        raise RuntimeError(f"vLLM returned {len(ids)} tokens but {len(entries)} log-prob entries")
    partial[0].extend(ids)
    partial[1].extend(float(entry[token].logprob) for entry, token in zip(entries, ids, strict=True))


def _result(out, partial: tuple[list[int], list[float]]) -> tuple:
    """The answer to a finished request: every token and log-prob it streamed, and why it stopped."""
    completion = out.outputs[0]
    return partial[0], partial[1], completion.finish_reason, completion.stop_reason


def _repack_tied_head(worker) -> bool:
    """Rebuild the output head's kernel weights from the (reloaded) input embeddings it is tied to.

    vLLM's CPU linear kernels run on a packed copy of each weight made after loading; a reload repacks
    the layers whose weights it loaded, but a tied ``lm_head`` loads none (it shares the embeddings),
    so without this it would keep computing logits with the OLD embeddings.
    """
    model = worker.get_model()
    head = getattr(model, "lm_head", None)
    method = getattr(head, "quant_method", None)
    if method is None or not getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        return False
    method.process_weights_after_loading(head)
    return True


def _reload_weights(llm, path: str) -> float:
    from safetensors import safe_open

    start = time.perf_counter()
    with safe_open(path, framework="pt") as f:
        weights = ((name, f.get_tensor(name)) for name in f.keys())  # noqa: SIM118 - safe_open has no iter
        llm.collective_rpc(
            "reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True}
        )
    llm.collective_rpc(_repack_tied_head)
    llm.reset_prefix_cache()  # its KV entries were computed with the old weights
    return time.perf_counter() - start


BARRIER_CALLS = ("reload_weights", "sleep", "wake_up", "weight_transfer_init", "weight_transfer_update")
"""Calls that wait for the requests in flight to finish, and that later calls wait for."""


def _barrier_call(llm, method: str, call: dict):
    if method == "reload_weights":
        return _reload_weights(llm, call["path"])
    return _placement_call(llm, method, call)


def _placement_call(llm, method: str, call: dict):
    """The calls of ``env.placement`` (stare_agent/engines/placement.py), against vLLM's documented API:
    ``sleep(level)`` / ``wake_up()`` (an engine built with ``enable_sleep_mode``), and NCCL weight
    transfer (built with ``weight_transfer_config={"backend": "nccl"}``): ``init_weight_transfer_engine``
    once, then per update ``start_weight_update``, ``update_weights`` (the parent broadcasts the tensors
    meanwhile), ``finish_weight_update``, on every worker of the engine; returns the seconds it took."""
    start = time.perf_counter()
    if method == "sleep":
        llm.sleep(level=int(call.get("level", 1)))
    elif method == "wake_up":
        llm.wake_up()
    elif method == "weight_transfer_init":
        llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": call["init_info"]})
    elif method == "weight_transfer_update":
        llm.collective_rpc("start_weight_update")
        llm.collective_rpc("update_weights", kwargs={"update_info": call["update_info"]})
        llm.collective_rpc("finish_weight_update")
        llm.reset_prefix_cache()  # its KV entries were computed with the old weights
    else:
        raise ValueError(f"unknown method {method!r}")
    return time.perf_counter() - start


def _one_line(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())


def _serve(conn, llm) -> int:
    """Answer the parent's calls while stepping the engine over every request in flight.

    Calls run in the order they arrive, except that a submitted request joins the batch at once and
    an ``interrupt`` acts at once: a weight reload waits until the requests before it finish, and the
    calls after it wait for it.
    """
    engine = llm.llm_engine
    # call id of each submitted request (vLLM reports them by this id) -> its tokens, log-probs so far
    in_flight: dict[str, tuple[list[int], list[float]]] = {}
    waiting: list[tuple] = []  # calls held behind a weight reload, in order
    while True:
        # Take every message that has arrived; block only when there is nothing to step.
        while conn.poll(0) or not (in_flight or waiting):
            try:
                call_id, method, call = conn.recv()
            except EOFError:
                return 0  # the parent closed the connection (or died)
            if method == "close":
                conn.send((call_id, "ok", None))
                return 0
            if method == "interrupt":
                conn.send((call_id, "ok", _interrupt(conn, engine, in_flight)))
            elif waiting or method in BARRIER_CALLS:
                waiting.append((call_id, method, call))
            else:
                _start_call(conn, engine, in_flight, call_id, method, call)
        while waiting and not (in_flight and waiting[0][1] in BARRIER_CALLS):
            call_id, method, call = waiting.pop(0)
            if method in BARRIER_CALLS:  # nothing in flight: the weights may change
                try:
                    conn.send((call_id, "ok", _barrier_call(llm, method, call)))
                except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises it
                    traceback.print_exc()
                    conn.send((call_id, "error", _one_line(exc)))
            else:
                _start_call(conn, engine, in_flight, call_id, method, call)
        if not in_flight:
            continue
        try:
            outputs = engine.step()
        except Exception as exc:  # the engine is broken: fail what is in flight, then exit
            traceback.print_exc()
            for rid in in_flight:
                conn.send((int(rid), "error", _one_line(exc)))
            raise
        for out in outputs:
            partial = in_flight.get(out.request_id)
            if partial is None:
                continue  # an aborted request's last step
            try:
                _take(out, partial)
                if not out.finished:
                    continue
                answer: tuple = (int(out.request_id), "ok", _result(out, partial))
            except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises it
                answer = (int(out.request_id), "error", _one_line(exc))
                with contextlib.suppress(Exception):
                    engine.abort_request([out.request_id])
            del in_flight[out.request_id]
            conn.send(answer)


def _interrupt(conn, engine, in_flight: dict[str, tuple[list[int], list[float]]]) -> int:
    """Abort every request in flight; answer each with its tokens so far and ``"abort"``."""
    if not in_flight:
        return 0
    aborted = list(in_flight)
    engine.abort_request(aborted)
    for rid in aborted:
        ids, logprobs = in_flight.pop(rid)
        conn.send((int(rid), "ok", (ids, logprobs, "abort", None)))
    return len(aborted)


def _start_call(
    conn,
    engine,
    in_flight: dict[str, tuple[list[int], list[float]]],
    call_id: int | None,
    method: str,
    call: dict,
) -> None:
    """Add every request of a submitted batch to the running batch, or answer an unknown method."""
    if method != "submit":
        conn.send((call_id, "error", f"unknown method {method!r}"))
        return
    for request_id, prompt, sampling in call["requests"]:
        try:
            engine.add_request(str(request_id), _tokens_prompt(prompt), _sampling_params(sampling))
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises it
            traceback.print_exc()
            conn.send((request_id, "error", _one_line(exc)))
            continue
        in_flight[str(request_id)] = ([], [])


def _tokens_prompt(prompt: list[int]):
    from vllm import TokensPrompt

    return TokensPrompt(prompt_token_ids=[int(t) for t in prompt])


def main(argv: list[str]) -> int:
    from multiprocessing.connection import Client

    socket_path, parent_pid = argv[1], int(argv[2])
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    conn = Client(socket_path, family="AF_UNIX", authkey=bytes.fromhex(os.environ.pop("STARE_VLLM_AUTHKEY")))
    try:
        kwargs = conn.recv()
        try:
            llm, info = _build(kwargs)
        except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises it
            traceback.print_exc()
            conn.send(("error", _one_line(exc)))
            return 1
        conn.send(("ready", info))
        return _serve(conn, llm)
    finally:
        conn.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
