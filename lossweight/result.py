"""StepResult: what a finished optimizer step reports, identical on every rank."""

from __future__ import annotations

import torch

from . import weighting
from ._payload import SAMPLES, TOKENS, Reduction


class StepResult:
    """What one optimizer step reports: the same values on every rank, whatever each held.

    Every value is a 0-dim tensor on the device the counts were reduced on (the GPU under
    NCCL). Reading one never issues a collective: it may wait for a reduction that every rank
    started in ``begin()`` or ``end()``, and on a GPU that wait is a stream dependency, not a
    host sync. Call ``.item()`` when you want a Python number, on any rank or on one only.

    Attributes:
        step: the index of the step, counted from 1 by its Accumulator.
    """

    def __init__(
        self,
        step: int,
        counts: Reduction,
        weight_kind: int,
        loss_source: tuple[Reduction, int] | None,
    ) -> None:
        self.step = step
        self._counts = counts
        self._weight_kind = weight_kind
        self._loss_source = loss_source
        self._loss: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def num_samples(self) -> torch.Tensor:
        """The global number of samples (int64).

        -1 when samples do not weight the step and they are not known for all of it: no rank
        gave ``num_samples``, or a rank with a microbatch did not.
        """
        return self._count(SAMPLES)

    @property
    def num_tokens(self) -> torch.Tensor:
        """The global number of tokens (int64); -1 as :attr:`num_samples` is."""
        return self._count(TOKENS)

    @property
    def is_empty(self) -> torch.Tensor:
        """True (a bool tensor) when the step's global weight ``W`` is 0.

        An empty step produced zero gradients and a logged loss of 0. ``optimizer.step()``
        would still apply weight decay and momentum: see docs/usage.md to skip it.
        """
        return self._counts.total(self._weight_kind) == 0

    @property
    def loss(self) -> torch.Tensor:
        """The step's weighted mean loss (float64), from the detached losses of every rank.

        It is reduced by the step's own ``end()`` (scale-after steps, and count-first steps
        with ``loss_logging="end"``), or with the next reduction of the Accumulator
        (``loss_logging="next_step"``: the next ``begin()`` of a count-first step, ``end()`` of
        a scale-after step, or ``flush()``). Reading it before that raises RuntimeError.
        """
        return self._reduced_loss()[0]

    @property
    def nonfinite_loss(self) -> torch.Tensor:
        """True (a bool tensor) if some rank's loss sum for this step was NaN or infinite.

        It arrives with :attr:`loss`. It sees the losses given to ``scale_loss()``, not the
        gradients: a NaN made inside a loss's own backward (a hand-written mean over zero
        items) does not show here.
        """
        return self._reduced_loss()[1]

    def _count(self, kind: int) -> torch.Tensor:
        return self._counts.count(kind, weighting=kind == self._weight_kind)

    def _reduced_loss(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._loss is None:
            if self._loss_source is None:
                raise RuntimeError(
                    f"the loss of step {self.step} is not reduced yet: with "
                    "loss_logging='next_step' it travels with the Accumulator's next reduction "
                    "(the next begin() of a count-first step, end() of a scale-after step, or "
                    "flush(), called on every rank); read it after that, or construct the "
                    "Accumulator with loss_logging='end'"
                )
            reduction, slot = self._loss_source
            loss_sum, nonfinite = reduction.loss(slot)
            loss = weighting.weighted_mean(loss_sum, self._counts.total(self._weight_kind))
            self._loss = (loss, nonfinite)
        return self._loss

    def _carried_by(self, reduction: Reduction, slot: int) -> None:
        """Say which later reduction carries this step's loss (``loss_logging="next_step"``)."""
        self._loss_source = (reduction, slot)
