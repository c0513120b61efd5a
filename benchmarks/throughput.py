"""Throughput benchmark: aiocollect against an upper bound and hand-written gymnasium loops.

What is measured (CartPole-v1, a 4-64-2 MLP policy acting by argmax of its logits, the same weights
everywhere via ``torch.manual_seed``; defaults: 2 workers x 8 envs, 2048 frames per batch):

* **limit** -- ``--workers`` independent processes (multiprocessing "spawn", started together), each
  stepping ``--envs-per-worker`` gymnasium envs in a plain loop: one batched policy forward under
  ``torch.no_grad`` with ``torch.set_num_threads(1)``, then ``env.step`` per env, reset on
  terminated/truncated. No communication, no storage. Each process bumps a shared frame counter; the
  parent reads the counters at the start and the end of one common wall-clock window after a warm-up,
  so fps is the sum over the processes. It runs first and again last; the mean of the two is the
  reference every other setup is reported against (ratio), and their difference shows whether the
  machine's load changed during the run.
* **gymnasium SyncVectorEnv loop** -- one process, ``SyncVectorEnv`` of workers x envs_per_worker envs,
  storing observation/action/reward/terminated/truncated of each step into preallocated torch tensors
  ``[num_envs, T]`` of one batch (T = frames_per_batch / num_envs).
* **gymnasium AsyncVectorEnv** (``shared_memory=True``) -- the same loop; gymnasium runs one process
  per env, so this is num_envs processes, not ``--workers``.
* **TorchRL MultiSyncCollector** (``MultiSyncDataCollector`` before TorchRL 0.14) -- only if ``torchrl``
  imports: ``--workers`` workers, each a ``SerialEnv`` of ``--envs-per-worker`` ``GymEnv``s.
* **aiocollect**, ``delivery="sync"`` and ``delivery="async"``: ``async for batch in collector`` under
  anyio + uvloop, counting ``batch.numel()`` frames; with the collector's default ``prefetch``, or once
  per value of ``--prefetch`` (``--prefetch 0,2``: collecting on demand and two batches ahead, side by
  side). The consumer does nothing with a batch unless ``--train-ms`` makes it wait that long after
  each one (``await anyio.sleep``: a trainer that leaves the CPUs to the workers, as one on a GPU
  does), which is where collecting ahead gains: the workers collect while it waits.

Batch-based setups discard the first batches (at least 2 and at least ``--warmup`` seconds after the
first one), then count frames for ``--seconds``: fps = frames / time between the end of the warm-up and
the batch that closes the window.

For every window the CPU time of this benchmark's processes (workers included) and of the rest of the
machine is read from /proc: "cores used", "per-core ratio" (frames per CPU-second relative to the
limit's; less sensitive to what else runs on a shared machine) and "busy elsewhere" (other processes,
hypervisor steal). On a noisy machine read the ratios, and distrust a run whose "busy elsewhere" is high.
The JSON has each setup's per-core ratio under ``per_core`` (``compare_trees.py`` shows them).

Also measured:

* **event-loop lag** while aiocollect collects: a ticker task does ``await anyio.sleep(0.001)`` in a loop
  and records ``actual_elapsed - 0.001``; p50/p99/max over ``--lag-seconds`` (default 2) right after each
  aiocollect throughput window, with the same collector still collecting. Not during the throughput
  window: the limit runs no ticker, and on a machine with no core to spare its 1,000 wake-ups a second
  preempt the workers (on 2 cores that took 3-10% of aiocollect's frames per CPU-second). The same
  ticker on the idle loop just before the collector starts is printed for reference (uvloop timers
  have 1 ms resolution).
* **Collector() -> first batch**, in a fresh subprocess (nothing pre-imported or pre-started): from just
  before ``Collector(...)`` (after ``import torch``, ``from aiocollect import Collector`` and building the
  policy) to the first batch; then, in that same process, a second collector constructed after the first
  one is closed. What a user waits for from process launch, imports included: ``benchmarks/startup.py``.

Run (the default run takes about a minute; the machine's noise matters, read ratios, not absolutes)::

    bash scripts/run.sh bench [--seconds 4] [--json benchmarks/results/throughput.json]
    .venv/bin/python benchmarks/throughput.py --help

With ``--sliced`` each aiocollect setup instead takes turns with the limit on the same cores
(``--turns`` turns of ``--turn-seconds`` each; while one side runs, the other's processes are
stopped with SIGSTOP), so that a drift of the machine's speed hits both alike: per setup, both rates
over all turns, their ratio, the per-core ratio (from the CPU time read between turns, both sides
stopped), the spread of the per-turn ratios and the limit's drift. No baselines, loop lag or time to
first batch in that mode. A first row, **limit meeting at each batch**, is the limit's processes
meeting at a barrier every ``frames_per_batch / (workers * envs_per_worker)`` steps, as the workers of
``delivery="sync"`` (``prefetch=0``) meet at each batch, with no collector: what waiting for one
another costs by itself. Each sync row is also given over it.

Every process the benchmark starts is stopped before it exits (also on Ctrl-C, SIGTERM or an error); a
section that leaves processes behind is reported with a warning and they are terminated. Options:
``--seconds``, ``--warmup``, ``--workers``, ``--envs-per-worker``, ``--frames-per-batch``, ``--prefetch``, ``--train-ms``,
``--lag-seconds``, ``--sliced``, ``--turns``, ``--turn-seconds``, ``--json PATH``,
``--skip-baselines`` (gymnasium and TorchRL; the limit always runs), ``--skip-aiocollect``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import gymnasium as gym
import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _util.py beside this file, also for python -m
from _util import (
    ArgmaxMLP,
    MP_HELPERS,
    LimitPool,
    Meter,
    Result,
    alternate,
    become_subreaper,
    child_signals,
    collect_taking_turns,
    descendants,
    limit_step,
    log,
    LOCKSTEP,
    lockstep_slices,
    machine,
    meet,
    over_lockstep,
    machine_line,
    percentiles_ms,
    reap,
    report_slices,
    run_limit_processes,
    sigterm_as_interrupt,
)

ENV_ID = "CartPole-v1"
SEED = 0
OBS_DIM = 4
TICK_S = 0.001
TTFB_MARKER = "AIOCOLLECT_TTFB_JSON "


def make_policy() -> ArgmaxMLP:
    """The one policy every setup uses: same seed, same weights."""
    torch.manual_seed(SEED)
    return ArgmaxMLP()


# --------------------------------------------------------------------------------------------------
# 1. the limit: independent processes, no communication, no storage


def _limit_worker(
    rank: int,
    num_envs: int,
    state_dict: dict[str, torch.Tensor],
    counter: Any,  # RawValue("q"): frames stepped so far, written only by this process
    ready: Any,  # multiprocessing Event
    go: Any,
    stop: Any,
) -> None:
    _limit_loop(rank, num_envs, state_dict, 1, None, counter, ready, go, stop)


def _limit_loop(rank: int, num_envs: int, state_dict: dict[str, torch.Tensor], steps: int, barrier: Any,
                counter: Any, ready: Any, go: Any, stop: Any) -> None:
    """The limit's loop in one process; with a ``barrier`` (:func:`_util.lockstep_slices`), the
    processes meet there every ``steps`` steps, as sync delivery's workers do at each batch."""
    torch.set_num_threads(1)
    policy = ArgmaxMLP()
    policy.load_state_dict(state_dict)
    envs = [gym.make(ENV_ID) for _ in range(num_envs)]
    obs = [env.reset(seed=SEED + rank * num_envs + i)[0] for i, env in enumerate(envs)]
    ready.set()
    go.wait()
    try:
        with torch.no_grad():
            while not stop.is_set():
                for _ in range(steps):
                    limit_step(policy, envs, obs)
                    counter.value += num_envs
                if barrier is not None and not meet(barrier):
                    break
    finally:
        for env in envs:
            env.close()


