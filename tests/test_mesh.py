"""group= a DeviceMesh, on a real gloo world of 4 processes: dp x cp under DDP (with a token
mean, and with each sequence's mean averaged over the sequences, each cp rank holding half of
every sequence), HSDP under FSDP2 (dividing by the ranks, and summing), dp x tp (a tensor-
parallel MLP under FSDP2), and 2 pipeline stages x 2 dp ranks (torch.distributed.pipelining's
GPipe under DDP, 1F1B under FSDP2), each against the single-process fp64 full batch
(tests/mesh_worker.py), counting first and scaling after."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lossweight.parallel import fingerprint_of

from . import mesh_worker
from .gloo import run_ranks, values
from .torch_range import FSDP2_ON_CPU, SCALE_GRADS, needs_scale_grads


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    # One launch for every layout; the deadline only stops a hang.
    if not (FSDP2_ON_CPU and SCALE_GRADS):
        pytest.skip(
            f"the layouts run FSDP2 on CPU and pipeline schedules with scale_grads, which torch "
            f"{torch.__version__} lacks"
        )
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


@pytest.mark.parametrize("mode", mesh_worker.MODES)
@pytest.mark.parametrize("case", mesh_worker.TP_COUNTS_DIFFER)
def test_tensor_parallel_ranks_giving_different_counts_is_an_error_on_every_rank(
    runs: list[dict], case: str, mode: str
) -> None:
    # group=mesh["dp"] of a (dp, tp) mesh: the one all-reduce spans the tp ranks too, and
    # checks that the two ranks of each tp group gave the same counts, group by group.
    for rank in runs:
        raised = rank[f"tp_differ/{case}/{mode}"]
        assert "ranks that differ only along the mesh dimensions ('tp',)" in raised
        assert "gave different counts" in raised
        # Not "count over it: group=mesh['dp']", the group given: a dimension named tp is
        # refused in group=, so the fix is its name.
        assert "count over it: rename it (tp, etp and pp say its ranks hold the same" in raised


@pytest.mark.parametrize("mode", mesh_worker.MODES)
def test_tensor_parallel_ranks_that_agree_add_one_ranks_counts_and_loss(
    runs: list[dict], mode: str
) -> None:
    # Two steps with loss_logging="next_step", the second's loss reduced by flush(): each
    # group's counts and losses are added once (not once per tp rank), and D is the dp size.
    for rank in runs:
        seen = rank[f"tp_agree/{mode}"]
        assert seen["tokens"] == [3 + 5 + 0 + 4, 2]
        assert seen["losses"] == [2.0, 2.0]  # every microbatch's loss is 2 per token
        # The second step: 1 token on each dp rank, DDP-style mean over 2 dp ranks undone by
        # D = 2: each rank's gradient of its own loss, 2 * 1 * D / W = 2 * 2 / 2.
        assert seen["gradient"] == 2.0
        # The dp x tp process group made at the first begin() is held by torch alone (and
        # freed by destroy_process_group()), not by the Accumulator or its results.
        assert seen["holds_a_group"] is False
        # Counts given as numbers on one tp rank and as a tensor on the other agree.
        assert rank[f"tp_agree_as_tensor/{mode}"] == 3 + 5 + 0 + 4


@pytest.mark.parametrize("mode", mesh_worker.MODES)
def test_tensor_parallel_ranks_of_a_pipeline_stage_are_checked_and_counted_once(
    runs: list[dict], mode: str
) -> None:
    # group=mesh["pp", "dp"], pipeline="pp" of a (pp, dp, tp) mesh of 2 x 1 x 2: the last
    # stage's 2 tp ranks give 4 tokens each (counted once), or 4 and 5.
    for rank in runs:
        assert rank[f"pp_tp/agree/{mode}"] == {"tokens": 4, "loss": 2.0}
        assert "differ only along the mesh dimensions ('tp',)" in rank[f"pp_tp/differ/{mode}"]


# What every rank raises where group= leaves out a dimension whose ranks hold different data,
# whatever its name: the dimension named, and the group that counts over it.
LEFT_OUT = {
    "cp left out": ("('cp',)", "group=mesh['dp', 'cp']"),
    "hsdp replicate alone": ("('shard',)", "group=mesh['replicate', 'shard']"),
    "hsdp replicate alone, same counts": ("('shard',)", "group=mesh['replicate', 'shard']"),
    "tp under another name, own shard": ("('model',)", "not of its own shard"),
    "pp left out, zeros before the last": ("('pp',)", "pipeline='pp'"),
}


@pytest.mark.parametrize("mode", mesh_worker.MODES)
@pytest.mark.parametrize("case", LEFT_OUT)
def test_a_dimension_left_out_of_the_group_is_checked_by_its_data(
    runs: list[dict], case: str, mode: str
) -> None:
    dimension, fix = LEFT_OUT[case]
    for rank in runs:
        raised = rank[f"outside/{case}/{mode}"]
        assert f"differ only along the mesh dimensions {dimension}" in raised
        assert "which group= does not span, gave different counts or losses" in raised
        assert fix in raised


@pytest.mark.parametrize("mode", mesh_worker.MODES)
def test_a_tensor_parallel_dimension_of_any_name_counts_once(runs: list[dict], mode: str) -> None:
    # (dp, model) with group=mesh["dp"]: the "model" ranks of each dp rank give 4 and 5 tokens
    # of the whole batch; counted once (9, not 18), D = 2, a DDP-style mean over dp exact.
    for rank in runs:
        seen = rank[f"outside/tp under another name, whole batch/{mode}"]
        assert seen == {"tokens": 9, "loss": 2.0, "gradient": 2.0}


@pytest.mark.parametrize("mode", mesh_worker.MODES)
def test_a_flattened_group_spans_the_dimensions_it_was_made_of(runs: list[dict], mode: str) -> None:
    # group=mesh["dp", "cp"]._flatten(): its one dimension "dp_cp" spans dp and cp, found from
    # its ranks; the four ranks' 3, 5, 3 and 5 tokens are all counted.
    for rank in runs:
        assert rank[f"outside/flattened/{mode}"]["tokens"] == 16


@pytest.mark.parametrize("mode", mesh_worker.MODES)
def test_counting_over_ranks_that_hold_the_same_data_multiplies_the_count(
    runs: list[dict], mode: str
) -> None:
    # The default group of a (dp, tp) world: the tp ranks of each dp rank count the same 4 and
    # 5 tokens, so the reported count is twice the batch's (docs/distributed.md); the loss, and
    # the gradient of a wrapper that divides by the dp ranks, are the full batch's.
    for rank in runs:
        assert rank[f"outside/whole world under tp/{mode}"] == {
            "tokens": 18,
            "loss": 2.0,
            "gradient": 2.0,
        }


@pytest.mark.parametrize("layout", mesh_worker.UNDECLARED)
def test_pipeline_stages_the_accumulator_is_not_told_of_are_refused_on_every_rank(
    runs: list[dict], layout: str
) -> None:
    # GPipe over 2 stages x 2 dp ranks without pipeline=: the earlier stages compute no loss.
    # Counting first, they refuse in end() (as a microbatch no loss took), and the step's loss
    # reduction carries it to the last stages, whose loss read raises; scaling after, their
    # backward reached gradients without scale_loss(), which end() refuses on every rank.
    hint = "tell the Accumulator of the pipeline: group=mesh['pp', 'dp'], pipeline='pp'"
    earlier = [
        rank[f"{layout}/count-first"]
        for rank in runs
        if "end() was called after 0 of" in rank[f"{layout}/count-first"]
    ]
    assert len(earlier) == 2 and all(hint in raised for raised in earlier)
    told = [
        rank[f"{layout}/count-first"]
        for rank in runs
        if rank[f"{layout}/count-first"] not in earlier
    ]
    assert len(told) == 2
    assert all("2 of the 4 ranks of the reduction refused to end this step" in t for t in told)
    for rank in runs:
        raised = rank[f"{layout}/scale-after"]
        assert "found nonzero gradients that no scale_loss() produced" in raised
        assert hint in raised


def test_a_mesh_that_holds_part_of_a_root_dimension_is_refused(runs: list[dict]) -> None:
    # An _unflatten-ed (replicate, shard) mesh's root is the 1-D world: the whole mesh spans
    # it, but its replicate dimension alone holds part of the world's one dimension, whose
    # other ranks lossweight cannot tell apart (same data, or other data).
    for rank in runs:
        assert rank["unflattened_whole"] == []
        assert "holds part of a dimension of its root mesh" in rank["partial_refused"]
        assert "init_device_mesh(..., mesh_dim_names=...)" in rank["partial_refused"]


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


@needs_scale_grads
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


# Counts as the payload holds them: float64 integers (count limbs, flags, per-microbatch counts)
# or float weights.
numbers = st.lists(
    st.one_of(st.integers(0, 2**53), st.floats(0, 1e12, allow_nan=False)), min_size=1, max_size=30
)


@given(numbers, st.data())
def test_counts_that_differ_in_one_16_bit_piece_have_different_fingerprints(
    values: list[float], data: st.DataObject
) -> None:
    own = torch.tensor(values, dtype=torch.float64)
    other = own.clone()
    index = data.draw(st.integers(0, len(values) - 1))
    shift = data.draw(st.sampled_from([0, 16, 32, 48]))
    bits = other.view(torch.int64)
    piece = (int(bits[index]) >> shift) & 0xFFFF
    changed = data.draw(st.integers(0, 0xFFFF).filter(lambda p: p != piece))
    bits[index] += (changed - piece) << shift
    print_own, print_other = fingerprint_of(own), fingerprint_of(other)
    assert print_own == fingerprint_of(own.clone())
    assert 0 <= int(print_own) < 2**20
    assert print_own != print_other
