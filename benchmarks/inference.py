"""Worker inference against server inference (``inference="server"``), on this machine's CPU.

Setups, taking turns in this process tree (``--rounds`` rounds; each round measures every setup
once for ``--seconds`` after ``--warmup``, so a drift of the shared machine touches all alike):

* **CartPole-v1**, the 4-64-2 MLP (argmax), ``--workers`` workers x ``--cartpole-envs`` envs.
* **Pong**: ``ALE/Pong-v5`` with ``AtariPreprocessing`` (84x84 grey, frame skip 4) and 4 stacked
  frames, a Nature-CNN (3 conv layers, 512 hidden, argmax over 6 actions), ``--workers`` workers
  x ``--pong-envs`` envs. Needs ``ale-py`` and OpenCV (``pip install -e .[atari]``); skipped
  cleanly without them.

"server, 2 groups" is the server with ``worker_groups=2`` (each worker's envs in two groups that
alternate: one steps while the server computes the other's actions); "server, idle" and "idle, 2
groups" the same with ``server_priority="idle"`` (the server's thread under Linux's ``SCHED_IDLE``);
"idle, pinned" and "pinned, 2 groups" those with the workers kept off this process's first CPU
(``worker_cpus=sorted(os.sched_getaffinity(0))[1:]``; only where this process may use two CPUs or more).

``--busy-trainer`` measures each setup beside a thread of this process that wants a core all the
time (matrix products without a pause: a trainer's stand-in), and reports its products per
second too (and alone, first): what ``server_priority="idle"`` costs when the CPU is not spare.
``--setups`` picks setups by name (``;``-separated).

With ``--serve-in-loop`` the server is also measured as a task on the event loop instead of its
own thread (the choice ``docs/inference.md`` explains).

For each: frames per second, the ratio to worker inference, and the lag of the event loop while
collecting (a task that sleeps 1 ms and records how late it wakes; p50 / p99 / max), the server's
forward passes per second and rows per pass. Worker inference runs a replica of the policy in
each worker (one torch thread each); server inference runs the policy object in this process
(one batched forward pass over every waiting worker's envs, in a thread of its own: see
``docs/inference.md``).

With ``--device cuda`` (a machine with a CUDA GPU): the Pong case with ``--gpu-envs`` envs in all
(default 64 and 256, over ``--workers`` workers), worker inference on the CPU against the server
on the GPU (its own stream, pinned staging): frames per second, the loop's lag, the time per
forward pass, and the GPU's utilisation where ``torch.cuda.utilization()`` can read it (pynvml);
the server on the GPU also with ``worker_groups=2`` and with ``cudagraph_policy=True``; and the
same envs stepped with random actions and no policy ("random actions"), the limit: each row's
frames/s is also given as a fraction of it.

With ``--pass-parts``, one more window of the server (on the GPU with ``--device cuda``) times each
part of its forward pass: gathering the observations, staging them, the copy to the device, the
forward pass, reading the actions back, writing the answers, waking the workers; and the wait
between two passes (``_pass_parts.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import threading
import time
from typing import Any

import torch
from torch import nn

from _util import ArgmaxMLP, log, machine, machine_line, next_batch, percentiles_ms, reap, sigterm_as_interrupt


class NatureCNN(nn.Module):
    """The DQN paper's network on 4x84x84 uint8 frames; greedy actions."""

    def __init__(self, actions: int = 6) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(4, 32, 8, stride=4), nn.ReLU(), nn.Conv2d(32, 64, 4, stride=2), nn.ReLU(),
            nn.Conv2d(64, 64, 3, stride=1), nn.ReLU(), nn.Flatten(), nn.Linear(3136, 512), nn.ReLU(),
            nn.Linear(512, actions),
        )

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return self.net(observation.float() / 255.0).argmax(-1)


def make_pong() -> Any:
    import ale_py
    import gymnasium as gym

    gym.register_envs(ale_py)
    env = gym.make("ALE/Pong-v5", frameskip=1)
    env = gym.wrappers.AtariPreprocessing(env, frame_skip=4, screen_size=84, grayscale_obs=True, noop_max=30)
    return gym.wrappers.FrameStackObservation(env, 4)


def pong_problem() -> str | None:
    try:
        import ale_py  # noqa: F401
        import cv2  # noqa: F401
    except ImportError as exc:
        return f"not installed ({exc.name}): pip install -e .[atari]"
    return None