def run_limit(args: argparse.Namespace, policy: ArgmaxMLP) -> Result:
    state = {k: v.detach().clone() for k, v in policy.state_dict().items()}
    return run_limit_processes(_limit_worker, lambda rank: (rank, args.envs_per_worker, state), args.workers,
                               args.warmup, args.seconds, f"limit ({args.workers} procs x {args.envs_per_worker} envs)")


# --------------------------------------------------------------------------------------------------
# 2-3. gymnasium vector envs with a hand-written collection loop


def _vector_loop(envs: gym.vector.VectorEnv, policy: ArgmaxMLP, args: argparse.Namespace, meter: Meter) -> None:
    """Collect batches of [num_envs, T] steps into freshly allocated tensors until the meter is done."""
    n = envs.num_envs
    steps = args.frames_per_batch // n
    obs, _ = envs.reset(seed=SEED)
    with torch.no_grad():
        while True:
            batch = {
                "observation": torch.empty(n, steps, OBS_DIM),
                "action": torch.empty(n, steps, dtype=torch.int64),
                "reward": torch.empty(n, steps),
                "terminated": torch.empty(n, steps, dtype=torch.bool),
                "truncated": torch.empty(n, steps, dtype=torch.bool),
            }
            for t in range(steps):
                o = torch.from_numpy(obs)
                action = policy(o)
                batch["observation"][:, t] = o
                batch["action"][:, t] = action
                obs, reward, terminated, truncated, _ = envs.step(action.numpy())
                batch["reward"][:, t] = torch.from_numpy(reward)
                batch["terminated"][:, t] = torch.from_numpy(terminated)
                batch["truncated"][:, t] = torch.from_numpy(truncated)
            if meter.add(n * steps):
                return


def run_sync_vector(args: argparse.Namespace, policy: ArgmaxMLP) -> Result:
    n = args.workers * args.envs_per_worker
    meter = Meter(args.seconds, args.warmup)
    # copy=False: the loop copies each observation into the batch before the next step.
    envs = gym.vector.SyncVectorEnv([functools.partial(gym.make, ENV_ID)] * n, copy=False)
    try:
        _vector_loop(envs, policy, args, meter)
    finally:
        envs.close()
    return meter.result(f"SyncVectorEnv x{n} loop")


