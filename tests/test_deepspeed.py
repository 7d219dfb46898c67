"""DeepSpeed engines on a real 2-rank gloo world: ZeRO stages 0 to 3, both backward calls,
uneven and short windows, a rank without rows; each step's gradient against the full batch.

The cases share one world (tests/deepspeed_workers.py); DeepSpeed keeps float32 master
gradients, so gradients are compared at float32 precision.
"""

from __future__ import annotations

import tempfile

import pytest

pytest.importorskip("deepspeed")

from . import deepspeed_workers as workers
from .gloo import run_ranks, values

FP32 = 1e-6  # relative, as the suite compares float32 results with a float64 reference
UPDATE = 1e-5  # a gradient read from a float32 update of learning rate LR


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    # About 40 s on 2 cores (10 engines); the deadline only stops a hang.
    return values(run_ranks(2, workers.run, deadline=240))


CASES = [f"zero{stage}/{backward}" for stage in range(4) for backward in ("engine", "plain")]


@pytest.mark.parametrize("case", [c for c in CASES if c != "zero0/plain"])
def test_every_step_has_the_full_batch_gradient_and_loss(runs: list[dict], case: str) -> None:
    for rank in runs:
        seen = rank[case]
        assert len(seen["errors"]) == len(workers.WINDOWS)  # the short window is a step too
        assert max(seen["errors"]) < FP32, seen["errors"]
        assert seen["losses"] == pytest.approx(rank["expected_losses"], rel=FP32)


@pytest.mark.parametrize("stage", range(4))
def test_deepspeeds_own_collectives_do_not_change(runs: list[dict], stage: int) -> None:
    # Counted by DeepSpeed's comms logger over two steps: lossweight reduces through
    # torch.distributed (one all-reduce in begin(), one in end() with loss_logging="end"), and
    # DeepSpeed's gradient reduction is the same with it as without it.
    for rank in runs:
        seen = rank[f"zero{stage}/collectives"]
        assert seen["deepspeed"] and seen["with_lossweight"] == seen["deepspeed"], seen
        # lossweight.testing counts every collective: lossweight adds its 2 all-reduces a step,
        # and DeepSpeedAccumulator one of the ranks' numbers of microbatches.
        added = dict(seen["all_with_lossweight"])
        added["all_reduce"] -= 2 * 3
        assert {name: n for name, n in added.items() if n} == seen["all_plain"], seen


@pytest.mark.parametrize("case", ["zero1/sum-allreduce", "zero0/after-abandon"])
def test_a_summing_engine_and_an_abandoned_step_stay_exact(runs: list[dict], case: str) -> None:
    # gradient_allreduce_op "sum": the engine sums the ranks' gradients, and the Accumulator
    # takes that from it. At stage 0, abandon() drops the step's partial gradients.
    for rank in runs:
        assert len(rank[case]) == 2 and max(rank[case]) < FP32, rank[case]


def test_the_engines_division_left_in_place_is_visibly_wrong(runs: list[dict]) -> None:
    # A plain Accumulator does not undo DeepSpeed's division by the 3 accumulation steps: the
    # comparison tells right from wrong.
    for rank in runs:
        assert min(rank["zero2/not-undone"]) > 0.5, rank["zero2/not-undone"]


def test_deepspeed_refuses_a_plain_backward_at_stage_0(runs: list[dict]) -> None:
    for rank in runs:
        assert "Direct calls to tensor.backward() are not supported" in rank["zero0/plain"]["error"]


def test_scale_after_at_stage_0(runs: list[dict]) -> None:
    for rank in runs:
        seen = rank["zero0/scale-after"]
        assert len(seen["errors"]) == 2 and max(seen["errors"]) < FP32, seen["errors"]
        assert seen["losses"] == pytest.approx(rank["expected_losses"][:2], rel=FP32)


@pytest.mark.parametrize(
    ("case", "message"),
    [
        (
            "divides_given",
            "DeepSpeedAccumulator got framework_divides_loss_by=3, which the engine decides",
        ),
        ("scale_after_zero2", "ZeRO stage 2 moves the gradients into its partitions"),
        ("early_end", "came before DeepSpeed's gradient accumulation boundary"),
        ("short_window_by_hand", "does not make the step's last microbatch (1) its boundary"),
        ("steps_changed", "the engine's gradient accumulation steps changed from 3 to 2"),
        ("abandoned_zero2", "ZeRO stage 2 keeps that step's partial gradients"),
        ("compiled", "DeepSpeedAccumulator.scale_loss() runs eagerly"),
    ],
)
def test_misuse_is_refused(runs: list[dict], case: str, message: str) -> None:
    for rank in runs:
        assert message in rank["misuse"][case]


