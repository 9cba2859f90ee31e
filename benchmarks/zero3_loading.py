"""CPU memory of loading a policy with two ranks: plain ``from_pretrained`` on every rank (baseline)
vs ZeRO-3 partitioned loading (``stare_agent.train.deepspeed_setup.load_training_policy``, under ``zero.Init``).

    python benchmarks/zero3_loading.py                 # the embedded SmolLM2-135M (fp32, ~0.5 GB)
    python benchmarks/zero3_loading.py --model PATH    # any checkpoint directory or hub id

Each variant runs in its own ``torchrun --nproc_per_node 2`` (gloo, CPU). Each rank reports the
parameter bytes it holds after the load (its ZeRO-3 partition, or the whole model), its RSS increase
once every weight it holds has been touched (as training touches them: a plain load maps the
safetensors file and reads pages lazily), and its peak RSS increase (ru_maxrss minus the RSS before
the load). Medians over ``--repeats`` launches.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _rank(model: str, zero3: bool, out: str) -> None:
    import torch.distributed as dist

    from stare_agent.config import load_config
    from stare_agent.train.deepspeed_setup import init_distributed, load_training_policy

    cfg = load_config(
        None,
        [
            f"model.name_or_path={model}",
            f"deepspeed.zero_stage={3 if zero3 else 0}",
            "deepspeed.precision=fp32",
        ],
    )
    init_distributed("gloo")
    dist.barrier()
    before = _rss_bytes()
    policy, _ = load_training_policy(cfg)
    tensors = [getattr(p, "ds_tensor", p) for p in policy.parameters()]
    for t in tensors:  # touch every weight this rank holds, as training will (mmap'ed pages load now)
        float(t.detach().float().sum())
    gc.collect()
    resident = _rss_bytes() - before
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    held = sum(t.numel() * t.element_size() for t in tensors)
    dist.barrier()
    record = {"resident": resident, "peak_increase": peak, "held": held}
    Path(out, f"rank{dist.get_rank()}.json").write_text(json.dumps(record))


def _launch(model: str, zero3: bool) -> list[dict[str, int]]:
    with tempfile.TemporaryDirectory() as out, socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2"]
        command += [
            "--master_addr=127.0.0.1",
            f"--master_port={port}",
            __file__,
            "--rank-of",
            model,
            str(int(zero3)),
            out,
        ]
        done = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise SystemExit(done.stderr[-3000:])
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(2)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default=None, help="checkpoint directory or hub id (default: the embedded model)"
    )
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.model is None:
        from stare_agent.models import embedded_model_path

        args.model = str(embedded_model_path())
    results: dict[bool, list[list[dict[str, int]]]] = {False: [], True: []}
    for _ in range(args.repeats):  # interleaved, so load drifts hit both alike
        for zero3 in (False, True):
            results[zero3].append(_launch(args.model, zero3))
    mib = 1024**2
    from stare_agent.provenance import machine

    print(f"machine: {platform.node()}, {machine()}")
    print(f"model: {args.model}; 2 ranks (gloo, CPU); medians over {args.repeats} launches\n")
    print("| rank | variant | params held MiB | RSS after load +MiB | peak RSS during load +MiB |")
    print("|---|---|---|---|---|")
    for r in range(2):
        for zero3, name in ((False, "plain from_pretrained (baseline)"), (True, "ZeRO-3 zero.Init")):
            med = {
                k: statistics.median(run[r][k] for run in results[zero3]) / mib
                for k in ("held", "resident", "peak_increase")
            }
            print(
                f"| {r} | {name} | {med['held']:.0f} | {med['resident']:.0f} | {med['peak_increase']:.0f} |"
            )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank-of":
        _rank(sys.argv[2], bool(int(sys.argv[3])), sys.argv[4])
    else:
        main()
