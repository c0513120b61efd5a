"""progress=True picks the bar that fits where the collector runs: tqdm's text bar on stderr in a
terminal; in a Jupyter kernel, tqdm's widget with ipywidgets, or a text line displayed once and
updated in place without (never a TqdmWarning, never text written into whichever cell runs).

The kernel is faked here (a stand-in ``IPython`` module whose ``display`` records what it shows);
the real check in Jupyter runs a notebook with nbclient, outside this suite."""

from __future__ import annotations

import sys
import types

import pytest
import tqdm
import tqdm.std

from aiocollect import Collector, ConfigError
from aiocollect._service import progress as _progress
from aiocollect.testing import CountingEnv


class FakeHandle:
    """What ``display(..., display_id=True)`` returns: records the texts it is updated with."""

    def __init__(self, shown: dict) -> None:
        self.texts = [shown["text/plain"]]

    def update(self, obj: dict, raw: bool = False) -> None:
        assert raw and set(obj) == {"text/plain"}
        self.texts.append(obj["text/plain"])


def _fake_ipython(monkeypatch: pytest.MonkeyPatch, config: dict | None) -> list[FakeHandle]:
    """Install a stand-in IPython whose shell has ``config`` (None: no shell); returns the
    handles of what its ``display`` showed."""
    shown: list[FakeHandle] = []

    def display(obj: dict, raw: bool = False, display_id: bool | None = None) -> FakeHandle | None:
        assert raw
        shown.append(FakeHandle(obj))
        return shown[-1] if display_id else None

    ipython = types.ModuleType("IPython")
    shell = None if config is None else types.SimpleNamespace(config=config)
    ipython.get_ipython = lambda: shell  # type: ignore[attr-defined]
    display_module = types.ModuleType("IPython.display")
    display_module.display = display  # type: ignore[attr-defined]
    ipython.display = display_module  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "IPython", ipython)
    monkeypatch.setitem(sys.modules, "IPython.display", display_module)
    return shown


@pytest.fixture
def kernel(monkeypatch: pytest.MonkeyPatch) -> list[FakeHandle]:
    """A Jupyter kernel without ipywidgets (as tqdm tells a kernel: IPKernelApp in the config)."""
    shown = _fake_ipython(monkeypatch, {"IPKernelApp": {}})
    monkeypatch.setattr(_progress, "_widget_class", lambda: None)
    return shown


@pytest.fixture
def fresh_tqdm_notebook():
    """tqdm.notebook imported afresh by the test (it caches whether ipywidgets imports), and
    restored afterwards."""
    saved = sys.modules.pop("tqdm.notebook", None), tqdm.__dict__.pop("notebook", None)
    yield
    sys.modules.pop("tqdm.notebook", None)
    tqdm.__dict__.pop("notebook", None)
    if saved[0] is not None:
        sys.modules["tqdm.notebook"] = saved[0]
    if saved[1] is not None:
        tqdm.notebook = saved[1]  # type: ignore[attr-defined]


def test_terminal_without_ipython(monkeypatch, capsys):
    """Outside a kernel: tqdm's text bar, on stderr."""
    monkeypatch.delitem(sys.modules, "IPython", raising=False)
    assert _progress.flavour() == "terminal"
    bar = _progress.make_bar(64, 0)
    bar.update_to(64, 1.5)
    bar.close()
    out = capsys.readouterr()
    assert out.out == ""
    assert "64.0/64.0" in out.err and "return 1.5" in out.err


@pytest.mark.parametrize("config", [None, {"TerminalIPythonApp": {}}], ids=["no-shell", "terminal-ipython"])
def test_ipython_outside_a_kernel_is_a_terminal(monkeypatch, config):
    """IPython imported without a shell, or IPython in a terminal: the terminal bar."""
    shown = _fake_ipython(monkeypatch, config)
    assert _progress.flavour() == "terminal"
    assert not shown


