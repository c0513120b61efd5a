"""A build hook of the docs site (``hooks:`` in mkdocs.yml).

The package's docstrings use Sphinx roles (``:class:`Collector```,
``:meth:`~aiocollect.Collector.update_weights```), which the Markdown renderer leaves as text in
front of a code span. This hook shows each role as its code span alone, without the leading
``~`` and the ``aiocollect.`` module path, and with ``:meth:`text <target>``` as ``text``. It also
drops doctest directives (``# doctest: +SKIP``) from the examples, which are for the test runner.
"""

from __future__ import annotations

import re
from typing import Any

_ROLE = re.compile(
    r":(?:class|meth|func|mod|attr|exc|data|obj):<code>~?(?:aiocollect\.(?:[a-z_]+\.)*)?([^<]*?)"
    r"(?: &lt;[^&<]*&gt;)?</code>"
)


# a doctest directive as Pygments renders it in a code block (a comment span), with the spaces before it
_DIRECTIVE = re.compile(r"\s*<span class=\"c1\"># doctest: [^<]*</span>")


def on_page_content(html: str, **kwargs: Any) -> str:
    """Rewrite the roles in the rendered HTML of a page (mkdocs' ``on_page_content`` event)."""
    return _DIRECTIVE.sub("", _ROLE.sub(r"<code>\1</code>", html))
