"""Fuzz report: the strategies of tests/test_fuzz.py (tests/fuzz_cases.py) with many more
examples, and the count of fuzzed inputs and how they ended.

For every constructor (Collector, Evaluator, ReplayBuffer, UniformSampler, StalenessAwareSampler,
SliceSampler, ProfileConfig), the collector's set_seed / load_state_dict / enable_profile /
subscribe, update_weights on a started collector and on one never started, and the Evaluator's
evaluate / trigger: hypothesis draws cases, half with every argument valid, half with one argument
(or one combination) wrong, and each case ends in one of

- ``valid: accepted`` / ``invalid: rejected with our error naming it`` (a ConfigError whose
  message names the argument, and shows the value where its repr is at most 40 characters), the
  two good outcomes;
- anything else: ``INVALID VALUE ACCEPTED``, ``VALID VALUE REFUSED``, ``RAW <exception>`` (not an
  AiocollectError), ``NOT A ConfigError``, ``MESSAGE LACKS ARGUMENT/VALUE``, ``PROCESS STARTED``
  (the launcher was asked to fork, or a pid was recorded), ``HANG`` (over 5 s). The first few
  examples of each are printed after the table.

Hypothesis does not repeat an example, so a target with few distinct valid values (a flag) counts
few valid cases; draws are random on each run (``--seed`` to repeat one).

    python benchmarks/fuzz_report.py                   # 2000 per constructor/method, 500 per running method
    python benchmarks/fuzz_report.py --examples 300 --running-examples 100 --seed 1
"""

from __future__ import annotations

import argparse
import collections
import faulthandler
import os
import sys
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=2000, help="examples per constructor or method")
    parser.add_argument("--running-examples", type=int, default=500, help="examples per method of a running object")
    parser.add_argument("--seed", type=int, default=None, help="hypothesis seed (default: random)")
    parser.add_argument("--uvloop", action="store_true", help="run the running objects on uvloop")
    args = parser.parse_args()

    warnings.simplefilter("error")  # as the tests: a warning is a failure
    faulthandler.dump_traceback_later(1800, exit=True)  # a real hang ends the run with its stack

    from hypothesis import HealthCheck, given, seed, settings

    import fuzz_cases as fc
    from aiocollect import Collector

    failures: dict[tuple[str, str, str], list[str]] = collections.defaultdict(list)
    times: dict[str, float] = {}

    def run(target: fc.Target, examples: int) -> None:
        @settings(
            max_examples=examples, deadline=None, database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
        )
        @given(case=fc.cases(target))
        def check(case: fc.Case) -> None:
            outcome, detail = fc.attempt(case)
            if outcome not in fc.GOOD:
                failures[(target.name, case.argument, outcome)].append(f"{case!r:.300} -> {detail:.300}")

        if args.seed is not None:
            check = seed(args.seed)(check)
        t0 = time.perf_counter()
        check()
        times[target.name] = time.perf_counter() - t0
        print(f"  {target.name}: {sum(n for (t, _), n in fc.STATS.items() if t == target.name)} cases in "
              f"{times[target.name]:.1f} s", file=sys.stderr, flush=True)

    t_start = time.perf_counter()
    for target in fc.constructor_targets():
        run(target, args.examples)
    collector = Collector("CartPole-v1", frames_per_batch=8, num_workers=1)
    try:
        for target in fc.collector_method_targets(collector):
            run(target, args.examples)
    finally:
        collector.close()
    with fc.RunningFuzz(args.uvloop) as fuzz:
        for target in fuzz.targets():
            run(target, args.running_examples)
        try:
            fuzz.still_usable()
        except Exception as exc:  # noqa: BLE001 - reported with the rest
            failures[("after the fuzzing", "-", "NOT USABLE / STARTED")].append(f"{type(exc).__name__}: {exc}")
    total_s = time.perf_counter() - t_start

    print(f"Fuzzed inputs and how they ended ({'uvloop' if args.uvloop else 'asyncio'} for the running objects; "
          f"hypothesis seed {args.seed if args.seed is not None else 'random'}; {total_s:.0f} s)")
    print()
    print(fc.table())
    bad = sum(n for (_, outcome), n in fc.STATS.items() if outcome not in fc.GOOD)
    print()
    if not failures:
        print(f"Every case ended well: {sum(fc.STATS.values())} inputs, none refused wrongly, accepted wrongly, "
              f"answered with a raw error, slow, or starting a process.")
    else:
        print(f"{bad} case(s) ended badly:")
        for (target, argument, outcome), examples in sorted(failures.items()):
            print(f"- {target} / {argument}: {outcome} ({len(examples)})")
            for text in examples[:3]:
                print(f"    {text}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
