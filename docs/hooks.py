"""A mkdocs hook: the Sphinx roles in lossweight's docstrings (``:class:`Term```), which
mkdocstrings renders as written, shown as the code they name."""

from __future__ import annotations

import re
from typing import Any

_ROLE = re.compile(r":(?:class|mod|func|meth|data|attr):(?=<code>)")


def on_page_content(html: str, **_: Any) -> str:
    return _ROLE.sub("", html)
