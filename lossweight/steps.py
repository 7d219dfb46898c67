"""The tensors of an open step, one class per mode; every number comes from weighting.py.

:class:`CountFirst` knows every count at ``begin()``: its reduction overlaps the first forward,
and each factor is final. :class:`ScaleAfter` gets the counts with each loss, scales by a
factor against an estimate ``E`` of ``W``, and at ``end()`` multiplies every gradient by
``E / W``. The step machine decides which microbatch a call takes; these classes do the
arithmetic and read nothing back to the host.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Mapping

import torch

from . import _torch, weighting
from .collectives import Collective
from .errors import device_message, error
from .payload import Reduction
from .terms import COUNTS, Layout

Count = int | torch.Tensor
Counts = dict[str, list[int] | torch.Tensor | None]
_STALE, _UNSCALED = device_message("stale_gradients"), device_message("unscaled_gradients")


class CountFirst:
    """A step whose counts were all given to ``begin()``: for each count, a list of ints, a
    1-D int64 tensor (a copy), or None."""

    def __init__(
        self,
        collective: Collective,
        layout: Layout,
        codes: tuple[int, ...],
        counts: Counts,
        carried: torch.Tensor | None,
        divisor: float,
    ) -> None:
        (self._term,) = layout.terms
        weights = counts[self._term.normaliser]
        assert weights is not None
        self.size, self._divisor = len(weights), divisor
        self.device = device = reduction_device(collective, counts)
        totals = {name: sum(c) if isinstance(c, list) else c for name, c in counts.items()}
        gave = {name: counts[name] is not None for name in layout.reported}
        flags = {name: (g, not g and self.size > 0) for name, g in gave.items()}
        losses = {(self._term.name, True): carried}
        # traceable: scale_loss() uses the totals in every case, maybe in a compiled graph.
        self.reduction = Reduction(collective, layout, codes, device, totals, flags, losses, True)
        # Weights given as ints stay on the host too, where "is this one empty?" costs nothing,
        # and move through a buffer (frombuffer refuses an empty one): faster than from a list.
        self._host_weights = weights if isinstance(weights, list) else None
        if isinstance(weights, list) and weights:
            weights = torch.frombuffer(array("d", weights), dtype=torch.float64)
        self._weights = torch.as_tensor(weights).to(device, torch.float64, non_blocking=True)
        self._factors: torch.Tensor | None = None
        self._cast: tuple[torch.device, torch.dtype, torch.Tensor, torch.Tensor] | None = None
        # Each microbatch's detached loss (float64, on the losses' device), indexed by its
        # position so that a compiled scale_loss() does not depend on how many came before.
        self._losses: torch.Tensor | None = None
        # A compiled step counts its microbatches on the device: dynamo specializes a Python
        # int reached from a global, so counting in one would compile a graph per microbatch.
        self.cursor: torch.Tensor | None = None

    def factors(self) -> torch.Tensor:
        """Every microbatch's factor (float64), made once: the first call waits for the counts."""
        if self._factors is None:
            total = self.reduction.total(self._term.normaliser)
            self._factors = weighting.backward_scale(
                self._weights, total, self._divisor, self._term.reduction
            )
        return self._factors

    def scale(self, loss: torch.Tensor, index: int | None, step: int) -> torch.Tensor:
        """``loss`` times microbatch ``index``'s factor; None: at the cursor (an eager call in a
        compiled step, where dynamo fell back)."""
        factors, positive = self._on(loss)
        if index is None:
            assert self.cursor is not None
            if (index := int(self.cursor)) >= self.size:
                raise error("too_many", number=index + 1, step=step, declared=self.size)
            self.cursor.add_(1)
        self.record(index, loss)
        if self._host_weights is not None and self._host_weights[index] > 0:
            return loss * factors[index]
        # A microbatch of weight 0 contributes exactly nothing: torch.where takes neither the
        # value nor the gradient of the loss it does not select (a NaN of 0/0 included).
        return torch.where(positive[index], loss, 0.0) * factors[index]

    def scale_traced(self, loss: torch.Tensor, start: int) -> torch.Tensor:
        """``scale()`` as torch.compile traces it: the position is a tensor, and nothing in the
        graph depends on the counts or on how many microbatches came before."""
        factors, positive = self._on(loss)
        if self.cursor is None:  # the first compiled microbatch, after ``start`` eager ones
            self.cursor = torch.full((), start, dtype=torch.int64, device=loss.device)
        cursor, losses = self.cursor, self._buffer(loss)
        # Sizes come from shapes, which torch.compile makes symbolic, never from self.size, a
        # Python int it would compile one graph for each value of; the position is clamped so
        # that the assert, not an index out of bounds, reports a microbatch too many.
        _torch.assert_true(cursor < factors.shape[0], device_message("traced_too_many"))
        position = cursor.clamp(max=factors.shape[0] - 1).view(1)
        losses.index_copy_(0, position, loss.detach().to(torch.float64).view(1))
        selected = positive.index_select(0, position).view(())
        factor = factors.index_select(0, position).view(())
        cursor.add_(1)
        return torch.where(selected, loss, 0.0) * factor

    def record(self, index: int, loss: torch.Tensor) -> None:
        """Keep a copy of microbatch ``index``'s detached loss for the logged loss."""
        self._buffer(loss)[index] = loss.detach()

    def _buffer(self, loss: torch.Tensor) -> torch.Tensor:
        """The microbatches' losses, made on the first loss's device."""
        if self._losses is None:
            self._losses = torch.zeros_like(self._weights, device=loss.device)
        return self._losses

    def loss_sum(self, known: bool) -> torch.Tensor:
        """This rank's term of the loss numerator, after its last microbatch; NaN where a loss
        was not handed over (``known`` False), so that no rank logs a wrong one."""
        if self.cursor is not None:  # a compiled step: checked on the device, no host sync
            _torch.assert_true(self.cursor == self.size, device_message("traced_too_few"))
        losses = self._losses
        if losses is None or not known:
            fill = 0.0 if known else torch.nan
            return torch.full((), fill, dtype=torch.float64, device=self.device)
        weights = self._weights.to(losses.device, non_blocking=True)
        if self._host_weights is None or not all(self._host_weights):
            losses = torch.where(weights > 0, losses, 0.0)  # an empty microbatch's NaN
        return weighting.loss_contribution(losses, weights, self._term.reduction).sum()  # type: ignore[no-any-return]

    def _on(self, loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The factors at the loss's precision (float32 at least), and whether each weight is
        positive, on the loss's device: made once a step (and a loss device and dtype)."""
        if self._cast is None or self._cast[:2] != (loss.device, loss.dtype):
            dtype = torch.promote_types(loss.dtype, torch.float32)
            factors = self.factors().to(loss.device, dtype, non_blocking=True)
            positive = (self._weights > 0).to(loss.device, non_blocking=True)
            self._cast = (loss.device, loss.dtype, factors, positive)
        return self._cast[2], self._cast[3]


class ScaleAfter:
    """A step whose counts come with each loss, and whose gradients ``end()`` rescales."""

    def __init__(
        self,
        parameters: list[torch.Tensor],
        estimate: torch.Tensor | float,
        divisor: float,
        layout: Layout,
    ) -> None:
        # Gradients left from before the step would be rescaled with this step's.
        _torch.check_zero_gradients(parameters, _STALE)
        self.parameters, self._estimate, self._divisor = parameters, estimate, divisor
        self._layout, (self._term,) = layout, layout.terms
        self._cast: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}
        self._counts: dict[str, list[int | torch.Tensor]] = {name: [] for name in COUNTS}
        self._weights: list[int | torch.Tensor] = []
        self._losses: list[torch.Tensor] = []
        self.reduction: Reduction | None = None
        self.total: torch.Tensor | None = None  # W, once end() has reduced and rescaled

    def scale(self, loss: torch.Tensor, counts: Mapping[str, Count | None]) -> torch.Tensor:
        """``loss`` times its provisional factor ``w * D / E`` (or ``D / E``)."""
        for name, count in counts.items():
            if count is not None:
                self._counts[name].append(count)
        if (key := (loss.device, loss.dtype)) not in self._cast:
            estimate = torch.as_tensor(self._estimate, dtype=torch.float64).to(loss.device)
            # A summed loss's factor D / E is the same for every microbatch: made once.
            shared = weighting.backward_scale(estimate, estimate, self._divisor, "sum")
            self._cast[key] = (estimate, shared.to(torch.promote_types(loss.dtype, torch.float32)))
        estimate, shared = self._cast[key]
        weight = counts[self._term.normaliser]
        if isinstance(weight, int) and weight > 0:
            guarded = loss
        elif isinstance(weight, int):  # weight 0: nothing of the loss, not even a NaN of 0/0
            guarded = torch.where(torch.zeros_like(loss, dtype=torch.bool), loss, 0.0)
        else:
            assert weight is not None
            weight = weight.to(loss.device, torch.float64, non_blocking=True)
            guarded = torch.where(weight > 0, loss, 0.0)
        self._losses.append(guarded.detach().to(torch.float64, copy=True))
        self._weights.append(weight)
        if self._term.reduction == "sum":
            return guarded * shared
        # A Python weight enters through full_like, a fill on the loss's device, so that the
        # factor is a tensor divided by a tensor, rounded once as a count-first factor is.
        as_tensor = torch.full_like(estimate, weight) if isinstance(weight, int) else weight
        factor: torch.Tensor = weighting.backward_scale(as_tensor, estimate, self._divisor, "mean")
        return guarded * factor.to(shared.dtype)

    def finish(
        self,
        collective: Collective,
        codes: tuple[int, ...],
        given: tuple[bool, bool] | None,
        carried: torch.Tensor | None,
    ) -> Reduction:
        """Reduce the step, then rescale its gradients: each once, even after a failure."""
        layout, term = self._layout, self._term
        if self.reduction is None:
            self._groups = self._gradients(codes[0])
            totals = {name: self._sum(name) for name in COUNTS}
            device = reduction_device(collective, totals)
            gave = dict(zip(COUNTS, given or (False, False), strict=True))
            flags = {n: (gave[n], not gave[n] and bool(self._losses)) for n in layout.reported}
            own = self._loss_sum(device)
            losses = {(term.name, False): own, (term.name, True): carried}
            self.reduction = Reduction(collective, layout, codes, device, totals, flags, losses)
        if self.total is None:
            total = self.reduction.total(term.normaliser)
            # Applied at the gradients' precision or better, never rounded to bf16 first.
            _torch.multiply(self._groups, weighting.gradient_correction(total, self._estimate))
            self.total = total
        return self.reduction

    def _gradients(self, step: int) -> _torch.Groups:
        """The step's gradients: some where a loss went through scale_loss(), else none that
        is nonzero (a backward that scale_loss() did not scale)."""
        groups, scaled = _torch.gradient_groups(self.parameters), len(self._losses)
        if not scaled and groups:
            _torch.check_zero_gradients(self.parameters, _UNSCALED)
        if scaled and not groups:
            raise error("no_gradients", parameters=len(self.parameters), scaled=scaled, step=step)
        return groups

    def _sum(self, name: str) -> int | torch.Tensor:
        """A count's total, or where a microbatch gave a tensor, the counts to sum."""
        tensors = [count for count in self._counts[name] if isinstance(count, torch.Tensor)]
        host = sum(count for count in self._counts[name] if isinstance(count, int))
        if not tensors:
            return host
        device = accelerator_of(f"num_{name}", (t.device for t in tensors))
        tensors = [*tensors, torch.tensor(host)] if host else tensors
        return torch.stack([t.to(device, non_blocking=True) for t in tensors])

    def _loss_sum(self, device: torch.device) -> torch.Tensor:
        if not self._losses:
            return torch.zeros((), dtype=torch.float64, device=device)
        losses = torch.stack(self._losses)
        if all(isinstance(w, int) for w in self._weights):
            weights = torch.tensor(self._weights, dtype=torch.float64, device=losses.device)
        else:
            weights = torch.stack(
                [torch.as_tensor(w, device=losses.device).to(torch.float64) for w in self._weights]
            )
        return weighting.loss_contribution(losses, weights, self._term.reduction).sum()  # type: ignore[no-any-return]


def accelerator_of(what: str, devices: Iterable[torch.device]) -> torch.device:
    """The one non-CPU device among ``devices``, or the CPU if there is none."""
    accelerators = {device for device in devices if device.type != "cpu"}
    if len(accelerators) > 1:
        raise error("devices_differ", what=what, devices=sorted(map(str, accelerators)))
    return accelerators.pop() if accelerators else torch.device("cpu")


def reduction_device(collective: Collective, counts: Mapping[str, object]) -> torch.device:
    """Where a step's counts are reduced: on the accelerator that holds count tensors (moving
    them would wait for it), else on the collective's device."""
    tensors = {name: c for name, c in counts.items() if isinstance(c, torch.Tensor)}
    device = accelerator_of("num_samples and num_tokens", (c.device for c in tensors.values()))
    if device.type == "cpu":
        return collective.device
    if not collective.can_reduce_on(device):
        name = next(f"num_{n}" for n, c in tensors.items() if c.device == device)
        raise error("cannot_reduce_on", name=name, device=device, reduces=collective.device.type)
    return device
