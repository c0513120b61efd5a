"""An event loop in a helper thread (an anyio blocking portal) for the blocking wrappers of the
collector and the evaluator: the same async code, run for synchronous callers. Portals still open
when the interpreter exits are closed (their owner's ``aclose()`` run) before it joins its threads,
so that a script that leaves ``for batch in collector`` early still exits."""

from __future__ import annotations

import threading
import weakref
from typing import Any


class Portal:
    """The blocking wrapper's event loop, in a helper thread (an anyio blocking portal)."""

    def __init__(self, run: Any) -> None:
        self.run = run
        self.portal: Any = None
        self._cm: Any = None

    def get(self) -> Any:
        if self.portal is None:
            from anyio.from_thread import start_blocking_portal

            options = {}
            try:
                import uvloop  # noqa: F401

                options = {"use_uvloop": True}
            except ImportError:  # pragma: no cover
                pass
            self._cm = start_blocking_portal("asyncio", options)
            self.portal = self._cm.__enter__()
            _close_portals_at_exit(self)
        return self.portal

    def close(self) -> None:
        cm, self._cm, self.portal = self._cm, None, None
        _open_portals.discard(self)
        if cm is not None:
            cm.__exit__(None, None, None)


_open_portals: "weakref.WeakSet[Portal]" = weakref.WeakSet()
_exit_hook_installed = False


def _close_portals_at_exit(portal: Portal) -> None:
    """A script that leaves ``for batch in collector`` (or never closes it) must still exit:
    before the interpreter joins its threads, close what runs in portal threads."""
    global _exit_hook_installed
    _open_portals.add(portal)
    if not _exit_hook_installed:
        _exit_hook_installed = True
        register = getattr(threading, "_register_atexit", None)  # runs before threads are joined
        if register is not None:
            register(_close_open_portals)
        else:  # pragma: no cover - very old Python
            import atexit

            atexit.register(_close_open_portals)


def _close_open_portals() -> None:
    for portal in list(_open_portals):
        try:
            if portal.portal is not None:
                portal.portal.call(portal.run.aclose)
        except BaseException:  # noqa: BLE001 - exiting: nothing to report it to
            pass
        finally:
            portal.close()


__all__ = ["Portal"]
