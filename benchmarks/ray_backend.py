"""Ray backend benchmark: ``backend="ray"`` (each worker a Ray actor on a local Ray instance)
against ``backend="process"`` (forked worker processes), same machine, same run.

CartPole-v1 with the benchmarks' 4-64-2 MLP acting by argmax (``ArgmaxMLP``), ``--workers`` x
``--envs-per-worker`` envs (default 2 x 8), ``--frames-per-batch`` (default 2048), delivery "sync",
``async for`` on anyio + uvloop. Each round measures both backends one after the other (process
first); ``--rounds`` (default 2) interleaves them so that a change in the machine's load shows.

Per backend and round:

* **Collector() -> first batch**: from constructing the collector to the first batch (the actors'
  or processes' start-up, env creation, the policy sent to them). Ray itself is started once,
  before the first round, and timed apart (``ray.init``).
* **fps**: frames delivered per second over ``--seconds`` after 2 warm-up batches (and at least
  ``--warmup`` seconds), and the ratio to the process backend of the same round.
* **update latency, idle**: wall time of ``await collector.update_weights(policy)`` (``wait=True``:
  until every worker applied it) while no batch is asked for (the workers have filled the batches
  they may collect ahead and wait), ``--updates`` times after 2 discarded; p50 / p99.
* **WeightsApplied latency, collecting**: for ``--updates`` batches, ``update_weights(policy,
  wait=False)`` after each batch; the latency the ``WeightsApplied`` events report (publication ->
  the acknowledgement seen by the collector; weights are applied at batch boundaries, so this
  includes waiting for the batch in progress); p50 / p99.

Run::

    .venv/bin/python -m pip install 'ray>=2.9'   # (or: pip install 'aiocollect[ray]')
    .venv/bin/python benchmarks/ray_backend.py [--seconds 4] [--rounds 2] [--json PATH]

Machine line first; progress as it goes; a table at the end. Every actor and process is stopped
before it exits (the collectors are closed; Ray is shut down).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import anyio  # noqa: E402
import torch  # noqa: E402

from _util import ArgmaxMLP, Meter, log, machine, machine_line, percentiles_ms  # noqa: E402


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=4.0, help="measuring window of each fps figure (s)")
    p.add_argument("--warmup", type=float, default=1.0, help="warm-up before each window (s)")
    p.add_argument("--rounds", type=int, default=2, help="rounds of [process, ray]")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--envs-per-worker", type=int, default=8)
    p.add_argument("--frames-per-batch", type=int, default=2048)
    p.add_argument("--updates", type=int, default=20, help="weight updates timed per backend and round")
    p.add_argument("--ray-cpus", type=int, default=None, help="num_cpus of the local Ray instance (default: all)")
    p.add_argument("--json", default=None, help="also write the figures to this JSON file")
    return p.parse_args()


async def measure(backend: str, args: argparse.Namespace) -> dict:
    from aiocollect import Collector
    from aiocollect.events import WeightsApplied

    torch.manual_seed(0)
    policy = ArgmaxMLP()
    latencies: list[float] = []
    t0 = time.perf_counter()
    collector = Collector("CartPole-v1", policy, frames_per_batch=args.frames_per_batch, num_workers=args.workers,
                          envs_per_worker=args.envs_per_worker, backend=backend, seed=0)
    collector.on(WeightsApplied, lambda e: latencies.append(e.latency))
    out: dict = {"backend": backend}
    async with collector:
        meter = Meter(args.seconds, args.warmup)
        async for batch in collector:
            if meter.t_first is None:
                out["first_batch_s"] = time.perf_counter() - t0
            if meter.add(batch.numel()):
                break
        result = meter.result(backend)
        out["fps"] = result.fps
        out["cores_used"] = result.cpu.get("ours")
        # WeightsApplied latency while collecting: an update after each batch
        latencies.clear()
        n = 0
        async for batch in collector:
            await collector.update_weights(policy, wait=False)
            n += 1
            if n >= args.updates:
                break
        await collector.update_weights(policy)  # (wait: every update before it is applied too)
        out["applied_collecting_ms"] = percentiles_ms(latencies)
        # idle: no batch asked for; the workers fill what they may collect ahead, then wait
        await anyio.sleep(1.0)
        times = []
        for i in range(args.updates + 2):
            with torch.no_grad():
                policy.net[0].bias.add_(1e-3)
            t = time.perf_counter()
            await collector.update_weights(policy)
            if i >= 2:
                times.append(time.perf_counter() - t)
        out["update_idle_ms"] = percentiles_ms(times)
    return out


async def main(args: argparse.Namespace) -> dict:
    import ray

    log(machine_line(machine()))
    log(f"ray {ray.__version__}; CartPole-v1, ArgmaxMLP 4-64-2, {args.workers} workers x {args.envs_per_worker} envs, "
        f"{args.frames_per_batch} frames per batch, delivery sync; {args.rounds} round(s) of [process, ray]")
    t = time.perf_counter()
    ray.init(num_cpus=args.ray_cpus, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    ray_init_s = time.perf_counter() - t
    log(f"ray.init (a local instance): {ray_init_s:.2f} s")
    rows = []
    try:
        for r in range(args.rounds):
            for backend in ("process", "ray"):
                log(f"round {r + 1}/{args.rounds}: {backend} ...")
                row = await measure(backend, args)
                row["round"] = r + 1
                rows.append(row)
                log(f"  {backend}: first batch {row['first_batch_s']:.2f} s, {row['fps']:,.0f} fps, update idle p50 "
                    f"{row['update_idle_ms']['p50']:.2f} ms")
    finally:
        ray.shutdown()
    log("")
    log(f"{'round':>5}  {'backend':<8} {'first batch':>11} {'fps':>9} {'ratio':>6}  {'update idle p50 / p99 (ms)':>27}"
        f"  {'WeightsApplied collecting p50 / p99 (ms)':>41}")
    for row in rows:
        base = next(x for x in rows if x["round"] == row["round"] and x["backend"] == "process")
        idle, coll = row["update_idle_ms"], row["applied_collecting_ms"]
        log(f"{row['round']:>5}  {row['backend']:<8} {row['first_batch_s']:>10.2f}s {row['fps']:>9,.0f} "
            f"{row['fps'] / base['fps']:>6.2f}  {idle['p50']:>13.2f} / {idle['p99']:>8.2f}   "
            f"{coll.get('p50', float('nan')):>24.2f} / {coll.get('p99', float('nan')):>8.2f}")
    return {"machine": machine(), "ray": ray.__version__, "ray_init_s": ray_init_s, "rows": rows}


if __name__ == "__main__":
    args = parse()
    try:
        import ray  # noqa: F401
    except ImportError:
        sys.exit("benchmarks/ray_backend.py needs Ray: pip install 'aiocollect[ray]' (or 'ray>=2.9')")
    figures = anyio.run(main, args, backend_options={"use_uvloop": True})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
