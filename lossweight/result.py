"""StepResult: what a finished optimizer step reports, identical on every rank."""

from __future__ import annotations

import torch

from . import weighting
from .errors import error
from .payload import Reduction


class PendingLoss:
    """A count-first step's loss sum waiting, with ``loss_logging="next_step"``, for the later
    reduction that carries it (``reduction``, set when that one starts)."""

    def __init__(self, step: int, loss_sum: torch.Tensor, collective: object) -> None:
        self.step, self.loss_sum, self.collective = step, loss_sum, collective
        self.reduction: Reduction | None = None
        self.dropped = ""  # why it will never be reduced, once it will not


class StepResult:
    """What one optimizer step reports: the same values on every rank, whatever each held.

    ``step`` is the index of the step (an int, counted from 1 by its Accumulator); every other
    value is a 0-dim tensor on the device the counts were reduced on (the GPU under NCCL), or
    a dict of them. Reading one never issues a collective: it may wait for a reduction that
    every rank started in ``begin()`` or ``end()``, and on a GPU that wait is a stream
    dependency, not a host sync. Call ``.item()`` when you want a Python number, on any rank
    or on one only.

    ``grad_norm`` is the total norm of the step's gradients before ``end(max_grad_norm=...)``
    clipped them, and None when ``end()`` did not clip.
    """

    grad_norm: torch.Tensor | None = None  # set by an end() that clips

    def __init__(
        self, step: int, counts: Reduction, loss: Reduction | PendingLoss, unrecorded: list[int]
    ) -> None:
        self.step, self._counts, self._loss, self._unrecorded = step, counts, loss, unrecorded

    def __repr__(self) -> str:
        return f"StepResult(step={self.step}, device={self._counts.device})"

    @property
    def num_samples(self) -> torch.Tensor:
        """The global number of samples (int64); -1 when samples normalise no term and they
        are not known for all of the step: no rank gave ``num_samples``, or a rank with a
        microbatch did not."""
        return self._counts.count("samples")

    @property
    def num_tokens(self) -> torch.Tensor:
        """The global number of tokens (int64); -1 as :attr:`num_samples` is."""
        return self._counts.count("tokens")

    @property
    def weight_sum(self) -> torch.Tensor:
        """The global sum of the float weights (float64); -1 as :attr:`num_samples` is."""
        return self._counts.count("weight_sum")

    @property
    def is_empty(self) -> torch.Tensor:
        """True (a bool tensor) when every term's global weight ``W`` is 0 (a term divided by
        a constant never is): its gradients are zero and its logged loss 0.
        ``optimizer.step()`` would still apply weight decay and momentum: docs/usage.md
        ("Empty data") says how to skip it."""
        terms = self._counts.layout.terms  # a constant's normaliser is a tensor too
        return torch.stack([self._counts.normaliser(term) == 0 for term in terms]).all()

    @property
    def loss(self) -> torch.Tensor:
        """The step's loss (float64), from the detached losses of every rank: each term's
        weighted mean, summed over the terms. It is reduced by the step's own ``end()``
        (scale-after steps, and count-first steps with ``loss_logging="end"``), or with the
        Accumulator's next reduction (``loss_logging="next_step"``). Reading it before that
        raises RuntimeError."""
        losses = list(self.losses.values())
        return losses[0] if len(losses) == 1 else torch.stack(losses).sum()

    @property
    def losses(self) -> dict[str, torch.Tensor]:
        """Each term's weighted mean loss (float64), by name, available as :attr:`loss` is."""
        return {
            term.name: weighting.weighted_mean(summed, self._counts.normaliser(term))
            for summed, term in zip(self._reduced_loss()[0], self._counts.layout.terms, strict=True)
        }

    @property
    def nonfinite_loss(self) -> torch.Tensor:
        """True (a bool tensor) if some rank's loss sum of some term for this step was NaN or
        infinite; it arrives with :attr:`loss`. It sees the losses handed to the Accumulator,
        not the gradients: a NaN made inside a loss's own backward does not show here."""
        return self._reduced_loss()[1].any()

    def _reduced_loss(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._unrecorded:
            raise error("loss_not_recorded", step=self.step, missing=self._unrecorded)
        if not isinstance(source := self._loss, PendingLoss):
            return source.loss(False)  # the step's own reduction
        if source.reduction is not None:
            return source.reduction.loss(True)  # a later one, which carried it
        if source.dropped:
            raise error("loss_dropped", step=self.step, why=source.dropped)
        raise error("loss_pending", step=self.step)
