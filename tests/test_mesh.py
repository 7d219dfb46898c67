"""group= a DeviceMesh, on a real gloo world of 4 processes: dp x cp under DDP (with a token
mean, and with each sequence's mean averaged over the sequences, each cp rank holding half of
every sequence), HSDP under FSDP2, and dp x tp (a tensor-parallel MLP under FSDP2), each
against the single-process fp64 full batch (tests/mesh_worker.py), counting first and scaling
after."""

from __future__ import annotations

import pytest

from . import mesh_worker
from .gloo import run_ranks, values


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    # One launch for every layout; the deadline only stops a hang.
    return values(run_ranks(4, mesh_worker.run, deadline=120))


@pytest.mark.parametrize("mode", mesh_worker.MODES)
@pytest.mark.parametrize("layout", mesh_worker.LAYOUTS)
def test_the_gradient_and_the_loss_are_the_full_batch_ones(
    runs: list[dict], layout: str, mode: str
) -> None:
    for rank in runs:
        seen = rank[f"{layout}/{mode}"]
        assert seen["relative_error"] < 1e-10, seen
        # Tokens are counted exactly; the sequence mean's count is a sum of each rank's float
        # share of each sequence.
        assert abs(seen["tokens"] - seen["expected_tokens"]) <= 1e-12 * seen["expected_tokens"]
        assert abs(seen["loss"] - seen["expected_loss"]) < 1e-12 * abs(seen["expected_loss"])


def test_a_tensor_parallel_dimension_in_the_count_group_is_refused(runs: list[dict]) -> None:
    for rank in runs:
        assert "has the mesh dimension 'tp', whose ranks hold the same data" in rank["tp_refused"]
        assert "pass the data-parallel dimensions only" in rank["tp_refused"]


def test_a_mesh_of_unnamed_dimensions_is_refused(runs: list[dict]) -> None:
    for rank in runs:
        assert "of several dimensions without names; name them" in rank["unnamed_refused"]
