"""What an Evaluator costs a Collector running in the same event loop.

One collector (CartPole-v1, the 4-64-2 ArgmaxMLP of benchmarks/_util.py acting greedily,
``--workers`` x ``--envs-per-worker`` envs, ``--frames-per-batch`` frames per batch) and one
evaluator (CartPole-v1, the same policy, ``--trajectories`` episodes per evaluation, seeded) run
in one uvloop event loop for the whole benchmark. Phases alternate (``--rounds`` times):

* **alone**: the evaluator's worker is up but idle; the consumer just counts frames.
* **with evaluator**: a second task runs ``await evaluator.evaluate(policy)`` back to back (the
  policy's weights are sent with every evaluation, as a trainer would), while the consumer counts.

Each phase discards ``--warmup`` seconds of batches, then counts frames for ``--seconds``; fps =
frames / time between the batches that open and close the window. For each window the CPU time
(utime + stime, from ``/proc/<pid>/stat``) of the evaluator's worker, of the collector's workers
and of this process is read, as cores = CPU seconds / wall seconds, and the busy time of the rest
of the machine (``/proc/stat`` less ours): a window where other processes ran is noisy.

Printed per kind of phase (means over the rounds):

* fps alone, fps with the evaluator, and their ratio;
* the evaluator's CPU share (cores used by its worker process) and its evaluations per second;
* **overhead beyond its own CPU** = 1 - (fps_with / fps_alone) / expected, where expected =
  min(1, (N - eval_cores - elsewhere) / C): N is the number of CPUs this process may run on, C
  the cores the collector (its workers and this process) used alone, and elsewhere the cores
  other processes of the machine used meanwhile, so ``expected`` is the share of its alone speed
  the collector would keep if the evaluator took nothing from it but the CPU its own process
  burns. On an idle 2-CPU machine with a collector that saturates it, this is
  ``1 - (fps_with / fps_alone) / ((2 - eval_cores) / 2)``. Near 0: evaluating costs
  the collector only the evaluator's own CPU; positive: something more (event-loop work,
  scheduling, cache effects); negative: noise, or spare CPU the formula does not see.
* **efficiency loss** = 1 - (fps per core the collector's processes used, with the evaluator) /
  (the same alone): what the evaluator costs the collector for each CPU-second it still gets.
  Other processes on the machine change the cores the collector gets, not this ratio: it is
  the figure to read on a shared machine.

Run (about 40 s with the defaults; read it on an otherwise idle machine)::

    .venv/bin/python benchmarks/evaluator_overhead.py [--seconds 5] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass, field

import anyio
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _util.py beside this file
from _util import ArgmaxMLP  # noqa: E402

ENV_ID = "CartPole-v1"
SEED = 0
_CLK_TCK = os.sysconf("SC_CLK_TCK")


def log(msg: str) -> None:
    print(msg, flush=True)


def machine_busy_seconds() -> float:
    """Busy CPU time of the whole machine (all CPUs, hypervisor steal included)."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / _CLK_TCK


