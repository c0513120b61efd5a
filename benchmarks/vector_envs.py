"""Vector-env benchmark: aiocollect stepping natively vectorized envs, against their limit.

What is measured (the 4-64-2 MLP of ``benchmarks/throughput.py``, argmax of its logits, same weights
everywhere):

* **limit** -- ``--workers`` independent processes (multiprocessing "spawn", started together), each
  stepping one ``gym.make_vec("CartPole-v1", num_envs=--num-envs, vectorization_mode="vector_entry_point")``
  with the MLP in a plain loop (one batched forward, one ``step``): no communication, no storage. Each
  process bumps a shared frame counter, read at the start and the end of one common window after a
  warm-up. It runs first and last; the ratios use the mean of the two, their difference shows whether
  the machine's load changed meanwhile.
* **aiocollect vector** -- ``Collector(lambda: gym.make_vec(...same...), policy, num_workers=--workers)``:
  one vector env of ``--num-envs`` sub-envs per worker, ``delivery="sync"``, ``async for`` under uvloop;
  then the same with ``zero_copy=True`` (batches are views on shared memory: no copy in the collector).
* **aiocollect single** -- the same number of rows as ``--num-envs`` plain ``CartPole-v1`` envs per worker
  (``envs_per_worker=--num-envs``): what the vector env saves.
* **EnvPool Pong** (``Pong-v5``, ``--pong-envs`` per process, one EnvPool thread each, a linear policy on
  64 pixels) -- its own limit (plain loop in ``--workers`` processes) before and after aiocollect with
  ``envpool.make_gymnasium``; skipped with the reason when ``envpool`` does not import or cannot make Pong.

Each batch-based window discards the first batches (at least 2 and ``--warmup`` seconds), then counts
frames for ``--seconds``. "cores used" is the CPU time of the benchmark's processes per second of the
window ("collector process": of the process that runs the collector, in it), "per-core ratio" the frames
per CPU-second relative to the limit's, "busy elsewhere" the CPU time of the rest of the machine: on a
noisy machine read the per-core ratio.

The limit counts transitions: the step after a sub-env's episode ended is its reset in the vector
env's next-step autoreset, which the collector does apart (``reset`` of the ended rows) and does
not count either.

With ``--sliced`` (CartPole only) each aiocollect vector setup instead takes turns with the limit
on the same cores (``--turns`` turns of ``--turn-seconds`` each, the other side stopped with
SIGSTOP), so that a drift of the machine's speed hits both alike; see ``benchmarks/pixels.py``.

Run::

    .venv/bin/python benchmarks/vector_envs.py [--seconds 4] [--num-envs 256] [--json PATH]
    .venv/bin/python benchmarks/vector_envs.py --sliced [--turns 8] [--turn-seconds 2]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
import time
import warnings
from dataclasses import asdict
from typing import Any

import gymnasium as gym
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _util.py beside this file
from _util import (  # noqa: E402
    ArgmaxMLP,
    LimitPool,
    Meter,
    Result,
    become_subreaper,
    log,
    machine,
    machine_line,
    reap,
    run_limit_processes,
    Slices,
    collect_taking_turns,
    report_slices,
    sigterm_as_interrupt,
)

SEED = 0


class PongPolicy(nn.Module):
    """uint8 frames [B, 4, 84, 84] -> actions [B]: a linear layer on 64 pixels (cheap on purpose:
    the env is what is measured)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(64, 6)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.net(obs.flatten(1)[:, 4000:4064].float()).argmax(-1)


def make_policy(cls: type[nn.Module]) -> nn.Module:
    torch.manual_seed(SEED)
    return cls()


def make_cartpole(num_envs: int) -> Any:
    return gym.make_vec("CartPole-v1", num_envs=num_envs, vectorization_mode="vector_entry_point")


def make_pong(num_envs: int, seed: int = SEED) -> Any:
    import envpool

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (gymnasium's Box warns about EnvPool's float64 bounds)
        return envpool.make_gymnasium("Pong-v5", num_envs=num_envs, batch_size=num_envs, num_threads=1, seed=seed)


