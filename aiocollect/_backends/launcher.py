"""The launcher: clean template processes of ours from which worker processes are forked.

Workers never fork the user's process (it holds an event loop, threads, perhaps CUDA). Instead
``python -m aiocollect._backends.launcher`` is started, a fresh interpreter that imports what
every worker needs (numpy, gymnasium, the worker's modules) once, then forks a worker per request
in a few milliseconds. It lives as long as the process that started it (it exits when that
process closes its socket, including on a crash) or until :func:`shutdown_launcher`. Its workers
get SIGKILL if it dies.

**Two templates.** The workers of server inference and of random actions never load torch (they
stay light; unless their env factory's module imports it: :mod:`aiocollect._core.imports`), so
this *light* template never imports it. Once its own imports are done it forks a
*torch template*, a child that imports torch on top of them, the first time a request needs torch
or tensordict (prefork's, or the first torch policy's); the light template forwards such requests
(and the worker's socket sent with them) to it over a socket pair, and the worker is forked from
there, with torch already imported; tensordict is imported there too, the first time a policy
needs it (without ``torch._dynamo``: :mod:`.quick_import`). Both run the same loop
(:class:`_Template`); the parent's side (:class:`Launcher`) sees one process. The torch template
gets SIGKILL when the light template dies and ends when its socket closes; its workers get SIGKILL
if it dies; a torch template found dead (a forward fails) is forked again; an error (a failing
import of torch) reaches the worker's socket, so the collector's error names the cause. The cost:
one more sleeping process (measured from ``/proc/PID/smaps_rollup``, CPU torch 2.13, Linux):
RSS 215 MB, of which 139 MB its own (``Private_Dirty``), the rest shared with the light template
(RSS 41 MB, 15 MB its own). It is started only by :func:`prefork` or the first torch policy.

**Started early** (:func:`prefork`): as soon as a program asks for ``aiocollect.Collector`` or
``aiocollect.Evaluator`` (``from aiocollect import Collector``), before that import loads torch,
the light template is started and imports what workers need in parallel with the program's own
imports, then the torch template imports torch (:data:`PREFORK_NEEDS`) beside the program's own
``import torch``, so that the first collector finds them ready instead of paying those imports a
second time after the program's. Unused, they are two sleeping processes that end with the
program (or with :func:`shutdown_launcher`). ``AIOCOLLECT_NO_PREFORK=1`` in the environment turns
this off (the light template is then started by the first collector, and the torch template by
the first torch policy). A process that forks gets no share of them: the child closes its
inherited socket at once (``os.register_at_fork``) and starts its own when it needs one.
"""

from __future__ import annotations

import atexit
import ctypes
import importlib
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from typing import Any, NoReturn

from .._core import wire as _wire
from .._core.public import public
from .._core.quick_import import import_module

_PR_SET_PDEATHSIG = 1
_PRELOAD = ("numpy", "gymnasium", "cloudpickle", "aiocollect._worker.rollout", "aiocollect._worker.main")
#: the needs (top-level modules) that a worker is forked from the torch template for
_TORCH_NEEDS = frozenset({"torch", "tensordict"})
#: what an early start (prefork) imports beyond _PRELOAD: torch, in the torch template (the light
#: template, which the workers of server inference and of random actions are forked from, never
#: imports it)
PREFORK_NEEDS: tuple[str, ...] = ("torch",)
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


def _needs_torch(request: dict[str, Any]) -> bool:
    return any(name.partition(".")[0] in _TORCH_NEEDS for name in request.get("needs", ()))


