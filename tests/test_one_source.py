"""Every number a step applies comes from lossweight.weighting: change a formula there and the
step's gradient or logged loss changes with it.

The torch-free property tests (tests/test_weighting.py) check the formulas of weighting.py. They
cover what a step really applies only if the step computes nothing itself: a factor, a
correction or a logged loss re-derived in torch code elsewhere would keep its old value when
the formula here changes. So each test below replaces one function of weighting.py by itself
times a marker, and checks that the marker shows up in exactly what that function is meant to
produce, in both modes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from lossweight import Accumulator, weighting

COUNTS = [3, 0, 1]  # the step's mean over 4 items of loss p has gradient 1


def step(scale_after: bool, loss_reduction: str) -> tuple[float, float]:
    """(the gradient of p, the logged loss) of one step whose exact values are (1, 2)."""
    p = torch.zeros((), dtype=torch.float64, requires_grad=True)
    acc = Accumulator(loss_reduction=loss_reduction)  # type: ignore[arg-type]
    if scale_after:
        acc.begin(parameters=[p])
    else:
        acc.begin(num_tokens=COUNTS)
    for count in COUNTS:
        loss = (p + 2.0) * (count if loss_reduction == "sum" else 1)
        given = {"num_tokens": count} if scale_after else {}
        acc.scale_loss(loss, **given).backward()
    result = acc.end()
    assert p.grad is not None
    return p.grad.item(), result.loss.item()


def marked(monkeypatch: pytest.MonkeyPatch, name: str, marker: float) -> None:
    """weighting.<name> now returns its value times ``marker``."""
    original: Callable[..., Any] = getattr(weighting, name)
    monkeypatch.setattr(weighting, name, lambda *args: original(*args) * marker)


MODES = [(False, "sum"), (False, "mean"), (True, "sum"), (True, "mean")]
IDS = ["count-first sum", "count-first mean", "scale-after sum", "scale-after mean"]


@pytest.mark.parametrize(("scale_after", "loss_reduction"), MODES, ids=IDS)
def test_the_unmarked_step_is_exact(scale_after: bool, loss_reduction: str) -> None:
    assert step(scale_after, loss_reduction) == pytest.approx((1.0, 2.0), rel=1e-15)


@pytest.mark.parametrize(("scale_after", "loss_reduction"), MODES, ids=IDS)
def test_the_factors_come_from_backward_scale(
    monkeypatch: pytest.MonkeyPatch, scale_after: bool, loss_reduction: str
) -> None:
    # Count first, the factor is final; scale after, the provisional factor's marker survives
    # the correction, which does not know of it.
    marked(monkeypatch, "backward_scale", 4.0)
    assert step(scale_after, loss_reduction) == pytest.approx((4.0, 2.0), rel=1e-15)


@pytest.mark.parametrize("loss_reduction", ["sum", "mean"])
def test_the_correction_comes_from_gradient_correction(
    monkeypatch: pytest.MonkeyPatch, loss_reduction: str
) -> None:
    marked(monkeypatch, "gradient_correction", 4.0)
    assert step(True, loss_reduction) == pytest.approx((4.0, 2.0), rel=1e-15)
    assert step(False, loss_reduction) == pytest.approx((1.0, 2.0), rel=1e-15)  # untouched


@pytest.mark.parametrize(("scale_after", "loss_reduction"), MODES, ids=IDS)
def test_the_divisor_comes_from_gradient_divisor(
    monkeypatch: pytest.MonkeyPatch, scale_after: bool, loss_reduction: str
) -> None:
    marked(monkeypatch, "gradient_divisor", 4.0)
    assert step(scale_after, loss_reduction) == pytest.approx((4.0, 2.0), rel=1e-15)


@pytest.mark.parametrize(("scale_after", "loss_reduction"), MODES, ids=IDS)
@pytest.mark.parametrize("name", ["loss_contribution", "weighted_mean"])
def test_the_logged_loss_comes_from_the_loss_formulas(
    monkeypatch: pytest.MonkeyPatch, name: str, scale_after: bool, loss_reduction: str
) -> None:
    marked(monkeypatch, name, 4.0)
    assert step(scale_after, loss_reduction) == pytest.approx((1.0, 8.0), rel=1e-15)