def run_async_vector(args: argparse.Namespace, policy: ArgmaxMLP) -> Result:
    n = args.workers * args.envs_per_worker
    meter = Meter(args.seconds, args.warmup)
    with child_signals():
        envs = gym.vector.AsyncVectorEnv([functools.partial(gym.make, ENV_ID)] * n, shared_memory=True, copy=False)
    clean = False
    try:
        _vector_loop(envs, policy, args, meter)
        clean = True
    finally:
        envs.close(terminate=not clean)
    return meter.result(f"AsyncVectorEnv x{n} ({n} procs, shm)")


# --------------------------------------------------------------------------------------------------
# optional: TorchRL


def _torchrl_env(envs_per_worker: int) -> Any:
    from torchrl.envs import GymEnv, SerialEnv

    return SerialEnv(envs_per_worker, functools.partial(GymEnv, ENV_ID, categorical_action_encoding=True))


def run_torchrl(args: argparse.Namespace, policy: ArgmaxMLP) -> Result:
    name = "TorchRL MultiSyncCollector"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import torchrl.collectors as collectors
            import torchrl.envs  # noqa: F401 - imported here so that its import-time warnings stay quiet
            from tensordict.nn import TensorDictModule
    except ModuleNotFoundError as exc:
        if exc.name == "torchrl":
            return Result(name, note="torchrl not installed")
        return Result(name, note=f"torchrl does not import: {exc}")
    except Exception as exc:  # noqa: BLE001 - e.g. a torchrl built for another tensordict
        return Result(name, note=f"torchrl does not import: {type(exc).__name__}: {exc}")
    # MultiSyncDataCollector was renamed MultiSyncCollector in TorchRL 0.14.
    collector_cls = getattr(collectors, "MultiSyncCollector", None) or collectors.MultiSyncDataCollector
    name = f"TorchRL {collector_cls.__name__}"
    meter = Meter(args.seconds, args.warmup)
    with child_signals():
        collector = collector_cls(
            [functools.partial(_torchrl_env, args.envs_per_worker)] * args.workers,
            TensorDictModule(policy, in_keys=["observation"], out_keys=["action"]),
            frames_per_batch=args.frames_per_batch,
            total_frames=-1,
        )
    try:
        for batch in collector:
            if meter.add(batch.numel()):
                break
    finally:
        collector.shutdown()
    return meter.result(name)


# --------------------------------------------------------------------------------------------------
# 4. aiocollect


def _import_aiocollect() -> tuple[Any, str]:
    """(Collector, "") or (None, why not)."""
    try:
        from aiocollect import Collector
    except Exception as exc:  # noqa: BLE001 - reported, the rest of the benchmark still runs
        return None, f"aiocollect does not import: {type(exc).__name__}: {exc}"
    return Collector, ""


async def _ticker(samples: list[tuple[float, float]]) -> None:
    """Sleep TICK_S forever, recording (wake-up time, lateness) of every tick."""
    import anyio

    while True:
        t = time.perf_counter()
        await anyio.sleep(TICK_S)
        now = time.perf_counter()
        samples.append((now, now - t - TICK_S))


async def _idle_lag(seconds: float) -> list[float]:
    """The ticker alone on the idle loop for ``seconds``: its lag samples."""
    import anyio

    samples: list[tuple[float, float]] = []
    with anyio.move_on_after(seconds):
        await _ticker(samples)
    return [lag for _, lag in samples]


async def _collect_aiocollect(
    collector_cls: Any, policy: ArgmaxMLP, args: argparse.Namespace, delivery: str, meter: Meter,
    prefetch: int | None = None,
) -> tuple[list[float], list[float]]:
    """Measure one aiocollect run: its throughput (no ticker), then, with the same collector, the
    event-loop lag over ``--lag-seconds`` (the ticker on). Returns (idle lag samples, lag samples
    while collecting)."""
    import anyio

    idle = await _idle_lag(0.5)
    samples: list[tuple[float, float]] = []
    lag_end: float | None = None
    async with anyio.create_task_group() as tg:
        meter.t_section = time.perf_counter()
        async with collector_cls(
            ENV_ID,
            policy,
            frames_per_batch=args.frames_per_batch,
            total_frames=-1,
            num_workers=args.workers,
            envs_per_worker=args.envs_per_worker,
            delivery=delivery,
            **({} if prefetch is None else {"prefetch": prefetch}),
        ) as collector:
            async for batch in collector:
                if lag_end is None:
                    if meter.add(batch.numel()):  # (the throughput window is over: now the lag's)
                        lag_end = time.perf_counter() + args.lag_seconds
                        tg.start_soon(_ticker, samples)
                elif time.perf_counter() >= lag_end:
                    break
                if args.train_ms:
                    await anyio.sleep(args.train_ms / 1000)
        tg.cancel_scope.cancel()
    return idle, [lag for _, lag in samples]


