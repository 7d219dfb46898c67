"""Properties of the pure weighting math, with data-parallel ranks simulated as lists.

These tests compute with floats and the standard library only (the splits come from
lossweight.testing's strategies): the module under test must not need torch, and one test
checks that it does not even import it.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from lossweight import weighting
from lossweight.testing import strategies

# An item is one sample or token: its loss, or None when it is padding (no loss, no count).
items = st.lists(st.one_of(st.none(), st.floats(-50, 50, allow_nan=False)), min_size=0, max_size=40)


@st.composite
def split_steps(draw: st.DrawFn) -> tuple[list[float | None], list[list[list[float | None]]]]:
    """A step's items, and a random split of them into ranks of microbatches.

    Splits are uneven: ranks may hold no microbatch, microbatches may be empty or all padding.
    """
    step = draw(items)
    ranks = draw(strategies.splits(len(step), max_ranks=6, max_microbatches=4))
    return step, [[[step[i] for i in microbatch] for microbatch in rank] for rank in ranks]


def full_batch_mean(step: list[float | None]) -> float:
    losses = [x for x in step if x is not None]
    return math.fsum(losses) / len(losses) if losses else 0.0


def microbatch_loss(microbatch: list[float | None], loss_reduction: str) -> tuple[float, int]:
    """(loss, weight); the mean over zero items is taken as 0, as Accumulator.scale_loss does."""
    losses = [x for x in microbatch if x is not None]
    if loss_reduction == "sum":
        return math.fsum(losses), len(losses)
    return (math.fsum(losses) / len(losses) if losses else 0.0), len(losses)


def close(actual: float, expected: float) -> bool:
    return math.isclose(actual, expected, rel_tol=1e-12, abs_tol=1e-12)


divisors = st.sampled_from(["mean", "sum", 0.37, 3.0])


@settings(max_examples=500)
@given(split_steps(), st.sampled_from(["mean", "sum"]), divisors)
def test_scaled_gradients_equal_the_full_batch_mean(
    case: tuple[list[float | None], list[list[list[float | None]]]],
    loss_reduction: str,
    grad_reduction: str | float,
) -> None:
    # The loss is linear in the item losses, so the gradient of the step with respect to each
    # item's loss is the coefficient it ends up with: checking the weighted sum of losses, with
    # the ranks combined as a wrapper combines gradients (sum, then divide by D), checks them.
    step, ranks = case
    divisor = weighting.gradient_divisor(grad_reduction, len(ranks))  # type: ignore[arg-type]
    total = sum(microbatch_loss(mb, loss_reduction)[1] for rank in ranks for mb in rank)
    rank_sums = []
    for rank in ranks:
        terms = []
        for microbatch in rank:
            loss, weight = microbatch_loss(microbatch, loss_reduction)
            scale = weighting.backward_scale(weight, total, divisor, loss_reduction)  # type: ignore[arg-type]
            terms.append(scale * loss)
        rank_sums.append(math.fsum(terms))
    combined = math.fsum(rank_sums) / divisor
    assert close(combined, full_batch_mean(step))


@settings(max_examples=400)
@given(split_steps(), st.sampled_from(["mean", "sum"]))
def test_logged_loss_equals_the_full_batch_mean(
    case: tuple[list[float | None], list[list[list[float | None]]]], loss_reduction: str
) -> None:
    step, ranks = case
    pairs = [microbatch_loss(mb, loss_reduction) for rank in ranks for mb in rank]
    total = sum(weight for _, weight in pairs)
    loss_sum = math.fsum(
        weighting.loss_contribution(loss, weight, loss_reduction)  # type: ignore[arg-type]
        for loss, weight in pairs
    )
    assert close(weighting.weighted_mean(loss_sum, total), full_batch_mean(step))


@settings(max_examples=300)
@given(st.lists(st.integers(0, 10**6), max_size=10), st.integers(1, 64), divisors)
def test_each_scale_is_finite_and_zero_weight_scales_to_zero(
    weights: list[int], world_size: int, grad_reduction: str | float
) -> None:
    total = sum(weights)
    divisor = weighting.gradient_divisor(grad_reduction, world_size)  # type: ignore[arg-type]
    for weight in weights:
        scale = weighting.backward_scale(weight, total, divisor, "mean")
        assert math.isfinite(scale)
        assert (scale == 0) == (weight == 0)
        if total:
            assert close(scale, weight * divisor / total)


def test_equal_microbatches_on_one_rank_give_one_over_accumulation_steps() -> None:
    # The familiar special case: loss / accumulation_steps.
    assert weighting.backward_scale(7, 4 * 7, 1.0, "mean") == 0.25


def test_an_empty_step_scales_and_logs_zero() -> None:
    assert weighting.backward_scale(0, 0, 4.0, "mean") == 0
    assert weighting.backward_scale(0, 0, 4.0, "sum") == 4.0  # times a summed loss of 0
    assert weighting.weighted_mean(0.0, 0) == 0.0


def test_gradient_divisor() -> None:
    assert weighting.gradient_divisor("mean", 8) == 8.0
    assert weighting.gradient_divisor("sum", 8) == 1.0
    assert weighting.gradient_divisor(2.5, 8) == 2.5


def test_the_math_module_runs_without_torch() -> None:
    # Load the file on its own, as a project that vendors it would, with torch made unimportable.
    path = Path(weighting.__file__)
    code = (
        "import importlib.util, sys\n"
        "sys.modules['torch'] = None\n"
        f"spec = importlib.util.spec_from_file_location('weighting', {str(path)!r})\n"
        "module = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        "assert module.backward_scale(1, 4, 2.0, 'mean') == 0.5\n"
        "assert not any(name.startswith('lossweight') for name in sys.modules)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
