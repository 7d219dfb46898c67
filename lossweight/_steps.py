"""One class per mode of an optimizer step, side by side, both made of weighting.py's math.

- :class:`CountFirstStep`: every count is known at ``begin()``. Its reduction starts there and
  overlaps the first forward; each microbatch's factor is final, and no gradient is touched.
- :class:`ScaleAfterStep`: counts come with each loss. Each microbatch is back-propagated with
  a provisional factor against an estimate ``E`` of the global weight, and ``end()`` reduces
  the counts, then multiplies every gradient by ``E / W`` in one pass.

Both take inputs by value and read nothing back to the host.
"""

from __future__ import annotations

import functools
from array import array
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from . import weighting
from ._checks import accelerator_of
from ._payload import (
    COUNT_FIRST_BEGIN,
    SAMPLES,
    SCALE_AFTER_END,
    TOKENS,
    Reduction,
    agreement_codes,
    option_codes,
    start_reduction,
)
from .collectives import Collective
from .weighting import LossReduction

COUNT_NAMES = ("num_samples", "num_tokens")


@dataclass(frozen=True)
class Settings:
    """What a step needs of its Accumulator's options, with ``D`` resolved for this world."""

    weight_by: str
    loss_reduction: LossReduction
    loss_logging: str
    divisor: float

    @property
    def weight_kind(self) -> int:
        return TOKENS if self.weight_by == "tokens" else SAMPLES

    @functools.cached_property
    def _option_codes(self) -> tuple[int, ...]:
        return option_codes(self.weight_by, self.loss_reduction, self.loss_logging, self.divisor)

    def codes(self, step: int, call: int) -> tuple[int, ...]:
        """What the ranks must agree on in one reduction of this step."""
        return agreement_codes(step, call, self._option_codes)


def reduction_device(collective: Collective, counts: Sequence[object]) -> torch.device:
    """Where a step's counts are reduced: on the accelerator that holds count tensors (moving
    them would wait for it), else on the collective's device."""
    tensors = {
        name: c for name, c in zip(COUNT_NAMES, counts, strict=True) if isinstance(c, torch.Tensor)
    }
    device = accelerator_of("num_samples and num_tokens", [c.device for c in tensors.values()])
    if device.type == "cpu":
        return collective.device
    if not collective.can_reduce_on(device):
        name = next(n for n, c in tensors.items() if c.device == device)
        raise ValueError(
            f"{name} is on {device}, where the collective cannot reduce (it reduces on "
            f"{collective.device.type}); pass {name} on the CPU (Python ints or a CPU "
            f"tensor), or reduce over a group whose backend handles {device.type} tensors"
        )
    return device


