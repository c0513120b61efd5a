"""Before and after in one run: a benchmark script of this tree, run alternately with aiocollect from
this tree and from another checkout, its ratios to the limit side by side.

    git worktree add /tmp/before <commit>
    .venv/bin/python benchmarks/compare_trees.py --with /tmp/before --rounds 2 -- \\
        benchmarks/vector_envs.py --seconds 3 --skip-envpool

The script (any of ``benchmarks/`` that takes ``--json PATH``) is this tree's file in both runs, so
only aiocollect differs; each run is a fresh process with ``PYTHONPATH`` set to the tree it
measures, checked before it starts. Rounds alternate the order (this tree first, then the other
first), so a drift of the machine's load favours neither. Every result in the script's JSON that has
a ratio (``ratio_to_limit`` or ``ratio``: frames/s over the limit measured in the same run) is
compared: the median of the rounds of each tree, and the change. Ratios, not frames/s: each run
divides by its own limit, so a busy machine moves both sides alike.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def log(msg: str) -> None:
    print(msg, flush=True)


def ratios(data: Any, path: tuple[str, ...] = ()) -> dict[str, float]:
    """``table / setup name`` -> ratio, for every result of a benchmark's JSON that has one."""
    found: dict[str, float] = {}
    if isinstance(data, dict):
        ratio = data.get("ratio_to_limit", data.get("ratio"))
        name = data.get("name")
        if isinstance(ratio, (int, float)) and not isinstance(ratio, bool):
            if isinstance(name, str):
                found[" / ".join((*path, name))] = float(ratio)
                return found
            if path:  # (results keyed by their setup's name: --sliced runs)
                found[" / ".join(path)] = float(ratio)
                return found
        for key, value in data.items():
            named = isinstance(value, dict) and value.get("name") == key  # (results keyed by their name)
            found.update(ratios(value, path if key == "results" or named else (*path, str(key))))
    elif isinstance(data, list):
        parts = [ratios(item, path) for item in data]
        if sum(map(len, parts)) > len({key for part in parts for key in part}):
            # the same setups in several items (pixels.py's runs: one per observation format and
            # repeat): each item under a label of its own, not the last one's figures alone
            labels = [_label(item) for item in data]
            if len(set(labels)) < len(labels):
                labels = [f"{label} {k + 1}" for k, label in enumerate(labels)]
            parts = [ratios(item, (*path, label)) for item, label in zip(data, labels)]
        for part in parts:
            found.update(part)
    return found


def _label(item: Any) -> str:
    """What tells an item of a list of runs apart: its observation format (pixels.py), else "run"."""
    obs = item.get("obs") if isinstance(item, dict) else None
    return obs if isinstance(obs, str) else "run"


def aiocollect_of(tree: str) -> str:
    """Where ``import aiocollect`` finds the package with ``PYTHONPATH=tree``."""
    out = subprocess.run(
        [sys.executable, "-c", "import aiocollect, os; print(os.path.dirname(os.path.dirname(os.path.abspath(aiocollect.__file__))))"],
        env={**os.environ, "PYTHONPATH": tree}, cwd=tree, capture_output=True, text=True, timeout=120,
    )
    if out.returncode:
        raise SystemExit(f"compare_trees: aiocollect does not import from {tree}: {out.stderr.strip()[-300:]}")
    return out.stdout.strip()


def run_once(script: list[str], tree: str, timeout: float) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="compare-trees-") as tmp:
        path = os.path.join(tmp, "out.json")
        # (run in the tree's directory, as `python -c` was for the check: nothing else on sys.path first)
        proc = subprocess.run([sys.executable, *script, "--json", path], env={**os.environ, "PYTHONPATH": tree},
                              cwd=tree, capture_output=True, text=True, timeout=timeout)
        if proc.returncode or not os.path.exists(path):
            tail = (proc.stderr or proc.stdout).strip()[-500:]
            raise SystemExit(f"compare_trees: {' '.join(script)} with {tree} failed (exit {proc.returncode}): {tail}")
        with open(path) as f:
            return ratios(json.load(f))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ours, theirs = HERE, os.path.abspath(args.other)
    for tree in (ours, theirs):
        if os.path.abspath(aiocollect_of(tree)) != os.path.abspath(tree):
            raise SystemExit(f"compare_trees: with PYTHONPATH={tree}, aiocollect imports from {aiocollect_of(tree)}; "
                             f"pass a checkout that holds aiocollect/ (git worktree add DIR COMMIT)")
    script = args.script[1:] if args.script[:1] == ["--"] else args.script
    if not script:
        raise SystemExit("compare_trees: name the benchmark script after --, e.g. -- benchmarks/vector_envs.py --seconds 3")
    script = [os.path.abspath(script[0]), *script[1:]]
    shown = " ".join([os.path.relpath(script[0], HERE), *script[1:]])
    runs: list[list[dict[str, float]]] = [[], []]  # this tree's, the other's (the same tree twice: an A/A run)
    trees = [(0, ours, "this tree"), (1, theirs, theirs)]
    total = 2 * args.rounds
    done = 0
    for r in range(args.rounds):
        for side, tree, label in trees if r % 2 == 0 else trees[::-1]:
            done += 1
            log(f"[{done}/{total}] {shown} with aiocollect from {label} ...")
            t0 = time.perf_counter()
            runs[side].append(run_once(script, tree, args.timeout))
            log(f"  -> {len(runs[side][-1])} ratios in {time.perf_counter() - t0:.0f} s")
    names = sorted(set().union(*runs[0], *runs[1]))
    width = max([len(n) for n in names] + [5])
    log(f"\n{shown}: ratio to the limit, median of {args.rounds} round(s) each (rounds in brackets)")
    log(f"{'setup':<{width}}  {'this tree':>9}  {'compared':>9}  change  rounds (this tree | compared)")
    for name in names:
        a = [run[name] for run in runs[0] if name in run]
        b = [run[name] for run in runs[1] if name in run]
        ma = statistics.median(a) if a else None
        mb = statistics.median(b) if b else None
        change = f"{(ma / mb - 1) * 100:+5.1f}%" if ma and mb else "    -"
        cells = (f"{ma:9.2f}" if ma is not None else f"{'-':>9}", f"{mb:9.2f}" if mb is not None else f"{'-':>9}")
        log(f"{name:<{width}}  {cells[0]}  {cells[1]}  {change}  "
            f"{' '.join(f'{x:.2f}' for x in a)} | {' '.join(f'{x:.2f}' for x in b)}")
    log(f"compared: aiocollect from {theirs}; this tree: {ours}")
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Run a benchmark script with aiocollect from this tree and from another checkout, "
        "alternately, and print its ratios to the limit side by side.",
        usage="compare_trees.py --with TREE [--rounds N] -- SCRIPT [SCRIPT'S OPTIONS]",
    )
    p.add_argument("--with", dest="other", required=True, metavar="TREE",
                   help="another checkout of aiocollect (e.g. `git worktree add /tmp/before <commit>`)")
    p.add_argument("--rounds", type=int, default=2, help="runs of the script with each tree (default 2)")
    p.add_argument("--timeout", type=float, default=900, help="seconds one run of the script may take (default 900)")
    p.add_argument("script", nargs=argparse.REMAINDER, help="the benchmark script and its options, after --")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds {args.rounds} must be >= 1")
    return args


if __name__ == "__main__":
    raise SystemExit(main())