def envpool_problem() -> str | None:
    """Why EnvPool's Pong cannot be measured here, or None."""
    try:
        import envpool  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any failure to import is a reason to skip
        return f"envpool does not import ({type(exc).__name__}: {exc}); pip install envpool"
    try:
        env = make_pong(2)
        env.reset()
        env.close()
    except Exception as exc:  # noqa: BLE001
        return f"envpool cannot make Pong-v5 ({type(exc).__name__}: {exc})"
    return None


# --------------------------------------------------------------------------------------------------
# the limit: the vector env and the policy in independent processes


def _limit_worker(kind: str, rank: int, num_envs: int, state: dict, counter: Any, ready: Any, go: Any, stop: Any) -> None:
    torch.set_num_threads(1)
    policy = ArgmaxMLP() if kind == "cartpole" else PongPolicy()
    policy.load_state_dict(state)
    if kind == "cartpole":
        env = make_cartpole(num_envs)
        obs, _ = env.reset(seed=SEED + rank * num_envs)
    else:
        env = make_pong(num_envs, SEED + rank * num_envs)
        obs, _ = env.reset()
    ready.set()
    go.wait()
    resetting = 0  # next-step autoreset: the step after an episode's end is its reset, not a transition
    try:
        with torch.no_grad():
            while not stop.is_set():
                actions = policy(torch.from_numpy(obs)).numpy()
                obs, _, term, trunc, _ = env.step(actions)  # (the env resets ended sub-envs itself)
                counter.value += num_envs - resetting  # transitions, as a collector's batch counts them
                resetting = int((term | trunc).sum()) if kind == "cartpole" else 0
    finally:
        env.close()


def run_limit(kind: str, args: argparse.Namespace, num_envs: int, policy: nn.Module) -> Result:
    state = {k: v.detach().clone() for k, v in policy.state_dict().items()}
    return run_limit_processes(_limit_worker, lambda rank: (kind, rank, num_envs, state), args.workers, args.warmup,
                               args.seconds, f"limit {kind} ({args.workers} procs x {num_envs})")


# --------------------------------------------------------------------------------------------------
# aiocollect


async def _collect(name: str, make: Any, policy: nn.Module, args: argparse.Namespace, envs_per_worker: int,
                   rows: int, meter: Meter, zero_copy: bool = False) -> None:
    from aiocollect import Collector

    async with Collector(make, policy, frames_per_batch=args.workers * rows * args.steps, num_workers=args.workers,
                         envs_per_worker=envs_per_worker, seed=SEED, zero_copy=zero_copy) as collector:
        async for batch in collector:
            if meter.add(batch.numel()):
                return


def run_aiocollect(name: str, make: Any, policy: nn.Module, args: argparse.Namespace, envs_per_worker: int,
                   rows: int, zero_copy: bool = False) -> Result:
    import anyio

    meter = Meter(args.seconds, args.warmup)
    anyio.run(_collect, name, make, policy, args, envs_per_worker, rows, meter, zero_copy,
              backend_options={"use_uvloop": True})
    return meter.result(name)


# --------------------------------------------------------------------------------------------------
# --sliced: each setup takes turns with the limit on the same cores


async def _collect_sliced(make: Any, policy: nn.Module, args: argparse.Namespace, rows: int, zero_copy: bool,
                          limit: LimitPool) -> tuple[Slices, int, int]:
    from aiocollect import Collector

    async with Collector(make, policy, frames_per_batch=args.workers * rows * args.steps, num_workers=args.workers,
                         seed=SEED, zero_copy=zero_copy, delivery=args.delivery) as collector:
        return await collect_taking_turns(collector, limit, args.warmup, args.turns, args.turn_seconds)


