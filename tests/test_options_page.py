"""docs/options.md, the options reference, is generated from the field docs of CollectorConfig and
EvaluatorConfig by scripts/options_page.py: every option has an entry with a docstring, and the
committed page is what the script writes now (regenerate: ``.venv/bin/python scripts/options_page.py``)."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "options.md"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("options_page", ROOT / "scripts" / "options_page.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("class_name", ["CollectorConfig", "EvaluatorConfig"])
def test_every_option_has_a_docstring_and_an_entry_in_its_section(script, class_name):
    import aiocollect

    config = getattr(aiocollect, class_name)
    _, anchor, _, path, _ = next(s for s in script.SECTIONS if s[2] == class_name)
    docs = script.field_docs((ROOT / path).read_text(encoding="utf-8"), class_name)
    names = [f.name for f in dataclasses.fields(config)]
    undocumented = [n for n in names if not docs.get(n, ("", ""))[1].strip()]
    assert not undocumented, f"{class_name} fields without a docstring under them: {undocumented}"
    page = PAGE.read_text(encoding="utf-8")
    missing = [n for n in names if f"### `{n}` {{#{anchor}-{n.replace('_', '-')}}}" not in page]
    assert not missing, (f"docs/options.md has no entry for {class_name}'s {missing}: run "
                         f".venv/bin/python scripts/options_page.py")


def test_the_committed_page_is_what_the_script_writes(script):
    assert PAGE.read_text(encoding="utf-8") == script.render(), (
        "docs/options.md is stale: run .venv/bin/python scripts/options_page.py and commit the page")
    reference = script.REFERENCE.read_text(encoding="utf-8")
    assert reference == script.reference_page(reference), (
        "docs/reference/config.md's CollectorConfig members are stale: run .venv/bin/python scripts/options_page.py")


def test_the_reader_finds_a_missing_docstring_and_renders_roles_and_pages(script):
    """The checks above can fail: a field without a docstring reads as empty; Sphinx roles become
    code spans and ``docs/x.md`` a link."""
    source = 'class C:\n    a: int = 1\n    """Doc of a."""\n    b: int = 2\n'
    assert script.field_docs(source, "C") == {"a": ("int", "Doc of a."), "b": ("int", "")}
    text = script.markdown("See :class:`~aiocollect.Collector` and ``docs/vector-envs.md``.")
    assert text == "See `Collector` and [vector envs](vector-envs.md)."
    assert not re.search(r"``", script.markdown("``x``"))