SETUPS = {  # name: (inference, where the server serves, policy_device, worker_groups, server_priority, options)
    "worker": ("worker", None, None, 1, "normal", {}),
    "server": ("server", "thread", None, 1, "normal", {}),
    "server, 2 groups": ("server", "thread", None, 2, "normal", {}),
    "server, idle": ("server", "thread", None, 1, "idle", {}),
    "idle, 2 groups": ("server", "thread", None, 2, "idle", {}),
    # the workers kept off this process's first CPU (worker_cpus), which the loop and the server share
    "idle, pinned": ("server", "thread", None, 1, "idle", {"worker_cpus": "rest"}),
    "pinned, 2 groups": ("server", "thread", None, 2, "idle", {"worker_cpus": "rest"}),
    "server on the loop": ("server", "loop", None, 1, "normal", {}),
    "server on cuda": ("server", "thread", "cuda", 1, "normal", {}),
    "cuda, 2 groups": ("server", "thread", "cuda", 2, "normal", {}),
    "cuda, cudagraph": ("server", "thread", "cuda", 1, "normal", {"cudagraph_policy": True}),
    # the same envs stepped with random actions and no policy: the limit the GPU rows are held to
    "random actions": ("worker", None, None, 1, "normal", {"random": True}),
}
RANDOM = "random actions"
PINNED = tuple(name for name, setup in SETUPS.items() if setup[5].get("worker_cpus"))


def _options(setup: str) -> dict[str, Any]:
    """The setup's extra Collector options (``worker_cpus="rest"``: every CPU but the first)."""
    options = dict(SETUPS[setup][5])
    options.pop("random", None)
    if options.get("worker_cpus") == "rest":
        options["worker_cpus"] = sorted(os.sched_getaffinity(0))[1:]
    return options


class BusyTrainer:
    """``--busy-trainer``: a thread of this process that multiplies 256x256 matrices without a
    pause (one torch thread; torch releases the GIL meanwhile), a training step's stand-in that
    wants a core all the time. ``steps`` counts its products. With ``--device cuda`` it trains on
    the GPU instead: 4096x4096 products on the device's default stream (the trainer's), waiting
    for its own stream every 8 of them, never for the server's, so the GPU stays busy while the
    inference server runs on its stream of its own."""

    def __init__(self, device: str = "cpu") -> None:
        self.steps = 0
        self.device = device
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="busy trainer", daemon=True)

    def _run(self) -> None:
        n = 256 if self.device == "cpu" else 4096
        a, b = torch.randn(n, n, device=self.device), torch.randn(n, n, device=self.device)
        while not self._stop.is_set():
            torch.mm(a, b)
            self.steps += 1
            if self.device != "cpu" and self.steps % 8 == 0:
                torch.cuda.current_stream().synchronize()  # (the trainer's own stream only)

    def __enter__(self) -> "BusyTrainer":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


async def _measure(env: Any, policy: nn.Module, setup: str, args: argparse.Namespace, envs: int,
                   steps: int) -> dict[str, Any]:
    import anyio

    import aiocollect._collector.inference_server
    from aiocollect import Collector

    inference, serve_in, device, groups, priority, _ = SETUPS[setup]
    if serve_in is not None:
        aiocollect._collector.inference_server.SERVE_IN = serve_in
    if device is None:
        policy = policy.cpu()
    if SETUPS[setup][5].get("random"):
        policy = None  # the collector steps the envs with their action spaces' samples

    frames = 0
    lags: list[float] = []
    async with Collector(env, policy, frames_per_batch=args.workers * envs * steps, num_workers=args.workers,
                         envs_per_worker=envs, inference=inference, seed=0, policy_device=device,
                         worker_groups=groups, **({"server_priority": priority} if inference == "server" else {}),
                         **_options(setup)) as c:
        it = aiter(c)
        t_end = time.perf_counter() + args.warmup  # (after the first batch: started, and warm)
        started = False
        while not started or time.perf_counter() < t_end:
            started = True
            if await next_batch(it, args.patience) is None:
                log(f"  {setup}: no batch within {args.patience:g} s (--patience): starved, counted as 0 frames/s")
                break
        measuring = True

        async def ticker() -> None:
            while measuring:
                t0 = time.perf_counter()
                await anyio.sleep(0.001)
                lags.append(time.perf_counter() - t0 - 0.001)

        first = c.stats().server  # the server's totals (None with worker inference)
        gpu: list[float] = []
        with contextlib.ExitStack() as stack:
            trainer = stack.enter_context(BusyTrainer(args.device)) if args.busy_trainer else None
            async with anyio.create_task_group() as tg:
                tg.start_soon(ticker)
                t0 = time.perf_counter()
                while time.perf_counter() - t0 < args.seconds:
                    if (batch := await next_batch(it, args.patience)) is None:
                        break
                    frames += batch.numel()
                    if device is not None:
                        gpu.append(_gpu_utilisation())
                elapsed = time.perf_counter() - t0
                measuring = False
        out: dict[str, Any] = {"fps": frames / elapsed, "lag_ms": percentiles_ms(lags, (50, 99))}
        if trainer is not None:
            out["trainer_per_s"] = trainer.steps / elapsed
        last = c.stats().server
        if first is not None and last is not None:
            passes = last["passes"] - first["passes"]
            out["passes_per_s"] = passes / elapsed
            out["rows_per_pass"] = (last["rows"] - first["rows"]) / max(passes, 1)
            out["ms_per_pass"] = (last["seconds"] - first["seconds"]) / max(passes, 1) * 1e3
        if gpu and all(g >= 0 for g in gpu):
            out["gpu_util"] = statistics.mean(gpu)
    return out


