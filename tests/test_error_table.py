"""docs/errors.md, row by row: each input raises the listed error with the listed message."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import lossweight

from .torch_range import COMPILED_CHECKS, COMPILED_CHECKS_REASON, needs_compiled_checks

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
    if "torch.compile" in row["code"] and not COMPILED_CHECKS:
        pytest.skip(COMPILED_CHECKS_REASON)
    namespace: dict[str, object] = {"__name__": "errors_page"}
    exec(SETUP.group(1), namespace)
    with pytest.raises(ERRORS[row["error"]]) as raised:
        exec(row["code"], namespace)
    assert type(raised.value) is ERRORS[row["error"]]
    assert row["message"] in str(raised.value)


# Codes no single-process row can raise: ranks that disagree (tests/test_faults.py and
# tests/test_device_checks.py), the fragments of their message, counts on two accelerators, and
# the checks inside a compiled graph that the rows above do not reach (tests/test_compile.py).
ELSEWHERE = {
    "cannot_be_reduced",
    "differ_step",
    "differ_call",
    "differ_mode",
    "differ_choice",
    "differ_terms",
    "differ_divisor",
    "differ_carried",
    "differ_estimate",
    "other_thread",
    "group_destroyed",
    "pending_elsewhere",
    "disagree",
    "total_too_large",
    "devices_differ",
    "graph_asserts",
    "mesh_unnamed",  # a DeviceMesh needs a process group: tests/test_mesh.py
    "mesh_model_parallel",
    "not_the_loss_stage",
    "clip_pipeline",
    "pipeline_unset",
    "peers_differ",  # tensor-parallel ranks need a mesh of processes: tests/test_mesh.py
    "peer_refused",  # a peer's refusal needs a second process: tests/test_faults.py
}


def code_of(exception: BaseException) -> set[str]:
    """The codes of the table whose template, its fields filled with anything, is the message."""
    found = set()
    for code, (kind, template) in lossweight.errors.MESSAGES.items():
        pattern = ".*?".join(map(re.escape, re.split(r"\{[^}]*\}", template)))
        if type(exception) is kind and re.fullmatch(pattern, str(exception), re.S):
            found.add(code)
    return found


@needs_compiled_checks  # some rows compile scale_loss()
def test_every_code_of_the_table_has_a_row() -> None:
    assert SETUP is not None
    raised: set[str] = set()
    for row in ROWS:
        namespace: dict[str, object] = {"__name__": "errors_page"}
        exec(SETUP.group(1), namespace)
        with pytest.raises(Exception) as info:
            exec(row["code"], namespace)
        codes = code_of(info.value)
        if row["code"].startswith(("lossweight.count_tokens", "lossweight.aggregate")) or (
            "token_cross_entropy" in row["code"]
        ):
            continue  # the counting helpers' own errors
        assert codes, f"{row['code']} raised {info.value!r}, which no code of the table makes"
        raised |= codes
    missing = set(lossweight.errors.MESSAGES) - raised - ELSEWHERE
    assert not missing, f"codes without a row in docs/errors.md: {sorted(missing)}"
