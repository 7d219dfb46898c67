"""The weighting math of one optimizer step, with no dependencies.

It imports nothing, not even the rest of lossweight: copy it alone, or property-test it
without torch. ``docs/math.md`` derives every formula. ``weight`` is a microbatch's weight
``w`` (the items its loss covers), ``total`` the step's global weight ``W`` (the sum of ``w``
over every rank), ``divisor`` is ``D`` (what the data-parallel wrapper divides the ranks' summed
gradients by). Every function is branch-free arithmetic on Python numbers or, just as well, on
torch tensors, element-wise on their device with no read back to the host.
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
    """``total``, or 1 where ``total`` is 0: an empty step's factors and mean come out 0, not
    0/0. Arithmetic rather than ``max(total, 1)``, so that a tensor is never read by Python."""
    return total + (total == 0)


def gradient_divisor(grad_reduction: GradReduction | float, world_size: int) -> float:
    """``D``: the number of ranks for ``"mean"`` (DDP, FSDP), 1 for ``"sum"``, or the number
    given."""
    if grad_reduction == "mean":
        return float(world_size)
    if grad_reduction == "sum":
        return 1.0
    return float(grad_reduction)


def backward_scale(
    weight: Quantity, total: Quantity, divisor: float, loss_reduction: LossReduction
) -> Any:
    """The factor ``s`` to back-propagate a microbatch's loss with: ``w * D / W`` for a mean
    loss, ``D / W`` for a summed one (``D`` when the step is empty, times losses that are all
    0). Rounded once."""
    if loss_reduction == "mean":
        return weight * divisor / nonzero_total(total)
    # weight * 0 + D is D, shaped and placed like the weight: for tensors the division is then
    # tensor by tensor, rounded once (a number divided by a tensor is computed as a reciprocal
    # times the number, rounded twice).
    return (weight * 0 + divisor) / nonzero_total(total)


def loss_contribution(loss: Quantity, weight: Quantity, loss_reduction: LossReduction) -> Any:
    """A microbatch's term in the numerator of the step's weighted mean loss: ``w * l`` for a
    mean loss, ``l`` itself for a summed one."""
    if loss_reduction == "mean":
        return weight * loss
    return loss


def weighted_mean(loss_sum: Quantity, total: Quantity) -> Any:
    """The step's loss ``L``: the global sum of loss contributions over ``W`` (0 if empty)."""
    return loss_sum / nonzero_total(total)


def gradient_correction(total: Quantity, estimate: Quantity) -> Any:
    """``E / W``, what a scale-after step multiplies its gradients by once ``W`` is known: its
    losses were scaled by ``backward_scale(w, E, D, ...)``. Both are guarded as by
    :func:`nonzero_total`."""
    # total * 0 + E is E, placed like the total: a tensor by a tensor, rounded once.
    return (total * 0 + nonzero_total(estimate)) / nonzero_total(total)
