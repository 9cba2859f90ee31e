"""The vLLM engine's worker process: holds ``vllm.LLM`` in process and serves the parent's requests.

Started by :class:`stare_agent.engines.vllm_engine.VLLMEngine` as ``<vllm python> vllm_worker.py
SOCKET PARENT_PID`` with the interpreter of a venv that has vLLM (``.venv-vllm``, where our package is
not installed), so this file imports only the standard library, vLLM, torch and safetensors, and no
other module of ours imports it. It connects to the parent's ``multiprocessing.connection`` listener
on the Unix socket ``SOCKET`` (authkey hex in ``$STARE_VLLM_AUTHKEY``), receives the ``vllm.LLM``
keyword arguments, builds the engine and answers ``("ready", info)``; then it serves one request at a
time, each ``(method, kwargs)``, answering ``("ok", result)`` or ``("error", one-line message)``:

- ``generate(prompts, sampling)``: token-id prompts and one vLLM ``SamplingParams`` dict per prompt
  (the parent builds them; a ``structured_outputs`` dict becomes ``StructuredOutputsParams``); returns per prompt ``(token_ids, logprobs, finish_reason, stop_reason)``.
- ``reload_weights(path)``: loads the tensors of the safetensors file ``path`` in place
  (``reload_weights`` of the model runner, checkpoint names), repacks a tied output head, and resets
  the prefix cache, whose KV entries were computed by the old weights.
- ``close()``: answers and exits.

It exits when the parent goes away: end of file on the connection, or the parent pid gone (checked
every second, also during a long ``generate``).
"""

from __future__ import annotations

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


def _generate(llm, prompts: list[list[int]], sampling: list[dict]) -> list[tuple]:
    from vllm import SamplingParams, TokensPrompt

    params = []
    for s in sampling:
        if isinstance(s.get("structured_outputs"), dict):  # e.g. {"regex": ...}: constrained decoding
            from vllm.sampling_params import StructuredOutputsParams

            s = {**s, "structured_outputs": StructuredOutputsParams(**s["structured_outputs"])}
        params.append(SamplingParams(**s))
    outputs = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
    results = []
    for out in outputs:
        completion = out.outputs[0]
        ids = [int(t) for t in completion.token_ids]
        entries = completion.logprobs or []
        if len(entries) != len(ids):
            raise RuntimeError(f"vLLM returned {len(ids)} tokens but {len(entries)} log-prob entries")
        logprobs = [float(entry[token].logprob) for entry, token in zip(entries, ids, strict=True)]
        stop_reason = completion.stop_reason
        results.append((ids, logprobs, completion.finish_reason, stop_reason))
    return results


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
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
            return 1
        conn.send(("ready", info))
        while True:
            try:
                method, call = conn.recv()
            except EOFError:
                return 0  # the parent closed the connection (or died)
            if method == "close":
                conn.send(("ok", None))
                return 0
            try:
                if method == "generate":
                    result: object = _generate(llm, call["prompts"], call["sampling"])
                elif method == "reload_weights":
                    result = _reload_weights(llm, call["path"])
                else:
                    raise ValueError(f"unknown method {method!r}")
            except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises it
                traceback.print_exc()
                conn.send(("error", " ".join(f"{type(exc).__name__}: {exc}".split())))
                continue
            conn.send(("ok", result))
    finally:
        conn.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
