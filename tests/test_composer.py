"""lossweight's Composer callback on 2 real gloo ranks (tests/composer_workers.py).

Composer pins torch < 2.7.1, so the default test environment (torch 2.13) does not install it
and these tests are skipped there; ``.ci/torch-range`` runs them, in its torch 2.6 environment.
Rank 1 holds few tokens and rows without any target; each step's gradient must equal the
single-process fp64 full-batch gradient, and the loss Composer logs the full-batch loss, for
every ``device_train_microbatch_size`` and when automatic microbatching retries a batch.
Composer's own token weighting on the same data is checked to be off, so that the data do tell
right from wrong.
"""

from __future__ import annotations

import math

import pytest

pytest.importorskip(
    "composer", reason="Composer is not installed: it pins torch < 2.7.1 (see .ci/torch-range)"
)

from . import composer_workers as workers
from .gloo import run_ranks, values
from .integration_workers import LOOP_STEPS

WORLD_SIZE = 2
EXACT = 1e-12  # fp64 end to end
FP32 = 1e-6


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    # About 40 s on 2 cores: 19 Trainer runs per rank; the deadline only stops a hang.
    names = list(workers.CONFIGS)
    return values(run_ranks(WORLD_SIZE, workers.composer_run, names, deadline=300))


def relative(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


LOSSWEIGHT = [name for name in workers.CONFIGS if name.startswith("lossweight")]


@pytest.mark.parametrize("name", LOSSWEIGHT)
def test_callback_gives_the_full_batch_gradient_and_loss(runs: list[dict], name: str) -> None:
    for outcome in runs:
        steps = outcome[name]
        assert len(steps) == LOOP_STEPS
        for step in steps:
            assert step["relative_error"] < EXACT, (name, step)
            assert relative(step["loss"], step["expected_loss"]) < EXACT, (name, step)


def test_a_retried_batch_begins_its_step_again(runs: list[dict]) -> None:
    # Automatic microbatching ran the first batch three times (8 rows, then 4, then 2 a
    # microbatch) and kept the smallest size: each attempt began a step, the last one ended.
    for outcome in runs:
        assert outcome["lossweight-sum/retried:steps_begun"] == LOOP_STEPS + 1


def test_composer_alone_counting_padding_is_off(runs: list[dict]) -> None:
    for outcome in runs:
        for size in (1, 3):
            for form in ("tensor", "dict"):
                steps = outcome[f"composer-padded-{form}/{size}"]
                assert min(step["relative_error"] for step in steps) > 0.1


def test_composer_alone_counting_targets_is_exact_to_float32_or_with_a_dict(
    runs: list[dict],
) -> None:
    for outcome in runs:
        for size in (1, 3):
            tensor, dictionary = (
                outcome[f"composer-targets-{f}/{size}"] for f in ("tensor", "dict")
            )
            assert max(step["relative_error"] for step in tensor) > 1e-9  # added into fp32
            assert max(step["relative_error"] for step in tensor) < FP32
            assert max(step["relative_error"] for step in dictionary) < EXACT


def test_composer_alone_logs_nan_for_a_step_with_an_empty_microbatch(runs: list[dict]) -> None:
    # With one row a microbatch, rank 1's rows without a target are microbatches of their own
    # in the first two steps: Composer logs NaN there, however it counts.
    for outcome in runs:
        for name in ("composer-targets-dict/1", "composer-padded-dict/1"):
            losses = [step["loss"] for step in outcome[name]]
            assert [math.isnan(loss) for loss in losses] == [True, True, False], name
        assert not any(math.isnan(step["loss"]) for step in outcome["lossweight-mean/1"])


def test_a_loss_the_callback_did_not_weigh_fails_on_every_rank() -> None:
    for outcome in values(run_ranks(WORLD_SIZE, workers.composer_misuse_run, deadline=120)):
        assert "went through no loss that LossweightCallback.scale_loss() returned" in (
            outcome["error"] or ""
        ), outcome
        assert "from the model's loss()" in outcome["error"]
