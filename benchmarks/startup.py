"""Start-up cost: what a user waits for, from process launch to the first batch.

Every figure comes from fresh subprocesses (a new interpreter each time: nothing imported, no
launcher running), ``--repeat`` runs each (default 5, interleaved), printed as the median
[min - max]:

* ``python -c pass``: the interpreter alone, for reference.
* ``import aiocollect`` (lazy: loads no submodule), ``from aiocollect import Collector`` (loads the
  collector and what it imports), ``import torch``, and ``import tensordict`` (torch included;
  broken down into torch, the ``torch._dynamo`` that tensordict imports, and the rest). Timed in
  the child around the statement.
* **launch -> first batch**: a user's script run as ``python -c <script>``: ``import anyio``, ``from
  aiocollect import Collector`` (and ``import torch`` and a 4-64-2 MLP acting by argmax, for the MLP
  policy), then ``anyio.run`` of ``async with Collector("CartPole-v1", policy, frames_per_batch=2048,
  num_workers=2, envs_per_worker=8)`` up to its first batch (``--workers 1,2,4``: a row per number
  of workers; where 2048 is not a multiple of the envs, the next multiple: 2160 for 15 workers). Timed from just before this process starts the child (so the interpreter's start is
  included) to the first batch in the child; the breakdown shows when the child's imports were
  done and what ``Collector(...)`` -> first batch took (what the launcher had not done yet, forking
  the workers, their envs' creation and first 2048 frames, the collector's import of tensordict).
  The launcher is started by ``from aiocollect import Collector`` and imports numpy, gymnasium and
  the worker's modules beside the script's own imports (torch once ``Collector(...)`` says its
  policy needs it; ``AIOCOLLECT_NO_PREFORK=1`` in this benchmark's environment: started by the
  first collector, as before).
* **beyond import torch**: launch -> first batch less launch -> ``import torch`` done (the
  ``import torch`` row, same run, medians): what a script that imports torch waits for more.
* **second collector**: in the same script, after the first collector closed, a second identical
  one: ``Collector(...)`` -> first batch (the launcher is still there, workers are forks of it).

The children inherit this process's environment: with ``PYTHONDONTWRITEBYTECODE`` set (as in many
container images), an editable install's modules are compiled at every import, which the output
says at its end; an installed package's bytecode is written when pip installs it.

Run (about a minute and a half; the machine's load matters: the min - max range shows the noise)::

    .venv/bin/python benchmarks/startup.py [--repeat 5] [--workers 2] [--json benchmarks/results/startup.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _util import become_subreaper, descendants, log, machine, machine_line, reap  # noqa: E402

MARK = "@@startup "
BYTECODE_WARNING = (
    "PYTHONDONTWRITEBYTECODE is set and aiocollect has no bytecode (an editable install): every child "
    "compiled its modules at each import, as an installed package's never are; unset it for the imports "
    "users get"
)
CLOCK = "time.clock_gettime(time.CLOCK_MONOTONIC)"  # system-wide: comparable across processes

# (row, statements): each statement timed in one fresh child, in order
IMPORTS: list[tuple[str, list[str]]] = [
    ("python -c pass", []),
    ("import aiocollect", ["import aiocollect"]),
    ("from aiocollect import Collector", ["from aiocollect import Collector"]),
    ("import torch", ["import torch"]),
    ("import tensordict (torch included)", ["import torch", "import torch._dynamo", "import tensordict"]),
]

_POLICIES = {
    "random": "policy = None\n",
    "MLP": """\
import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 2))

    def forward(self, obs):
        return self.net(obs).argmax(-1)


torch.manual_seed(0)
policy = MLP()
""",
}

USER_SCRIPT = """\
import time
t_up = {clock}
import json
import anyio
from aiocollect import Collector
{policy}t_ready = {clock}


async def main():
    out = {{}}
    for key in ("first", "second"):
        t0 = {clock}
        async with Collector("CartPole-v1", policy, frames_per_batch={frames}, num_workers={workers},
                             envs_per_worker=8) as collector:
            async for batch in collector:
                assert batch.numel() == {frames}
                out[key] = {clock} - t0
                out[key + "_at"] = {clock}
                break
    return out


