"""What the vLLM worker's OpenMP wait policy costs: one batch's decoding time, and the CPU the idle worker
burns right after it, for the engine's passive wait beside the library's default and spin-forever.

    flock /tmp/bench.lock .venv/bin/python benchmarks/vllm_wait_policy.py

Per policy, a fresh ``VLLMEngine`` (bf16 where the CPU computes it natively, else fp32) decodes 64
chat prompts x 128 new tokens (temperature 1, seeded), then sits idle: the worker process's CPU
seconds (user + system, all its threads) in the next 0.5 s and the 5 s after. ``PASSIVE`` is the
engine's own (``stare_agent/engines/vllm_engine.py``); ``""`` leaves libgomp its default (spin
briefly, then sleep); ``ACTIVE`` spins forever. The idle seconds matter because the learner shares the
cores with the worker.
"""

from __future__ import annotations

import os
import time
from pathlib import Path


def worker_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    from stare_agent.config import cpu_has_bf16
    from stare_agent.engines.vllm_engine import VLLMEngine
    from stare_agent.models import load_tokenizer, resolve_policy_path
    from stare_envs.engine import SamplingParams

    name = "embedded:smollm2-135m-instruct"
    tokenizer = load_tokenizer(name)
    dtype = "bfloat16" if cpu_has_bf16() else "float32"
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Count to {i} and explain."}],
            add_generation_prompt=True,
            return_dict=False,
        )
        for i in range(64)
    ]
    print(f"{dtype}, 64 prompts x 128 new tokens; load average {os.getloadavg()[0]:.1f}\n")
    print("| OMP_WAIT_POLICY | decoding s | worker CPU s, 0.5 s after | worker CPU s, next 5 s |")
    print("|---|---:|---:|---:|")
    for policy in ("PASSIVE", "", "ACTIVE"):
        env = {} if policy == "PASSIVE" else {"OMP_WAIT_POLICY": policy}
        engine = VLLMEngine(
            resolve_policy_path(name), dtype=dtype, max_model_len=2048, kv_cache_gib=1, env=env
        )
        try:
            pid = engine.worker_pid
            assert pid is not None, f"the vLLM worker exited: see {engine.log_path}"
            engine.generate(prompts[:1], SamplingParams(max_new_tokens=4), [])  # warm-up
            start = time.perf_counter()
            engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=128, seed=0), [])
            seconds = time.perf_counter() - start
            a = worker_cpu_s(pid)
            time.sleep(0.5)
            b = worker_cpu_s(pid)
            time.sleep(5.0)
            c = worker_cpu_s(pid)
        finally:
            engine.close()
        label = f'"{policy}"' if policy else '"" (libgomp default)'
        print(f"| {label} | {seconds:.1f} | {b - a:.2f} | {c - b:.2f} |")


if __name__ == "__main__":
    main()
