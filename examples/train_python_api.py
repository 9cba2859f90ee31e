"""Train with STARE from Python: load a config, override a few fields, fit, plot.

python examples/train_python_api.py                 # embedded SmolLM2-135M, 2 steps on CPU
"""

from __future__ import annotations

import argparse
from pathlib import Path

from stare_agent import Trainer, load_config
from stare_agent.recipes.plots import plot_dashboard

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", default="runs/python_api")
    parser.add_argument("--tiny", action="store_true", help="a tiny random model (tests)")
    parser.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. algorithm.variant=C2")
    args = parser.parse_args(argv)

    config = load_config(
        CONFIG,
        [
            "trainer.steps=2",
            f"trainer.run_dir={args.run_dir}",
            "algorithm.name=stare",
            "algorithm.variant=O1",  # C2 also attenuates L- by M
            "algorithm.W=1.1",
            "algorithm.H_tgt=0.3",
            *args.overrides,
        ],
    )
    model = tokenizer = None
    if args.tiny:
        from stare_agent.models import tiny_model

        model, tokenizer = tiny_model()
    summary = Trainer(config, model=model, tokenizer=tokenizer).fit()
    print(plot_dashboard(config.trainer.run_dir))
    return summary


if __name__ == "__main__":
    main()
