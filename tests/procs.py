"""Process helpers shared by the tests (imported as a plain module: pytest puts tests/ on sys.path)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from typing import Iterator


def child_env(*front: object) -> dict[str, str]:
    """This process's environment for a child Python, with the folders ``front`` put before the
    inherited ``PYTHONPATH`` (kept, not replaced: where aiocollect or its dependencies are found
    through it, as in a source tree run with ``PYTHONPATH=.``, the child finds them too)."""
    env = dict(os.environ)
    parts = [str(p) for p in front] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(parts)
    return env


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def ctrl_c(proc: subprocess.Popen, timeout: float = 60) -> tuple[str, str]:
    """One Ctrl-C (SIGINT to ``proc``'s process group, as a terminal sends it), then its output.
    A script still running after ``timeout`` writes every thread's stack (faulthandler on
    SIGUSR1, which the scripts register), is killed, and fails the test with that output."""
    import pytest

    os.killpg(proc.pid, signal.SIGINT)
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGUSR1)  # every thread's stack, on its stderr
        time.sleep(2)
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"Ctrl-C did not end the script in {timeout:g} s; its output:\n{out}\nits stderr:\n{err}")


@contextlib.contextmanager
def local_ray() -> Iterator[None]:
    """A local Ray instance of 2 CPUs, unless one runs already (then that one, left running). The
    actors find the tests' modules (they unpickle envs and policies defined in them by name)."""
    import ray

    started = not ray.is_initialized()
    if started:  # (Ray starts its workers at niceness 15: a busy machine, such as the suite beside, starves them)
        os.environ.setdefault("RAY_worker_niceness", "0")
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR",
                 runtime_env={"env_vars": {"PYTHONPATH": os.path.dirname(os.path.abspath(__file__))}})
    try:
        yield
    finally:
        if started:
            ray.shutdown()


def children(pid: int) -> list[int]:
    """The live children of ``pid``."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [p for p in map(int, f.read().split()) if alive(p)]
    except OSError:
        return []


def torch_template(launcher: int | None) -> int | None:
    """The torch template of the launcher (the light template) ``launcher``: its child that leads a
    process group of its own; ``None`` if it has none."""
    for pid in children(launcher) if launcher is not None else ():
        try:
            if os.getpgid(pid) == pid:
                return pid
        except OSError:  # (it ended meanwhile)
            pass
    return None


def template_workers(launcher: int | None) -> list[int]:
    """The live worker processes forked from the launcher's templates (the light one and its torch
    template), the torch template itself left out."""
    if launcher is None:
        return []
    torch = torch_template(launcher)
    return [p for p in children(launcher) if p != torch] + (children(torch) if torch is not None else [])


def forked_workers(pid: int) -> list[int]:
    """The live workers forked by the templates that process ``pid`` started (its children, the
    launchers), through their torch templates."""
    return [w for launcher in children(pid) for w in template_workers(launcher)]