def test_kernel_with_ipywidgets_gets_the_widget(monkeypatch):
    """In a kernel where tqdm's notebook widget can be made, that widget is the bar."""
    _fake_ipython(monkeypatch, {"IPKernelApp": {}})

    class Widget(tqdm.std.tqdm):  # stands in for tqdm.notebook.tqdm
        made = 0

        def __init__(self, *args, **kwargs):
            Widget.made += 1
            super().__init__(*args, file=_progress._Discard(), **kwargs)

    monkeypatch.setattr(_progress, "_widget_class", lambda: Widget)
    assert _progress.flavour() == "widget"
    bar = _progress.make_bar(-1, 16)
    assert isinstance(bar, Widget) and Widget.made == 1 and bar.n == 16 and bar.total is None
    bar.update_to(48, None)
    assert bar.n == 48
    bar.close()


def test_kernel_without_ipywidgets_warns_nothing(monkeypatch, capsys, fresh_tqdm_notebook):
    """With the real tqdm.notebook and no ipywidgets: the displayed line, and no TqdmWarning
    (warnings are errors in this suite)."""
    shown = _fake_ipython(monkeypatch, {"IPKernelApp": {}})
    monkeypatch.setitem(sys.modules, "ipywidgets", None)  # not installed
    assert _progress._widget_class() is None
    assert _progress.flavour() == "display"
    bar = _progress.make_bar(64, 0)
    bar.update_to(64, None)
    bar.close()
    assert len(shown) == 1 and "64.0/64.0" in shown[0].texts[-1]
    assert capsys.readouterr() == ("", "")


def test_kernel_without_ipywidgets_updates_one_display_in_place(kernel, capsys):
    """One display, updated in place with tqdm's text line (frames, mean return); nothing
    written to stdout or stderr, which would land in whichever cell runs."""
    bar = _progress.make_bar(1024, 0)
    assert len(kernel) == 1
    handle = kernel[0]
    assert "collecting" in handle.texts[-1] and "0/1.02k" in handle.texts[-1]
    bar.update_to(512, 21.25)
    bar.close()
    assert len(kernel) == 1  # never a second output
    last = handle.texts[-1]
    assert "512/1.02k" in last and "return 21.2" in last and "frames/s" in last
    assert capsys.readouterr() == ("", "")


def test_kernel_display_is_throttled(kernel, monkeypatch):
    """The displayed line is updated at most 4 times per second (of tqdm's clock, faked here),
    however often batches arrive, and shows the final count once closed."""
    now = [1000.0]
    monkeypatch.setattr(tqdm.std, "time", lambda: now[0])
    bar = _progress.make_bar(-1, 0)
    handle = kernel[0]
    start = len(handle.texts)
    for frames in range(16, 16 * 201, 16):  # 200 batches over 2 s
        now[0] += 0.01
        bar.update_to(frames, None)
    updates = len(handle.texts) - start
    assert 1 <= updates <= 2 / _progress._DISPLAY_INTERVAL + 1
    bar.close()
    assert "3.20k" in handle.texts[-1]


async def test_collector_in_a_kernel_shows_its_bar_in_one_display(kernel, capsys):
    """A collector with progress=True in a kernel without ipywidgets: one display, ending at
    the frames collected; nothing on stdout or stderr."""
    async with Collector(CountingEnv, frames_per_batch=16, total_frames=64, num_workers=0, progress=True) as c:
        assert len([b async for b in c]) == 4
    assert len(kernel) == 1 and "64.0/64.0" in kernel[0].texts[-1]
    assert capsys.readouterr() == ("", "")


def test_progress_without_tqdm_is_a_config_error(monkeypatch):
    """progress=True without tqdm installed fails at construction, saying what to install."""
    monkeypatch.setitem(sys.modules, "tqdm", None)  # as if not installed
    with pytest.raises(ConfigError, match=r"pip install 'aiocollect\[progress\]'"):
        Collector(CountingEnv, frames_per_batch=16, num_workers=0, progress=True)
    Collector(CountingEnv, frames_per_batch=16, num_workers=0)  # without progress: fine
