"""The docs site builds with ``mkdocs build --strict`` (every nav page present, every relative link
and anchor resolved, every docstring readable by mkdocstrings' griffe, no warning at all), and its
API reference documents the package's public names: each one exported by ``aiocollect``,
``aiocollect.events`` and ``aiocollect.testing``, each option of ``CollectorConfig``, and the
collector's methods, with no Sphinx role left unrendered.

One build (a subprocess of this interpreter's ``python -m mkdocs``, into a temporary folder) serves
every test of the module; it takes a few seconds.
"""

from __future__ import annotations

import dataclasses
import html
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mkdocs", reason="the docs site needs the docs extra: pip install -e '.[docs]'")
pytest.importorskip("mkdocstrings", reason="the docs site needs the docs extra: pip install -e '.[docs]'")

ROOT = Path(__file__).resolve().parent.parent
BUILD_TIMEOUT = 120  # seconds; a build takes a few


@dataclasses.dataclass(frozen=True)
class Site:
    """A finished build: its folder and the build's log."""

    path: Path
    log: str

    def page(self, name: str) -> str:
        """The HTML of a page, by its Markdown path relative to docs/ ("reference/collector.md")."""
        stem = name.removesuffix(".md")
        target = self.path / ("index.html" if stem == "index" else f"{stem.removesuffix('/index')}/index.html")
        assert target.is_file(), f"{name} was not built (no {target.relative_to(self.path)})"
        return target.read_text(encoding="utf-8")

    def reference(self) -> str:
        """Every API reference page, concatenated."""
        return "\n".join(p.read_text(encoding="utf-8") for p in sorted((self.path / "reference").rglob("index.html")))


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Site:
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--clean", "--site-dir", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=BUILD_TIMEOUT, env=env,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"mkdocs build --strict failed (exit {proc.returncode}):\n{log[-6000:]}"
    return Site(out, log)


def nav_pages() -> list[str]:
    """The Markdown files named in mkdocs.yml's nav (read as text: the file has no custom tags)."""
    text = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    nav = text[text.index("\nnav:") :]
    return re.findall(r"([\w./-]+\.md)\s*$", nav, flags=re.MULTILINE)


def ids(html_text: str) -> set[str]:
    return set(re.findall(r'id="([^"]+)"', html_text))


@pytest.mark.timeout(BUILD_TIMEOUT + 30)
def test_strict_build_succeeds_without_a_warning(site):
    assert "WARNING" not in site.log, site.log[-6000:]
    assert "Documentation built" in site.log, site.log[-2000:]


@pytest.mark.timeout(BUILD_TIMEOUT + 30)
def test_every_nav_page_is_built_and_every_docs_page_is_in_the_nav(site):
    pages = nav_pages()
    assert len(pages) >= 20, pages  # the guides, the recipes, the benchmarks and the reference
    for name in pages:
        site.page(name)
    in_docs = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")}
    assert in_docs <= set(pages), f"pages missing from the nav: {sorted(in_docs - set(pages))}"


@pytest.mark.timeout(BUILD_TIMEOUT + 30)
def test_reference_documents_every_public_name(site):
    import aiocollect
    import aiocollect.events
    import aiocollect.testing

    found = ids(site.reference())
    expected = {f"aiocollect.{name}" for name in aiocollect.__all__
                if name not in ("__version__", "events", "testing", *aiocollect.events.__all__)}  # (events: below)
    expected |= {f"aiocollect.events.{name}" for name in aiocollect.events.__all__}
    expected |= {f"aiocollect.testing.{name}" for name in aiocollect.testing.__all__}
    assert not expected - found, f"public names without a reference entry: {sorted(expected - found)}"


@pytest.mark.timeout(BUILD_TIMEOUT + 30)
def test_reference_documents_the_collector_methods_and_every_option(site):
    from aiocollect import CollectorConfig, EvaluatorConfig, ProfileConfig

    found = ids(site.page("reference/collector.md"))
    methods = ["update_weights", "collect", "start", "aclose", "pause", "on", "subscribe", "wait_for", "stats",
               "enable_profile", "set_seed", "state_dict", "load_state_dict", "update_policy_weights_", "close"]
    missing = [m for m in methods if f"aiocollect.Collector.{m}" not in found]
    assert not missing, f"Collector methods missing from reference/collector.md: {missing}"
    text = html.unescape(site.page("reference/collector.md"))
    assert "Publish new policy weights to the workers" in text  # update_weights' docstring, rendered
    for config, page in ((CollectorConfig, "reference/config.md"), (ProfileConfig, "reference/config.md"),
                         (EvaluatorConfig, "reference/evaluator.md")):
        found = ids(site.page(page))
        missing = [f.name for f in dataclasses.fields(config) if f"aiocollect.{config.__name__}.{f.name}" not in found]
        assert not missing, f"{config.__name__} options missing from {page}: {missing}"


@pytest.mark.timeout(BUILD_TIMEOUT + 30)
def test_reference_shows_sphinx_roles_as_code_not_as_text(site):
    """The docstrings' :class:`X` roles are rendered as the code span alone (docs/reference/hooks.py)."""
    text = site.reference()
    left = re.findall(r":(?:class|meth|func|mod|attr|exc|data|obj):", text)
    assert not left, f"{len(left)} Sphinx roles left as text in the reference, e.g. {left[:3]}"
    assert "<code>WorkerFailed</code>" in text or "<code>events.WorkerFailed</code>" in text


@pytest.mark.timeout(BUILD_TIMEOUT + 30)
def test_reference_shows_docstring_examples_as_code_and_signatures_formatted(site):
    """``>>>`` examples are code blocks (not nested quotes), without doctest directives; signatures
    are formatted one parameter a line (the docs extra's black), with no default that does not
    exist (``frames_per_batch`` has none)."""
    text = site.reference()
    assert "<blockquote" not in text, "a docstring's >>> example rendered as a quote: put it in an Examples: section"
    assert "doctest:" not in text
    assert "&gt;&gt;&gt;" in text  # (the examples are there, as code)
    assert "Formatting signatures requires" not in site.log, "install the docs extra (black formats the signatures)"
    config = html.unescape(re.sub(r"<[^>]+>", "", site.page("reference/config.md")))
    signature = config[config.index("CollectorConfig(") :]
    assert "\n    create_env_fn: Any,\n" in signature, signature[:300]
    assert re.search(r"frames_per_batch: int,", signature) and "frames_per_batch: int =" not in signature, signature[:300]


@pytest.mark.timeout(BUILD_TIMEOUT + 30)
def test_benchmarks_page_shows_a_plot_per_benchmark_that_plots_py_draws(site):
    page = site.page("benchmarks.md")
    for name in ("throughput", "pixels", "vector_envs", "inference", "weight_sync", "startup"):
        assert f'img/{name}.png"' in page, f"benchmarks.md does not show img/{name}.png"
        assert (site.path / "img" / f"{name}.png").is_file(), f"docs/img/{name}.png is missing"


@pytest.mark.timeout(BUILD_TIMEOUT + 30)
def test_the_changelog_page_shows_the_repositorys_changelog(site):
    first = next(line for line in (ROOT / "CHANGELOG.md").read_text().splitlines() if line.startswith("- "))
    words = re.findall(r"[A-Za-z]{5,}", first)[:4]
    page = html.unescape(re.sub(r"<[^>]+>", "", site.page("changelog.md")))
    assert "Unreleased" in page and all(word in page for word in words), words
