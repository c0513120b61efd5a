"""The launcher started early: ``from aiocollect import Collector`` starts the template process
before the collector's module (and torch) is imported, so that both import side by side; it is
process-wide (``shutdown_launcher()`` ends it), never started by the template or its workers, nor
by a child of multiprocessing, nor with ``AIOCOLLECT_NO_PREFORK=1``; a forked child holds no share
of it. And tensordict is imported without ``torch._dynamo``, whose marks reach the compiler when
it is imported later."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import anyio
import pytest
from procs import child_env

from aiocollect import Collector

REPO = Path(__file__).resolve().parent.parent


def run_child(code: str, *, env: dict[str, str] | None = None, timeout: float = 150) -> list:
    """Run ``code`` in a fresh interpreter; the JSON it prints last."""
    proc = subprocess.run([sys.executable, "-W", "error", "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env={**child_env(REPO), **(env or {})})
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


PREFORK_SCRIPT = """
    import json, os, sys
    import aiocollect
    from aiocollect._backends.launcher import get_launcher

    before = get_launcher().pid
    from aiocollect import Collector

    pid = get_launcher().pid
    cmdline = open(f"/proc/{pid}/cmdline").read().split("\\0") if pid else []
    from aiocollect import shutdown_launcher

    shutdown_launcher()
    print(json.dumps([before, pid, "aiocollect._backends.launcher" in cmdline, get_launcher().pid,
                      pid is not None and os.path.exists(f"/proc/{pid}")]))
"""


@pytest.mark.timeout(180)
def test_asking_for_collector_starts_the_launcher_and_shutdown_launcher_ends_it():
    """``import aiocollect`` starts nothing; ``from aiocollect import Collector`` starts the
    launcher (a process of ours); ``shutdown_launcher()`` ends it (and reaps it)."""
    before, pid, is_ours, after, still_there = run_child(PREFORK_SCRIPT)
    assert before is None and pid is not None and is_ours
    assert after is None and not still_there


@pytest.mark.timeout(180)
def test_no_prefork_environment_variable_leaves_the_start_to_the_first_collector():
    """With ``AIOCOLLECT_NO_PREFORK=1`` asking for Collector starts no process."""
    before, pid, _, _, _ = run_child(PREFORK_SCRIPT, env={"AIOCOLLECT_NO_PREFORK": "1"})
    assert before is None and pid is None


@pytest.mark.timeout(180)
def test_a_forked_child_holds_no_share_of_the_launcher():
    """A process that forks after the launcher started: the child has no launcher (it would start
    its own), and the parent's ``shutdown_launcher()`` ends the launcher at once although the
    child still runs (it closed its copy of the launcher's socket at the fork)."""
    code = """
        import json, os, time
        from aiocollect import Collector, shutdown_launcher
        from aiocollect._backends.launcher import get_launcher

        launcher = get_launcher().pid
        r, w = os.pipe()
        child = os.fork()
        if child == 0:
            os.write(w, b"1" if get_launcher().pid is None else b"0")
            time.sleep(60)
            os._exit(0)
        in_child = os.read(r, 1) == b"1"
        t0 = time.monotonic()
        shutdown_launcher()
        took = time.monotonic() - t0
        gone = not os.path.exists(f"/proc/{launcher}")
        os.kill(child, 9)
        os.waitpid(child, 0)
        print(json.dumps([in_child, gone, took]))
    """
    in_child, gone, took = run_child(code)
    assert in_child and gone
    assert took < 4.5, took  # (the launcher ends once its socket closes; 5 s is when it would be killed)


@pytest.mark.timeout(180)
def test_multiprocessing_children_and_workers_do_not_start_a_launcher(tmp_path):
    """A spawned multiprocessing child importing a module that asks for Collector starts no
    launcher of its own; nor does a worker process (forked from the launcher) that does."""
    module = tmp_path / "asks_for_collector.py"
    module.write_text(textwrap.dedent("""
        from aiocollect import Collector  # noqa: F401
        from aiocollect._backends.launcher import get_launcher, prefork_wanted


        def report(_=None):
            return [prefork_wanted(), get_launcher().pid]
    """))
    code = f"""
        import json, multiprocessing, sys
        sys.path.insert(0, {str(tmp_path)!r})
        if __name__ == "__main__":
            import asks_for_collector
            with multiprocessing.get_context("spawn").Pool(1) as pool:
                print(json.dumps(pool.apply(asks_for_collector.report)))
    """
    wanted, pid = run_child(code)
    assert not wanted and pid is None


def _worker_reports(path: str):
    def make():
        from aiocollect._backends.launcher import get_launcher, prefork_wanted
        from aiocollect.testing import CountingEnv

        with open(path, "w") as f:
            json.dump([prefork_wanted(), get_launcher().pid], f)
        return CountingEnv()

    return make


@pytest.mark.timeout(120)
async def test_a_worker_never_starts_a_launcher(tmp_path):
    """In a worker process (a fork of the launcher) prefork is not wanted and no launcher is there."""
    path = tmp_path / "report.json"
    with anyio.fail_after(90):
        async with Collector(_worker_reports(str(path)), frames_per_batch=8, total_frames=8, num_workers=1) as c:
            async for _ in c:
                pass
    wanted, pid = json.loads(path.read_text())
    assert not wanted and pid is None


@pytest.mark.timeout(180)
def test_tensordict_without_dynamo_then_dynamo_sees_the_same_marks():
    """tensordict imported through quick_import does not import torch._dynamo; importing it later
    gives torch.compile the same functions allowed in its graphs (and marked constant) as a plain
    import of tensordict does, and a compiled function over a TensorDict still runs."""
    code = """
        import json, sys, importlib
        import torch

        if QUICK:
            from aiocollect._core.quick_import import import_module

            import_module("tensordict")
        else:
            import tensordict
        dynamo_at_import = "torch._dynamo" in sys.modules
        import torch._dynamo
        from torch._dynamo import trace_rules

        allowed, constant = [], []
        for name, mod in sorted(sys.modules.items()):
            if not name.startswith("tensordict") or mod is None:
                continue
            for attr, value in sorted(vars(mod).items()):
                if callable(value) and id(value) in trace_rules._allowed_callable_ids:
                    allowed.append(f"{name}.{attr}")
                if getattr(value, "_dynamo_marked_constant", False):
                    constant.append(f"{name}.{attr}")
        from tensordict import TensorDict

        out = torch.compile(lambda td: td["x"] * 2, backend="eager")(TensorDict({"x": torch.ones(3)}, [3]))
        print(json.dumps([dynamo_at_import, allowed, constant, out.tolist()]))
    """
    quick = run_child(code.replace("QUICK", "True"), timeout=170)
    plain = run_child(code.replace("QUICK", "False"), timeout=170)
    assert quick[0] is False and plain[0] is True
    assert quick[1:] == plain[1:] and quick[1] and quick[3] == [2.0, 2.0, 2.0]