class CountFirstStep:
    """A step whose counts were all given to ``begin()``: ``counts[kind]`` is a list of ints,
    a 1-D int64 tensor (already copied), or None when not given."""

    def __init__(
        self,
        index: int,
        settings: Settings,
        collective: Collective,
        counts: list[list[int] | torch.Tensor | None],
        carried_loss: torch.Tensor | None,
    ) -> None:
        self.index = index
        self.settings = settings
        weights = counts[settings.weight_kind]
        assert weights is not None
        self.size = len(weights)
        other = counts[1 - settings.weight_kind]
        device = reduction_device(collective, list(counts))
        totals = [sum(c) if isinstance(c, list) else c for c in counts]
        self.reduction = start_reduction(
            collective,
            settings.codes(index, COUNT_FIRST_BEGIN),
            device,
            samples=totals[SAMPLES],
            tokens=totals[TOKENS],
            other_count=(other is not None, other is None and self.size > 0),
            previous_loss=carried_loss,
            traceable=True,  # end() uses the totals in every case
        )
        # Weights given as ints stay on the host, where "is this microbatch empty?" costs
        # nothing; weights given as tensors stay on their device.
        self._host_weights = weights if isinstance(weights, list) else None
        self._weights = (
            float64_tensor(weights, device)
            if isinstance(weights, list)
            else weights.to(device, torch.float64, non_blocking=True)
        )
        self._eager_scaled = 0  # the microbatches scaled in eager code
        self._factors: torch.Tensor | None = None
        self._cast_key: tuple[torch.device, torch.dtype] | None = None
        self._cast: tuple[torch.Tensor, torch.Tensor] | None = None
        # Each microbatch's detached loss, as float64 on the losses' device, made with the
        # first loss. A tensor indexed by the microbatch's position rather than a growing
        # list, so that a graph torch.compile traces through scale_loss() does not depend on
        # how many losses came before.
        self._losses: torch.Tensor | None = None
        # A step whose first microbatch went through a compiled scale_loss() counts its
        # microbatches in a tensor: dynamo specializes a Python int reached from a global or
        # a module attribute (where an Accumulator usually lives), so counting in one would
        # compile a graph per microbatch. Two graphs serve every step: its first microbatch
        # (which waits for the counts) and the others.
        self._traced = False
        self._cursor: torch.Tensor | None = None

    @property
    def scaled(self) -> int:
        """How many microbatches went through scale_loss(); in a compiled step, read from
        the device (off the hot path: end() of an eager step never reads it)."""
        if self._traced:
            assert self._cursor is not None
            return int(self._cursor)
        return self._eager_scaled

    def factors(self) -> torch.Tensor:
        """Every microbatch's factor as float64, computed once, when first needed: that first
        call waits for the count reduction."""
        if self._factors is None:
            settings, weights = self.settings, self._weights
            total = self.reduction.total(settings.weight_kind)
            self._factors = weighting.backward_scale(
                weights, total, settings.divisor, settings.loss_reduction
            )
        return self._factors

    def backward_scale(self, microbatch: int | None) -> torch.Tensor:
        index = self.scaled if microbatch is None else microbatch
        if microbatch is None and index >= self.size:
            raise RuntimeError(
                f"backward_scale() has no next microbatch: all {self.size} microbatches that "
                f"begin() declared for step {self.index} went through scale_loss(); pass "
                "backward_scale(index) to read the factor of one of them"
            )
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < self.size:
            raise ValueError(
                f"backward_scale({microbatch!r}): step {self.index} declared {self.size} "
                f"microbatches in begin(); pass an index from 0 to {self.size - 1}"
            )
        return self.factors()[index]

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return self._traced_scale_loss(loss)
        index = self.scaled
        if index >= self.size:
            raise RuntimeError(
                f"scale_loss() was called for microbatch {index + 1} of step {self.index}, but "
                f"begin() declared {self.size} microbatches; declare one count per microbatch "
                "in begin()"
            )
        factors, positive = self._on(loss)
        losses = self._losses
        assert losses is not None
        losses[index] = loss.detach()
        if self._traced:  # an eager microbatch in a compiled step (dynamo fell back)
            assert self._cursor is not None
            self._cursor.add_(1)
        else:
            self._eager_scaled = index + 1
        if self._host_weights is not None and self._host_weights[index] > 0:
            return loss * factors[index]
        # A microbatch of weight 0 contributes exactly nothing: torch.where takes neither the
        # value nor the gradient of the loss it does not select (the NaN of a mean over zero
        # items included).
        return torch.where(positive[index], loss, 0.0) * factors[index]

    def _traced_scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """scale_loss() as torch.compile traces it: the microbatch's position is a tensor,
        and nothing in the graph depends on the counts or on how many microbatches came
        before."""
        if self._eager_scaled:  # a guard of value 0 in every compiled step: no recompile
            raise RuntimeError(
                f"scale_loss() of step {self.index} is compiled, but {self._eager_scaled} of "
                "its microbatches went through scale_loss() in eager code before; compile "
                "the function that calls it from a step's first microbatch on, or not at all"
            )
        factors, positive = self._on(loss)
        if self._cursor is None:  # the step's first microbatch: nothing scaled yet
            self._cursor = torch.zeros((), dtype=torch.int64, device=loss.device)
        losses, cursor = self._losses, self._cursor
        assert losses is not None
        self._traced = True
        torch._assert_async(cursor < self.size, _TOO_MANY_TRACED)
        position = cursor.view(1)
        losses.index_copy_(0, position, loss.detach().to(torch.float64).view(1))
        selected = positive.index_select(0, position).view(())
        factor = factors.index_select(0, position).view(())
        cursor.add_(1)
        return torch.where(selected, loss, 0.0) * factor

    def loss_sum(self) -> torch.Tensor:
        """This rank's term of the step's loss numerator, after its last microbatch."""
        if self._traced:  # checked on the device, where the count is: no host sync
            assert self._cursor is not None
            torch._assert_async(self._cursor == self.size, _TOO_FEW_TRACED)
        elif self._eager_scaled != self.size:
            raise RuntimeError(
                f"end() was called after {self._eager_scaled} of the {self.size} microbatches "
                f"that begin() declared for step {self.index}; pass every declared "
                "microbatch's loss through scale_loss(), or declare fewer"
            )
        losses = self._losses
        if losses is None:
            return torch.zeros((), dtype=torch.float64, device=self.reduction.device)
        weights = self._weights.to(losses.device, non_blocking=True)
        host = self._host_weights
        if host is None or not all(host):  # an empty microbatch's loss may be NaN: drop it
            losses = torch.where(weights > 0, losses, 0.0)
        if self.settings.loss_reduction == "sum":
            return losses.sum()
        return torch.dot(losses, weights)  # the sum of weighting.loss_contribution's w * l

    def _on(self, loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every microbatch's factor at the loss's precision (float32 at least) and whether
        its weight is positive, on the loss's device: made once per step (and per loss
        device and dtype)."""
        key = (loss.device, loss.dtype)
        if key != self._cast_key:
            dtype = torch.promote_types(loss.dtype, torch.float32)
            factors = self.factors().to(loss.device, dtype, non_blocking=True)
            positive = (self._weights > 0).to(loss.device, non_blocking=True)
            self._cast = (factors, positive)
            self._cast_key = key
            if self._losses is None:  # the step's first microbatch
                self._losses = torch.zeros(self.size, dtype=torch.float64, device=loss.device)
        assert self._cast is not None
        return self._cast


# Fixed: a message naming the step would make dynamo compile a graph per step.
_TOO_MANY_TRACED = (
    "lossweight: a compiled scale_loss() was called for more microbatches than begin() "
    "declared; declare one count per microbatch in begin()"
)


_TOO_FEW_TRACED = (
    "lossweight: end() was called before every microbatch that begin() declared went through "
    "scale_loss(); pass every declared microbatch's loss through scale_loss(), or declare fewer"
)


def float64_tensor(values: list[int] | list[float], device: torch.device) -> torch.Tensor:
    """A float64 tensor of ``values`` on ``device``, made from a buffer (several times faster
    than from a list)."""
    if not values:
        return torch.zeros(0, dtype=torch.float64, device=device)
    return torch.frombuffer(array("d", values), dtype=torch.float64).to(device, non_blocking=True)


class ScaleAfterStep:
    """A step whose counts come with each loss, and whose gradients ``end()`` rescales."""

    def __init__(
        self,
        index: int,
        settings: Settings,
        parameters: list[torch.Tensor],
        estimate: float | torch.Tensor,
    ) -> None:
        self.index = index
        self.settings = settings
        self._parameters = parameters
        for grads in _gradient_groups(parameters).values():
            # Gradients left from before the step would be rescaled with this step's: they
            # must be absent or zero (checked on their device, without a sync).
            torch._assert_async(
                torch.stack(torch._foreach_norm(grads)).sum() == 0,
                "parameters given to begin() of a scale-after step already hold nonzero "
                "gradients, which end() would rescale as if they came from this step; call "
                "optimizer.zero_grad() before begin(), and pass every loss of the step "
                "through scale_loss()",
            )
        self._estimate = estimate
        self._cast: dict[
            tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.dtype, torch.Tensor]
        ] = {}
        self._declared: tuple[bool, bool] | None = None
        self._host_totals = [0, 0]
        self._tensor_counts: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        self._weights: list[int | torch.Tensor] = []
        self._losses: list[torch.Tensor] = []
        self.reduction: Reduction | None = None
        self._gradients: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        self._rescaled = False

    @property
    def size(self) -> int:
        return len(self._losses)

    def scale_loss(
        self,
        loss: torch.Tensor,
        counts: tuple[int | torch.Tensor | None, int | torch.Tensor | None],
    ) -> torch.Tensor:
        settings = self.settings
        declared = (counts[0] is not None, counts[1] is not None)
        if self._declared is not None and declared != self._declared:
            raise ValueError(
                f"scale_loss() got {_given(declared)} for microbatch {self.size + 1} but "
                f"{_given(self._declared)} for the ones before; give the same counts for every "
                "microbatch of a step"
            )
        self._declared = declared
        for kind, count in enumerate(counts):
            if isinstance(count, int):
                self._host_totals[kind] += count
            elif count is not None:
                self._tensor_counts[kind].append(count)
        weight = counts[settings.weight_kind]
        assert weight is not None
        if isinstance(weight, int):
            guarded = loss if weight > 0 else torch.where(_false(loss), loss, 0.0)
        else:
            weight = weight.to(loss.device, torch.float64, non_blocking=True)
            guarded = torch.where(weight > 0, loss, 0.0)
        self._losses.append(guarded.detach().to(torch.float64, copy=True))
        self._weights.append(weight)
        return guarded * self._factor(loss, weight)

    def _factor(self, loss: torch.Tensor, weight: int | torch.Tensor) -> torch.Tensor:
        """The provisional factor, ``w * D / E`` or ``D / E``: computed in float64 and rounded
        once, as a count-first factor is, then at the loss's precision (float32 at least).
        Python numbers enter through ``full_like``, a fill on the loss's device, never a copy
        from the host per call."""
        key = (loss.device, loss.dtype)
        if key not in self._cast:
            estimate = torch.as_tensor(
                weighting.nonzero_total(self._estimate), dtype=torch.float64
            ).to(loss.device, non_blocking=True)
            shared = torch.full_like(estimate, self.settings.divisor) / estimate
            dtype = torch.promote_types(loss.dtype, torch.float32)
            self._cast[key] = (estimate, dtype, shared.to(dtype))
        estimate, dtype, shared = self._cast[key]
        if self.settings.loss_reduction == "sum":
            return shared  # the same for every microbatch
        numerator = (
            torch.full_like(estimate, weight * self.settings.divisor)
            if isinstance(weight, int)
            else weight * self.settings.divisor
        )
        return (numerator / estimate).to(dtype)

    def finish(self, collective: Collective, carried_loss: torch.Tensor | None) -> Reduction:
        """Reduce the step (once, even if called again after a failure) and rescale its
        gradients (once)."""
        settings = self.settings
        if self.reduction is None:
            self._gradients = _gradient_groups(self._parameters)
            if self.size and not self._gradients:
                raise ValueError(
                    f"none of the {len(self._parameters)} parameters given to begin() has a "
                    f"gradient after {self.size} microbatches of step {self.index} went through "
                    "scale_loss(); pass the parameters of the model those losses came from"
                )
            totals = [self._total(kind) for kind in (SAMPLES, TOKENS)]
            other = 1 - settings.weight_kind
            declared_other = self._declared is not None and self._declared[other]
            device = reduction_device(collective, totals)
            self.reduction = start_reduction(
                collective,
                settings.codes(self.index, SCALE_AFTER_END),
                device,
                samples=totals[SAMPLES],
                tokens=totals[TOKENS],
                other_count=(declared_other, not declared_other and self.size > 0),
                own_loss=self._loss_sum(device),
                previous_loss=carried_loss,
            )
        if not self._rescaled:
            total = self.reduction.total(settings.weight_kind)
            correction = weighting.gradient_correction(total, self._estimate)
            for (device, _), grads in self._gradients.items():
                # The float64 factor is applied at the gradients' precision or better, never
                # rounded to bf16 or fp16 first.
                torch._foreach_mul_(grads, correction.to(device, non_blocking=True))
            self._rescaled = True
        return self.reduction

    def _total(self, kind: int) -> int | torch.Tensor:
        tensors, host = self._tensor_counts[kind], self._host_totals[kind]
        if not tensors:
            return host
        device = accelerator_of(COUNT_NAMES[kind], [t.device for t in tensors])
        if host:
            tensors = [*tensors, torch.tensor(host)]
        return torch.stack([t.to(device, non_blocking=True) for t in tensors])

    def _loss_sum(self, device: torch.device) -> torch.Tensor:
        if not self._losses:
            return torch.zeros((), dtype=torch.float64, device=device)
        losses = torch.stack(self._losses)
        if self.settings.loss_reduction == "sum":
            return losses.sum()
        if all(isinstance(w, int) for w in self._weights):
            weights = torch.tensor(self._weights, dtype=torch.float64, device=losses.device)
        else:
            weights = torch.stack(
                [torch.as_tensor(w, device=losses.device).to(torch.float64) for w in self._weights]
            )
        contributions: torch.Tensor = weighting.loss_contribution(losses, weights, "mean")
        return contributions.sum()


def _false(like: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), dtype=torch.bool, device=like.device)


def _given(declared: tuple[bool, bool]) -> str:
    names = [name for name, given in zip(COUNT_NAMES, declared, strict=True) if given]
    return " and ".join(names) or "no counts"


def _gradient_groups(
    parameters: list[torch.Tensor],
) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    """The parameters' gradients that exist, grouped by device and dtype for foreach calls.
    A DTensor gradient (FSDP2) is taken through its local shard, which is all this rank
    holds."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for parameter in parameters:
        grad = parameter.grad
        if grad is None:
            continue
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        groups[(local.device, local.dtype)].append(local)
    return groups
