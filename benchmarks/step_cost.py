"""What a worker's step costs: a worker's rollout against the limit's loop, in one process, turn by turn.

For each ``--envs`` count (default 8 and 32 envs; CartPole-v1 and the 4-64-2 MLP acting by argmax,
as ``benchmarks/throughput.py``), two loops take turns in this process:

* **limit**: the throughput benchmark's per-process loop: one forward pass of the policy on the
  stacked observations, ``env.step`` per env, a reset at each episode end; nothing stored.
* **rollout**: a worker's rollout (``Rollout.run_batch`` into a batch slot of a memfd mapping, as
  a worker fills one: the frames, the episodes, the trajectory ids), ``--steps`` steps a batch.

Both get the same envs (seeded alike) and the same weights. The same pair then runs with an env and
a policy that do nothing ("no-op": the env returns one fixed observation and ends an episode every
20 steps; the policy returns zeros), so that what is left is the rollout's own work per step.

The turns alternate (limit, rollout, limit, ...), ``--steps`` steps each, ``--turns`` turns after one
warm-up turn each. ``time.thread_time()`` is read around each turn: the CPU time of this thread, so
that what else runs on the machine slows both loops alike. Printed per setup, as medians over the
turns:

* µs per step of each loop;
* the **ratio**, limit over rollout: the frames per CPU-second of a worker relative to the limit.
  This is the worker's part of ``throughput.py``'s per-core ratio, without the collector's
  process, the messages and the scheduler;
* the rollout's cost over the limit, per step.

With ``--idle-ms N`` the CartPole setups also take turns asleep for ``N`` ms before each (between
their busy turns), as a worker of ``delivery="sync"`` waits before each batch: what waking costs,
if anything, shows in both loops' CPU time per step, a second row per setup.

With ``--json PATH`` the results are written there; ``benchmarks/compare_trees.py`` compares their
ratios between two trees.

Run (about half a minute)::

    .venv/bin/python benchmarks/step_cost.py [--envs 8,32] [--steps 128] [--turns 15] [--idle-ms 3]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import time
from typing import Any, Callable

import gymnasium as gym
import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _util import ArgmaxMLP, limit_step, log, machine, machine_line  # noqa: E402

from aiocollect._core import pickling  # noqa: E402
from aiocollect._core.layout import SlotLayout, frame_leaves  # noqa: E402
from aiocollect._worker.policy import PolicySpec  # noqa: E402
from aiocollect._worker.rollout import Rollout, RolloutConfig  # noqa: E402

ENV_ID = "CartPole-v1"
SEED = 0


class NoOpEnv(gym.Env):
    """An env that does nothing: one fixed observation, reward 1, an episode end every 20 steps."""

    observation_space = gym.spaces.Box(-np.inf, np.inf, (4,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self) -> None:
        self.t = 0
        self.obs = np.zeros(4, np.float32)

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        self.t = 0
        return self.obs.copy(), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        self.t += 1
        return self.obs.copy(), 1.0, self.t >= 20, False, {}


class NoOpPolicy(torch.nn.Module):
    """A policy that does nothing: action 0 for every env."""

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return torch.zeros(observation.shape[0], dtype=torch.int64)


def limit_loop(make_env: Callable[[], gym.Env], policy: torch.nn.Module, E: int) -> Callable[[int], None]:
    """``run(steps)``: the limit's loop (:func:`_util.limit_step`, as ``throughput.py``'s) on its own envs."""
    envs = [make_env() for _ in range(E)]
    obs = [env.reset(seed=SEED + i)[0] for i, env in enumerate(envs)]

    def run(steps: int) -> None:
        with torch.no_grad():
            for _ in range(steps):
                limit_step(policy, envs, obs)

    return run


def rollout_loop(env_fn: Any, policy: torch.nn.Module, E: int, T: int) -> tuple[Callable[[int], None], Callable[[], None]]:
    """``run(steps)`` (whole batches of ``T`` steps into two slots of a memfd mapping, as a worker
    fills them) and ``close()``."""
    spec = PolicySpec("module", pickling.dumps(policy))
    rollout = Rollout(RolloutConfig(env_fn=env_fn, env_kwargs={}, policy=spec, worker=0, envs_per_worker=E,
                                    total_envs=E, seed=SEED))
    s = rollout.spec()
    layout = SlotLayout.build(frame_leaves(s["obs"], s["act"], s["extras"]), E, T, 2)
    fd = os.memfd_create("aiocollect-step-cost")
    os.ftruncate(fd, layout.nbytes)
    mapping = mmap.mmap(fd, layout.nbytes)
    os.close(fd)
    views = [layout.views(mapping, k, 0) for k in range(2)]
    batches = [0]

    def run(steps: int) -> None:
        for _ in range(steps // T):
            rollout.run_batch(views[batches[0] % 2])
            batches[0] += 1

    def close() -> None:
        nonlocal views
        rollout.close()
        views = []
        mapping.close()

    return run, close


def _row(name: str, E: int, limit: list[float], rollout: list[float]) -> dict[str, Any]:
    lim, roll = statistics.median(limit), statistics.median(rollout)
    per_turn = [a / b for a, b in zip(limit, rollout)]
    return {
        "name": name, "envs": E, "limit_us_per_step": lim, "rollout_us_per_step": roll, "ratio": lim / roll,
        "over_us_per_step": roll - lim, "turn_ratios": [min(per_turn), statistics.median(per_turn), max(per_turn)],
    }


def measure(name: str, make_env: Callable[[], gym.Env], env_fn: Any, policy: torch.nn.Module, E: int,
            args: argparse.Namespace, idle_s: float = 0.0) -> list[dict[str, Any]]:
    """The setup's row; with ``idle_s``, a second row: the same loops, each turn started after
    ``idle_s`` asleep, in turns taken between the busy ones (so that a drift of the machine's
    speed moves both rows alike)."""
    limit = limit_loop(make_env, policy, E)
    rollout, close = rollout_loop(env_fn, policy, E, args.steps)
    sides = [("limit", limit, 0.0), ("rollout", rollout, 0.0)]
    if idle_s:
        sides += [("idle limit", limit, idle_s), ("idle rollout", rollout, idle_s)]
    times: dict[str, list[float]] = {side: [] for side, _, _ in sides}
    try:
        for turn in range(args.turns + 1):
            for side, run, sleep_s in sides:
                if sleep_s:  # (asleep before the turn: it starts as a worker's batch does after a wait)
                    time.sleep(sleep_s)
                t0 = time.thread_time()
                run(args.steps)
                if turn:  # (the first turn of each: the warm-up)
                    times[side].append(1e6 * (time.thread_time() - t0) / args.steps)
    finally:
        close()
    rows = [_row(name, E, times["limit"], times["rollout"])]
    if idle_s:
        rows.append(_row(f"{name}, idle {1000 * idle_s:g} ms a turn", E, times["idle limit"], times["idle rollout"]))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--envs", default="8,32", help="envs per worker, comma-separated (default 8,32)")
    p.add_argument("--steps", type=int, default=128, help="steps per turn, and per batch of the rollout (default 128)")
    p.add_argument("--turns", type=int, default=15, help="measured turns of each loop (default 15)")
    p.add_argument("--idle-ms", type=float, default=0.0,
                   help="also time the CartPole setups in turns that start after this long asleep (default 0: not)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = p.parse_args()
    counts = [int(n) for n in args.envs.split(",") if n.strip()]
    if not counts or min(counts) < 1 or args.steps < 1 or args.turns < 1 or args.idle_ms < 0:
        p.error("--envs takes counts of 1 or more; --steps and --turns must be 1 or more; --idle-ms 0 or more")
    torch.set_num_threads(1)  # (as a worker runs its policy)
    torch.set_grad_enabled(False)
    m = machine()
    log(f"aiocollect step cost: a worker's rollout against the limit's loop, one process, {args.turns} turns of "
        f"{args.steps} steps each")
    log(machine_line(m))
    torch.manual_seed(SEED)
    mlp = ArgmaxMLP()
    idle_s = args.idle_ms / 1000
    setups = [(f"CartPole, {E} envs", lambda: gym.make(ENV_ID), ENV_ID, mlp, E, idle_s) for E in counts]
    setups += [(f"no-op env and policy, {E} envs", NoOpEnv, NoOpEnv, NoOpPolicy(), E, 0.0) for E in counts]
    results, idle_pairs = [], []
    for k, (name, make_env, env_fn, policy, E, idle) in enumerate(setups, 1):
        log(f"[{k}/{len(setups)}] {name}{f' (and idle {args.idle_ms:g} ms a turn)' if idle else ''} ...")
        rows = measure(name, make_env, env_fn, policy, E, args, idle)
        if len(rows) == 2:
            idle_pairs.append(rows)
        for r in rows:
            results.append(r)
            log(f"  -> {r['name']}: limit {r['limit_us_per_step']:.1f} µs a step, rollout {r['rollout_us_per_step']:.1f}: "
                f"{r['ratio']:.3f}")
    log("")
    log(f"{'setup':34s} {'limit µs/step':>14s} {'rollout µs/step':>16s} {'ratio':>6s} {'over the limit':>15s}"
        f"  turn ratios min / median / max")
    for r in results:
        lo, med, hi = r["turn_ratios"]
        log(f"{r['name']:34s} {r['limit_us_per_step']:14.1f} {r['rollout_us_per_step']:16.1f} {r['ratio']:6.3f} "
            f"{r['over_us_per_step']:12.1f} µs  {lo:.3f} / {med:.3f} / {hi:.3f}")
    log("ratio: limit over rollout, CPU time of this thread (the frames per CPU-second a worker gets relative to the "
        "limit, without the collector's process)")
    for busy, idle in idle_pairs:
        log(f"turns after {args.idle_ms:g} ms asleep, {busy['envs']} envs: a step of the limit costs "
            f"{idle['limit_us_per_step'] / busy['limit_us_per_step'] - 1:+.0%} CPU, of the rollout "
            f"{idle['rollout_us_per_step'] / busy['rollout_us_per_step'] - 1:+.0%} (what waking costs on this machine, "
            f"paid by any loop that waits)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": m, "args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
