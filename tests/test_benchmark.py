"""The benchmark's invariants that are not timings, from a real 2-rank gloo run of it.

Timings are left to the benchmark itself (docs/performance.md); what it counts is checked
here: lossweight's collectives per step (one with the logged loss included, or two when a
count-first step's end() reduces its loss), their bytes, and no host sync on its path, beside
the documented counts of the other trainers' patterns; and the same figures for lossweight
in each parallel layout.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import pytest

from benchmarks import layouts as layouts_run
from benchmarks.overhead import walk_overhead
from benchmarks.report import markdown
from benchmarks.runner import measure
from lossweight.terms import Layout, Term

from .gloo import run_ranks, values
from .torch_range import TENSOR_PARALLEL_CHECKED

# The benchmark's ranks run under the test harness, which kills them past this deadline.
DEADLINE = 300


@pytest.fixture(scope="module")
def counts() -> dict:
    settings = argparse.Namespace(
        steps=2,
        warmup=1,
        microbatches=3,
        rows=2,
        context=16,
        vocabulary=32,
        width=16,
        layers=1,
        threads=2,
        seed=0,
    )
    with tempfile.TemporaryDirectory() as scratch:  # measure() makes its own process group
        run_ranks(2, measure, scratch, settings, init_group=False, deadline=DEADLINE)
        return json.loads(Path(scratch, "results.json").read_text())


def test_lossweight_issues_its_collectives_and_no_host_sync_per_step(counts: dict) -> None:
    # float64: agreement codes, count limbs, loss sums
    payload = Layout((Term("loss", "sum"),)).length * 8
    for name, reductions in [
        ("lossweight count-first", 1),  # the loss rides on the next step's counts
        ("lossweight count-first, loss in end()", 2),
        ("lossweight scale-after", 1),  # the loss travels with the counts
    ]:
        assert counts[name]["collectives_per_step"] == {"all_reduce": reductions}
        assert counts[name]["bytes_per_step"] == reductions * payload
        assert counts[name]["host_reads_per_step"] == 0


def test_more_terms_travel_in_the_same_one_collective(counts: dict) -> None:
    # Every payload has slots for 8 terms (ranks that differ in their terms then disagree in
    # the digest, and cannot hang on payloads of different lengths): 656 bytes.
    kinds = [Term("lm", "sum"), Term("aux", "mean", "samples")]
    kinds += [Term("kl", "sum", "weight_sum"), Term("dr", "sum", 1e4)]
    for terms in (2, 4):
        figures = counts[f"lossweight count-first, {terms} terms"]
        assert figures["collectives_per_step"] == {"all_reduce": 1}
        assert figures["bytes_per_step"] == Layout(tuple(kinds[:terms])).length * 8
        assert figures["bytes_per_step"] == 656  # slots for 8 terms, whatever the number
        assert figures["host_reads_per_step"] == 0


def test_the_other_patterns_cost_what_their_math_says(counts: dict) -> None:
    assert counts["baseline: loss / k"]["collectives_per_step"] == {}
    assert counts["baseline: loss / k"]["host_reads_per_step"] == 0
    hf = counts["HF Trainer pattern"]
    assert hf["collectives_per_step"] == {"all_gather_into_tensor": 2}
    assert hf["host_reads_per_step"] == 3  # one NaN check per microbatch
    for name in ("Composer pattern", "torchtune pattern"):
        assert counts[name]["collectives_per_step"] == {"all_reduce": 2}
        assert counts[name]["host_reads_per_step"] == 2


def test_no_parallel_layout_adds_a_collective_or_a_host_sync() -> None:
    # benchmarks.layouts on 4 gloo processes: every layout's step issues what plain data
    # parallelism's does, on every rank (a figure that differs by rank is not one dict).
    # A tensor-parallel mesh adds its agreement check to the same reduction, 32 bytes per
    # tensor-parallel group (2 groups here): the sums of the fingerprints of the counts, of the
    # losses, and of their squares; a pipeline adds nothing, its stages sharing it.
    layouts = layouts_run.combined(
        values(run_ranks(4, layouts_run.rank_figures, deadline=DEADLINE))
    )
    plain = layouts["dp 4 (a process group)"]
    assert plain["count first"] == {"calls": {"all_reduce": 1}, "bytes": 656, "host_syncs": 0}
    assert plain["count first, loss in end()"]["calls"] == {"all_reduce": 2}
    assert plain["scale after"] == plain["count first"]
    for mode, figures in plain.items():
        assert layouts["dp 2 x cp 2"][mode] == figures
        assert layouts["pp 2 x dp 2"][mode] == figures
        reductions = figures["calls"]["all_reduce"]
        tensor_parallel = layouts["dp 2 x tp 2"][mode]
        check = reductions * 2 * 32 if TENSOR_PARALLEL_CHECKED else 0  # none on torch 2.6
        assert tensor_parallel == {**figures, "bytes": figures["bytes"] + check}


def test_the_graph_walk_is_reported_beside_a_forward_and_backward_at_three_depths() -> None:
    settings = argparse.Namespace(vocabulary=32, context=16, width=16, layers=1, rows=2)
    walks = walk_overhead(settings, repeats=1)
    assert list(walks) == ["1 layers", "4 layers", "16 layers"]
    assert all(t["forward_backward_ms"] > 0 for t in walks.values())
    assert all(set(t) == {"walk_ms", "counters_ms", "forward_backward_ms"} for t in walks.values())
    overhead = {"per_call_us": {}, "per_step_us": {}, "group_per_step_us": {}, "walk": walks}
    table = markdown({}, overhead, {})
    assert "| scale after, 1 process | graph walk per microbatch, ms |" in table
    assert table.count("| GPT, ") == 3