def _gpu_utilisation() -> float:
    try:
        return float(torch.cuda.utilization())
    except Exception:  # noqa: BLE001 - pynvml missing: not measured
        return -1.0


def run_case(name: str, env: Any, policy: nn.Module, args: argparse.Namespace, envs: int, steps: int,
             setups: list[str] | None = None) -> dict:
    import anyio

    if setups is None and args.setups:
        setups = args.setups if "worker" in args.setups else ["worker", *args.setups]  # (the ratios' base)
    setups = setups or (["worker", "server", "server, 2 groups", "server, idle", "idle, 2 groups"]
                        + (list(PINNED) if len(os.sched_getaffinity(0)) > 1 else [])  # (one CPU: nothing to keep)
                        + (["server on the loop"] if args.serve_in_loop else []))
    results: dict[str, list[dict[str, Any]]] = {s: [] for s in setups}
    for r in range(args.rounds):
        for setup in setups:
            log(f"{name}: round {r + 1}/{args.rounds}, {setup} inference ({args.seconds:g} s) ...")
            try:
                res = anyio.run(_measure, env, policy, setup, args, envs, steps, backend="asyncio",
                                backend_options={"use_uvloop": True})
            finally:
                reap(f"{name} {setup}")
            log(f"  -> {res['fps']:,.0f} frames/s, loop lag p99 {res['lag_ms'].get('p99', float('nan')):.2f} ms")
            results[setup].append(res)
    base = statistics.median(r["fps"] for r in results["worker"])
    table = {}
    for inference, runs in results.items():
        fps = statistics.median(r["fps"] for r in runs)
        lag = {k: statistics.median(r["lag_ms"][k] for r in runs) for k in ("p50", "p99", "max")}
        row = {"fps": fps, "ratio": fps / base if base else float("nan"), "lag_ms": lag, "runs_fps": [r["fps"] for r in runs]}
        if SETUPS[inference][0] == "server":
            row["passes_per_s"] = statistics.median(r["passes_per_s"] for r in runs)
            row["rows_per_pass"] = statistics.median(r["rows_per_pass"] for r in runs)
            row["ms_per_pass"] = statistics.median(r["ms_per_pass"] for r in runs)
        if all("trainer_per_s" in r for r in runs):
            row["trainer_per_s"] = statistics.median(r["trainer_per_s"] for r in runs)
        if all("gpu_util" in r for r in runs):
            row["gpu_util"] = statistics.median(r["gpu_util"] for r in runs)
        table[inference] = row
    return table


def pass_parts(title: str, env: Any, policy: nn.Module, args: argparse.Namespace, envs: int, steps: int,
               setup: str) -> dict[str, Any]:
    """``--pass-parts``: one more window of ``setup`` with the server's parts timed (see
    ``_pass_parts.py``); prints the table and returns ms per pass of each part."""
    import anyio

    from _pass_parts import PassParts

    parts = PassParts("cuda" if SETUPS[setup][2] == "cuda" else "cpu")
    log(f"{title}: {setup}, its forward pass part by part ({args.seconds:g} s) ...")
    try:
        with parts.active(type(policy)):
            res = anyio.run(_measure, env, policy, setup, args, envs, steps, backend="asyncio",
                            backend_options={"use_uvloop": True})
    finally:
        reap(f"{title} parts")
    log(f"\n{title}: {setup}, one forward pass part by part ({res['fps']:,.0f} frames/s while timed; each part "
        f"{'waits for the GPU before the next, so the parts add up to more than a pass untimed' if parts.cuda else 'timed on its own'})")
    for line in parts.table():
        log("  " + line)
    n = max(parts.passes, 1)
    return {"fps": res["fps"], "passes": parts.passes, "ms": {k: v / n * 1e3 for k, v in parts.seconds.items()},
            "ms_per_pass": parts.pass_seconds / n * 1e3, "ms_between": parts.between / max(parts.passes - 1, 1) * 1e3}


