"""group= a DeviceMesh, on a real gloo world of 4 processes: dp x cp under DDP (with a token
mean, and with each sequence's mean averaged over the sequences, each cp rank holding half of
every sequence), HSDP under FSDP2 (dividing by the ranks, and summing), dp x tp (a tensor-
parallel MLP under FSDP2), and 2 pipeline stages x 2 dp ranks (torch.distributed.pipelining's
GPipe under DDP, 1F1B under FSDP2), each against the single-process fp64 full batch
(tests/mesh_worker.py), counting first and scaling after."""

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


@pytest.mark.parametrize("mode", mesh_worker.MODES)
def test_a_schedule_that_divides_unannounced_is_wrong(runs: list[dict], mode: str) -> None:
    # The control of "pp x dp, GPipe dividing": the same run without framework_divides_loss_by
    # gets half the gradient (2 microbatches), which the exact runs above would have caught.
    for rank in runs:
        assert rank[f"{mesh_worker.UNANNOUNCED}/{mode}"]["relative_error"] > 0.4


def test_an_earlier_pipeline_stage_cannot_scale_a_loss(runs: list[dict]) -> None:
    first_stage = [rank for rank in runs if "first_stage_scales" in rank]
    assert len(first_stage) == 2  # the pp rank 0 of each dp rank
    for rank in first_stage:
        assert "on a rank whose pipeline stage is not the last one" in rank["first_stage_scales"]


def test_a_pipeline_dimension_is_refused_unless_named_by_pipeline(runs: list[dict]) -> None:
    for rank in runs:
        assert "has the mesh dimension 'pp'" in rank["pp_refused"]
        assert "pipeline='pp'" in rank["pp_refused"]


@pytest.mark.parametrize("mode", mesh_worker.MODES)
@pytest.mark.parametrize("layout", mesh_worker.PIPELINES)
def test_pipeline_stages_need_no_collective_of_their_own(
    runs: list[dict], layout: str, mode: str
) -> None:
    # The stages share the step's one reduction of counts (over pp x dp): what a step of a
    # single stage issues, and nothing to carry totals from the last stage to the others.
    # Counting first, begin() reduces the counts and end() the loss; scaling after, end() both.
    expected = {"all_reduce": 2 if mode == "count-first" else 1}
    for rank in runs:
        assert rank[f"{layout}/{mode}"]["lossweight_collectives"] == expected


def test_earlier_stages_giving_zeros_leave_the_reported_count_known(runs: list[dict]) -> None:
    # Counting first, the last stage reports num_samples beside num_tokens and the first stage
    # gives zero tokens only; the step's rows (2 dp ranks x 4) reach every rank.
    for rank in runs:
        for layout in mesh_worker.PIPELINES:
            assert rank[f"{layout}/count-first"]["samples"] == 8


def test_clipping_in_end_is_refused_under_a_pipeline(runs: list[dict]) -> None:
    for rank in runs:
        assert "under pipeline= each stage holds a part of the model" in rank["pipeline_clip"]


@pytest.mark.parametrize("told", [True, False])
def test_torchs_shape_inference_call_takes_no_microbatch(told: bool) -> None:
    (outcome,) = values(run_ranks(1, mesh_worker.one_stage, told, deadline=60))
    if told:  # a pipeline of one stage, told: exact
        assert outcome["relative_error"] < 1e-12, outcome
    else:  # not told: the call would count microbatch 0 twice, so it is refused
        assert (
            "called by torch.distributed.pipelining to infer a stage's shapes" in outcome["refused"]
        )
        assert "pipeline='pp'" in outcome["refused"]