def run_aiocollect(
    args: argparse.Namespace, policy: ArgmaxMLP, collector_cls: Any, delivery: str, prefetch: int | None = None
) -> Result:
    import anyio

    meter = Meter(args.seconds, args.warmup)
    idle, window = anyio.run(
        _collect_aiocollect,
        collector_cls,
        policy,
        args,
        delivery,
        meter,
        prefetch,
        backend_options={"use_uvloop": True},
    )
    result = meter.result(f"aiocollect {delivery}" + ("" if prefetch is None else f" prefetch={prefetch}"))
    result.extra = {"loop_lag_ms": percentiles_ms(window), "idle_loop_lag_ms": percentiles_ms(idle)}
    return result


# --sliced: each aiocollect setup takes turns with the limit on the same cores


async def _collect_sliced(collector_cls: Any, policy: ArgmaxMLP, args: argparse.Namespace, delivery: str,
                          prefetch: int | None, limit: LimitPool) -> Any:
    async with collector_cls(
        ENV_ID, policy, frames_per_batch=args.frames_per_batch, total_frames=-1, num_workers=args.workers,
        envs_per_worker=args.envs_per_worker, delivery=delivery, **({} if prefetch is None else {"prefetch": prefetch}),
    ) as collector:
        return await collect_taking_turns(collector, limit, args.warmup, args.turns, args.turn_seconds)