def print_table(title: str, table: dict[str, Any]) -> None:
    log(f"\n{title}")
    trainer = any("trainer_per_s" in row for row in table.values())
    log(f"{'inference':<18} {'frames/s':>10} {'ratio':>6} {'loop lag p50 / p99 / max (ms)':>31} {'passes/s':>9} "
        f"{'rows/pass':>9} {'ms/pass':>7} {'GPU %':>5}" + (f" {'trainer/s':>9}" if trainer else "") + "  runs (frames/s)")
    for setup, row in table.items():
        lag = row["lag_ms"]
        passes = f"{row['passes_per_s']:,.0f}" if "passes_per_s" in row else "-"
        rows = f"{row['rows_per_pass']:.1f}" if "rows_per_pass" in row else "-"
        ms = f"{row['ms_per_pass']:.2f}" if "ms_per_pass" in row else "-"
        util = f"{row['gpu_util']:.0f}" if "gpu_util" in row else "-"
        runs = ", ".join(f"{x:,.0f}" for x in row["runs_fps"])
        busy = f" {row['trainer_per_s']:>9,.0f}" if trainer else ""
        log(f"{setup:<18} {row['fps']:>10,.0f} {row['ratio']:>6.2f} "
            f"{lag['p50']:>12.2f} / {lag['p99']:>5.2f} / {lag['max']:>6.2f} {passes:>9} {rows:>9} {ms:>7} {util:>5}{busy}  {runs}")


