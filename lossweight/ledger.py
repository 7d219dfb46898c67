"""The reductions of a run, across its steps: their world (the data-parallel ranks, ``D``, the
options' agreement codes), those whose check is still to read, the loss of a count-first step
that waits (``loss_logging="next_step"``) for the next reduction to carry it, and the estimate
``E`` of ``W`` that the next scale-after step assumes."""

from __future__ import annotations

import torch

from . import payload, terms
from .collectives import Collective, parallel_layout
from .errors import error
from .result import PendingLoss
from .terms import Layout, Options


class Ledger:
    """What an Accumulator's reductions share across its steps (the module's docstring says
    what): the Accumulator opens and flushes through it, and each step's ``end()``
    (:mod:`lossweight.steps`) reduces and reports through it."""

    def __init__(self, options: Options, layout: Layout) -> None:
        self.options, self.layout, self.default = options, layout, float(options.weight_estimate)
        # A reduced estimate is the same on every rank, but where its W is 0 it falls back to
        # the option, which may not be: its codes are the option's, negated to say both.
        self.reduced = terms.number_codes(-self.default)
        self.world: tuple[int, float, tuple[int, ...]] = (0, 1.0, ())
        self.unsettled: list[payload.Reduction] = []
        self.pending: PendingLoss | None = None
        self.estimate: float | torch.Tensor | payload.Reduction
        self.assume(self.default)

    def assume(self, estimate: float) -> None:
        """Take an estimate given on the host (0, of an empty step: the option's), and its
        agreement codes."""
        estimate = estimate or self.default
        self.estimate, self.assumed = estimate, terms.number_codes(estimate)

    def estimated(self) -> float | torch.Tensor:
        """The ``E`` of the next scale-after step: the last reduction's ``W``, or the option's
        where that is 0 (an empty step says nothing of the next one's size) or its check
        failed, with the same value and codes on every rank whether it knows of the failure yet
        or not (on an accelerator the total is NaN until the host knows)."""
        if isinstance(self.estimate, payload.Reduction):
            self.estimate = self.estimate.agreed_total(self.options.weight_by, self.default)
        return self.estimate

    def adopt(self, collective: Collective) -> float:
        """``D`` for this world (its ranks of different data: a parallel layout's pipeline
        stages and tensor-parallel peers are not), and its codes (made when that number
        changes), once every reduction started so far is checked (:meth:`settle`). A loss that
        waits is reduced over the collective it was computed in, or never."""
        if self.pending is not None and self.pending.collective is not collective:
            step = self.drop("the process group changed before the loss was reduced")
            raise error("pending_elsewhere", step=step, ranks=collective.world_size)
        parallel, replicas = parallel_layout(collective), collective.world_size
        replicas = replicas if parallel is None else parallel.replicas(replicas)
        if replicas != self.world[0]:
            divisor = self.options.divisor(replicas)
            self.world = (replicas, divisor, self.options.codes(divisor))
        self.settle()
        return self.world[1]

    def codes(self, step: int, call: int, clip: float | None = None) -> tuple[int, ...]:
        """What the ranks agree on in a reduction: the step, the call, whether it carries a loss,
        the options, the estimate (of a reduced one, the option it falls back to), and the norm
        a scale-after ``end()`` clips to (``clip``), if any."""
        estimate = self.assumed if isinstance(self.estimate, float) else self.reduced
        clipped = terms.NO_NUMBER if clip is None else terms.number_codes(clip)
        return (step % 2**16, call, self.pending is not None, *self.world[2], *estimate, *clipped)

    def drop(self, why: str) -> int | None:
        """Forget the loss that waits, which its result then explains with ``why``."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.dropped = why
        return None if pending is None else pending.step

    def hold(self, step: int, loss_sum: torch.Tensor, collective: Collective) -> PendingLoss:
        """Keep a count-first step's loss sum for the next reduction to carry."""
        self.pending = PendingLoss(step, loss_sum, collective)
        return self.pending

    @property
    def carried(self) -> torch.Tensor | None:
        return None if self.pending is None else self.pending.loss_sum

    def add(self, reduction: payload.Reduction, estimates: bool = False) -> None:
        """A reduction started: it carries the loss that waited, and is checked later; one that
        ``estimates`` (a count-first ``begin()``'s) holds the next ``E``, on every rank alike,
        whether its step then ends, refuses or is abandoned."""
        if self.pending is not None:
            self.pending.reduction, self.pending = reduction, None
        self.unsettled.append(reduction)
        if estimates:
            self.estimate = reduction

    def reduce_loss(
        self,
        collective: Collective,
        codes: tuple[int, ...],
        device: torch.device,
        own: torch.Tensor | None = None,
        refusal: Exception | None = None,
    ) -> payload.Reduction:
        """A reduction of loss sums alone: a count-first step's own, or the one that waits;
        one that carries this rank's ``refusal`` is not checked here, where it was raised."""
        reduction = payload.Reduction(
            collective, self.layout, codes, device, {}, {}, (own, self.carried), refusal=refusal
        )
        if refusal is None:
            self.add(reduction)
        return reduction

    def settle(self, verdicts: bool = False) -> None:
        """Check every reduction started so far before a new one starts, so that a disagreement
        surfaces at the reduction that paired it (on an accelerator, at the first call after its
        verdict reached the host). ``verdicts``: only the verdicts on their way, waited for."""
        unsettled, self.unsettled = self.unsettled, []
        for index, reduction in enumerate(unsettled):
            try:
                if not reduction.settled and (not verdicts or reduction.awaiting):
                    reduction.settle(wait=verdicts)
            except BaseException:
                self.unsettled.extend(unsettled[index + 1 :])
                raise
            if not reduction.settled:
                self.unsettled.append(reduction)
