"""Pixel throughput benchmark: Atari Pong with a random policy, aiocollect against the limit.

What is measured (``--workers`` x ``--envs-per-worker`` envs, default 2 x 4; a random policy, so the
env and the data path are all there is), for two observation formats (``--obs``):

* ``raw``: ``ALE/Pong-v5`` as registered (210x160x3 uint8 frames, 100,800 bytes; frameskip 4,
  sticky actions 0.25);
* ``84x84x4``: ``ALE/Pong-v5`` with ``frameskip=1``, ``AtariPreprocessing`` (frame skip 4, 84x84
  grey) and ``FrameStackObservation(4)``: 4x84x84 uint8, 28,224 bytes, the usual DQN/PPO input.

Setups, one after the other in this process tree, the limit first and last:

* **limit** -- measured first, last, and between the other setups; ``--workers`` independent processes (multiprocessing "spawn"), each stepping its envs
  in a plain loop with ``action_space.sample()``, resetting at episode ends. No communication, no
  storage. Frames are counted through a shared counter over one common wall-clock window.
* **gymnasium AsyncVectorEnv** (``shared_memory=True``, one process per env, as gymnasium does it):
  a hand-written loop that stores each step's observation, action, reward and flags into a
  preallocated batch (the same number of frames per batch as aiocollect).
* **aiocollect**, ``delivery="sync"`` and ``"async"``, with the default batches (yours to keep: each
  is lent, a view on a slot of the workers' shared memory that goes back to them once the consumer
  drops the batch, or a copy where no slot can be spared), and with ``zero_copy=True`` (views valid
  until the next batch is requested): ``async for batch in collector`` under anyio + uvloop. The
  loop drops each batch when it takes the next, as a training loop does.

For each: frames/s, the ratio to the limit (the mean of its first and last runs), the ratio to the
limit runs just before and after the setup ("adjacent": this VM's speed drifts by 10-20% within
minutes, with nothing else running in it), the cores this benchmark's processes used, the per-core
ratio (frames per CPU-second relative to the adjacent limits'), the CPU busy elsewhere, and the bytes
moved per frame: what the workers write into shared memory and what the consumer's process copies
out of it (the batches it copied, from ``stats().batches_copied``; the limit moves none).

With ``--sliced`` each aiocollect setup instead takes turns with the limit on the same cores
(``--turns`` turns of ``--turn-seconds`` each; while one side runs, the other's processes are
stopped with SIGSTOP): a drift of this VM's speed then hits both alike, where setups measured one
after the other each see a different machine. It prints, per setup, both rates over all turns,
their ratio, the spread of the per-turn ratios, how much the limit drifted (its first third of
turns against its last) and how many batches were copied. gymnasium's ``AsyncVectorEnv`` is not
measured in this mode. A first row, **limit meeting at each batch**, is the limit's processes
meeting at a barrier after each one's share of a batch, as sync delivery's workers do (no
collector): what waiting for one another costs by itself; each sync row is also given over it.

Run (needs the ``atari`` extra, ale-py and OpenCV: ``bash scripts/run.sh pixels`` installs it)::

    .venv/bin/python benchmarks/pixels.py [--obs raw 84x84x4] [--seconds 6] [--repeat 2]
    .venv/bin/python benchmarks/pixels.py --sliced [--turns 8] [--turn-seconds 2]

Every process the benchmark starts is stopped before it exits.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
import time
from dataclasses import asdict
from typing import Any

import gymnasium as gym
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _util.py beside this file
from _util import (  # noqa: E402
    MP_HELPERS,
    LimitPool,
    Meter,
    Result,
    Slices,
    collect_taking_turns,
    LOCKSTEP,
    lockstep_slices,
    meet,
    over_lockstep,
    report_slices,
    become_subreaper,
    child_signals,
    log,
    machine,
    machine_line,
    reap,
    run_limit_processes,
    sigterm_as_interrupt,
)

SEED = 0
OBS_FORMATS = ("raw", "84x84x4")


def make_pong(obs: str = "raw") -> gym.Env:
    """The benchmark's env (a module-level function: workers get it by value or by reference)."""
    import ale_py

    gym.register_envs(ale_py)
    if obs == "raw":
        return gym.make("ALE/Pong-v5")
    env = gym.make("ALE/Pong-v5", frameskip=1)
    env = gym.wrappers.AtariPreprocessing(env, frame_skip=4, screen_size=84, grayscale_obs=True, noop_max=30)
    return gym.wrappers.FrameStackObservation(env, 4)


# --------------------------------------------------------------------------------------------------
# the limit


