"""The launcher: a clean template process of ours from which worker processes are forked.

Workers never fork the user's process (it holds an event loop, threads, perhaps CUDA). Instead
``python -m aiocollect._backends.launcher`` is started, a fresh interpreter that imports what
workers need (numpy, gymnasium; torch and tensordict the first time a policy needs them) once,
then forks a worker per request in a few milliseconds. It lives as long as the process that
started it (it exits when that process closes its socket, including on a crash) or until
:func:`shutdown_launcher`. Its workers get SIGKILL if it dies.

**Started early** (:func:`prefork`): as soon as a program asks for ``aiocollect.Collector`` or
``aiocollect.Evaluator`` (``from aiocollect import Collector``), before that import loads torch,
the template is started and imports numpy, gymnasium and the worker's modules in parallel with
the program's own imports, so that the first collector finds it ready instead of paying those
imports a second time after the program's (torch waits for a policy that needs it:
:data:`PREFORK_NEEDS`). Unused, it is a sleeping process that ends with the program (or with
:func:`shutdown_launcher`). ``AIOCOLLECT_NO_PREFORK=1`` in the environment turns this off (it is
then started by the first collector, as before). A process that forks gets no share of it: the
child closes its inherited socket at once (``os.register_at_fork``) and starts its own when it
needs one.
"""

from __future__ import annotations

import atexit
import ctypes
import importlib
import os
import signal
import socket
import subprocess
import sys
import threading
from typing import Any

from .._core import wire as _wire
from .._core.public import public
from .._core.quick_import import import_module

_PR_SET_PDEATHSIG = 1
_PRELOAD = ("numpy", "gymnasium", "cloudpickle", "aiocollect._worker.rollout", "aiocollect._worker.main")
#: what an early start (prefork) imports beyond _PRELOAD: nothing, and torch in particular not:
#: the workers of server inference and of random actions never load torch (they stay light), so
#: the template imports it only once a collector's policy needs it
PREFORK_NEEDS: tuple[str, ...] = ()
#: environment variable: set to anything but "" or "0", no template is started before a collector needs one
NO_PREFORK = "AIOCOLLECT_NO_PREFORK"
_in_template = False  # True in the template process and in its workers (forks of it): they never prefork


def _set_parent_death_signal() -> None:
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except Exception:  # pragma: no cover - best effort
            pass


def _child(fd: int, sock: socket.socket, request: dict[str, Any], parent_pid: int) -> None:
    """In the forked child: become a worker."""
    try:
        sock.close()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        _set_parent_death_signal()
        if os.getppid() != parent_pid:  # the launcher died between fork and prctl
            os._exit(1)
        sys.path[:] = request["sys_path"]
        os.environ.clear()
        os.environ.update(request["environ"])
        try:
            os.chdir(request["cwd"])
        except OSError:
            pass
        module, _, name = request.get("entry", "aiocollect._worker.main:serve").partition(":")
        serve = getattr(importlib.import_module(module), name)
    except BaseException:  # pragma: no cover
        os._exit(1)
    serve(fd)  # never returns: it ends the process


def main() -> None:
    """Template process: serve fork requests until the collector's process closes the socket."""
    import warnings

    sock = socket.socket(fileno=int(sys.argv[1]))
    sock.setblocking(True)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the user's process's to handle
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
    warnings.filterwarnings("ignore", message=".*fork.*", category=DeprecationWarning)
    from . import launcher as this  # (this file runs as __main__: the module the workers see is another)

    this._in_template = True
    for name in _PRELOAD:
        importlib.import_module(name)
    while True:
        got = _wire.recv_blocking(sock)
        if got is None:
            os._exit(0)
        request, fds = got
        try:
            for name in request.get("needs", ()):
                import_module(name)  # (tensordict without torch._dynamo: quick_import)
            if request["op"] != "spawn":
                continue
            template_pid = os.getpid()
            pid = os.fork()
            if pid == 0:
                _child(fds[0], sock, request, template_pid)
        except BaseException as exc:  # noqa: BLE001 - report through the worker's socket
            import traceback

            from .._worker.peer import pack_exception

            if request.get("op") == "spawn" and fds:
                try:
                    with socket.socket(fileno=os.dup(fds[0])) as wsock:
                        wsock.setblocking(True)
                        _wire.send_blocking(wsock, _wire.Error(pack_exception(exc), traceback.format_exc()))
                except OSError:
                    pass
        finally:
            for fd in fds:
                os.close(fd)


