"""Tool-use evaluation on AIME 2024 (or any problem file / hub dataset) with the code interpreter.

python examples/evaluate_aime.py                                   # embedded SmolLM2-135M, 5 problems
python examples/evaluate_aime.py --model Qwen/Qwen2.5-7B-Instruct --limit 30 --samples 32
"""

from __future__ import annotations

import argparse

from stare_agent import evaluate
from stare_agent.engines import TransformersEngine
from stare_agent.models import load_policy, tiny_model
from stare_sandbox import SandboxPool


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default="embedded:smollm2-135m-instruct", help="HF id, path, or 'tiny' (tests)"
    )
    parser.add_argument(
        "--data",
        default="aime2024",
        help="built-in set (aime2024, aime2025, amc23, math500), file or hub name",
    )
    parser.add_argument("--samples", type=int, default=2, help="k sampled episodes per problem")
    parser.add_argument("--limit", type=int, default=5, help="first N problems")
    parser.add_argument("--max-response-tokens", type=int, default=512)
    parser.add_argument(
        "--backend", default="auto", choices=["auto", "docker", "local"], help="sandbox backend"
    )
    parser.add_argument("--batch-size", type=int, default=8, help="episodes played at once, one sandbox each")
    parser.add_argument("--out", default="runs/eval_aime")
    parser.add_argument("--overwrite", action="store_true", help="delete an evaluation --out holds first")
    args = parser.parse_args(argv)

    model, tokenizer = tiny_model() if args.model == "tiny" else load_policy(args.model)
    size = min(args.batch_size, args.limit * args.samples)  # one sandbox per episode played at once
    with SandboxPool(size, backend=args.backend) as pool:  # started together, shared by the envs
        report = evaluate(
            args.data,
            engine=TransformersEngine(model, tokenizer),
            tokenizer=tokenizer,
            samples=args.samples,
            limit=args.limit,
            max_response_tokens=args.max_response_tokens,
            batch_size=args.batch_size,
            env_kwargs={"format": "retool", "pool": pool, "max_turns": 4},
            out_dir=args.out,
            overwrite=args.overwrite,
        )
    print(report.table())
    return report


if __name__ == "__main__":
    main()