out = anyio.run(main)
print({mark!r} + json.dumps(dict(out, up_at=t_up, ready_at=t_ready)), flush=True)
"""


def _run_child(code: str) -> tuple[float, dict[str, Any]]:
    """Run ``python -c code`` in a fresh process; (the launch time on CLOCK, its marked JSON)."""
    baseline = frozenset(p.pid for p in descendants())
    t_launch = time.clock_gettime(time.CLOCK_MONOTONIC)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    left = reap("a start-up child", keep=(), baseline=baseline)
    if proc.returncode != 0 or left:
        raise RuntimeError(f"child failed (exit {proc.returncode}, left {left}):\n{proc.stderr[-3000:]}")
    lines = [line for line in proc.stdout.splitlines() if line.startswith(MARK)]
    if not lines:
        raise RuntimeError(f"child printed no result:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return t_launch, json.loads(lines[-1][len(MARK):])


def measure_imports(statements: list[str]) -> dict[str, float]:
    """Seconds per statement (in one fresh child, in order) and from launch to the last one done."""
    body = ["import time", "import json", f"_t = [{CLOCK}]"]
    for stmt in statements:
        body += [stmt, f"_t.append({CLOCK})"]
    body.append(f"print({MARK!r} + json.dumps(_t), flush=True)")
    t_launch, marks = _run_child("\n".join(body))
    out = {"launch_to_done": marks[-1] - t_launch, "total": marks[-1] - marks[0]}
    for i, stmt in enumerate(statements):
        out[stmt] = marks[i + 1] - marks[i]
    return out


def measure_first_batch(policy: str, workers: int = 2) -> dict[str, float]:
    code = USER_SCRIPT.format(clock=CLOCK, policy=_POLICIES[policy], mark=MARK, workers=workers,
                              frames=-(-2048 // (workers * 8)) * workers * 8)
    t_launch, out = _run_child(code)
    return {
        "launch_to_first_batch": out["first_at"] - t_launch,
        "python_up": out["up_at"] - t_launch,
        "imports_done": out["ready_at"] - t_launch,
        "collector_to_first_batch": out["first"],
        "second_collector": out["second"],
    }


def _has_bytecode(package: str) -> bool:
    """Whether ``package``'s ``__init__`` has its bytecode cached (found without importing it)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return True  # (not there, or not from source: nothing to compile)
    return os.path.exists(importlib.util.cache_from_source(spec.origin))


def bytecode_note() -> str | None:
    """What the output says at its end when the children compiled aiocollect at each import."""
    if os.environ.get("PYTHONDONTWRITEBYTECODE") and not _has_bytecode("aiocollect"):
        return BYTECODE_WARNING
    return None


def _label(policy: str, workers: int, counts: list[int]) -> str:
    """The row's name: the policy, and the number of workers when more than one is measured."""
    return policy if counts == [2] else f"{policy}, {workers} worker{'s' if workers != 1 else ''}"


def _policy_words(label: str) -> str:
    policy, _, workers = label.partition(", ")
    return f"{policy} policy" + (f", {workers}" if workers else "")


def _median(runs: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def _span(runs: list[dict[str, float]], key: str) -> str:
    values = [r[key] for r in runs]
    return f"{statistics.median(values):6.2f} s  [{min(values):.2f} - {max(values):.2f}]"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=5, help="fresh processes per figure (default 5)")
    p.add_argument("--workers", default="2", help="numbers of workers, comma-separated (default 2)")
    p.add_argument("--json", metavar="PATH", help="also write the raw figures there")
    args = p.parse_args(argv)
    counts = [int(n) for n in args.workers.split(",")]
    become_subreaper()  # a launcher or worker a child leaves behind is reparented to us and seen

    log(
        f"aiocollect start-up benchmark: fresh subprocesses, median of {args.repeat} [min - max]; "
        f"{time.strftime('%Y-%m-%d %H:%M %Z')}"
    )
    log(machine_line(machine()))
    load_start = os.getloadavg()[0]
    imports: dict[str, list[dict[str, float]]] = {row: [] for row, _ in IMPORTS}
    batches: dict[str, list[dict[str, float]]] = {_label(name, n, counts): [] for n in counts for name in _POLICIES}
    for i in range(args.repeat):  # interleaved, so that a change of the machine's load hits all rows
        log(f"  round {i + 1}/{args.repeat} ...")
        for row, statements in IMPORTS:
            imports[row].append(measure_imports(statements))
        for n in counts:
            for name in _POLICIES:
                batches[_label(name, n, counts)].append(measure_first_batch(name, n))

    log("")
    log(f"{'':<42}{'median':>8}    [min - max]")
    for row, statements in IMPORTS:
        runs = imports[row]
        if not statements:
            log(f"{'python up (launch -> first statement)':<42}{_span(runs, 'launch_to_done')}")
            continue
        log(f"{row:<42}{_span(runs, 'total')}")
        if len(statements) > 1:
            parts = ", then ".join(f"{s.removeprefix('import ')} {_median(runs, s):.2f} s" for s in statements)
            log(f"{'':<44}in steps: {parts} (the rest)")
    for name, runs in batches.items():
        log(f"{f'launch -> first batch, {_policy_words(name)}':<42}{_span(runs, 'launch_to_first_batch')}")
        log(
            f"{'':<44}python up {_median(runs, 'python_up'):.2f} s, imports (and policy) done "
            f"{_median(runs, 'imports_done'):.2f} s, Collector() -> first batch "
            f"{_median(runs, 'collector_to_first_batch'):.2f} s"
        )
    torch_done = _median(imports["import torch"], "launch_to_done")
    log(f"launch -> import torch done (median)      {torch_done:6.2f} s")
    for name, runs in batches.items():
        beyond = _median(runs, "launch_to_first_batch") - torch_done
        log(f"{f'first batch beyond import torch, {name}':<42}{beyond:+6.2f} s")
    for name, runs in batches.items():
        log(f"{f'second collector, same process, {name}':<42}{_span(runs, 'second_collector')}")
    log(f"load average (1 min) at the start / end: {load_start:.2f} / {os.getloadavg()[0]:.2f}; "
        f"AIOCOLLECT_NO_PREFORK={os.environ.get('AIOCOLLECT_NO_PREFORK') or 'unset'}")
    note = bytecode_note()
    if note:
        log(note)

    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"benchmark": "startup", "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **machine(),
                       "imports": imports, "first_batch": batches}, f, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
