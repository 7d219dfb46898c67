"""docs/errors.md, row by row: each input raises the listed error with the listed message."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import lossweight

PAGE = Path(__file__).resolve().parent.parent / "docs" / "errors.md"
SETUP = re.search(r"^```python\n(.*?)^```$", PAGE.read_text(), flags=re.M | re.S)
ROW = re.compile(r"^\| `(?P<code>[^|]+)` \| `(?P<error>\w+)` `(?P<message>[^|]+)` \| [^|]+ \|$")
ROWS = [match.groupdict() for match in map(ROW.match, PAGE.read_text().splitlines()) if match]
ERRORS = {
    "TypeError": TypeError,
    "ValueError": ValueError,
    "RuntimeError": RuntimeError,
    "DisagreementError": lossweight.DisagreementError,
}


def test_the_table_covers_the_errors() -> None:
    assert SETUP is not None
    assert len(ROWS) >= 40
    assert len({row["code"] for row in ROWS}) == len(ROWS)  # no row twice
    table_lines = [line for line in PAGE.read_text().splitlines() if line.startswith("| `")]
    assert len(table_lines) == len(ROWS)  # every row of the tables parses


@pytest.mark.parametrize("row", ROWS, ids=[row["code"] for row in ROWS])
def test_row(row: dict[str, str]) -> None:
    assert SETUP is not None
    namespace: dict[str, object] = {"__name__": "errors_page"}
    exec(SETUP.group(1), namespace)
    with pytest.raises(ERRORS[row["error"]]) as raised:
        exec(row["code"], namespace)
    assert type(raised.value) is ERRORS[row["error"]]
    assert row["message"] in str(raised.value)