def _limit_worker(rank: int, num_envs: int, obs: str, counter: Any, ready: Any, go: Any, stop: Any) -> None:
    _limit_loop(rank, num_envs, obs, 1, None, counter, ready, go, stop)


def _limit_loop(rank: int, num_envs: int, obs: str, steps: int, barrier: Any, counter: Any, ready: Any, go: Any,
                stop: Any) -> None:
    """The limit's loop in one process; with a ``barrier`` (:func:`_util.lockstep_slices`), the
    processes meet there every ``steps`` steps, as sync delivery's workers do at each batch."""
    envs = [make_pong(obs) for _ in range(num_envs)]
    for i, env in enumerate(envs):
        env.reset(seed=SEED + rank * num_envs + i)
        env.action_space.seed(SEED + rank * num_envs + i)
    ready.set()
    go.wait()
    try:
        while not stop.is_set():
            for _ in range(steps):
                for env in envs:
                    _, _, terminated, truncated, _ = env.step(env.action_space.sample())
                    if terminated or truncated:
                        env.reset()
                counter.value += num_envs
            if barrier is not None and not meet(barrier):
                break
    finally:
        for env in envs:
            env.close()


def run_limit(args: argparse.Namespace, obs: str) -> Result:
    return run_limit_processes(_limit_worker, lambda rank: (rank, args.envs_per_worker, obs), args.workers,
                               args.warmup, args.seconds, "limit")


# --------------------------------------------------------------------------------------------------
# gymnasium AsyncVectorEnv with a hand-written loop


def run_async_vector(args: argparse.Namespace, obs: str) -> Result:
    n = args.workers * args.envs_per_worker
    steps = args.frames_per_batch // n
    meter = Meter(args.seconds, args.warmup)
    with child_signals():
        envs = gym.vector.AsyncVectorEnv([functools.partial(make_pong, obs)] * n, shared_memory=True, copy=False)
    clean = False
    try:
        observation, _ = envs.reset(seed=SEED)
        envs.action_space.seed(SEED)
        shape, dtype = envs.single_observation_space.shape, envs.single_observation_space.dtype
        while True:
            batch = {
                "observation": np.empty((n, steps) + shape, dtype),
                "next_observation": np.empty((n, steps) + shape, dtype),
                "action": np.empty((n, steps), np.int64),
                "reward": np.empty((n, steps), np.float32),
                "terminated": np.empty((n, steps), bool),
                "truncated": np.empty((n, steps), bool),
            }
            for t in range(steps):
                action = envs.action_space.sample()
                batch["observation"][:, t] = observation
                batch["action"][:, t] = action
                observation, reward, terminated, truncated, _ = envs.step(action)
                batch["next_observation"][:, t] = observation
                batch["reward"][:, t] = reward
                batch["terminated"][:, t] = terminated
                batch["truncated"][:, t] = truncated
            if meter.add(n * steps):
                break
        clean = True
    finally:
        envs.close(terminate=not clean)
    result = meter.result("AsyncVectorEnv")
    frame = int(np.prod(shape)) * np.dtype(dtype).itemsize
    result.extra = {"shm_write_per_frame": frame, "copy_out_per_frame": 2 * frame}
    return result


# --------------------------------------------------------------------------------------------------
# aiocollect


async def _collect(args: argparse.Namespace, obs: str, delivery: str, zero_copy: bool, meter: Meter) -> dict:
    from aiocollect import Collector

    meter.t_section = time.perf_counter()
    options = {"zero_copy": True} if zero_copy else {}
    if args.prefetch is not None:
        options["prefetch"] = args.prefetch
    async with Collector(
        functools.partial(make_pong, obs),
        None,
        frames_per_batch=args.frames_per_batch,
        total_frames=-1,
        num_workers=args.workers,
        envs_per_worker=args.envs_per_worker,
        delivery=delivery,
        seed=SEED,
        **options,
    ) as collector:
        async for batch in collector:
            if meter.add(batch.numel()):
                break
        run = collector._run  # (private: the benchmark reads the slot layout; older versions kept it on the run)
        shared = getattr(run, "shared", None)
        layout = shared.pool.slots.layout if hasattr(shared, "pool") else shared.slots.layout if shared else run.layout
        rows = getattr(layout, "rows", None) or layout.num_envs  # (older versions' names: num_envs, frames_per_env)
        per_row = getattr(layout, "frames_per_row", None) or layout.frames_per_env
        frames = layout.workers * rows * per_row  # in one slot
        written = layout.slot_nbytes
        batch_bytes = sum(t.numel() * t.element_size() for t in batch.values(True, True))
        stats = collector.stats()
    return {
        "shm_write_per_frame": written / frames,
        # what the batches copied out of shared memory moved, per frame delivered (a lent batch,
        # the default where a slot can be spared, and a zero_copy one move nothing)
        "copy_out_per_frame": stats.batches_copied * batch_bytes / batch.numel() / max(stats.batches, 1),
    }