def run_sliced(args: argparse.Namespace, policy: nn.Module) -> dict[str, Any]:
    import anyio

    n = args.num_envs
    state = {k: v.detach().clone() for k, v in policy.state_dict().items()}
    rows = []
    with LimitPool(_limit_worker, lambda rank: ("cartpole", rank, n, state), args.workers) as limit:
        keep = frozenset(p.pid for p in limit.procs)
        for zero_copy in (False, True):
            name = f"aiocollect vector {args.delivery}{' zero_copy' if zero_copy else ''} ({args.workers} x 1 x {n})"
            log(f"{name}: {args.turns} turns of {args.turn_seconds:g} s, taking turns with the limit ...")
            try:
                slices, copied, batches = anyio.run(
                    _collect_sliced, functools.partial(make_cartpole, n), policy, args, n, zero_copy, limit,
                    backend_options={"use_uvloop": True},
                )
            except Exception as exc:  # noqa: BLE001 - a failed setup is reported, the others still run
                log(f"  -> failed: {type(exc).__name__}: {exc}")
                continue
            finally:
                reap(name, baseline=keep)
            log(f"  -> {slices.fps('setup'):,.0f} frames/s against the limit's {slices.fps('limit'):,.0f}: {slices.ratio():.2f}")
            rows.append((name, slices, copied, batches))
    log(f"\nCartPole-v1, vector entry point, {n} sub-envs per worker, 4-64-2 MLP (argmax); each setup took "
        f"{args.turns} turns of {args.turn_seconds:g} s with the limit (the other side stopped)")
    return report_slices(rows, 46)


# --------------------------------------------------------------------------------------------------
# report

_COLUMNS = ("frames/s", "ratio to limit", "cores used", "per-core ratio", "collector process", "busy elsewhere")


def _row(name: str, cells: tuple[str, ...]) -> str:
    return f"{name:<40}" + "".join(f"  {cell:>{max(len(head), 9)}}" for cell, head in zip(cells, _COLUMNS, strict=True))


def _cores(r: Result, key: str) -> str:
    return f"{r.cpu[key]:.2f}" if key in r.cpu else "-"


def _table(title: str, limits: list[Result], others: list[Result]) -> dict[str, Any]:
    ok = [r.fps for r in limits if r.fps]
    limit = sum(ok) / len(ok) if ok else None
    log(f"\n{title}")
    log(_row("setup", _COLUMNS))
    for r in limits + others:
        if r.fps is None:
            log(f"{r.name:<40}  {r.note}")
            continue
        ratio = f"{r.fps / limit:.2f}" if limit else "n/a"
        per_core = "-"
        if limit and r.cpu.get("ours") and all(x.cpu.get("ours") for x in limits):
            limit_cores = sum(x.cpu["ours"] for x in limits) / len(limits)
            per_core = f"{(r.fps / r.cpu['ours']) / (limit / limit_cores):.2f}"
        main = _cores(r, "main") if r in others else "-"
        log(_row(r.name, (f"{r.fps:,.0f}", ratio, _cores(r, "ours"), per_core, main, _cores(r, "elsewhere"))))
    if len(ok) == 2:
        drift = abs(ok[1] - ok[0]) / max(ok)
        log(f"limit at the start and the end differ by {drift:.0%}"
            + ("  <- the machine's load changed during the run: ratios are unreliable" if drift > 0.15 else ""))
    return {"limit_fps": limit, "results": [{**asdict(r), "ratio_to_limit": (r.fps / limit if r.fps and limit else None)}
                                            for r in limits + others]}


def _guarded(name: str, fn: Any, *a: Any) -> Result:
    try:
        return fn(*a)
    except Exception as exc:  # noqa: BLE001 - a failed setup is reported, the others still run
        log(f"  {name} failed: {type(exc).__name__}: {exc}")
        return Result(name, note=f"failed: {type(exc).__name__}: {exc}")
    finally:
        reap(name)


