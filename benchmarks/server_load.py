"""Request latency of the example training server (examples/training_server.py), with collection
on and off.

    .venv/bin/python benchmarks/server_load.py                 # 2,000 requests at concurrency 20
    .venv/bin/python benchmarks/server_load.py --json out.json

For each mode, the server runs in a process of its own (uvicorn on 127.0.0.1, uvloop), exactly
as ``python examples/training_server.py`` starts it:

* **collecting**: the collector (CartPole-v1, ``--workers`` x ``--envs-per-worker`` envs in
  worker processes) and the trainer (an optimizer step per batch, in a thread; the weights
  published every 4 batches) run in the server's event loop;
* **idle**: the same app with ``--no-collect``.

This process sends ``--requests`` GET requests to ``--endpoint`` (default ``/stats``, which reads
the collector's statistics) from ``--concurrency`` concurrent httpx clients, after a warm-up, and
prints the latency percentiles, the requests per second, and the server's event-loop lag over the
same window (measured inside the server: a task sleeping 1 ms, how late it wakes; read from
``/stats?lag_since=``). Everything shares the machine's cores: client, server, workers.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from typing import Any

from _util import log, machine, machine_line, percentiles_ms

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "training_server.py")


def start_server(args: argparse.Namespace, collect: bool) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, EXAMPLE, "--port", "0", "--num-workers", str(args.workers),
           "--envs-per-worker", str(args.envs_per_worker), "--frames-per-batch", str(args.frames_per_batch)]
    if not collect:
        cmd.append("--no-collect")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.stdout is not None
    seen = []
    deadline = time.monotonic() + 90
    for line in proc.stdout:
        seen.append(line)
        found = re.search(r"listening on (http://[\d.]+:\d+)", line)
        if found:
            return proc, found.group(1)
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise RuntimeError("the example server did not start:\n" + "".join(seen))


def stop_server(proc: subprocess.Popen) -> str:
    proc.send_signal(signal.SIGINT)
    try:
        out, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise RuntimeError("the example server did not stop within 30 s of SIGINT")
    if proc.returncode != 0:
        raise RuntimeError(f"the example server exited with {proc.returncode}:\n{out}")
    return out


async def load(url: str, args: argparse.Namespace) -> dict[str, Any]:
    import anyio
    import httpx

    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60) as client:

        async def run(n: int, out: list[float]) -> None:
            per = n // args.concurrency

            async def one_client() -> None:
                for _ in range(per):
                    t0 = time.perf_counter()
                    response = await client.get(args.endpoint)
                    out.append(time.perf_counter() - t0)
                    response.raise_for_status()

            async with anyio.create_task_group() as tg:
                for _ in range(args.concurrency):
                    tg.start_soon(one_client)

        await run(args.warmup_requests, [])
        before = (await client.get("/stats")).json()
        since = time.monotonic()
        latencies: list[float] = []
        t0 = time.perf_counter()
        await run(args.requests, latencies)
        elapsed = time.perf_counter() - t0
        after = (await client.get("/stats", params={"lag_since": since})).json()
    lag = after["loop_lag"]
    row: dict[str, Any] = {
        "requests": len(latencies),
        "seconds": elapsed,
        "requests_per_s": len(latencies) / elapsed,
        "latency_ms": percentiles_ms(latencies, (50, 99)),
        "loop_lag_ms": {"p50": lag["p50_ms"], "p99": lag["p99_ms"], "max": lag["max_ms"], "n": lag["samples"]},
    }
    if "frames" in after:
        row["collector_fps"] = (after["frames"] - before["frames"]) / elapsed
        row["train_steps"] = after["train_steps"] - before["train_steps"]
    return row


def measure(args: argparse.Namespace, collect: bool) -> dict[str, Any]:
    import anyio

    name = "collecting" if collect else "idle"
    log(f"{name}: starting the server ...")
    proc, url = start_server(args, collect)
    try:
        if collect:
            time.sleep(args.settle)  # (the first batches, the first weights)
        log(f"{name}: {args.requests} requests to {args.endpoint} at concurrency {args.concurrency} ...")
        row = anyio.run(load, url, args, backend_options={"use_uvloop": True})
    finally:
        out = stop_server(proc)
    if collect and "collector closed" not in out:
        raise RuntimeError(f"the collector did not report closing:\n{out}")
    log(f"  -> latency p50 {row['latency_ms']['p50']:.2f} ms, p99 {row['latency_ms']['p99']:.2f} ms; "
        f"loop lag p99 {row['loop_lag_ms']['p99']:.2f} ms")
    return row


def main(args: argparse.Namespace) -> int:
    try:
        import httpx  # noqa: F401
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        log(f"needs the example server's packages ({exc.name} is missing): pip install 'aiocollect[server]'")
        return 2
    m = machine()
    log(machine_line(m))
    log(f"{args.requests} GET {args.endpoint} at concurrency {args.concurrency} (after {args.warmup_requests} "
        f"warm-up requests); collecting: {args.workers} workers x {args.envs_per_worker} CartPole-v1 envs, "
        f"{args.frames_per_batch} frames per batch, a training step per batch; {args.rounds} round(s)")
    runs: dict[str, list[dict[str, Any]]] = {"idle": [], "collecting": []}
    for r in range(args.rounds):
        for collect in (False, True):
            runs["collecting" if collect else "idle"].append(measure(args, collect))
    table = {}
    for name, rows in runs.items():
        med = statistics.median
        table[name] = {
            "latency_ms": {k: med(r["latency_ms"][k] for r in rows) for k in ("p50", "p99")},
            "loop_lag_ms": {k: med(r["loop_lag_ms"][k] for r in rows) for k in ("p50", "p99", "max")},
            "requests_per_s": med(r["requests_per_s"] for r in rows),
            "collector_fps": med(r["collector_fps"] for r in rows) if "collector_fps" in rows[0] else None,
            "runs": rows,
        }
    log("")
    log(f"{'server':<12} {'requests/s':>10} {'latency p50 / p99 (ms)':>23} {'loop lag p50 / p99 / max (ms)':>31} "
        f"{'collector frames/s':>19}")
    for name, row in table.items():
        lat, lag = row["latency_ms"], row["loop_lag_ms"]
        fps = f"{row['collector_fps']:,.0f}" if row["collector_fps"] is not None else "-"
        log(f"{name:<12} {row['requests_per_s']:>10,.0f} {lat['p50']:>11.2f} / {lat['p99']:>7.2f} "
            f"{lag['p50']:>14.2f} / {lag['p99']:>5.2f} / {lag['max']:>6.2f} {fps:>19}")
    log("(medians over rounds; client, server and workers share the machine's cores)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "server_load", "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": m,
                       "args": vars(args), "results": table}, f, indent=2)
        log(f"results written to {args.json}")
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=2000, help="measured requests per mode (default 2000)")
    p.add_argument("--concurrency", type=int, default=20, help="concurrent clients (default 20)")
    p.add_argument("--warmup-requests", type=int, default=200, help="requests before measuring (default 200)")
    p.add_argument("--endpoint", default="/stats", help="what is requested (default /stats)")
    p.add_argument("--workers", type=int, default=2, help="collecting: worker processes (default 2)")
    p.add_argument("--envs-per-worker", type=int, default=4, help="collecting: envs per worker (default 4)")
    p.add_argument("--frames-per-batch", type=int, default=1024, help="collecting: frames per batch (default 1024)")
    p.add_argument("--settle", type=float, default=2.0, help="collecting: seconds before the requests (default 2)")
    p.add_argument("--rounds", type=int, default=1, help="rounds of both modes; medians reported (default 1)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = p.parse_args(argv)
    if args.requests % args.concurrency or args.warmup_requests % args.concurrency:
        p.error("--requests and --warmup-requests must be multiples of --concurrency")
    return args


if __name__ == "__main__":
    sys.exit(main(parse_args()))