def cpu_seconds(pid: int) -> float:
    """utime + stime of one process (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


@dataclass
class Window:
    kind: str  # "alone" or "with evaluator"
    fps: float
    seconds: float
    cores: dict[str, float]  # "evaluator", "workers", "main", "elsewhere" (the rest of the machine)
    evaluations: int
    eval_seconds: list[float] = field(default_factory=list)


class Phases:
    """Shared between the consumer and the task that evaluates back to back."""

    def __init__(self) -> None:
        self.evaluating = False
        self.resume = anyio.Event()
        self.done: list[dict] = []


async def evaluate_back_to_back(evaluator, policy: nn.Module, phases: Phases) -> None:
    while True:
        if not phases.evaluating:
            phases.resume = anyio.Event()
            await phases.resume.wait()
            continue
        phases.done.append(await evaluator.evaluate(policy))


async def measure(collector, evaluator, phases: Phases, kind: str, args: argparse.Namespace) -> Window:
    phases.evaluating = kind != "alone"
    phases.resume.set()
    pids = {"evaluator": [evaluator.worker_pid], "workers": list(collector.worker_pids), "main": [os.getpid()]}

    def snapshot() -> dict[str, float]:
        cpu = {name: sum(cpu_seconds(p) for p in group) for name, group in pids.items()}
        cpu["elsewhere"] = machine_busy_seconds() - sum(cpu.values())
        return cpu

    t_phase = time.perf_counter()
    t0 = cpu0 = None
    frames = 0
    evals0 = 0
    last_report = t_phase
    async for batch in collector:
        now = time.perf_counter()
        if t0 is None:
            if now - t_phase >= args.warmup:
                t0, cpu0, evals0 = now, snapshot(), len(phases.done)
            continue
        frames += batch.numel()
        if now - last_report >= 1.0:
            last_report = now
            log(f"    {now - t0:4.1f} s: {frames / (now - t0):8.0f} fps, {len(phases.done) - evals0} evaluations")
        if now - t0 >= args.seconds:
            cpu1 = snapshot()
            wall = now - t0
            evals = phases.done[evals0:]
            return Window(
                kind,
                frames / wall,
                wall,
                {k: (cpu1[k] - cpu0[k]) / wall for k in cpu1},
                len(evals),
                [m["seconds"] for m in evals],
            )
    raise RuntimeError("the collector ended before the measuring window closed")


async def run(args: argparse.Namespace) -> list[Window]:
    from aiocollect import Collector
    from aiocollect._evaluator.evaluator import Evaluator

    torch.manual_seed(SEED)
    policy = ArgmaxMLP()
    windows: list[Window] = []
    log(
        f"collector: {ENV_ID}, {args.workers} workers x {args.envs_per_worker} envs, "
        f"{args.frames_per_batch} frames/batch; evaluator: {args.trajectories} episodes per evaluation, "
        f"nice={args.nice}"
    )
    t_start = time.perf_counter()
    collector = Collector(
        ENV_ID,
        policy,
        frames_per_batch=args.frames_per_batch,
        num_workers=args.workers,
        envs_per_worker=args.envs_per_worker,
        seed=SEED,
    )
    evaluator = Evaluator(ENV_ID, policy, num_trajectories=args.trajectories, seed=SEED, nice=args.nice)
    async with collector, evaluator, anyio.create_task_group() as tg:
        log(f"started in {time.perf_counter() - t_start:.1f} s (collector workers {collector.worker_pids}, "
            f"evaluator worker {evaluator.worker_pid})")
        phases = Phases()
        tg.start_soon(evaluate_back_to_back, evaluator, policy, phases)
        kinds = ["alone", "with evaluator"] * args.rounds
        for i, kind in enumerate(kinds, 1):
            log(f"  phase {i}/{len(kinds)}: {kind} ({args.warmup:.0f} s warm-up, {args.seconds:.0f} s measured)")
            w = await measure(collector, evaluator, phases, kind, args)
            windows.append(w)
            log(
                f"  -> {w.fps:,.0f} fps; cores: evaluator {w.cores['evaluator']:.2f}, collector workers "
                f"{w.cores['workers']:.2f}, this process {w.cores['main']:.2f}, rest of the machine "
                f"{w.cores['elsewhere']:.2f}; {w.evaluations} evaluations"
            )
        phases.evaluating = False
        tg.cancel_scope.cancel()
    return windows


def report(windows: list[Window]) -> None:
    alone = [w for w in windows if w.kind == "alone"]
    with_ = [w for w in windows if w.kind != "alone"]
    mean = statistics.fmean
    fps_alone, fps_with = mean(w.fps for w in alone), mean(w.fps for w in with_)
    eval_cores = mean(w.cores["evaluator"] for w in with_)
    collector_cores = mean(w.cores["workers"] + w.cores["main"] for w in alone)
    main_alone, main_with = mean(w.cores["main"] for w in alone), mean(w.cores["main"] for w in with_)
    ncpu = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    elsewhere_with = mean(w.cores["elsewhere"] for w in with_)
    available = max(0.0, ncpu - eval_cores - elsewhere_with)
    expected = min(1.0, available / collector_cores) if collector_cores > 0 else 1.0
    ratio = fps_with / fps_alone
    evals = sum(w.evaluations for w in with_)
    eval_rate = evals / sum(w.seconds for w in with_)
    eval_s = [s for w in with_ for s in w.eval_seconds]
    spread = [w.fps for w in alone]
    log("")
    log("results (means over the rounds)")
    log(f"  fps alone                      {fps_alone:10,.0f}   (windows: {', '.join(f'{f:,.0f}' for f in spread)})")
    log(f"  fps with evaluator             {fps_with:10,.0f}   (windows: {', '.join(f'{w.fps:,.0f}' for w in with_)})")
    log(f"  ratio with / alone             {ratio:10.3f}")
    log(f"  evaluator CPU share            {eval_cores:10.2f} cores (its worker process)")
    log(f"  evaluations                    {eval_rate:10.1f} /s  (median {statistics.median(eval_s) * 1e3:.1f} ms each)" if eval_s else "  evaluations: none")
    log(f"  collector cores used alone     {collector_cores:10.2f}   (of {ncpu} CPUs)")
    log(f"  this process's cores           {main_alone:10.2f} alone, {main_with:.2f} with evaluator")
    log(
        f"  expected ratio (own CPU only)  {expected:10.3f}   = min(1, ({ncpu} - {eval_cores:.2f} - "
        f"{elsewhere_with:.2f} elsewhere) / {collector_cores:.2f})"
    )
    log(f"  overhead beyond its own CPU    {1 - ratio / expected:10.3f}   = 1 - ratio / expected")
    per_core_alone = mean(w.fps / (w.cores["workers"] + w.cores["main"]) for w in alone)
    per_core_with = mean(w.fps / (w.cores["workers"] + w.cores["main"]) for w in with_)
    log(
        f"  collector fps per core used    {per_core_alone:10,.0f} alone, {per_core_with:,.0f} with evaluator: "
        f"efficiency loss {1 - per_core_with / per_core_alone:.3f}"
    )
    elsewhere = max(w.cores["elsewhere"] for w in windows)
    if elsewhere > 0.1:
        log(f"  WARNING: other processes used up to {elsewhere:.2f} cores during a window: the figures are noisy")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=5.0, help="measured seconds per phase")
    p.add_argument("--warmup", type=float, default=1.5, help="discarded seconds at the start of each phase")
    p.add_argument("--rounds", type=int, default=2, help="alone / with-evaluator pairs")
    p.add_argument("--trajectories", type=int, default=10, help="episodes per evaluation")
    p.add_argument("--nice", type=int, default=0, help="the evaluator's nice= (0-19): lower its CPU priority")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--envs-per-worker", type=int, default=8)
    p.add_argument("--frames-per-batch", type=int, default=2048)
    args = p.parse_args()
    if args.rounds < 1 or args.seconds <= 0:
        p.error("--rounds must be >= 1 and --seconds > 0")
    return args


def main() -> int:
    args = parse_args()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo, for aiocollect
    try:
        windows = anyio.run(run, args, backend_options={"use_uvloop": True})
    except KeyboardInterrupt:
        log("interrupted")
        return 130
    finally:
        from aiocollect import shutdown_launcher

        shutdown_launcher()
    report(windows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
