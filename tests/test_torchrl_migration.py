"""docs/migrating-from-torchrl.md covers TorchRL 0.14.1 whole: every constructor argument and
public method of its collectors and of its Evaluator (``inspect.signature`` and ``dir`` of the
installed classes) is a row of the page's tables, with a mapping or a stated difference.

Runs in ``.venv-torchrl`` (``bash scripts/torchrl-compat.sh``); skipped where TorchRL is absent.
"""

from __future__ import annotations

import inspect
import pathlib
import re
import warnings

import pytest

torchrl = pytest.importorskip("torchrl")

PAGE = pathlib.Path(__file__).resolve().parent.parent / "docs" / "migrating-from-torchrl.md"
COLLECTORS = ("Collector", "MultiSyncCollector", "MultiCollector", "AsyncCollector", "AsyncBatchedCollector")


def torchrl_classes() -> dict[str, type]:
    with warnings.catch_warnings():  # (``import torchrl.collectors`` emits DeprecationWarnings)
        warnings.simplefilter("ignore", DeprecationWarning)
        import torchrl.collectors as tc
    assert torchrl.__version__.startswith("0.14"), f"the page is about TorchRL 0.14.1, this is {torchrl.__version__}"
    return {name: getattr(tc, name) for name in COLLECTORS + ("MultiAsyncCollector", "Evaluator")}


def arguments(cls: type) -> set[str]:
    params = inspect.signature(cls.__init__).parameters.values()  # type: ignore[misc]
    return {p.name for p in params if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}


def methods(cls: type) -> set[str]:
    return {name for name in dir(cls) if not name.startswith("_")}


def page_tables() -> dict[str, dict[str, str]]:
    """Per section (the nearest ``##``/``###`` heading): the names in each table row's first cell
    (backticked; ``name(args)`` gives ``name``), each with its row's last cell."""
    sections: dict[str, dict[str, str]] = {}
    heading = ""
    for line in PAGE.read_text().splitlines():
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
            continue
        if not line.startswith("|") or set(line) <= set("|- "):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0].startswith("TorchRL"):
            continue  # the header row
        for code in re.findall(r"`([^`]+)`", cells[0]):
            name = re.match(r"[A-Za-z_][A-Za-z_0-9]*", code.replace("for batch in collector", "__iter__"))
            if name:
                sections.setdefault(heading, {})[name.group()] = cells[-1]
    return sections


def rows(sections: dict[str, dict[str, str]], *words: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for heading, names in sections.items():
        if all(w in heading.lower() for w in words):
            out.update(names)
    return out


def test_every_collector_argument_and_method_is_on_the_page():
    classes = torchrl_classes()
    sections = page_tables()
    args = rows(sections, "constructor argument")
    meths = rows(sections, "method")
    missing_args = {n: sorted(arguments(classes[n]) - set(args)) for n in COLLECTORS}
    assert not any(missing_args.values()), f"TorchRL arguments with no row on {PAGE.name}: {missing_args}"
    skip = set(arguments(classes["Collector"])) | {"policy_version"}  # (properties listed with the arguments too)
    missing_meths = {n: sorted(methods(classes[n]) - set(meths) - skip) for n in COLLECTORS + ("MultiAsyncCollector",)}
    assert not any(missing_meths.values()), f"TorchRL methods with no row on {PAGE.name}: {missing_meths}"
    empty = sorted(n for n, mapping in {**args, **meths}.items() if not mapping)
    assert not empty, f"rows without a mapping or a stated difference: {empty}"


def test_every_evaluator_argument_and_method_is_on_the_page():
    ev = torchrl_classes()["Evaluator"]
    sections = page_tables()
    args = rows(sections, "its arguments")
    meths = rows(sections, "its methods")
    assert not sorted(arguments(ev) - set(args)), f"Evaluator arguments missing: {sorted(arguments(ev) - set(args))}"
    assert not sorted(methods(ev) - set(meths)), f"Evaluator methods missing: {sorted(methods(ev) - set(meths))}"
    assert all(args.values()) and all(meths.values())


def test_the_evaluator_names_the_page_maps_exist_here():
    """What the page says to call on our Evaluator is there, with TorchRL's parameter names."""
    from aiocollect import Evaluator

    for name in ("evaluate", "trigger_eval", "poll", "wait", "shutdown"):
        ours = set(inspect.signature(getattr(Evaluator, name)).parameters)
        theirs = set(inspect.signature(getattr(torchrl_classes()["Evaluator"], name)).parameters)
        assert theirs <= ours, f"Evaluator.{name}: TorchRL's parameters {sorted(theirs - ours)} are not accepted"
    assert "log_prefix" in inspect.signature(Evaluator).parameters