def run_sliced(args: argparse.Namespace, policy: ArgmaxMLP, collector_cls: Any) -> dict[str, Any]:
    """Each aiocollect setup (delivery x ``--prefetch``) takes turns with the limit's processes
    (``--turns`` turns of ``--turn-seconds``, the other side stopped), so that both see the same
    machine: its ratio and per-core ratio over all turns."""
    import anyio

    state = {k: v.detach().clone() for k, v in policy.state_dict().items()}
    rows = []
    with LimitPool(_limit_worker, lambda rank: (rank, args.envs_per_worker, state), args.workers) as limit:
        keep = frozenset(p.pid for p in limit.procs)
        # the limit meeting at each batch: its processes take turns with the free-running limit's
        steps = max(1, args.frames_per_batch // (args.workers * args.envs_per_worker))
        log(f"{LOCKSTEP} (every {steps} steps): {args.turns} turns of {args.turn_seconds:g} s, taking turns with the limit ...")
        try:
            rows.append((LOCKSTEP, lockstep_slices(limit, _limit_loop, lambda rank, barrier: (
                rank, args.envs_per_worker, state, steps, barrier), args.workers, args.turns, args.turn_seconds), None, None))
        except Exception as exc:  # noqa: BLE001 - the collector's setups are measured all the same
            log(f"  -> FAILED: {_describe(exc)}")
        for delivery in ("sync", "async"):
            for prefetch in args.prefetch:
                name = f"aiocollect {delivery}" + ("" if prefetch is None else f" prefetch={prefetch}")
                log(f"{name}: {args.turns} turns of {args.turn_seconds:g} s, taking turns with the limit ...")
                try:
                    slices, copied, batches = anyio.run(_collect_sliced, collector_cls, policy, args, delivery,
                                                        prefetch, limit, backend_options={"use_uvloop": True})
                except Exception as exc:  # noqa: BLE001 - one failing setup must not hide the others
                    log(f"  -> FAILED: {_describe(exc)}")
                    continue
                finally:
                    _shutdown_aiocollect_launcher()
                    reap(name, baseline=keep)
                per_core = slices.per_core()
                log(f"  -> {slices.fps('setup'):,.0f} frames/s against the limit's {slices.fps('limit'):,.0f}: "
                    f"{slices.ratio():.2f}" + ("" if per_core is None else f" (per core {per_core:.2f})"))
                rows.append((name, slices, copied, batches))
    log("")
    log(f"{args.workers} workers x {args.envs_per_worker} envs, {args.frames_per_batch} frames/batch; each setup "
        f"took {args.turns} turns of {args.turn_seconds:g} s with the limit (the other side stopped)")
    out = report_slices(rows, 36)
    over_lockstep(out, LOCKSTEP, steps)
    return out


# one tree's aiocollect in a child process (--compare-with): the child runs this file with
# --_tree-child DELIVERY, PYTHONPATH=TREE, and prints its Result as one JSON line


def tree_child(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    collector_cls, missing = _import_aiocollect()
    if collector_cls is None:
        raise SystemExit(missing)
    import aiocollect

    result = run_aiocollect(args, make_policy(), collector_cls, args.tree_child)
    result.extra["aiocollect_file"] = aiocollect.__file__
    print("RESULT " + json.dumps(asdict(result)), flush=True)


def run_tree(args: argparse.Namespace, tree: str, delivery: str, name: str) -> Result:
    """aiocollect from checkout ``tree``, measured in a child process (same settings as ours)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--_tree-child", delivery, "--seconds", str(args.seconds),
           "--warmup", str(args.warmup), "--workers", str(args.workers), "--envs-per-worker",
           str(args.envs_per_worker), "--frames-per-batch", str(args.frames_per_batch),
           "--lag-seconds", str(args.lag_seconds)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.path.abspath(tree)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.seconds * 10 + 120)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        return Result(name, note=f"FAILED (exit {proc.returncode}): {proc.stderr.strip()[-300:]}")
    result = Result(**json.loads(lines[-1][len("RESULT "):]))
    result.name = name
    where = os.path.dirname(os.path.dirname(os.path.abspath(result.extra["aiocollect_file"])))
    if where != os.path.abspath(tree):
        return Result(name, note=f"FAILED: the child imported aiocollect from {where}, not {tree}")
    return result


# time to first batch: the child side runs in a fresh interpreter (this file with --_ttfb-child)


async def _ttfb_child_main(collector_cls: Any, policy: ArgmaxMLP, args: argparse.Namespace) -> dict[str, float]:
    out: dict[str, float] = {}
    for key in ("first_s", "second_s"):
        t0 = time.perf_counter()
        async with collector_cls(
            ENV_ID,
            policy,
            frames_per_batch=args.frames_per_batch,
            total_frames=-1,
            num_workers=args.workers,
            envs_per_worker=args.envs_per_worker,
            delivery="sync",
        ) as collector:
            async for _ in collector:
                out[key] = time.perf_counter() - t0
                break
        out[key.replace("_s", "_close_s")] = time.perf_counter() - t0 - out[key]
    return out


def ttfb_child(args: argparse.Namespace) -> None:
    """Entry point of the fresh subprocess: prints one marked JSON line on stdout."""
    t_import = time.perf_counter()
    import anyio

    collector_cls, why = _import_aiocollect()
    if collector_cls is None:
        raise SystemExit(why)
    import_s = time.perf_counter() - t_import
    policy = make_policy()
    out = anyio.run(_ttfb_child_main, collector_cls, policy, args, backend_options={"use_uvloop": True})
    out["aiocollect_import_s"] = import_s
    print(TTFB_MARKER + json.dumps(out), flush=True)


def run_ttfb(args: argparse.Namespace) -> tuple[dict[str, float], list[str]]:
    """Run the time-to-first-batch measurement in a fresh interpreter; (figures, leftover processes)."""
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--_ttfb-child",
        "--workers", str(args.workers),
        "--envs-per-worker", str(args.envs_per_worker),
        "--frames-per-batch", str(args.frames_per_batch),
    ]  # fmt: skip
    # Whatever it leaves behind is reparented to us (become_subreaper) and found as a new descendant.
    # Its own session: Ctrl-C does not reach it from the terminal; we stop it (and its group) ourselves.
    baseline = frozenset(p.pid for p in descendants())
    t_spawn = time.perf_counter()
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, _ = child.communicate(timeout=180)
    finally:
        if child.poll() is None:
            for sig, wait in ((signal.SIGINT, 10.0), (signal.SIGKILL, 5.0)):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.pid, sig)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.wait(wait)
                    break
        left = reap("the time-to-first-batch subprocess", keep=MP_HELPERS, baseline=baseline)
    wall = time.perf_counter() - t_spawn
    if child.returncode != 0:
        raise RuntimeError(f"time-to-first-batch subprocess exited with code {child.returncode}")
    lines = [line for line in stdout.splitlines() if line.startswith(TTFB_MARKER)]
    if not lines:
        raise RuntimeError("time-to-first-batch subprocess printed no result")
    out: dict[str, float] = json.loads(lines[-1][len(TTFB_MARKER) :])
    out["subprocess_wall_s"] = wall
    return out, left


# --------------------------------------------------------------------------------------------------
# driver


@dataclass
class Stage:
    """One measured setup of the run."""

    key: str  # in the JSON results; "limit" for both limit runs
    name: str  # in the table
    title: str  # in the progress lines
    run: Callable[[], Result]


def _describe(exc: BaseException) -> str:
    """``Type: message`` of an error, unwrapping exception groups (anyio's task groups raise those)."""
    inner: tuple[BaseException, ...] = getattr(exc, "exceptions", ())  # exception groups
    while len(inner) == 1:
        exc = inner[0]
        inner = getattr(exc, "exceptions", ())
    return f"{type(exc).__name__}: {exc}"


def _fmt_lag(lag: dict[str, float]) -> str:
    if not lag.get("n"):
        return "no samples"
    return f"p50 {lag['p50']:.2f} ms, p99 {lag['p99']:.2f} ms, max {lag['max']:.2f} ms"


def _stage_result(r: Result) -> str:
    if r.fps is None:
        return f"  -> {r.note}"
    start = "" if r.startup_s is None else f", first batch after {r.startup_s:.2f} s"
    cpu = (
        f"; cores used: {r.cpu['ours']:.2f} (this process: {r.cpu['main']:.2f}),"
        f" busy elsewhere: {r.cpu['elsewhere']:.2f}"
        if r.cpu
        else ""
    )
    return f"  -> {r.fps:,.0f} frames/s ({r.frames:,} frames in {r.seconds:.2f} s{start}{cpu})"


_COLUMNS = ("frames/s", "ratio to limit", "cores used", "per-core ratio", "busy elsewhere")


def _row(name: str, cells: tuple[str, ...]) -> str:
    return f"{name:<36}" + "".join(f"  {cell:>{max(len(head), 9)}}" for cell, head in zip(cells, _COLUMNS, strict=True))


def _cores(r: Result, key: str) -> str:
    return f"{r.cpu[key]:.2f}" if key in r.cpu else "-"


def _per_core_value(r: Result, limit: Result) -> float | None:
    """Frames per CPU-second of the benchmark's own processes, relative to the limit's."""
    if r.fps is None or limit.fps is None or not r.cpu.get("ours") or not limit.cpu.get("ours"):
        return None
    return (r.fps / r.cpu["ours"]) / (limit.fps / limit.cpu["ours"])


def _per_core_ratio(r: Result, limit: Result) -> str:
    value = _per_core_value(r, limit)
    return "-" if value is None else f"{value:.2f}"


def _prefetch_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: pass whole numbers separated by commas, e.g. 0,2") from None
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: prefetch is 0 or more")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--seconds", type=float, default=4.0, help="measuring window of each setup (default 4)")
    p.add_argument(
        "--warmup",
        type=float,
        default=0.5,
        help="warm-up discarded before each window (default 0.5 s; batch-based setups also discard at least 2 batches)",
    )
    p.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    p.add_argument("--envs-per-worker", type=int, default=8, help="envs per worker (default 8)")
    p.add_argument("--frames-per-batch", type=int, default=2048, help="frames per batch (default 2048)")
    p.add_argument(
        "--prefetch",
        type=_prefetch_list,
        default=[None],
        metavar="N[,N...]",
        help="aiocollect's prefetch: measure each value side by side (e.g. 0,2); default: the collector's default",
    )
    p.add_argument(
        "--train-ms",
        type=float,
        default=0.0,
        help="aiocollect's consumer waits this long after each batch (a trainer off the CPUs; default 0)",
    )
    p.add_argument(
        "--lag-seconds",
        type=float,
        default=2.0,
        help="aiocollect: the event-loop lag's window, after the throughput's (default 2 s)",
    )
    p.add_argument(
        "--sliced",
        action="store_true",
        help="aiocollect's setups take turns with the limit on the same cores (the other side stopped with "
        "SIGSTOP), so that a drift of the machine's speed hits both alike; no baselines, loop lag or start-up",
    )
    p.add_argument("--turns", type=int, default=8, help="--sliced: turns of each side per setup (default 8)")
    p.add_argument("--turn-seconds", type=float, default=2.0, help="--sliced: seconds per turn (default 2)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    p.add_argument(
        "--skip-baselines",
        action="store_true",
        help="skip the gymnasium and TorchRL setups (the limit still runs)",
    )
    p.add_argument(
        "--skip-aiocollect",
        action="store_true",
        help="skip aiocollect (throughput, loop lag, time to first batch)",
    )
    p.add_argument(
        "--compare-with",
        metavar="TREE",
        help="also measure aiocollect from another checkout TREE (e.g. `git worktree add /tmp/before <commit>`): "
        "both trees' sync and async setups then run in child processes, interleaved (ours then TREE's for sync, "
        "TREE's then ours for async)",
    )
    p.add_argument("--_ttfb-child", action="store_true", dest="ttfb_child", help=argparse.SUPPRESS)
    p.add_argument("--_tree-child", choices=("sync", "async"), dest="tree_child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.sliced and args.compare_with:
        p.error("--sliced and --compare-with do not go together: compare two trees with benchmarks/compare_trees.py "
                "-- benchmarks/throughput.py --sliced ...")
    n = args.workers * args.envs_per_worker
    if args.workers < 1 or args.envs_per_worker < 1 or args.frames_per_batch % n:
        p.error(f"--frames-per-batch ({args.frames_per_batch}) must be a multiple of workers x envs-per-worker ({n})")
    return args


def _shutdown_aiocollect_launcher() -> None:
    """Stop aiocollect's launcher (kept alive between collectors on purpose), if aiocollect was used."""
    if "aiocollect" in sys.modules:
        with contextlib.suppress(Exception):
            from aiocollect import shutdown_launcher

            shutdown_launcher()


def _combine_limits(name: str, runs: list[Result]) -> Result:
    """The limit the ratios use: the mean of its runs at the start and the end of the benchmark."""
    ok = [r for r in runs if r.fps is not None]
    if not ok:
        return Result(name, note=runs[0].note if runs else "not measured")
    fps = [r.fps for r in ok if r.fps is not None]
    cpu_keys = set.intersection(*(set(r.cpu) for r in ok))
    return Result(
        name,
        sum(fps) / len(fps),
        sum(r.frames for r in ok),
        sum(r.seconds for r in ok),
        cpu={k: sum(r.cpu[k] for r in ok) / len(ok) for k in sorted(cpu_keys)},
        extra={
            "runs_fps": fps,
            "runs_cpu": [r.cpu for r in ok],
            "fps_per_process": [r.extra.get("fps_per_process") for r in ok],
        },
    )


def main(args: argparse.Namespace) -> int:
    become_subreaper()  # so that the leftover checks also see orphans of our children
    torch.set_num_threads(1)  # as in the limit's processes; the policy is far too small for threads
    policy = make_policy()
    collector_cls, aiocollect_missing = (None, "skipped (--skip-aiocollect)")
    if not args.skip_aiocollect:
        collector_cls, aiocollect_missing = _import_aiocollect()

    n = args.workers * args.envs_per_worker
    log(
        f"aiocollect throughput benchmark: {ENV_ID}, ArgmaxMLP 4-64-2, {args.workers} workers x "
        f"{args.envs_per_worker} envs, {args.frames_per_batch} frames/batch, "
        + (f"{args.turns} turns of {args.turn_seconds:g} s per setup, taking turns with the limit" if args.sliced
           else f"{args.seconds:g} s per setup after {args.warmup:g} s warm-up")
    )
    log(machine_line(machine()))
    if args.sliced:
        if collector_cls is None:
            log(f"aiocollect: {aiocollect_missing}")
            return 1
        sliced = run_sliced(args, policy, collector_cls)
        if args.json:
            _write_json(args.json, {
                "benchmark": "throughput", "sliced": True, "env": ENV_ID, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                **machine(), "args": {k: v for k, v in vars(args).items() if k not in ("ttfb_child", "tree_child")},
                "results": sliced,
                "per_core": {name: {"name": f"{name}, per core", "ratio": r["per_core"]}
                             for name, r in sliced.items() if r["per_core"] is not None},
            })  # fmt: skip
        return 0

    limit_name = f"limit ({args.workers} procs x {args.envs_per_worker} envs)"
    limit_title = f"limit: {args.workers} independent processes x {args.envs_per_worker} envs"
    # "limit" runs first and last, the mean of the two is the reference.
    stages = [Stage("limit", limit_name, limit_title, lambda: run_limit(args, policy))]
    if not args.skip_baselines:
        stages += [
            Stage("sync_vector", f"SyncVectorEnv x{n} loop", f"gymnasium SyncVectorEnv x{n}, hand-written loop",
                  lambda: run_sync_vector(args, policy)),
            Stage("async_vector", f"AsyncVectorEnv x{n} ({n} procs, shm)",
                  f"gymnasium AsyncVectorEnv x{n} (shared_memory=True, {n} processes)",
                  lambda: run_async_vector(args, policy)),
            Stage("torchrl", "TorchRL MultiSyncCollector",
                  "TorchRL MultiSyncCollector (MultiSyncDataCollector before 0.14)", lambda: run_torchrl(args, policy)),
        ]  # fmt: skip
    if collector_cls is not None and args.compare_with:
        ours = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        pair = [("this tree", ours), ("compared", args.compare_with)]
        for delivery in ("sync", "async"):  # (ours first, then theirs first: a drift favours neither)
            for label, tree in pair if delivery == "sync" else pair[::-1]:
                key = f"aiocollect_{delivery}" + ("" if tree == ours else "_compared")
                stages.append(
                    Stage(key, f"aiocollect {delivery} ({label})",
                          f'aiocollect delivery="{delivery}" from {tree} (child process; then the loop lag)',
                          functools.partial(run_tree, args, tree, delivery, f"aiocollect {delivery} ({label})"))
                )  # fmt: skip
    elif collector_cls is not None:
        for delivery in ("sync", "async"):
            for prefetch in args.prefetch:  # (None: the collector's default)
                tail = "" if prefetch is None else f" prefetch={prefetch}"
                stages.append(
                    Stage(f"aiocollect_{delivery}" + ("" if prefetch is None else f"_prefetch{prefetch}"),
                          f"aiocollect {delivery}{tail}",
                          f'aiocollect delivery="{delivery}"{tail} (then the loop lag, with a 1 ms ticker)',
                          functools.partial(run_aiocollect, args, policy, collector_cls, delivery, prefetch))
                )  # fmt: skip
    stages.append(
        Stage("limit", limit_name, f"{limit_title}, again (did the machine's load change?)",
              lambda: run_limit(args, policy))
    )  # fmt: skip

    limit_runs: list[Result] = []
    results: dict[str, Result] = {}
    leftovers: dict[str, list[str]] = {}
    ttfb: dict[str, float] | None = None
    total = len(stages) + (collector_cls is not None)
    for i, stage in enumerate(stages, 1):
        log(f"[{i}/{total}] {stage.title} ...")
        try:
            result = stage.run()
        except Exception as exc:  # noqa: BLE001 - one failing setup must not hide the others
            result = Result(stage.name, note=f"FAILED: {_describe(exc)}")
        finally:
            if stage.key.startswith("aiocollect_async"):
                _shutdown_aiocollect_launcher()
            left = reap(stage.title)
            if left:
                leftovers[stage.title] = left
        log(_stage_result(result))
        if "loop_lag_ms" in result.extra:
            log(f"     event-loop lag: {_fmt_lag(result.extra['loop_lag_ms'])}"
                f" (idle loop before it: {_fmt_lag(result.extra['idle_loop_lag_ms'])})")  # fmt: skip
        if stage.key == "limit":
            limit_runs.append(result)
        else:
            results[stage.key] = result
    if collector_cls is not None:
        log(f"[{total}/{total}] aiocollect time to first batch, fresh subprocess ...")
        try:
            ttfb, left = run_ttfb(args)
            if left:
                leftovers["time to first batch"] = left
            log(f"  -> first collector {ttfb['first_s']:.2f} s, second {ttfb['second_s']:.2f} s")
        except Exception as exc:  # noqa: BLE001
            log(f"  -> FAILED: {_describe(exc)}")

    # ---- summary
    limit_result = _combine_limits(limit_name, limit_runs)
    limit = limit_result.fps
    rows = [limit_result, *results.values()]
    log("")
    log(_row("setup", _COLUMNS))
    for r in rows:
        if r.fps is None:
            log(f"{r.name:<36} {r.note}")
            continue
        ratio = f"{r.fps / limit:.2f}" if limit else "n/a"
        per_core = _per_core_ratio(r, limit_result)
        log(_row(r.name, (f"{r.fps:,.0f}", ratio, _cores(r, "ours"), per_core, _cores(r, "elsewhere"))))
    if collector_cls is None:
        log(f"{'aiocollect':<36} {aiocollect_missing}")
    runs = limit_result.extra.get("runs_fps", [])
    if len(runs) == 2:
        drift = abs(runs[1] - runs[0]) / max(runs)
        log(
            f"limit at the start / at the end: {runs[0]:,.0f} / {runs[1]:,.0f} frames/s (differ by {drift:.0%})"
            + ("  <- the machine's load changed during the run: ratios are unreliable" if drift > 0.15 else "")
        )
    sync = next((r for key, r in results.items() if key.startswith("aiocollect_sync")), None)
    if sync is not None and sync.fps is not None:
        log(f"event-loop lag while collecting: {_fmt_lag(sync.extra['loop_lag_ms'])}")
        log(f"  (same ticker on the idle loop just before: {_fmt_lag(sync.extra['idle_loop_lag_ms'])})")
    if ttfb is not None:
        log(
            f"Collector() -> first batch: {ttfb['first_s']:.2f} s in a fresh process, after `from aiocollect import "
            f"Collector` ({ttfb['aiocollect_import_s']:.2f} s); second collector: {ttfb['second_s']:.2f} s "
            f"(from process launch: benchmarks/startup.py)"
        )
    if limit_result.cpu:
        log(
            "cores used: CPU time of this benchmark's processes per second of the window; per-core ratio: "
            "its frames per\n  CPU-second relative to the limit's; busy elsewhere: the rest of the machine's "
            "CPU (other processes, steal)"
        )
    if leftovers:
        log(f"WARNING: processes were left running after: {'; '.join(leftovers)} (terminated)")

    if args.json:
        payload = {
            "benchmark": "throughput",
            "env": ENV_ID,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            **machine(),
            "args": {k: v for k, v in vars(args).items() if k not in ("ttfb_child", "tree_child")},
            "limit_fps": limit,
            "results": {
                key: {**asdict(r), "ratio_to_limit": (r.fps / limit if r.fps and limit else None)}
                for key, r in {"limit": limit_result, **results}.items()
            },
            "per_core": {
                key: {"name": f"{r.name}, per core", "ratio": ratio}
                for key, r in results.items()
                if (ratio := _per_core_value(r, limit_result)) is not None
            },
            "aiocollect_status": aiocollect_missing or "measured",
            "time_to_first_batch": ttfb,
            "leftover_processes": leftovers,
        }
        _write_json(args.json, payload)
    return 0


def _write_json(path: str, payload: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
    log(f"results written to {path}")


if __name__ == "__main__":
    _args = parse_args()
    if _args.tree_child:
        try:
            tree_child(_args)
        except KeyboardInterrupt:
            sys.exit(130)
        finally:
            _shutdown_aiocollect_launcher()
        sys.exit(0)
    if _args.ttfb_child:
        try:
            ttfb_child(_args)
        except KeyboardInterrupt:  # the parent stops us with SIGINT; it reports the interruption
            sys.exit(130)
        sys.exit(0)
    with sigterm_as_interrupt():
        try:
            sys.exit(main(_args))
        except KeyboardInterrupt:
            log("interrupted; stopping everything this benchmark started")
            sys.exit(130)
        finally:
            _shutdown_aiocollect_launcher()
            reap("the benchmark", keep=MP_HELPERS, grace_s=1.0)