def run_one_after_another(args: argparse.Namespace, policy: nn.Module) -> dict[str, Any]:
    """The setups one after the other, the limit first and last; then EnvPool's Pong."""
    out: dict[str, Any] = {}
    n = args.num_envs
    limits = [_guarded("limit cartpole", run_limit, "cartpole", args, n, policy)]
    vec = _guarded("aiocollect vector", run_aiocollect, f"aiocollect vector ({args.workers} x 1 x {n})",
                   lambda: make_cartpole(n), policy, args, 1, n)
    vec_zc = _guarded("aiocollect vector zero_copy", run_aiocollect,
                      f"aiocollect vector zero_copy ({args.workers} x 1 x {n})", lambda: make_cartpole(n), policy,
                      args, 1, n, True)
    single = _guarded("aiocollect single", run_aiocollect, f"aiocollect single ({args.workers} x {n} envs)",
                      "CartPole-v1", policy, args, n, n)
    limits.append(_guarded("limit cartpole", run_limit, "cartpole", args, n, policy))
    out["cartpole"] = _table(f"CartPole-v1, vector entry point, {n} sub-envs per worker, 4-64-2 MLP (argmax)",
                             limits, [vec, vec_zc, single])
    if vec.fps and single.fps:
        log(f"vector env over {n} single envs per worker: x{vec.fps / single.fps:.1f}")
    problem = envpool_problem()
    if args.skip_envpool:
        problem = "--skip-envpool"
    if problem is not None:
        log(f"\nEnvPool Pong: skipped: {problem}")
        out["pong"] = {"skipped": problem}
    else:
        m = args.pong_envs
        pong_policy = make_policy(PongPolicy)
        plimits = [_guarded("limit pong", run_limit, "pong", args, m, pong_policy)]
        pong = _guarded("aiocollect pong", run_aiocollect, f"aiocollect EnvPool Pong ({args.workers} x {m})",
                        lambda: make_pong(m), pong_policy, args, 1, m)
        plimits.append(_guarded("limit pong", run_limit, "pong", args, m, pong_policy))
        out["pong"] = _table(f"EnvPool Pong-v5, {m} envs per worker (1 EnvPool thread), linear policy", plimits, [pong])
    return out


def main(args: argparse.Namespace) -> int:
    become_subreaper()
    torch.set_num_threads(1)
    import aiocollect

    log(machine_line(machine()))
    log(f"cpu cores available: {len(os.sched_getaffinity(0))}; {args.workers} workers; windows of {args.seconds:g} s "
        f"after {args.warmup:g} s of warm-up; batches of {args.steps} steps of every env row")
    out: dict[str, Any] = {"machine": machine(), "aiocollect": aiocollect.__version__,
                           "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "args": vars(args)}
    policy = make_policy(ArgmaxMLP)
    if args.sliced:
        out["cartpole_sliced"] = run_sliced(args, policy)
    else:
        out.update(run_one_after_another(args, policy))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    with contextlib.suppress(Exception):
        aiocollect.shutdown_launcher()
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=4.0, help="measuring window of each setup (default 4)")
    p.add_argument("--warmup", type=float, default=1.0, help="warm-up discarded before each window (default 1 s)")
    p.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    p.add_argument("--num-envs", type=int, default=256, help="sub-envs of each worker's CartPole vector env (default 256)")
    p.add_argument("--steps", type=int, default=64, help="steps of each env row in a batch (default 64)")
    p.add_argument("--pong-envs", type=int, default=8, help="EnvPool Pong envs per worker (default 8)")
    p.add_argument("--skip-envpool", action="store_true", help="skip EnvPool's Pong")
    p.add_argument("--sliced", action="store_true",
                   help="CartPole only: each aiocollect vector setup takes turns with the limit, the other side "
                        "stopped (SIGSTOP), instead of setups one after the other")
    p.add_argument("--delivery", choices=("sync", "async"), default="sync",
                   help="--sliced: the collectors' delivery (default sync)")
    p.add_argument("--turns", type=int, default=8, help="--sliced: turns of each side per setup (default 8)")
    p.add_argument("--turn-seconds", type=float, default=2.0, help="--sliced: seconds per turn (default 2)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    return p.parse_args(argv)


if __name__ == "__main__":
    with sigterm_as_interrupt():
        sys.exit(main(parse_args()))