class Launcher:
    """Parent side: starts the template process on first use and sends it fork requests."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self._pid_owner = os.getpid()
        self._inherited: list[subprocess.Popen] = []  # a forked child's: the parent's to wait for

    def forget_after_fork(self) -> None:
        """In a forked child: close the inherited socket (the template then ends with the parent's
        own, not with the last child's), and start a template of its own when it needs one."""
        self._lock = threading.Lock()  # (another thread may have held it at the fork)
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:  # pragma: no cover
                pass
        if self._proc is not None:
            self._inherited.append(self._proc)  # (not this process's child: never waited for here)
        self._proc = self._sock = None
        self._pid_owner = os.getpid()

    def _start(self) -> None:
        if self._pid_owner != os.getpid():  # pragma: no cover - forget_after_fork ran at the fork
            self.forget_after_fork()
        self._stop_locked()  # a dead launcher: close its socket, reap it
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = dict(os.environ)
        pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # above aiocollect/
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH")) if p)
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "aiocollect._backends.launcher", str(theirs.fileno())],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                # no terminal signals (the collector stops its workers), and a scheduling group of
                # its own under Linux's autogroups: the user's threads, a mostly sleeping event loop
                # among them, get a core at once when they wake (Pong, worker inference: loop lag
                # p99 0.6 ms, against 3.5 ms with the workers in the user's session)
                start_new_session=True,
                env=env,
                # `-m` puts the working directory first on sys.path: ours, so that an `aiocollect`
                # directory where the user runs their script is not imported instead of this package
                cwd=pkg_root,
            )
        finally:
            theirs.close()
        self._sock = ours
        self._pid_owner = os.getpid()

    def _alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None and self._pid_owner == os.getpid()

    def ensure_started(self, needs: tuple[str, ...] = ()) -> None:
        """Start the template process if needed (non-blocking) and let it import ``needs``."""
        with self._lock:
            if not self._alive():
                self._start()
            if needs:
                self._send({"op": "preload", "needs": list(needs)}, ())

    def _send(self, request: dict[str, Any], fds: tuple[int, ...]) -> None:
        assert self._sock is not None
        _wire.send_blocking(self._sock, request, fds)

    def spawn(self, fd: int, needs: tuple[str, ...], entry: str = "aiocollect._worker.main:serve") -> None:
        """Ask for a worker serving socket ``fd`` (the caller closes its copy of ``fd``).

        ``entry`` (``"module:function"``) is called in the forked child with ``fd``; it must end
        the process itself (``os._exit``) and never return.
        """
        request = {
            "op": "spawn",
            "entry": entry,
            "needs": list(needs),
            "sys_path": list(sys.path),
            "environ": dict(os.environ),
            "cwd": os.getcwd(),
        }
        with self._lock:
            for attempt in (0, 1):
                if not self._alive():
                    self._start()
                try:
                    self._send(request, (fd,))
                    return
                except OSError:
                    if attempt:
                        raise
                    self._stop_locked()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def _stop_locked(self) -> None:
        proc, sock = self._proc, self._sock
        self._proc = self._sock = None
        if sock is not None:
            sock.close()
        if proc is not None:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:  # pragma: no cover
                proc.kill()
                proc.wait()

    def shutdown(self) -> None:
        with self._lock:
            self._stop_locked()


_launcher = Launcher()
atexit.register(_launcher.shutdown)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_launcher.forget_after_fork)


def get_launcher() -> Launcher:
    return _launcher


def prefork_wanted() -> bool:
    """Whether :func:`prefork` starts the template here: not when ``AIOCOLLECT_NO_PREFORK`` is set,
    not in the template or its workers, not in a child of :mod:`multiprocessing` (a spawned
    process that imports the program's modules: the program's own process starts one)."""
    if os.environ.get(NO_PREFORK, "") not in ("", "0") or _in_template:
        return False
    mp = sys.modules.get("multiprocessing")
    return mp is None or mp.parent_process() is None


def prefork() -> None:
    """Start the template process now, if it is wanted (:func:`prefork_wanted`) and not running,
    to import what workers need while this process goes on: returns at once. A failure to start
    it is left for the first collector to meet (and report)."""
    if not prefork_wanted():
        return
    try:
        _launcher.ensure_started(PREFORK_NEEDS)
    except OSError:  # pragma: no cover - the first collector starts it again, and says why not
        pass


@public
def shutdown_launcher() -> None:
    """Stop the template process that worker processes are forked from.

    It is started by the first collector of a process and then kept so that later collectors and
    replacement workers start in milliseconds; it ends by itself when the process exits. Call this
    to release it earlier; the next collector starts a new one. Running workers are killed.
    """
    _launcher.shutdown()


if __name__ == "__main__":
    main()
