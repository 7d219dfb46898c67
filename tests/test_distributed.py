"""Real data-parallel runs: gloo process groups of 2 and 4 CPU processes, DDP and FSDP2.

Each process runs one optimizer step on an uneven share of one global batch (an empty
microbatch, a rank with zero weight); the gradients after the wrapper's reduction must equal
the single-process full-batch gradient, and every rank must log the full-batch loss. The
collectives are counted by wrapping torch.distributed's functions, which still run.
"""

from __future__ import annotations

import json

import pytest
import torch.multiprocessing as mp

from .distributed_worker import SCENARIOS, worker


@pytest.fixture(scope="module", params=[2, 4], ids=["2-ranks", "4-ranks"])
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    world_size = request.param
    out = tmp_path_factory.mktemp(f"ranks{world_size}")
    mp.spawn(worker, args=(world_size, str(out / "init"), str(out)), nprocs=world_size)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world_size)]


SCENARIO_IDS = [f"{w}/{n}" for w, n in SCENARIOS]
MODES = ["count_first", "scale_after"]


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
def test_scale_after_gives_the_gradient_of_count_first(runs: list[dict], scenario: str) -> None:
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
    assert all(rank[scenario][mode]["num_tokens"] == expected["expected_tokens"] for rank in runs)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("scenario", SCENARIO_IDS)
def test_one_collective_per_step(runs: list[dict], scenario: str, mode: str) -> None:
    for rank in runs:
        step = rank[scenario][mode]["step_collectives"]
        plain = rank[scenario]["plain_collectives"]
        added = {name: step.get(name, 0) - plain.get(name, 0) for name in {*step, *plain}}
        assert {name: n for name, n in added.items() if n} == {"all_reduce": 1}
        read = rank[scenario][mode]["read_collectives"]
        if mode == "scale_after":
            assert read == {}  # the loss sums travelled with the counts
        else:
            # The first step's loss, read before any next step: one all-reduce, with either
            # loss_logging (test_accumulator shows "next_step" reads cost none afterwards).
            assert read == {"all_reduce": 1}
