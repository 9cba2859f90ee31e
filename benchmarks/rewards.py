"""Answer-checking throughput and worst-case latency: AnswerChecker vs serial math-verify.

Run: ``python benchmarks/rewards.py [--workers 2] [--repeats 3]``. Needs ../shared/data (AIME 2024/25
and MATH-500 golds). Pairs are all distinct, and each repeat starts a fresh process (serial) or a
fresh checker with its result cache off (pool), so neither side profits from caches. The baseline is what a training loop would do without the pool: math-verify
called serially in the main thread with its own (signal-based) timeouts.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import statistics
import sys
import time
from pathlib import Path

from stare_envs.rewards import AnswerChecker

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
POWER_TOWER = "9^{9^{9^{9}}}"


def aime_pairs() -> list[tuple[str, str]]:
    """(prediction, gold): how models write AIME answers, right and wrong, all pairs distinct."""
    golds = [
        json.loads(line)["answer"]
        for name in ("aime2024", "aime2025")
        for line in (DATA / f"{name}.jsonl").open()
    ]
    pairs = []
    for gold in golds:
        g = int(gold)
        pairs += [
            (gold, gold),
            (f"0{gold}", gold),
            (f"\\boxed{{{gold}}}", gold),
            (f"{g}.0", gold),
            (f"\\frac{{{2 * g}}}{{2}}", gold),
            (f"{g}^\\circ", gold),
            (f"x = {g}", gold),
            (f"{g} \\text{{ minutes}}", gold),
        ]
        pairs += [(str(g + k), gold) for k in range(1, 9)]  # wrong integers
        pairs += [(f"\\frac{{{g + k}}}{{3}}", gold) for k in range(1, 5)]  # wrong fractions
    return pairs


def math500_pairs() -> list[tuple[str, str]]:
    golds = [json.loads(line)["answer"] for line in (DATA / "math500.jsonl").open()]
    pairs = [(f"The answer is $\\boxed{{{gold}}}$.", gold) for gold in golds]
    pairs += [(f"{gold} + 1", gold) for gold in golds]  # wrong, still parseable
    return pairs


def _serial_rate(pairs: list[tuple[str, str]], queue: multiprocessing.Queue) -> None:
    from math_verify import parse, verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)
    verify(parse("$\\frac{1}{7}$"), parse("$0.5$"))  # warm up on an unrelated pair
    started = time.perf_counter()
    for prediction, gold in pairs:
        verify(parse(f"${gold}$"), parse(prediction if "\\boxed" in prediction else f"${prediction}$"))
    queue.put(len(pairs) / (time.perf_counter() - started))


def serial_math_verify(pairs: list[tuple[str, str]]) -> float:
    """Checks/s of math-verify called serially in one fresh process (cold caches), main thread,
    default signal-based timeouts."""
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=_serial_rate, args=(pairs, queue), daemon=True)
    process.start()
    rate = queue.get()
    process.join()
    return rate


def pooled(workers: int, timeout_s: float, pairs: list[tuple[str, str]]) -> float:
    """Checks/s of a fresh AnswerChecker (cold caches, result cache off), after warm-up."""
    with AnswerChecker(workers, timeout_s=timeout_s, cache_size=0) as checker:
        checker.check_many([(f"\\frac{{{k}}}{{7}}", "1") for k in range(4 * workers)])
        started = time.perf_counter()
        checker.check_many(pairs)
        return len(pairs) / (time.perf_counter() - started)


def _serial_pathological(queue: multiprocessing.Queue) -> None:
    from math_verify import parse, verify

    started = time.perf_counter()
    verify(parse("$7$"), parse(f"${POWER_TOWER}$"))
    queue.put(time.perf_counter() - started)


def serial_pathological_latency(cap_s: float) -> float | None:
    """Latency of the power tower with math-verify's own timeouts, in a child capped at ``cap_s``."""
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=_serial_pathological, args=(queue,), daemon=True)
    process.start()
    process.join(cap_s + 5)  # includes the child's import time
    if process.is_alive():
        process.kill()
        process.join()
        return None
    return queue.get()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=3.0)
    parser.add_argument("--serial-cap", type=float, default=20.0)
    args = parser.parse_args()
    logging.getLogger("math_verify").setLevel(logging.ERROR)

    workloads = {"AIME-style": aime_pairs(), "MATH-500-style": math500_pairs()}
    rows = []
    for name, pairs in workloads.items():
        serial_rates = [serial_math_verify(pairs) for _ in range(args.repeats)]
        pool_rates = [pooled(args.workers, args.timeout, pairs) for _ in range(args.repeats)]
        rows.append((name, len(pairs), statistics.median(serial_rates), statistics.median(pool_rates)))
    with AnswerChecker(args.workers, timeout_s=args.timeout, cache_size=0) as checker:
        checker.check_many(workloads["AIME-style"])
        fast_share = checker.stats["fast_path"] / checker.stats["checks"]

        latencies, recoveries = [], []
        for _ in range(args.repeats):
            started = time.perf_counter()
            assert checker.check(POWER_TOWER, "7") is False
            latencies.append(time.perf_counter() - started)
            started = time.perf_counter()
            while checker.stats["idle_workers"] < args.workers:
                time.sleep(0.005)
            recoveries.append(time.perf_counter() - started)
        started = time.perf_counter()
        megabyte_false = checker.check("x+" * 500_000, "7") is False
        megabyte_s = time.perf_counter() - started
        healthy = checker.check_many(workloads["AIME-style"][:40]) == pooled_truth(
            workloads["AIME-style"][:40]
        )
        stats = checker.stats

    serial_tower = serial_pathological_latency(args.serial_cap)

    print(
        f"\nAnswer checking, {args.workers} workers, timeout {args.timeout:.1f} s, median of {args.repeats}\n"
    )
    print(f"{'workload':<16} {'pairs':>6} {'serial checks/s':>16} {'pool checks/s':>14} {'ratio':>7}")
    for name, count, serial_rate, pool_rate in rows:
        print(
            f"{name:<16} {count:>6} {serial_rate:>16.0f} {pool_rate:>14.0f} {pool_rate / serial_rate:>6.1f}x"
        )
    print(f"(the integer fast path decides {fast_share:.0%} of the AIME-style pairs without the pool)")
    bound = args.timeout + 0.5
    serial_text = (
        f"{serial_tower:.1f} s" if serial_tower is not None else f"> {args.serial_cap:.0f} s (killed)"
    )
    print(f"\n{'pathological input':<34} {'median latency':>15} {'bound':>8}")
    print(f"{'power tower, pool':<34} {statistics.median(latencies):>13.2f} s {bound:>6.1f} s")
    print(f"{'power tower, serial math-verify':<34} {serial_text:>15} {'-':>8}")
    print(f"{'1 MB prediction, pool':<34} {megabyte_s:>13.4f} s {bound:>6.1f} s   (False: {megabyte_false})")
    print(f"worker replaced and idle again after (median): {statistics.median(recoveries):.2f} s")
    print(f"pool healthy afterwards: {healthy}; stats: {stats}")
    aime_rate = rows[0][3]
    ok = aime_rate >= 200 and max(latencies) <= bound and healthy and megabyte_false
    print(
        f"\ntargets (>= 200 AIME checks/s, every pathological check <= {bound:.1f} s, healthy): {'met' if ok else 'MISSED'}"
    )
    sys.exit(0 if ok else 1)


def pooled_truth(pairs: list[tuple[str, str]]) -> list[bool]:
    """Expected verdicts for ``aime_pairs()`` prefixes: 8 right variants, then 12 wrong ones, per gold."""
    return [index % 20 < 8 for index in range(len(pairs))]


if __name__ == "__main__":
    main()