@pytest.fixture(scope="module")
def strays() -> list[dict]:
    # About 15 s on 2 cores (8 engines); the deadline only stops a hang.
    return values(run_ranks(2, workers.stray_run, list(workers.STRAYS), deadline=240))


@pytest.mark.parametrize("case", ["documented/long", "end-after-step/short"])
def test_a_window_of_other_length_than_the_engines_is_one_exact_update(
    strays: list[dict], case: str
) -> None:
    # Counting first, scale_loss() places the boundary: a window of 4 or 2 microbatches under
    # 3 accumulation steps is one update, and end() after that engine.step() is exact too.
    for rank in strays:
        seen = rank[case]
        assert seen["error"] is None and len(seen["errors"]) == 2, seen
        assert max(seen["errors"]) < UPDATE, seen["errors"]


@pytest.mark.parametrize(
    ("case", "message"),
    [
        # backward_scale(i) leaves the boundary to DeepSpeed's count: 4 microbatches under 3
        # accumulation steps would update after the third, and after a short window of 2
        # the count would update after the next window's first.
        ("by-hand/long", "makes microbatch 2 of the step's 4 its boundary"),
        ("by-hand/after-short", "makes microbatch 0 of the step's 3 its boundary"),
        ("scale-wrt-gas-false", "engine.backward(loss, scale_wrt_gas=False) in step 1"),
        ("unmanaged/documented", '"managed_gradient_accumulation": true (the default)'),
        ("unmanaged/caller-owned", '"managed_gradient_accumulation": true (the default)'),
        # Scaling after, 2 microbatches and an engine.step() each: DeepSpeed's count reached
        # no boundary, so nothing was reduced or updated.
        ("end-after-step/scale-after", "its last microbatch (1) was not the boundary"),
        # Scaling after, 4 microbatches under 3 accumulation steps, stepped at the boundary
        # only after end(): DeepSpeed reduced at the third, and the fourth came after it.
        (
            "step-at-end/scale-after-long",
            "in step 1, microbatch 2 was DeepSpeed's accumulation boundary",
        ),
    ],
)
def test_a_loop_the_engine_would_step_wrongly_is_refused_before_the_update(
    strays: list[dict], case: str, message: str
) -> None:
    for rank in strays:
        seen = rank[case]
        assert seen["error"] is not None and message in seen["error"], seen
        # Every window before the refusal was exact, and the refused one updated nothing.
        assert all(error < UPDATE for error in seen["errors"]), seen["errors"]
        assert seen["unchanged"] is True, seen


@pytest.mark.parametrize(
    ("case", "message"),
    [
        # Scaling after, an engine.step() after each microbatch: DeepSpeed's count reaches its
        # boundary at the third microbatch and updates with provisional gradients, which end()
        # can no longer rescale; the next microbatch, or end(), says so.
        (
            "end-after-step/scale-after-long",
            "DeepSpeed updated the parameters during step 1, at the engine.step() after "
            "microbatch 2, before microbatch 3",
        ),
        (
            "end-after-step/scale-after-full",
            "end() of step 1 came after the engine.step() that updated the parameters",
        ),
    ],
)
def test_an_update_inside_a_scale_after_step_is_reported(
    strays: list[dict], case: str, message: str
) -> None:
    for rank in strays:
        seen = rank[case]
        assert seen["error"] is not None and message in seen["error"], seen


@pytest.mark.parametrize("stage", [0, 2])
def test_uneven_numbers_of_microbatches_are_refused_on_every_rank(stage: int) -> None:
    # At stage 2 the ranks' reductions would pair wrongly (gloo aborts); at stage 0 the ranks'
    # engines would count different micro steps from then on.
    outcomes = values(run_ranks(2, workers.uneven_run, stage, deadline=120))
    for rank, seen in enumerate(outcomes):
        declared = len(workers.UNEVEN[0][rank])
        assert seen["error"] is not None, seen
        assert f"this rank declared {declared} microbatches for step 1" in seen["error"]
        assert "the 2 ranks declared 2.5 on average" in seen["error"]
        assert seen["unchanged"], seen


@pytest.fixture(scope="module")
def hf_runs() -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        return values(run_ranks(2, workers.hf_run, tmp, deadline=240))


@pytest.mark.parametrize("model", ["llama", "no-loss-kwargs"])
def test_hf_trainer_under_deepspeed_is_exact(hf_runs: list[dict], model: str) -> None:
    # A forward without loss kwargs is transformers #45305's case.
    for rank in hf_runs:
        seen = rank[model]
        assert seen["error"] < FP32, seen
        assert seen["loss"] == pytest.approx(seen["expected_loss"], rel=FP32)
