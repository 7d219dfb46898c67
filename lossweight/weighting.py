"""The weighting math of one optimizer step, with no dependencies.

It imports nothing, not even the rest of lossweight: copy it alone, or property-test it
without torch. ``docs/math.md`` derives every formula. For one step: ``weight`` is a
microbatch's weight ``w`` (the items its loss covers); ``total`` the global weight ``W``, the
sum of ``w`` over every microbatch of every rank; ``divisor`` is ``D``, what the data-parallel
wrapper divides the ranks' summed gradients by; ``loss_reduction`` whether a microbatch's loss
is the mean or the sum of its items' losses.

Every function is branch-free arithmetic on Python numbers or, just as well, on torch tensors,
element-wise on their device with no read back to the host: the step applies these functions.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol

LossReduction = Literal["mean", "sum"]
GradReduction = Literal["mean", "sum"]


class Quantity(Protocol):
    """A Python number, or anything with the same arithmetic (a torch tensor)."""

    def __add__(self, other: Any, /) -> Any: ...
    def __mul__(self, other: Any, /) -> Any: ...
    def __truediv__(self, other: Any, /) -> Any: ...
    def __rtruediv__(self, other: Any, /) -> Any: ...


def nonzero_total(total: Quantity) -> Any:
    """``total``, or 1 where ``total`` is 0.

    Dividing by this instead of ``total`` keeps an empty step finite: every weight of an empty
    step is 0, so its scale factors and its weighted mean come out 0 instead of 0/0. For integer
    counts it changes nothing else, since a non-empty total is at least 1. It is written as
    ``total + (total == 0)`` rather than ``max(total, 1)`` so that a tensor never has its value
    read by Python.
    """
    return total + (total == 0)


def gradient_divisor(grad_reduction: GradReduction | float, world_size: int) -> float:
    """``D``: what the data-parallel wrapper divides the ranks' summed gradients by.

    ``"mean"`` (DDP, FSDP) divides by the number of ranks, ``"sum"`` by 1, and a number is
    the divisor itself.
    """
    if grad_reduction == "mean":
        return float(world_size)
    if grad_reduction == "sum":
        return 1.0
    return float(grad_reduction)


def backward_scale(
    weight: Quantity, total: Quantity, divisor: float, loss_reduction: LossReduction
) -> Any:
    """The factor ``s`` to back-propagate a microbatch's loss with.

    ``s = w * D / W`` for a mean loss and ``s = D / W`` for a summed one, so that the gradients
    of all microbatches of all ranks, summed and divided by ``D``, are the gradient of the
    step's weighted mean loss. Zero for a mean loss when the step is empty (a summed loss's
    factor is then ``D``, times losses that are all 0). Rounded once.
    """
    if loss_reduction == "mean":
        return weight * divisor / nonzero_total(total)
    # weight * 0 + D is D, shaped and placed like the weight: for tensors the division is then
    # tensor by tensor, rounded once (a number divided by a tensor is computed as a reciprocal
    # times the number, rounded twice).
    return (weight * 0 + divisor) / nonzero_total(total)


def loss_contribution(loss: Quantity, weight: Quantity, loss_reduction: LossReduction) -> Any:
    """A microbatch's term in the numerator of the step's weighted mean loss.

    ``w * l`` for a mean loss (the sum of its items' losses), ``l`` itself for a summed one.
    """
    if loss_reduction == "mean":
        return weight * loss
    return loss


def weighted_mean(loss_sum: Quantity, total: Quantity) -> Any:
    """The step's loss ``L``: the global sum of loss contributions over the global weight.

    Zero when the step is empty.
    """
    return loss_sum / nonzero_total(total)


def gradient_correction(total: Quantity, estimate: Quantity) -> Any:
    """What scale-after mode multiplies the step's gradients by, once ``W`` is known.

    Back-propagating each loss with ``backward_scale(w, estimate, D, ...)`` and multiplying the
    gradients by ``estimate / W`` gives the gradients of ``backward_scale(w, W, D, ...)``: the
    provisional scales only had the wrong global weight, and it appears once, in a common
    factor. Both totals are guarded as in :func:`nonzero_total`.
    """
    # total * 0 + E is E, placed like the total: a tensor by a tensor, rounded once.
    return (total * 0 + nonzero_total(estimate)) / nonzero_total(total)
