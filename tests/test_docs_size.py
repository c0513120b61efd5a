"""The user pages (README.md and docs/, the contributors' design page aside) stay short: about
20,000 words in all, each page answering "how do I ..." in few words; internals go to
docs/design.md. And no line of prose is absurdly long (a table row or a paragraph on one line)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_WORDS = 20_000  # about 20,000 words: say it once, link to it; internals go to docs/design.md
MAX_PROSE_LINE = 400  # characters, outside code blocks (table rows included)
DESIGN = ROOT / "docs" / "design.md"


def user_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").rglob("*.md") if p != DESIGN)]


def words(text: str) -> int:
    """Whitespace-separated words, code blocks included (what a reader scrolls through)."""
    return len(text.split())


def long_prose_lines(text: str, limit: int = MAX_PROSE_LINE) -> list[int]:
    """Line numbers (from 1) of lines outside fenced code blocks longer than ``limit``."""
    found, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced and len(line) > limit:
            found.append(number)
    return found


def test_the_user_pages_are_at_most_about_20000_words():
    counts = {p.relative_to(ROOT).as_posix(): words(p.read_text(encoding="utf-8")) for p in user_pages()}
    total = sum(counts.values())
    largest = ", ".join(f"{name} {n:,}" for name, n in sorted(counts.items(), key=lambda kv: -kv[1])[:6])
    assert total <= MAX_WORDS, (f"the user pages hold {total:,} words (at most {MAX_WORDS:,}); largest: {largest}. "
                                f"Say it in fewer words, or move internals to docs/design.md")


def test_the_design_page_is_linked_from_contributing_and_not_a_user_page():
    assert DESIGN.is_file()
    assert "docs/design.md" in (ROOT / "CONTRIBUTING.md").read_text(encoding="utf-8")
    assert DESIGN not in user_pages()


def test_no_line_of_a_user_page_is_absurdly_long():
    hits = [f"{p.relative_to(ROOT)}:{n}" for p in user_pages() for n in long_prose_lines(p.read_text(encoding="utf-8"))]
    assert not hits, f"lines longer than {MAX_PROSE_LINE} characters outside code blocks: {hits}"


def test_the_checks_can_fail():
    assert words("one two\n```\nthree\n```") == 5
    text = "short\n" + "x" * 500 + "\n```\n" + "y" * 500 + "\n```\n"
    assert long_prose_lines(text) == [2]
    assert not re.search(r"\S", "")
