"""Real data-parallel runs: gloo process groups of 2 and 4 CPU processes, DDP and FSDP2.

Each process runs one optimizer step on an uneven share of one global batch (an empty
microbatch, a rank with zero weight), counting first with each loss_logging and scaling after;
the gradients after the wrapper's reduction must equal the single-process full-batch gradient,
and every rank must log the full-batch loss. The collectives are counted where they reach the
process group's backend (lossweight.testing.count_collectives); they still run. The processes
are started by tests/gloo.py, which kills them, and fails the test, if they outlive its
deadline.
"""

from __future__ import annotations

import pytest

from . import distributed_worker
from .distributed_worker import MODES, SCENARIOS, TERM_MODES
from .gloo import run_ranks, values
from .torch_range import needs_fsdp2_on_cpu


@pytest.fixture(scope="module", params=[2, 4], ids=["2-ranks", "4-ranks"])
def runs(request: pytest.FixtureRequest) -> list[dict]:
    # About 4 s with 2 ranks and 7 s with 4 on 2 cores; the deadline only stops a hang.
    return values(run_ranks(request.param, distributed_worker.run, deadline=40))


SCENARIO_IDS = [
    pytest.param(f"{w}/{n}", marks=[needs_fsdp2_on_cpu] if w == "fsdp" else [], id=f"{w}/{n}")
    for w, n in SCENARIOS
]
WRAPPERS = ["ddp", pytest.param("fsdp", marks=needs_fsdp2_on_cpu)]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("scenario", SCENARIO_IDS)
def test_gradients_equal_the_full_batch_reference(
    runs: list[dict], scenario: str, mode: str
) -> None:
    for rank in runs:
        assert rank[scenario][mode]["relative_error"] < 1e-10
        # The plain loss / accumulation_steps on the same split is visibly wrong, so the data
        # of this test does tell right from wrong weighting.
        assert rank[scenario]["plain_relative_error"] > 1e-3


@pytest.mark.parametrize("scenario", SCENARIO_IDS)
def test_end_clips_the_full_batch_gradient(runs: list[dict], scenario: str) -> None:
    # end(max_grad_norm=half the full-batch norm): the norm before clipping is the full
    # batch's, on every rank, and the gradient is the full batch's clipped to half of it.
    for rank in runs:
        assert rank[scenario]["clipped"]["norm_relative_error"] < 1e-10
        assert rank[scenario]["clipped"]["relative_error"] < 1e-10


@pytest.mark.parametrize("scenario", SCENARIO_IDS)
def test_scale_after_gives_the_gradient_of_count_first(runs: list[dict], scenario: str) -> None:
    # The largest difference of any mode (scale-after, count-first with next_step logging) to
    # count-first with end logging.
    for rank in runs:
        assert rank[scenario]["modes_relative_difference"] < 1e-12


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("scenario", SCENARIO_IDS)
def test_every_rank_logs_the_full_batch_loss_and_counts(
    runs: list[dict], scenario: str, mode: str
) -> None:
    logged = {rank[scenario][mode]["logged_loss"] for rank in runs}
    assert len(logged) == 1
    expected = runs[0][scenario]
    assert logged.pop() == pytest.approx(expected["expected_loss"], rel=1e-12)
    for rank in runs:
        seen = rank[scenario][mode]
        assert seen["num_tokens"] == expected["expected_tokens"]
        assert seen["num_samples"] == expected["expected_samples"]
        assert seen["is_empty_or_nonfinite"] == [False, False]
        assert seen["step"] == 1


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("scenario", SCENARIO_IDS)
def test_collectives_per_step(runs: list[dict], scenario: str, mode: str) -> None:
    # Beyond the wrapper's own: one all-reduce in a scale-after step (counts and loss) and in a
    # count-first step whose loss waits for the next reduction; two when the count-first
    # step's end() reduces its loss. Reading the result afterwards issues none in any mode.
    expected_step, expected_flush = {
        "count_first/end": (2, {}),
        "count_first/next_step": (1, {"all_reduce": 1}),
        "scale_after": (1, {}),
    }[mode]
    for rank in runs:
        seen = rank[scenario][mode]
        plain = rank[scenario]["plain_collectives"]
        step = seen["step_collectives"]
        added = {name: step.get(name, 0) - plain.get(name, 0) for name in {*step, *plain}}
        assert {name: n for name, n in added.items() if n} == {"all_reduce": expected_step}
        # flush() reduces a waiting next_step loss, and nothing when none waits.
        assert seen["flush_collectives"] == expected_flush
        assert seen["read_collectives"] == {}


@pytest.mark.parametrize("scenario", SCENARIO_IDS)
def test_a_next_step_loss_is_not_readable_before_it_travels(
    runs: list[dict], scenario: str
) -> None:
    for rank in runs:
        assert rank[scenario]["count_first/next_step"]["read_before_flush"].startswith(
            "RuntimeError: the loss of step 1 is not reduced yet"
        )
        assert rank[scenario]["count_first/end"]["read_before_flush"] == "ready"
        assert rank[scenario]["scale_after"]["read_before_flush"] == "ready"


@pytest.mark.parametrize("mode", TERM_MODES)
@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_several_terms_give_the_full_batch_gradient_and_losses(
    runs: list[dict], wrapper: str, mode: str
) -> None:
    # Every term weighted by its own count (tokens, sequences, float weights, a constant),
    # with an empty microbatch and a sequence without tokens in the step.
    for rank in runs:
        seen = rank[f"terms/{wrapper}/{mode}"]
        assert seen["relative_error"] < 1e-10
        assert seen["losses"].keys() == seen["expected"].keys()
        for name, value in seen["losses"].items():
            assert value == pytest.approx(seen["expected"][name], rel=1e-10)
        assert seen["loss"] == pytest.approx(sum(seen["expected"].values()), rel=1e-10)
        assert seen["counts"] == pytest.approx(seen["expected_counts"], rel=1e-14)
