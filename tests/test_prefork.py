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



# what both scripts below begin with: imports, a torch policy, a process's parent
TEMPLATES_PREAMBLE = """
    import json, os, signal, sys, time
    import anyio, torch
    from aiocollect import Collector, shutdown_launcher
    from aiocollect._backends.launcher import get_launcher

    sys.path.insert(0, TESTS)
    from procs import alive, torch_template

    class Greedy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(4, 2)

        def forward(self, observation):
            return self.net(observation).argmax(-1)

    def parent(pid):
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
"""

TWO_TEMPLATES_SCRIPT = TEMPLATES_PREAMBLE + """
    def mapped(pid):  # torch's library in the process (the check test_server's never-torch test makes)
        with open(f"/proc/{pid}/maps") as f:
            return "libtorch" in f.read()

    light = get_launcher().pid
    deadline = time.monotonic() + 120  # (prefork: the torch template imports torch meanwhile)
    while not (torch_template(light) and mapped(torch_template(light))) and time.monotonic() < deadline:
        time.sleep(0.05)
    template = torch_template(light)
    before = [template, template is not None and mapped(template), mapped(light)]

    async def main():
        out = {}
        for name, policy in (("random", None), ("torch", Greedy())):
            async with Collector("CartPole-v1", policy, frames_per_batch=16, num_workers=2, envs_per_worker=2) as c:
                await anext(aiter(c))
                out[name] = [[parent(pid), mapped(pid)] for pid in c.worker_pids]
        return out

    workers = anyio.run(main, backend=BACKEND, backend_options=OPTIONS)
    shutdown_launcher()
    print(json.dumps([light, before, workers, alive(light) or (template is not None and alive(template)),
                      mapped(light) if alive(light) else False]))
"""


def _script_on(loop: str, script: str) -> str:
    backend, options = ("trio", {}) if loop == "trio" else ("asyncio", {"use_uvloop": loop == "uvloop"})
    return (script.replace("TESTS", repr(str(REPO / "tests"))).replace("BACKEND", repr(backend))
            .replace("OPTIONS", repr(options)))


@pytest.mark.parametrize("loop", ["asyncio", "uvloop", "trio"])
@pytest.mark.timeout(240)
def test_torch_workers_fork_from_a_torch_template_and_the_others_never_see_torch(loop):
    """After prefork, a child of the launcher (the light template, which never maps torch) imports
    torch before any collector asks: a torch policy's workers are forked from it (torch mapped in
    their parent at the fork), a random policy's from the light template, without torch; after
    ``shutdown_launcher()`` neither template is alive."""
    light, (template, template_has_torch, light_had_torch), workers, left, _ = run_child(
        _script_on(loop, TWO_TEMPLATES_SCRIPT), timeout=230)
    assert template is not None and template_has_torch and not light_had_torch
    assert workers["random"] and all(ppid == light and not torch for ppid, torch in workers["random"])
    assert workers["torch"] and all(ppid == template and torch for ppid, torch in workers["torch"])
    assert not left


NO_PREFORK_SCRIPT = TEMPLATES_PREAMBLE + """
    async def parents():
        async with Collector("CartPole-v1", Greedy(), frames_per_batch=16, num_workers=1, envs_per_worker=2) as c:
            await anext(aiter(c))
            return [parent(pid) for pid in c.worker_pids]

    out = [get_launcher().pid]
    first = anyio.run(parents, backend=BACKEND, backend_options=OPTIONS)
    light = get_launcher().pid
    template = torch_template(light)
    os.kill(template, signal.SIGKILL)
    while alive(template):
        time.sleep(0.01)
    second = anyio.run(parents, backend=BACKEND, backend_options=OPTIONS)
    again = torch_template(light)
    shutdown_launcher()
    print(json.dumps(out + [light, template, first, again, second, alive(light) or alive(again)]))
"""


@pytest.mark.parametrize("loop", ["asyncio", "uvloop", "trio"])
@pytest.mark.timeout(240)
def test_without_prefork_the_torch_template_starts_on_demand_and_again_once_killed(loop):
    """With ``AIOCOLLECT_NO_PREFORK=1`` the first torch policy starts the light template and its
    torch template, which its workers are forked from; once the torch template is killed, the next
    torch policy's workers come from a new one (never left unserved); the shutdown leaves neither."""
    before, light, template, first, again, second, left = run_child(
        _script_on(loop, NO_PREFORK_SCRIPT), env={"AIOCOLLECT_NO_PREFORK": "1"}, timeout=230)
    assert before is None and template is not None and first == [template]
    assert again not in (None, template) and second == [again]
    assert not left


@pytest.mark.timeout(120)
def test_a_failing_import_in_the_torch_template_reaches_the_workers_socket():
    """A request whose needs the torch template cannot import is answered on the worker's socket
    with the error (the collector's error then names the cause), and the template serves on."""
    import socket

    from aiocollect._backends.launcher import get_launcher
    from aiocollect._core import wire

    for _ in range(2):  # (the second: the template survived the first)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with ours:
            try:
                get_launcher().spawn(theirs.fileno(), ("tensordict.no_such_module",))
            finally:
                theirs.close()
            ours.settimeout(100)
            got = wire.recv_blocking(ours)
        assert got is not None and isinstance(got[0], wire.Error), got
        assert "tensordict.no_such_module" in got[0].traceback
