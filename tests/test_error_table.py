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
    "AssertionError": AssertionError,
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


# Codes that no row of the page raises, each with the test that asserts its message: that test's
# file and a fragment of the message it asserts (test_every_code_without_a_row_has_a_test checks
# both). A row is one line in one process: these need ranks that disagree, a mesh of processes,
# two accelerators, a compiled graph, a torch without graph asserts, or a failure inside
# InProcessGroup.run(), which raises the first rank's error, not the one its peers then see.
ELSEWHERE: dict[str, tuple[str, str]] = {
    "cannot_be_reduced": ("test_faults.py", "lossweight step "),
    "differ_step": ("test_faults.py", "this rank is at step"),
    "differ_call": ("test_faults.py", "this rank reduces for"),
    "differ_mode": ("test_faults.py", "call begin(parameters=...) and end() as the other ranks do"),
    "differ_choice": ("test_faults.py", "% of the ranks have"),
    "differ_terms": ("test_declarations.py", "the ranks differ in their loss terms"),
    "differ_divisor": ("test_device_checks.py", "the ranks differ in grad_reduction"),
    "differ_carried": ("test_faults.py", "% of the ranks' reductions carry the loss"),
    "differ_estimate": ("test_faults.py", "the ranks differ in the estimate of W"),
    "other_thread": ("test_hardening.py", "another thread was inside a call"),
    "group_destroyed": (
        "test_faults.py",
        "was destroyed (torch.distributed.destroy_process_group())",
    ),
    "pending_elsewhere": (
        "test_faults.py",
        "call flush() on every rank before tearing a process group down",
    ),
    "disagree": ("test_integrations.py", "the data-parallel ranks disagree on"),
    "devices_differ": ("test_errors.py", "are on different devices"),
    "graph_asserts": ("test_compile.py", "inside torch.compile needs torch 2.9"),
    "mesh_unnamed": ("test_mesh.py", "of several dimensions without names"),
    "mesh_model_parallel": ("test_mesh.py", "whose ranks hold the same data"),
    "not_the_loss_stage": ("test_mesh.py", "whose pipeline stage is not the last one"),
    "clip_pipeline": ("test_mesh.py", "under pipeline= each stage holds a part of the model"),
    "pipeline_unset": ("test_mesh.py", "to infer a stage's shapes"),
    "peers_differ": ("test_mesh.py", "ranks of one tensor-parallel group"),
    "peer_refused": ("test_device_checks.py", "ranks of the reduction refused to end this step"),
    "split_ranks": ("test_testing.py", "which are the ranks of every split"),
    "checks_differ": ("test_testing.py", "called assert_split_invariant with other"),
    "context_parallel_processes": ("test_testing.py", "simulates ranks in one process"),
    "reduce_abandoned": ("test_testing.py", "was abandoned when a run of this group failed"),
    "rank_failed": ("test_testing.py", "abandoned: another rank failed"),
    "reduce_timed_out": ("test_testing.py", "did not start it within"),
}


def code_of(exception: BaseException) -> set[str]:
    """The codes of the table whose template, its fields filled with anything, is the message."""
    found = set()
    for code, (kind, template) in lossweight.errors.MESSAGES.items():
        pattern = ".*?".join(map(re.escape, re.split(r"\{[^}]*\}", template)))
        if type(exception) is kind and re.fullmatch(pattern, str(exception), re.S):
            found.add(code)
    return found


def test_every_code_of_the_table_has_a_row() -> None:
    assert SETUP is not None
    raised: set[str] = set()
    for row in ROWS:
        namespace: dict[str, object] = {"__name__": "errors_page"}
        exec(SETUP.group(1), namespace)
        with pytest.raises(Exception) as info:
            exec(row["code"], namespace)
        codes = code_of(info.value)
        assert codes, f"{row['code']} raised {info.value!r}, which no code of the table makes"
        raised |= codes
    missing = set(lossweight.errors.MESSAGES) - raised - set(ELSEWHERE)
    assert not missing, f"codes without a row in docs/errors.md: {sorted(missing)}"
    assert not raised & set(ELSEWHERE), "a code with a row needs no other test"


@pytest.mark.parametrize("code", ELSEWHERE)
def test_every_code_without_a_row_has_a_test(code: str) -> None:
    test_file, fragment = ELSEWHERE[code]
    templates = {c: template for c, (_, template) in lossweight.errors.MESSAGES.items()}
    # A fragment of this message's fixed words, and of no other message's.
    assert any(fragment in words for words in re.split(r"\{[^}]*\}", templates[code]))
    assert [c for c, template in templates.items() if fragment in template] == [code]
    assert fragment in (PAGE.parent.parent / "tests" / test_file).read_text()