def run_aiocollect(args: argparse.Namespace, obs: str, delivery: str, zero_copy: bool) -> Result:
    import anyio

    meter = Meter(args.seconds, args.warmup)
    extra = anyio.run(_collect, args, obs, delivery, zero_copy, meter, backend_options={"use_uvloop": True})
    result = meter.result(f"aiocollect {delivery}" + (" zero_copy" if zero_copy else ""))
    result.extra = extra
    return result


# --------------------------------------------------------------------------------------------------
# --sliced: each setup takes turns with the limit on the same cores


async def _collect_sliced(args: argparse.Namespace, obs: str, delivery: str, zero_copy: bool,
                          limit: LimitPool) -> tuple[Slices, int, int]:
    from aiocollect import Collector

    async with Collector(
        functools.partial(make_pong, obs), None, frames_per_batch=args.frames_per_batch, total_frames=-1,
        num_workers=args.workers, envs_per_worker=args.envs_per_worker, delivery=delivery, seed=SEED,
        zero_copy=zero_copy, **({} if args.prefetch is None else {"prefetch": args.prefetch}),
    ) as collector:
        return await collect_taking_turns(collector, limit, args.warmup, args.turns, args.turn_seconds)


def run_sliced(args: argparse.Namespace, obs: str) -> dict[str, Any]:
    """Each aiocollect setup takes turns with the limit (``--turns`` turns of ``--turn-seconds``
    each, the other side stopped), so that both see the same machine."""
    import anyio

    setups = [(d, z) for z in ((False, True) if not args.copy_only else (False,)) for d in ("sync", "async")]
    rows = []
    with LimitPool(_limit_worker, lambda rank: (rank, args.envs_per_worker, obs), args.workers) as limit:
        keep = frozenset(p.pid for p in limit.procs)
        steps = max(1, args.frames_per_batch // (args.workers * args.envs_per_worker))
        log(f"[{obs}] {LOCKSTEP} (every {steps} steps): {args.turns} turns of {args.turn_seconds:g} s, taking turns with "
            "the limit ...")
        try:
            rows.append((LOCKSTEP, lockstep_slices(limit, _limit_loop, lambda rank, barrier: (
                rank, args.envs_per_worker, obs, steps, barrier), args.workers, args.turns, args.turn_seconds), None, None))
        except Exception as exc:  # noqa: BLE001 - the collector's setups are measured all the same
            log(f"  -> FAILED: {_describe(exc)}")
        for delivery, zero_copy in setups:
            name = f"aiocollect {delivery}" + (" zero_copy" if zero_copy else "")
            log(f"[{obs}] {name}: {args.turns} turns of {args.turn_seconds:g} s, taking turns with the limit ...")
            try:
                slices, copied, batches = anyio.run(_collect_sliced, args, obs, delivery, zero_copy, limit,
                                                    backend_options={"use_uvloop": True})
            except Exception as exc:  # noqa: BLE001 - one failing setup must not hide the others
                log(f"  -> FAILED: {_describe(exc)}")
                continue
            finally:
                with contextlib.suppress(Exception):
                    from aiocollect import shutdown_launcher

                    shutdown_launcher()
                reap(name, baseline=keep)
            log(f"  -> {slices.fps('setup'):,.0f} frames/s against the limit's {slices.fps('limit'):,.0f}: "
                f"{slices.ratio():.2f}")
            rows.append((name, slices, copied, batches))
    log("")
    log(f"{obs}: {args.workers} workers x {args.envs_per_worker} envs, {args.frames_per_batch} frames/batch; each setup "
        f"took {args.turns} turns of {args.turn_seconds:g} s with the limit (the other side stopped)")
    out = report_slices(rows, 28)
    over_lockstep(out, LOCKSTEP, steps)
    return {"obs": obs, "sliced": True, "results": out}


# --------------------------------------------------------------------------------------------------
# driver


def _describe(exc: BaseException) -> str:
    inner: tuple[BaseException, ...] = getattr(exc, "exceptions", ())
    while len(inner) == 1:
        exc = inner[0]
        inner = getattr(exc, "exceptions", ())
    return f"{type(exc).__name__}: {exc}"


def _kb(value: Any) -> str:
    return "-" if value is None else f"{value / 1000:,.1f}"


_COLUMNS = ("frames/s", "ratio", "adjacent", "cores used", "per-core (adj.)", "busy elsewhere", "shm write kB/f",
            "copy out kB/f")


def _row(name: str, cells: tuple[str, ...]) -> str:
    return f"{name:<28}" + "".join(f"  {cell:>{max(len(head), 8)}}" for cell, head in zip(cells, _COLUMNS, strict=True))


def run_format(args: argparse.Namespace, obs: str) -> dict[str, Any]:
    setups: list[tuple[str, Any]] = []
    if not args.skip_gymnasium:
        setups.append(("AsyncVectorEnv", functools.partial(run_async_vector, args, obs)))
    for zero_copy in (False, True) if not args.copy_only else (False,):
        for delivery in ("sync", "async"):
            name = f"aiocollect {delivery}" + (" zero_copy" if zero_copy else "")
            setups.append((name, functools.partial(run_aiocollect, args, obs, delivery, zero_copy)))
    limit_stage = ("limit", functools.partial(run_limit, args, obs))
    # the limit first, last, and (--interleave) between setups: each setup is also compared with the
    # limits measured just before and just after it, which a slow drift of the machine affects less
    stages: list[tuple[str, Any]] = [limit_stage]
    for setup in setups:
        stages.append(setup)
        if args.interleave or setup is setups[-1]:
            stages.append(limit_stage)
    if not setups:
        stages.append(limit_stage)
    limits: list[Result] = []
    results: list[tuple[Result, list[Result]]] = []  # (result, the limits around it)
    for i, (name, fn) in enumerate(stages, 1):
        log(f"[{obs} {i}/{len(stages)}] {name} ...")
        try:
            r = fn()
        except Exception as exc:  # noqa: BLE001 - one failing setup must not hide the others
            r = Result(name, note=f"FAILED: {_describe(exc)}")
        finally:
            if name.startswith("aiocollect"):
                with contextlib.suppress(Exception):
                    from aiocollect import shutdown_launcher

                    shutdown_launcher()
            reap(name)
        if r.fps is not None:
            log(f"  -> {r.fps:,.0f} frames/s, cores used {r.cpu.get('ours', 0):.2f}, busy elsewhere {r.cpu.get('elsewhere', 0):.2f}")
        else:
            log(f"  -> {r.note}")
        if name == "limit":
            limits.append(r)
            if results and len(results[-1][1]) == 1:
                results[-1][1].append(r)
        else:
            results.append((r, [limits[-1]] if limits else []))

    ends = [r for r in (limits[0], limits[-1]) if r.fps] if limits else []
    limit = sum(r.fps for r in ends) / len(ends) if ends else None  # type: ignore[misc]
    limit_cpu = sum(r.cpu.get("ours", 0) for r in ends) / max(len(ends), 1)
    frame_bytes = int(np.prod(make_pong_space(obs).shape))
    log("")
    log(f"{obs}: {args.workers} workers x {args.envs_per_worker} envs, {args.frames_per_batch} frames/batch, "
        f"observation {frame_bytes:,} bytes; ratio: to the mean of the first and last limit runs; "
        f"adjacent: to the limit runs just before and after the setup")  # fmt: skip
    log(_row("setup", _COLUMNS))
    if limit:
        log(_row("limit (first and last run)", (f"{limit:,.0f}", "1.00", "1.00", f"{limit_cpu:.2f}", "1.00", "-", "0", "0")))
    out_results = {}
    for r, around in results:
        if r.fps is None or not limit:
            log(f"{r.name:<28}  {r.note or 'no limit measured'}")
            continue
        near = [x for x in around if x.fps]
        near_fps = sum(x.fps for x in near) / len(near) if near else None  # type: ignore[misc]
        near_cpu = sum(x.cpu.get("ours", 0) for x in near) / len(near) if near else 0
        per_core = (r.fps / r.cpu["ours"]) / (near_fps / near_cpu) if r.cpu.get("ours") and near_cpu and near_fps else None
        log(_row(r.name, (
            f"{r.fps:,.0f}", f"{r.fps / limit:.2f}", "-" if near_fps is None else f"{r.fps / near_fps:.2f}",
            f"{r.cpu.get('ours', 0):.2f}", "-" if per_core is None else f"{per_core:.2f}",
            f"{r.cpu.get('elsewhere', 0):.2f}",
            _kb(r.extra.get("shm_write_per_frame")), _kb(r.extra.get("copy_out_per_frame")),
        )))  # fmt: skip
        out_results[r.name] = {**asdict(r), "ratio": r.fps / limit, "ratio_adjacent": None if near_fps is None else r.fps / near_fps,
                               "per_core_ratio_adjacent": per_core}
    drift = None
    ok = [r.fps for r in limits if r.fps]
    if len(ends) == 2:
        drift = abs(ends[1].fps - ends[0].fps) / max(ends[0].fps, ends[1].fps)  # type: ignore[operator]
        log(f"limit at the start / at the end: {ends[0].fps:,.0f} / {ends[1].fps:,.0f} frames/s (differ by {drift:.0%})"
            + ("  <- the machine's load changed: ratios unreliable" if drift > 0.10 else ""))  # fmt: skip
    if len(ok) > 2:
        log(f"every limit run: {' / '.join(f'{x:,.0f}' for x in ok)} frames/s")
    return {"obs": obs, "limit_fps": limit, "limit_runs": ok, "limit_drift": drift, "results": out_results}


def make_pong_space(obs: str) -> gym.Space:
    env = make_pong(obs)
    try:
        return env.observation_space
    finally:
        env.close()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--obs", nargs="+", choices=OBS_FORMATS, default=list(OBS_FORMATS), help="observation formats (default both)")
    p.add_argument("--seconds", type=float, default=6.0, help="measuring window of each setup (default 6)")
    p.add_argument("--warmup", type=float, default=1.5, help="warm-up discarded before each window (default 1.5 s)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--envs-per-worker", type=int, default=4)
    p.add_argument("--frames-per-batch", type=int, default=512)
    p.add_argument("--repeat", type=int, default=1, help="run everything this many times (default 1)")
    p.add_argument("--skip-gymnasium", action="store_true", help="skip gymnasium's AsyncVectorEnv")
    p.add_argument("--copy-only", action="store_true", help="skip the zero_copy setups")
    p.add_argument("--sliced", action="store_true",
                   help="each aiocollect setup takes turns with the limit, the other side stopped (SIGSTOP), "
                        "instead of setups one after the other (gymnasium's AsyncVectorEnv is not measured)")
    p.add_argument("--turns", type=int, default=8, help="--sliced: turns of each side per setup (default 8)")
    p.add_argument("--turn-seconds", type=float, default=2.0, help="--sliced: seconds per turn (default 2)")
    p.add_argument("--prefetch", type=int, help="the collectors' prefetch (default: the collector's default)")
    p.add_argument("--no-interleave", dest="interleave", action="store_false",
                   help="measure the limit only first and last (default: also between setups)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = p.parse_args(argv)
    n = args.workers * args.envs_per_worker
    if args.frames_per_batch % n:
        p.error(f"--frames-per-batch ({args.frames_per_batch}) must be a multiple of workers x envs-per-worker ({n})")
    return args


def main(args: argparse.Namespace) -> int:
    try:
        import ale_py  # noqa: F401
    except ModuleNotFoundError:
        log("ale-py is not installed: `pip install 'aiocollect[atari]'` (or `bash scripts/run.sh pixels`, which installs it)")
        return 2
    become_subreaper()
    timing = (f"{args.turns} turns of {args.turn_seconds:g} s per setup, taking turns with the limit" if args.sliced
              else f"{args.seconds:g} s per setup")
    log(f"aiocollect pixel benchmark: ALE/Pong-v5, random policy, {args.workers} workers x {args.envs_per_worker} envs, "
        f"{args.frames_per_batch} frames/batch, {timing}, after {args.warmup:g} s warm-up")  # fmt: skip
    log(machine_line(machine()))
    runs = []
    for k in range(args.repeat):
        for obs in args.obs:
            if args.repeat > 1:
                log(f"\n=== run {k + 1}/{args.repeat}")
            runs.append(run_sliced(args, obs) if args.sliced else run_format(args, obs))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"benchmark": "pixels", "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **machine(),
                       "args": vars(args), "runs": runs}, f, indent=2)  # fmt: skip
        log(f"results written to {args.json}")
    return 0


if __name__ == "__main__":
    with sigterm_as_interrupt():
        try:
            sys.exit(main(parse_args()))
        except KeyboardInterrupt:
            log("interrupted; stopping everything this benchmark started")
            sys.exit(130)
        finally:
            with contextlib.suppress(Exception):
                from aiocollect import shutdown_launcher

                shutdown_launcher()
            reap("the benchmark", keep=MP_HELPERS, grace_s=1.0)
