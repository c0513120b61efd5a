"""Recurrent PPO on CartPole without velocities: a GRU against the same GRU without memory.

Runs ``examples/recurrent_ppo.py`` twice on the same frame budget and seed, each in its own
process (both at once by default, ``--one-at-a-time`` to run them in turn): once as it is (the
GRU's state carried from step to step), once with ``--no-memory`` (the same network, its state
zeroed every step: a memoryless net that sees only the cart's position and the pole's angle).
The learning curves (frames collected -> mean return of the episodes that ended in each window of
``--log-every`` frames) are printed side by side, and drawn to ``--plot`` (needs matplotlib:
``pip install 'aiocollect[plots]'``; ``--plot ''`` draws nothing).

Run::

    .venv/bin/python benchmarks/recurrent_ppo.py                        # 163,840 frames each
    .venv/bin/python benchmarks/recurrent_ppo.py --frames 40960 --plot /tmp/rppo.png

The figures are frames against returns, not timings: a loaded machine takes longer, not
differently.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "recurrent_ppo.py")
PROGRESS = re.compile(r"^frames\s+(\d+)\s+fps\s+\d+\s+episodes\s+(\d+)\s+mean return\s+(\S+)", re.MULTILINE)
FINAL = re.compile(r"^final mean return (\S+) .*$", re.MULTILINE)
VARIANTS = {"GRU (memory)": [], "same GRU, state zeroed every step": ["--no-memory"]}


def run_variants(args: argparse.Namespace) -> dict[str, tuple[list[tuple[int, float]], float]]:
    """Each variant's curve ``[(frames, mean return)]`` and final mean return."""
    common = ["--frames", str(args.frames), "--log-every", str(args.log_every), "--seed", str(args.seed)]
    procs: dict[str, subprocess.Popen[str]] = {}
    outputs: dict[str, str] = {}
    try:
        for name, extra in VARIANTS.items():
            print(f"running {name}: {os.path.relpath(EXAMPLE, ROOT)} {' '.join(common + extra)}", flush=True)
            procs[name] = subprocess.Popen([sys.executable, EXAMPLE, *common, *extra], cwd=ROOT, text=True,
                                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            if args.one_at_a_time:
                outputs[name] = procs[name].communicate()[0]
        for name, proc in procs.items():
            outputs.setdefault(name, proc.communicate()[0])
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    results = {}
    for name, proc in procs.items():
        out = outputs[name]
        final = FINAL.search(out)
        if proc.returncode != 0 or final is None:
            raise SystemExit(f"recurrent_ppo: the {name} run failed (exit status {proc.returncode}):\n{out[-3000:]}")
        print(f"{name}: {final.group(0)}")  # (with the largest replay error: float rounding when the state is right)
        results[name] = ([(int(f), float(r)) for f, _, r in PROGRESS.findall(out)], float(final.group(1)))
    return results


def print_table(results: dict[str, tuple[list[tuple[int, float]], float]]) -> None:
    names = list(results)
    print(f"\n{'frames':>8}  " + "  ".join(f"{name:>34}" for name in names))
    curves = [dict(results[name][0]) for name in names]
    for frames in sorted(set().union(*curves)):
        print(f"{frames:>8}  " + "  ".join(f"{curve.get(frames, float('nan')):>34.1f}" for curve in curves))
    print(f"{'final':>8}  " + "  ".join(f"{results[name][1]:>34.1f}" for name in names)
          + "   (mean return of the last 100 training episodes)")


def save_plot(results: dict[str, tuple[list[tuple[int, float]], float]], args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    for (name, (curve, _)), colour in zip(results.items(), ("#3070b0", "#e0a040")):
        ax.plot([f for f, _ in curve], [r for _, r in curve], marker="o", markersize=3, color=colour, label=name)
    ax.axhline(22, color="#9e9e9e", linestyle="--", linewidth=1, label="random policy (about 22)")
    ax.set_xlabel("frames collected")
    ax.set_ylabel(f"mean return (episodes of each {args.log_every:,} frames)")
    ax.set_title(f"Recurrent PPO, CartPole-v1 without velocities (seed {args.seed}, "
                 f"{os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d')})", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(args.plot)
    plt.close(fig)
    print(f"plot written to {args.plot}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--frames", type=int, default=163_840, help="frames each run collects (a multiple of 1024)")
    p.add_argument("--log-every", type=int, default=8192, help="frames per point of the curves")
    p.add_argument("--seed", type=int, default=1, help="seed of both runs")
    p.add_argument("--one-at-a-time", action="store_true", help="run the two variants in turn, not at once")
    p.add_argument("--plot", default=os.path.join(ROOT, "docs", "img", "recurrent_ppo.png"),
                   help="PNG of the two curves ('' for none)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError as exc:
            raise SystemExit(f"--plot needs matplotlib ({exc}): pip install 'aiocollect[plots]', or pass --plot ''")
    start = time.perf_counter()
    results = run_variants(args)
    print_table(results)
    print(f"both runs: {time.perf_counter() - start:.0f} s wall, {os.cpu_count()} CPUs")
    if args.plot:
        save_plot(results, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
