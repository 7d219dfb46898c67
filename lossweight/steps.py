"""The tensors of an open step, one class per mode; every number comes from weighting.py.

- :class:`CountFirst`: every count is known at ``begin()``. Its reduction starts there and
  overlaps the first forward; each microbatch's factor is final, and no gradient is touched.
- :class:`ScaleAfter`: counts come with each loss. Each microbatch is back-propagated with a
  provisional factor against an estimate ``E`` of the global weight, and ``end()`` reduces the
  counts, then multiplies every gradient by ``E / W`` in one pass.

Which microbatch a call takes, and whether it may, is the step machine's decision
(:mod:`lossweight.machine`); these classes only do the arithmetic on tensors, take inputs by
value and read nothing back to the host.
"""

from __future__ import annotations

import torch

from . import _torch, payload, weighting
from .collectives import Collective
from .errors import device_message, error
from .terms import Layout
from .validate import Count, accelerator_of, reduction_device


class CountFirst:
    """A step whose counts were all given to ``begin()``: ``counts[name]`` is a list of ints, a
    1-D int64 tensor (already copied), or None when not given."""

    def __init__(
        self,
        collective: Collective,
        layout: Layout,
        codes: tuple[int, ...],
        counts: dict[str, list[int] | torch.Tensor | None],
        divisor: float,
        carried: torch.Tensor | None,
    ) -> None:
        (term,) = layout.terms
        weights = counts[term.normaliser]
        assert weights is not None
        self.size, self._term, self._divisor = len(weights), term, divisor
        device = reduction_device(collective, counts)
        self.reduction = payload.start(
            collective,
            layout,
            codes,
            device,
            {name: sum(c) if isinstance(c, list) else c for name, c in counts.items()},
            {
                n: (counts[n] is not None, counts[n] is None and self.size > 0)
                for n in layout.reported
            },
            {(term.name, True): carried},
            traceable=True,  # end() uses the totals in every case
        )
        # Weights given as ints stay on the host too, where "is this one empty?" costs nothing.
        self._host_weights = weights if isinstance(weights, list) else None
        self._weights = (
            _torch.float64(weights, device)
            if isinstance(weights, list)
            else weights.to(device, torch.float64, non_blocking=True)
        )
        self._factors: torch.Tensor | None = None
        self._cast: tuple[torch.device, torch.dtype, torch.Tensor, torch.Tensor] | None = None
        # Each microbatch's detached loss (float64, on the losses' device), indexed by its
        # position so that a compiled scale_loss() does not depend on how many came before.
        self._losses: torch.Tensor | None = None
        # A compiled step counts its microbatches on the device: dynamo specializes a Python
        # int reached from a global, so counting in one would compile a graph per microbatch.
        self.cursor: torch.Tensor | None = None

    def factors(self, loss_reduction: str) -> torch.Tensor:
        """Every microbatch's factor as float64, computed once: the first call waits for the
        count reduction."""
        if self._factors is None:
            total = self.reduction.total(self._term.normaliser)
            self._factors = weighting.backward_scale(
                self._weights,
                total,
                self._divisor,
                loss_reduction,  # type: ignore[arg-type]
            )
        return self._factors

    def scale(
        self, loss: torch.Tensor, index: int | None, loss_reduction: str, step: int
    ) -> torch.Tensor:
        """``loss`` times microbatch ``index``'s factor; None: the cursor's (a compiled step's
        microbatch run in eager code, where dynamo fell back)."""
        factors, positive = self._on(loss, loss_reduction)
        if index is None:
            assert self.cursor is not None
            index = int(self.cursor)
            if index >= self.size:
                raise error("too_many", number=index + 1, step=step, declared=self.size)
            self.cursor.add_(1)
        self.record(index, loss)
        if self._host_weights is not None and self._host_weights[index] > 0:
            return loss * factors[index]
        # A microbatch of weight 0 contributes exactly nothing: torch.where takes neither the
        # value nor the gradient of the loss it does not select (a NaN of 0/0 included).
        return torch.where(positive[index], loss, 0.0) * factors[index]

    def scale_traced(self, loss: torch.Tensor, loss_reduction: str) -> torch.Tensor:
        """``scale()`` as torch.compile traces it: the position is a tensor, and nothing in the
        graph depends on the counts or on how many microbatches came before."""
        factors, positive = self._on(loss, loss_reduction)
        if self.cursor is None:  # the step's first microbatch
            self.cursor = torch.zeros((), dtype=torch.int64, device=loss.device)
        cursor, losses = self.cursor, self._losses
        assert losses is not None
        _torch.assert_true(cursor < self.size, device_message("traced_too_many"))
        position = cursor.view(1)
        losses.index_copy_(0, position, loss.detach().to(torch.float64).view(1))
        selected = positive.index_select(0, position).view(())
        factor = factors.index_select(0, position).view(())
        cursor.add_(1)
        return torch.where(selected, loss, 0.0) * factor

    def record(self, index: int, loss: torch.Tensor) -> None:
        """Keep a copy of microbatch ``index``'s detached loss for the logged loss."""
        if self._losses is None:
            self._losses = torch.zeros(self.size, dtype=torch.float64, device=loss.device)
        self._losses[index] = loss.detach()

    def loss_sum(self, loss_reduction: str, known: bool) -> torch.Tensor:
        """This rank's term of the step's loss numerator, after its last microbatch; NaN when
        some loss was not handed over (``known`` False), so that no rank logs a wrong one."""
        if self.cursor is not None:  # a compiled step: checked on the device, no host sync
            _torch.assert_true(self.cursor == self.size, device_message("traced_too_few"))
        losses = self._losses
        if losses is None or not known:
            fill = 0.0 if known else torch.nan
            return torch.full((), fill, dtype=torch.float64, device=self.reduction.device)
        weights = self._weights.to(losses.device, non_blocking=True)
        host = self._host_weights
        if host is None or not all(host):  # an empty microbatch's loss may be NaN: drop it
            losses = torch.where(weights > 0, losses, 0.0)
        total: torch.Tensor = weighting.loss_contribution(losses, weights, loss_reduction).sum()  # type: ignore[arg-type]
        return total

    def _on(self, loss: torch.Tensor, loss_reduction: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The factors at the loss's precision (float32 at least) and whether each weight is
        positive, on the loss's device: made once per step (and per loss device and dtype)."""
        if self._cast is None or self._cast[:2] != (loss.device, loss.dtype):
            dtype = torch.promote_types(loss.dtype, torch.float32)
            factors = self.factors(loss_reduction).to(loss.device, dtype, non_blocking=True)
            positive = (self._weights > 0).to(loss.device, non_blocking=True)
            self._cast = (loss.device, loss.dtype, factors, positive)
            if self._losses is None:
                self._losses = torch.zeros(self.size, dtype=torch.float64, device=loss.device)
        return self._cast[2], self._cast[3]


class ScaleAfter:
    """A step whose counts come with each loss, and whose gradients ``end()`` rescales."""

    def __init__(
        self, parameters: list[torch.Tensor], estimate: float | torch.Tensor, divisor: float
    ) -> None:
        self._parameters = parameters
        for grads in _torch.gradient_groups(parameters).values():
            # Gradients left from before the step would be rescaled with this step's.
            _torch.assert_true(_torch.all_zero(grads), device_message("stale_gradients"))
        self._estimate, self._divisor = estimate, divisor
        self._cast: dict[
            tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.dtype, torch.Tensor]
        ] = {}
        self._host_totals: dict[str, int] = {}
        self._tensor_counts: dict[str, list[torch.Tensor]] = {}
        self._weights: list[int | torch.Tensor] = []
        self._losses: list[torch.Tensor] = []
        self.reduction: payload.Reduction | None = None
        self._rescaled = False

    def scale(
        self, loss: torch.Tensor, counts: dict[str, Count | None], weight_by: str, reduction: str
    ) -> torch.Tensor:
        """``loss`` times its provisional factor ``w * D / E`` (or ``D / E``)."""
        for name, count in counts.items():
            if isinstance(count, int):
                self._host_totals[name] = self._host_totals.get(name, 0) + count
            elif count is not None:
                self._tensor_counts.setdefault(name, []).append(count)
        key = (loss.device, loss.dtype)
        if key not in self._cast:
            nonzero = weighting.nonzero_total(self._estimate)
            estimate = torch.as_tensor(nonzero, dtype=torch.float64).to(loss.device)
            # A summed loss's factor D / E is the same for every microbatch: made once.
            shared = weighting.backward_scale(estimate, estimate, self._divisor, "sum")
            dtype = torch.promote_types(loss.dtype, torch.float32)
            self._cast[key] = (estimate, dtype, shared.to(dtype))
        estimate, dtype, shared = self._cast[key]
        weight = counts[weight_by]
        assert weight is not None
        if isinstance(weight, int):
            guarded = (
                loss
                if weight > 0
                else torch.where(torch.zeros_like(loss, dtype=torch.bool), loss, 0.0)
            )
        else:
            weight = weight.to(loss.device, torch.float64, non_blocking=True)
            guarded = torch.where(weight > 0, loss, 0.0)
        self._losses.append(guarded.detach().to(torch.float64, copy=True))
        self._weights.append(weight)
        if reduction == "sum":
            return guarded * shared
        # A Python weight enters through full_like, a fill on the loss's device, so that the
        # factor is a tensor divided by a tensor, rounded once as a count-first factor is.
        as_tensor = torch.full_like(estimate, weight) if isinstance(weight, int) else weight
        factor: torch.Tensor = weighting.backward_scale(as_tensor, estimate, self._divisor, "mean")
        return guarded * factor.to(dtype)

    def finish(
        self,
        collective: Collective,
        layout: Layout,
        codes: tuple[int, ...],
        given: tuple[bool, bool] | None,
        loss_reduction: str,
        carried: torch.Tensor | None,
    ) -> payload.Reduction:
        """Reduce the step (once, even if called again after a failure), then rescale its
        gradients (once)."""
        (term,) = layout.terms
        if self.reduction is None:
            self._gradients = _torch.gradient_groups(self._parameters)
            if self._losses and not self._gradients:
                raise error(
                    "no_gradients",
                    parameters=len(self._parameters),
                    scaled=len(self._losses),
                    step=codes[0],
                )
            totals = {name: self._total(name) for name in ("samples", "tokens")}
            device = reduction_device(collective, totals)
            flags = {}
            for name in layout.reported:
                gave = given is not None and given[("samples", "tokens").index(name)]
                flags[name] = (gave, not gave and bool(self._losses))
            losses = {
                (term.name, False): self._loss_sum(device, loss_reduction),
                (term.name, True): carried,
            }
            self.reduction = payload.start(collective, layout, codes, device, totals, flags, losses)
        if not self._rescaled:
            total = self.reduction.total(term.normaliser)
            correction = weighting.gradient_correction(total, self._estimate)
            for (device, _), grads in self._gradients.items():
                # Applied at the gradients' precision or better, never rounded to bf16 first.
                _torch.multiply(grads, correction.to(device, non_blocking=True))
            self._rescaled = True
        return self.reduction

    def _total(self, name: str) -> int | torch.Tensor:
        tensors, host = self._tensor_counts.get(name, []), self._host_totals.get(name, 0)
        if not tensors:
            return host
        device = accelerator_of(f"num_{name}", (t.device for t in tensors))
        if host:
            tensors = [*tensors, torch.tensor(host)]
        return torch.stack([t.to(device, non_blocking=True) for t in tensors])

    def _loss_sum(self, device: torch.device, loss_reduction: str) -> torch.Tensor:
        if not self._losses:
            return torch.zeros((), dtype=torch.float64, device=device)
        losses = torch.stack(self._losses)
        if all(isinstance(w, int) for w in self._weights):
            weights = torch.tensor(self._weights, dtype=torch.float64, device=losses.device)
        else:
            weights = torch.stack(
                [torch.as_tensor(w, device=losses.device).to(torch.float64) for w in self._weights]
            )
        total: torch.Tensor = weighting.loss_contribution(losses, weights, loss_reduction).sum()  # type: ignore[arg-type]
        return total