def main(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    m = machine()
    log(machine_line(m))
    log(f"{args.workers} workers; {args.rounds} rounds of {args.seconds:g} s per setup after {args.warmup:g} s of "
        f"warm-up; sync delivery; {'CPU only' if args.device == 'cpu' else 'the GPU comparison'}")
    out: dict[str, Any] = {"machine": m, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "args": vars(args)}
    if args.device == "cuda":
        return run_gpu(args, out)
    if args.busy_trainer:
        with BusyTrainer() as alone:
            time.sleep(args.seconds)
        out["trainer_alone_per_s"] = alone.steps / args.seconds
        log(f"the busy trainer alone (nothing collecting): {alone.steps / args.seconds:,.0f} products/s")
    torch.manual_seed(0)
    cartpole = run_case("cartpole", "CartPole-v1", ArgmaxMLP(), args, args.cartpole_envs, args.steps)
    out["cartpole"] = cartpole
    pong = None
    problem = None if not args.skip_pong else "skipped (--skip-pong)"
    problem = problem or pong_problem()
    if problem is None:
        torch.manual_seed(0)
        pong = run_case("pong", make_pong, NatureCNN(), args, args.pong_envs, args.pong_steps)
        out["pong"] = pong
    print_table(f"CartPole-v1, 4-64-2 MLP, {args.workers} workers x {args.cartpole_envs} envs "
                f"(ratio: to worker inference)", cartpole)
    if pong is not None:
        print_table(f"Pong (84x84 grey, 4 frames), Nature-CNN, {args.workers} workers x {args.pong_envs} envs", pong)
    else:
        log(f"\nPong: {problem}")
    if args.pass_parts:
        torch.manual_seed(0)
        out["cartpole_parts"] = pass_parts("CartPole-v1", "CartPole-v1", ArgmaxMLP(), args, args.cartpole_envs,
                                           args.steps, "server")
        if pong is not None:
            torch.manual_seed(0)
            out["pong_parts"] = pass_parts("Pong", make_pong, NatureCNN(), args, args.pong_envs, args.pong_steps,
                                           "server")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


def run_gpu(args: argparse.Namespace, out: dict[str, Any]) -> int:
    """``--device cuda``: Pong with ``--gpu-envs`` envs in all, worker inference (CPU) against the
    server on the GPU."""
    if not torch.cuda.is_available():
        log("--device cuda: CUDA is not available here (torch.cuda.is_available() is False)")
        return 2
    problem = pong_problem()
    if problem is not None:
        log(f"--device cuda runs the Pong case: {problem}")
        return 2
    log(f"GPU: {torch.cuda.get_device_name()}")
    if args.busy_trainer:
        with BusyTrainer("cuda") as alone:
            time.sleep(args.seconds)
        out["trainer_alone_per_s"] = alone.steps / args.seconds
        log(f"the busy GPU trainer alone (nothing collecting): {alone.steps / args.seconds:,.0f} products/s")
    tables = {}
    for total in args.gpu_envs:
        envs = max(total // args.workers, 1)
        torch.manual_seed(0)
        tables[total] = run_case(f"pong {total} envs", make_pong, NatureCNN(), args, envs, args.pong_steps,
                                 setups=[RANDOM, "worker", "server on cuda", "cuda, 2 groups", "cuda, cudagraph"])
    for total, table in tables.items():
        print_table(f"Pong (84x84 grey, 4 frames), Nature-CNN, {args.workers} workers x {max(total // args.workers, 1)} "
                    f"envs: worker inference (CPU) against the server on CUDA", table)
        limit = table[RANDOM]["fps"]
        log("  frames/s as a fraction of random actions (no policy): " + ", ".join(
            f"{setup} {row['fps'] / limit:.2f}" for setup, row in table.items() if setup != RANDOM))
    if args.pass_parts:
        out["gpu_parts"] = {}
        for total in args.gpu_envs:
            torch.manual_seed(0)
            envs = max(total // args.workers, 1)
            out["gpu_parts"][str(total)] = pass_parts(
                f"Pong, {args.workers} workers x {envs} envs", make_pong, NatureCNN(), args, envs, args.pong_steps,
                "server on cuda")
    out["gpu"] = {str(k): v for k, v in tables.items()}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


def _setup_names(text: str) -> list[str]:
    names = [x.strip() for x in text.split(";") if x.strip()]
    unknown = [n for n in names if n not in SETUPS or SETUPS[n][2] is not None]
    if unknown:
        cpu = "; ".join(n for n, s in SETUPS.items() if s[2] is None)
        raise argparse.ArgumentTypeError(f"unknown setup {unknown[0]!r}; the CPU setups: {cpu}")
    return names


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    p.add_argument("--cartpole-envs", type=int, default=32, help="CartPole envs per worker (default 32)")
    p.add_argument("--pong-envs", type=int, default=4, help="Pong envs per worker (default 4)")
    p.add_argument("--steps", type=int, default=32, help="CartPole steps of each env per batch (default 32)")
    p.add_argument("--pong-steps", type=int, default=16, help="Pong steps of each env per batch (default 16)")
    p.add_argument("--seconds", type=float, default=5.0, help="measuring window per setup and round (default 5)")
    p.add_argument("--warmup", type=float, default=1.0, help="warm-up before each window (default 1 s)")
    p.add_argument("--patience", type=float, default=60.0,
                   help="the longest wait for one batch before a setup counts as starved (default 60 s)")
    p.add_argument("--rounds", type=int, default=3, help="rounds; figures are medians over them (default 3)")
    p.add_argument("--skip-pong", action="store_true", help="CartPole only")
    p.add_argument("--serve-in-loop", action="store_true",
                   help="also measure the server run as a task on the event loop instead of its own thread")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: the GPU comparison (Pong, --gpu-envs envs in all); default cpu")
    p.add_argument("--gpu-envs", type=lambda s: [int(x) for x in s.split(",")], default=[64, 256],
                   help="--device cuda: envs in all, comma-separated (default 64,256)")
    p.add_argument("--busy-trainer", action="store_true",
                   help="while measuring, a thread of this process multiplies matrices without a pause (a trainer "
                        "that wants a core all the time; with --device cuda, the GPU); its products per second are "
                        "reported")
    p.add_argument("--setups", type=_setup_names, default=None,
                   help="the CPU setups to measure, ';'-separated, e.g. 'server, idle;idle, pinned' (default: all; "
                        "worker inference, the ratios' base, is always measured)")
    p.add_argument("--pass-parts", action="store_true",
                   help="then one more window of the server (on the GPU with --device cuda) with each part of its "
                        "forward pass timed: gathering, staging, the copy to the device, the forward pass, reading "
                        "the actions back, the answers; and the wait between passes")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    return p.parse_args(argv)


if __name__ == "__main__":
    with sigterm_as_interrupt():
        sys.exit(main(parse_args()))
