"""A training run on the tiny model with scripted rollouts, runnable as a subprocess:

    python tests/stare_agent/train/scripted_training.py RUN_DIR PROBLEMS.jsonl STEPS [--resume] [override ...]

Used by the trainer tests (SIGKILL + resume, two ranks under torchrun)."""

from __future__ import annotations

import itertools
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))


def scripted_policy():
    """Turn 0 runs code, which is right on even episodes and off by one on odd ones; turn 1 boxes
    what the interpreter printed (so the episode's state lives in its own context)."""
    episodes = itertools.count()

    def turn(prompt_text: str, turn_index: int) -> str:
        if turn_index == 0:
            a, b = map(int, re.findall(r"What is (\d+) \+ (\d+)\?", prompt_text)[-1])
            extra = " + 1" if next(episodes) % 2 else ""
            return f"Let me compute.\n<code>\n```python\nprint({a} + {b}{extra})\n```\n</code>"
        printed = re.findall(r"<interpreter>\s*(\d+)", prompt_text)[-1]
        return f"The interpreter says so.\n<answer>\\boxed{{{printed}}}</answer>"

    return turn


ADDITIONS = [
    {"id": f"add-{a}-{b}", "problem": f"What is {a} + {b}?", "answer": str(a + b)}
    for a, b in [(2, 3), (10, 7), (40, 2), (6, 6)]
]
"""Four problems the scripted policy answers (right on even episodes)."""


def write_problems(path: Path, problems: list[dict] = ADDITIONS) -> Path:
    """``problems`` as a JSONL problem file at ``path``."""
    import json

    path.write_text("".join(json.dumps(p) + "\n" for p in problems))
    return path


def overrides(run_dir: str, problems: str, steps: int) -> list[str]:
    return [
        f"data.train={problems}",
        "data.prompts_per_step=2",
        "data.samples_per_prompt=2",
        "data.max_sampling_batches=2",
        "env.max_turns=3",
        "env.max_response_tokens=256",
        "sandbox.backend=local",
        "sandbox.pool_size=2",
        "optim.lr=1e-3",
        f"trainer.steps={steps}",
        "trainer.checkpoint_every=1",
        "trainer.keep_checkpoints=10",
        f"trainer.run_dir={run_dir}",
        "deepspeed.micro_batch_tokens=512",
        "algorithm.H_tgt=100.0",  # a random model's entropy (~10.8 nats) is below it: the gate is on
    ]


def main(argv: list[str]) -> None:
    from stare_agent.config import load_config
    from stare_agent.engines.scripted import ScriptedEngine
    from stare_agent.models import tiny_model
    from stare_agent.train.trainer import Trainer

    run_dir, problems, steps, *rest = argv
    resume = "--resume" in rest
    dump = "--dump-weights" in rest
    extra = [a for a in rest if a not in ("--resume", "--dump-weights")]
    config = load_config(None, overrides(run_dir, problems, int(steps)) + extra)
    model, tokenizer = tiny_model()
    engine = ScriptedEngine(tokenizer, scripted_policy())
    trainer = Trainer(config, model=model, tokenizer=tokenizer, engine=engine, resume=resume)
    trainer.fit()
    if dump:  # this rank's final weights, to compare ranks
        import torch

        torch.save(trainer.learner.state_dict(), Path(run_dir) / f"weights-rank{trainer.rank}.pt")


if __name__ == "__main__":
    main(sys.argv[1:])
