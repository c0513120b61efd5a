"""The progress bar (``progress=True``), in the form that fits where the collector runs.

* In a Jupyter kernel (also VS Code, Colab) with ipywidgets: tqdm's notebook widget.
* In a kernel without ipywidgets: tqdm's text line, shown with IPython's ``display(...,
  display_id=True)`` and updated in place (``handle.update``) at most 4 times a second. No
  widget, no ``TqdmWarning``.
* Anywhere else (a terminal, a script, IPython in a terminal): tqdm's text bar on stderr.

In a notebook the bar is displayed once, in the cell that starts the collector, and then
updated where it is: the collector keeps running in the background while other cells execute,
and a bar written to stdout or stderr would land in whichever cell runs at the time.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any, Literal, Protocol

from .._core.errors import ConfigError

Flavour = Literal["terminal", "widget", "display"]

_DISPLAY_INTERVAL = 0.25  # seconds between updates of a displayed text line (tqdm's mininterval)
_DISPLAY_NCOLS = 100  # width of that line: there is no terminal to measure


def check_available() -> None:
    """Raise :class:`ConfigError` if tqdm is not installed (without importing it)."""
    if importlib.util.find_spec("tqdm") is None:
        raise ConfigError(
            "progress=True needs tqdm, which is not installed: pip install 'aiocollect[progress]' "
            "(in Jupyter, 'aiocollect[notebook]' also brings ipywidgets, for a widget bar)"
        )


def _in_kernel() -> bool:
    """Whether this process is an IPython kernel (Jupyter, VS Code, Colab), the test tqdm uses.
    IPython is not imported here: a kernel has imported it already."""
    ipython = sys.modules.get("IPython")
    get_ipython = getattr(ipython, "get_ipython", None)
    if get_ipython is None:
        return False
    shell = get_ipython()
    return shell is not None and "IPKernelApp" in getattr(shell, "config", {})


def _widget_class() -> Any:
    """tqdm's notebook widget bar, or ``None`` where ipywidgets is missing (tqdm.notebook then
    has no ``IProgress``; importing it does not warn, creating a bar would)."""
    try:
        from tqdm import notebook
    except ImportError:  # pragma: no cover - tqdm without its notebook module
        return None
    return notebook.tqdm if getattr(notebook, "IProgress", None) is not None else None


def flavour() -> Flavour:
    """Which bar :func:`make_bar` makes here."""
    if not _in_kernel():
        return "terminal"
    return "widget" if _widget_class() is not None else "display"


class _Discard:
    """The ``file`` of a displayed bar: tqdm's own writes (a newline at close) go nowhere."""

    encoding = "utf-8"  # tqdm draws its unicode bar only for a utf-8 file

    def write(self, s: str) -> int:
        return len(s)

    def flush(self) -> None:
        pass


def _display_class(base: Any) -> Any:
    from IPython.display import display

    class DisplayedBar(base):  # type: ignore[misc, valid-type]
        """tqdm's text line as an IPython display, updated in place."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self._handle = display({"text/plain": kwargs.get("desc") or ""}, raw=True, display_id=True)
            super().__init__(*args, file=_Discard(), mininterval=_DISPLAY_INTERVAL, ncols=_DISPLAY_NCOLS, **kwargs)

        def display(self, msg: str | None = None, pos: int | None = None) -> bool:
            if msg == "":  # tqdm clearing its line: keep the last state on show
                return True
            self._handle.update({"text/plain": str(self) if msg is None else msg}, raw=True)
            return True

    return DisplayedBar


class ProgressBar(Protocol):
    """The collector's progress bar (what :func:`make_bar` returns)."""

    def update_to(self, frames: int, mean_return: float | None) -> None:
        """Show ``frames`` collected (and the mean return of the last episodes)."""

    def close(self) -> None:
        """Close it (a closed bar is no longer updated)."""


def make_bar(total_frames: int | None, initial: int) -> ProgressBar:
    """A tqdm bar counting frames, with ``update_to(frames, mean_return)``; closes with ``close()``."""
    try:
        from tqdm.std import tqdm
    except ImportError as exc:  # pragma: no cover - check_available() ran at construction
        raise ImportError("progress=True needs tqdm: pip install 'aiocollect[progress]'") from exc

    kind = flavour()
    options: dict[str, Any] = {}
    if kind == "terminal":
        base, options["dynamic_ncols"] = tqdm, True
    elif kind == "widget":
        base = _widget_class()
    else:
        base = _display_class(tqdm)

    class Bar(base):  # type: ignore[misc, valid-type]
        monitor_interval = 0  # no monitor thread: nothing may outlive the collector

        def update_to(self, frames: int, mean_return: float | None) -> None:
            if mean_return is not None:
                self.set_postfix_str(f"return {mean_return:.1f}", refresh=False)
            self.update(frames - self.n)
            if self.total is not None and self.n >= self.total:
                # shown at once, by the consumer (close() follows from the collector's own task:
                # in a notebook, in the context of the cell that started it)
                self.refresh()

    return Bar(
        total=None if total_frames is None or total_frames == -1 else total_frames,
        initial=initial,
        unit="frames",
        unit_scale=True,
        desc="collecting",
        **options,
    )