class _Template:
    """A template process's loop: serve the requests that arrive on ``sock`` until it closes.

    The light template (``forwards_torch``) hands the requests that need torch to its torch
    template, which it forks on the first one (prefork's ``preload``, or the first torch policy's),
    after its own imports: the child has them all at once and shares their pages. The torch
    template runs this same loop, serving everything itself.
    """

    def __init__(self, sock: socket.socket, forwards_torch: bool) -> None:
        self.sock = sock
        self.forwards_torch = forwards_torch
        self.torch: socket.socket | None = None  # (the light template's socket to its torch template)
        self.torch_pidfd: int | None = None  # (and a handle on that process: its pid may be reused once it ends)

    def serve(self) -> NoReturn:
        while True:
            got = _wire.recv_blocking(self.sock)
            if got is None:
                self._stop_torch_template()
                os._exit(0)
            request, fds = got
            try:
                if self.forwards_torch and _needs_torch(request):
                    self._forward(request, fds)
                    continue
                for name in request.get("needs", ()):
                    import_module(name)  # (tensordict without torch._dynamo: quick_import)
                if request["op"] != "spawn":
                    continue
                template_pid = os.getpid()
                pid = os.fork()
                if pid == 0:
                    self._close_in_child(fds[1:])
                    _child(fds[0], request, template_pid)
            except BaseException as exc:  # noqa: BLE001 - report through the worker's socket
                _report(request, fds, exc)
            finally:
                for fd in fds:
                    os.close(fd)

    def _forward(self, request: dict[str, Any], fds: list[int]) -> None:
        """Send ``request`` (and ``fds``) to the torch template, starting it if it is not there:
        never started, or dead (a send then fails: its end of the socket closed with it), once."""
        for attempt in (0, 1):
            if self.torch is None:
                self._start_torch_template(fds)
            assert self.torch is not None
            try:
                _wire.send_blocking(self.torch, request, fds)
                return
            except OSError:
                self._stop_torch_template()
                if attempt:
                    raise

    def _start_torch_template(self, fds: list[int]) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        light_pid = os.getpid()
        pid = os.fork()
        if pid == 0:
            try:
                ours.close()
                self._close_in_child(fds)  # (the request's fds: its copy would keep a worker's socket open)
                # a process group of its own, its workers' too: told apart from the light template's
                # (`ps -o pgid`, the tests), and `kill -- -PGID` ends it with its workers
                os.setpgid(0, 0)
                _set_parent_death_signal()
                if os.getppid() != light_pid:  # the light template died between fork and prctl
                    os._exit(1)
            except BaseException:  # pragma: no cover
                os._exit(1)
            try:
                _Template(theirs, forwards_torch=False).serve()
            finally:  # (never back into the light template's loop, in the child)
                os._exit(1)
        theirs.close()
        self.torch = ours
        try:
            self.torch_pidfd = os.pidfd_open(pid)
        except (AttributeError, OSError):  # pragma: no cover - no pidfds (Linux < 5.3): not waited for
            pass

    def _stop_torch_template(self) -> None:
        """Kill the torch template and wait for its end, so that a shutdown returns with both
        templates gone (SIGKILL: it may be in the middle of ``import torch``, deaf to its socket)."""
        sock, pidfd = self.torch, self.torch_pidfd
        self.torch = self.torch_pidfd = None
        if sock is not None:
            sock.close()
        if pidfd is not None:
            try:
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                select.select([pidfd], [], [])  # (readable once it has ended; the kernel reaps it)
            except OSError:  # it had ended already
                pass
            finally:
                os.close(pidfd)

    def _close_in_child(self, fds: list[int]) -> None:
        """In a fork of this template: close what only the template uses (its sockets, which would
        otherwise keep its peers from seeing it end) and ``fds``."""
        for sock in (self.sock, self.torch):
            if sock is not None:
                sock.close()
        if self.torch_pidfd is not None:
            os.close(self.torch_pidfd)
        for fd in fds:
            os.close(fd)


def _report(request: dict[str, Any], fds: list[int], exc: BaseException) -> None:
    """Send a failed request's error to the worker it was for: its collector raises it."""
    import traceback

    from .._worker.peer import pack_exception

    if request.get("op") == "spawn" and fds:
        try:
            with socket.socket(fileno=os.dup(fds[0])) as wsock:
                wsock.setblocking(True)
                _wire.send_blocking(wsock, _wire.Error(pack_exception(exc), traceback.format_exc()))
        except OSError:
            pass


def _child(fd: int, request: dict[str, Any], parent_pid: int) -> NoReturn:
    """In the forked child: become a worker."""
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        _set_parent_death_signal()
        if os.getppid() != parent_pid:  # the template died between fork and prctl
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
    os._exit(1)  # pragma: no cover - (an entry that broke its promise)


def main() -> None:
    """The light template: import what every worker needs, then serve until the collector's
    process closes the socket."""
    import warnings

    sock = socket.socket(fileno=int(sys.argv[1]))
    sock.setblocking(True)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the user's process's to handle
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel (the torch template's too: inherited)
    warnings.filterwarnings("ignore", message=".*fork.*", category=DeprecationWarning)
    from . import launcher as this  # (this file runs as __main__: the module the workers see is another)

    this._in_template = True
    for name in _PRELOAD:
        importlib.import_module(name)
    _Template(sock, forwards_torch=True).serve()


class Launcher:
    """Parent side: starts the light template on first use and sends it fork requests (it forwards
    those that need torch to the torch template)."""

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
        """Start the template process if needed (non-blocking) and let it import ``needs`` (torch
        and tensordict: the torch template, started for them)."""
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
        """The light template's process id (the torch template is a child of it); ``None`` before
        the start or after the shutdown."""
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
    """Stop the template processes that worker processes are forked from.

    It is started by the first collector of a process and then kept so that later collectors and
    replacement workers start in milliseconds; it ends by itself when the process exits. Call this
    to release it earlier; the next collector starts a new one. Running workers are killed.
    """
    _launcher.shutdown()


if __name__ == "__main__":
    main()
