"""The Accumulator and the collectives it reduces over: lossweight's torch glue.

The math lives in :mod:`lossweight.weighting` (no torch there); this module feeds it tensors,
reduces the step's counts over the data-parallel ranks, and checks what the user passes in.
It needs nothing but torch and that one module, so the two files can be vendored together.
"""

from __future__ import annotations

import math
import numbers
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any, Literal, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from lossweight import weighting
from lossweight.weighting import GradReduction, LossReduction

WeightBy = Literal["samples", "tokens"]
LossLogging = Literal["on_read", "next_step"]
Count = int | torch.Tensor
Counts = torch.Tensor | Sequence[Count]


@runtime_checkable
class Waitable(Protocol):
    """A collective in flight; ``wait()`` returns once its result may be used."""

    def wait(self) -> Any: ...


@runtime_checkable
class Collective(Protocol):
    """Sums a tensor in place over the data-parallel ranks.

    Implement it to reduce over something other than a ``torch.distributed`` process group.
    """

    @property
    def world_size(self) -> int:
        """The number of data-parallel ranks."""
        ...

    @property
    def device(self) -> torch.device:
        """Where counts given on the CPU (Python ints included) are moved to be reduced."""
        ...

    def can_reduce_on(self, device: torch.device) -> bool:
        """Whether tensors on ``device`` can be reduced."""
        ...

    def all_reduce_sum(self, tensor: torch.Tensor) -> Waitable | None:
        """Start summing ``tensor`` in place over the ranks.

        Return a handle whose ``wait()`` completes the sum, or None when the sum is already
        complete. Every rank must call this the same number of times, in the same order.
        """
        ...


class SingleProcess:
    """The collective of a run without data parallelism: one rank, nothing to reduce."""

    world_size = 1
    device = torch.device("cpu")

    def can_reduce_on(self, device: torch.device) -> bool:
        return True

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        return None


# Device types each torch.distributed backend reduces on.
_BACKEND_DEVICE_TYPES = {
    "gloo": ("cpu",),
    "nccl": ("cuda",),
    "xccl": ("xpu",),
    "mpi": ("cpu",),
}


class ProcessGroupCollective:
    """Reduces over a ``torch.distributed`` process group (default: the default group).

    The all-reduce is launched with ``async_op=True`` and waited on only when its result is
    needed, so it overlaps the work in between. NCCL reduces CUDA tensors and gloo CPU tensors;
    a process group made of several backends (``"cpu:gloo,cuda:nccl"``) reduces on each of
    their devices.
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.world_size = dist.get_world_size(group)
        self._device_types = _device_types(str(dist.get_backend(group)))
        if "cuda" in self._device_types and torch.cuda.is_available():
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device(self._device_types[0])

    def can_reduce_on(self, device: torch.device) -> bool:
        return device.type in self._device_types

    def all_reduce_sum(self, tensor: torch.Tensor) -> Waitable | None:
        # Looked up on the module at each call, so that code which wraps
        # torch.distributed.all_reduce (to count or trace collectives) sees this one too.
        return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=True)


def _device_types(backend: str) -> tuple[str, ...]:
    if ":" in backend:  # "cpu:gloo,cuda:nccl"
        return tuple(pair.split(":")[0] for pair in backend.split(","))
    return _BACKEND_DEVICE_TYPES.get(backend, ("cpu", "cuda"))


def default_collective(group: dist.ProcessGroup | None) -> Collective:
    """The process group's collective, or a single process when torch.distributed is not
    initialized."""
    if dist.is_available() and dist.is_initialized():
        return ProcessGroupCollective(group)
    if group is not None:
        raise ValueError(
            f"group={group!r} was given but torch.distributed is not initialized; call "
            "torch.distributed.init_process_group() before creating the Accumulator, or pass "
            "group=None for a single process"
        )
    return SingleProcess()


class _Reduction:
    """One all-reduce of a small payload: started when made, waited on once, when first read."""

    def __init__(self, collective: Collective, payload: torch.Tensor) -> None:
        self._payload = payload
        self._handle = collective.all_reduce_sum(payload)

    def result(self) -> torch.Tensor:
        if self._handle is not None:
            self._handle.wait()
            self._handle = None
        return self._payload

    def total(self, slot: int) -> torch.Tensor:
        """One reduced number as float64, such as the step's global weight W."""
        return self.result()[slot].to(torch.float64)


# Where each number sits in the payload a step reduces: the step's two count totals, then, when
# losses travel with them, the previous step's loss sum (loss_logging="next_step") and this
# step's own (scale-after steps).
_SAMPLES, _TOKENS, _PREVIOUS_LOSS, _OWN_LOSS = 0, 1, 2, 3


class StepResult:
    """What one optimizer step reports; the same numbers on every rank.

    Every value is a 0-dim tensor on the device the counts were reduced on. Reading one never
    forces a host sync by itself: call ``.item()`` when you want a Python number.
    """

    def __init__(
        self,
        counts: _Reduction,
        weight_slot: int,
        declared: tuple[bool, bool],
        local_loss_sum: torch.Tensor | None,
        collective: Collective,
        missing_losses: int,
        loss_slot: int | None,
    ) -> None:
        self._counts = counts
        self._weight_slot = weight_slot
        self._declared = declared
        self._local_loss_sum = local_loss_sum
        self._collective = collective
        self._missing_losses = missing_losses
        # The reduction that carries the global loss sum, and where; None until one does.
        self._loss_source = None if loss_slot is None else (counts, loss_slot)
        self._loss: torch.Tensor | None = None

    @property
    def num_samples(self) -> torch.Tensor | None:
        """The global number of samples (int64), or None if the step did not give them."""
        return self._count(_SAMPLES)

    @property
    def num_tokens(self) -> torch.Tensor | None:
        """The global number of tokens (int64), or None if the step did not give them."""
        return self._count(_TOKENS)

    @property
    def is_empty(self) -> torch.Tensor:
        """True (a bool tensor) when the step's global weight is 0.

        An empty step produced zero gradients and a logged loss of 0; test this flag before
        ``optimizer.step()`` if weight decay or momentum must not act on such a step.
        """
        return self._global_weight() == 0

    @property
    def loss(self) -> torch.Tensor:
        """The step's weighted mean loss (float64), from the detached losses of every rank.

        A scale-after step reduced it with its counts. Otherwise, with
        ``loss_logging="on_read"``, the first read issues one all-reduce, so every rank must
        read it, or none; with ``"next_step"`` it travels with the next step's counts, so a read
        after the next ``begin()`` costs no collective (a read before that issues its own).
        """
        if self._missing_losses:
            raise RuntimeError(
                f"the loss of this step is unknown: {self._missing_losses} of its microbatches "
                "went through backward_scale() without their loss; pass each microbatch's loss "
                "through scale_loss() to have it logged"
            )
        if self._loss is None:
            if self._loss_source is None:
                self._loss_source = (_Reduction(self._collective, self._loss_sum_to_send()), 0)
            reduction, slot = self._loss_source
            loss_sum = reduction.result()[slot].to(torch.float64)
            self._loss = weighting.weighted_mean(loss_sum, self._global_weight())
        return self._loss

    def _global_weight(self) -> torch.Tensor:
        return self._counts.total(self._weight_slot)

    def _count(self, slot: int) -> torch.Tensor | None:
        if not self._declared[slot]:
            return None
        return self._counts.result()[slot].to(torch.int64)

    def _loss_sum_to_send(self) -> torch.Tensor:
        """This rank's share of the loss numerator, on the device the counts are reduced on."""
        device = self._counts.result().device
        if self._local_loss_sum is None:
            return torch.zeros(1, dtype=torch.float64, device=device)
        return self._local_loss_sum.to(device, non_blocking=True).reshape(1)


class _Step:
    """The state of one optimizer step between ``begin()`` and ``end()``.

    A count-first step has its weights and its count reduction from ``begin()``; a scale-after
    step adds up its counts as the microbatches come, against ``estimate``, the global weight
    its provisional scales assume.
    """

    def __init__(
        self,
        index: int,
        declared: tuple[bool, bool],
        weights: torch.Tensor | None = None,
        counts: _Reduction | None = None,
        estimate: torch.Tensor | None = None,
    ) -> None:
        self.index = index
        self.declared = declared
        self.weights = weights
        self.counts = counts
        self.estimate = estimate
        self.local_totals: dict[str, torch.Tensor] = {}  # scale-after: sums so far
        self.microbatches = 0
        self.missing_losses = 0
        self.loss_sum: torch.Tensor | None = None
        self._scales: torch.Tensor | None = None

    @property
    def counts_first(self) -> bool:
        return self.weights is not None

    def scales(
        self, weight_slot: int, divisor: float, loss_reduction: LossReduction
    ) -> torch.Tensor:
        """Every declared microbatch's factor (float64), computed once, when first needed:
        that first call waits for the count reduction."""
        if self._scales is None:
            assert self.weights is not None and self.counts is not None
            total = self.counts.total(weight_slot)
            weights = self.weights.to(torch.float64)
            scales = weighting.backward_scale(weights, total, divisor, loss_reduction)
            self._scales = scales.expand(weights.shape)  # a summed loss's factor is shared
        return self._scales

    def add_loss(self, contribution: torch.Tensor) -> None:
        self.loss_sum = contribution if self.loss_sum is None else self.loss_sum + contribution


class Accumulator:
    """Weights each microbatch's loss so that an optimizer step optimises the global mean.

    One step, on every data-parallel rank, counting first (the counts come from the batch)::

        acc.begin(num_tokens=[...])         # this rank's count per microbatch
        for batch in microbatches:
            acc.scale_loss(loss_of(batch)).backward()
        result = acc.end()                  # result.loss, .num_tokens, .is_empty

    or scaling after (the counts are known only as the microbatches come)::

        acc.begin()
        for batch in microbatches:
            acc.scale_loss(loss_of(batch), num_tokens=count_of(batch)).backward()
        result = acc.end(model.parameters())  # rescales the gradients once

    The gradient of the step, after the data-parallel wrapper has combined the ranks, is the
    gradient of ``sum(w * l) / W`` (mean losses) or ``sum(l) / W`` (summed losses) over every
    microbatch of every rank, where ``w`` is a microbatch's count and ``W`` the global count:
    the same however the step's items are split into ranks and microbatches.

    Args:
        weight_by: which count weights a microbatch: ``"tokens"`` or ``"samples"``.
        loss_reduction: whether each loss you pass is the ``"mean"`` or the ``"sum"`` of its
            items' losses. ``"sum"`` is exact for empty microbatches whatever the loss; a
            hand-written mean over zero items has a NaN backward of its own (docs/usage.md).
        grad_reduction: how the data-parallel wrapper combines the ranks' gradients:
            ``"mean"`` (DDP and FSDP by default), ``"sum"`` (e.g. FSDP2 with
            ``set_gradient_divide_factor(1.0)``), or the number it divides their sum by.
        group: the data-parallel ``torch.distributed`` process group to reduce the counts
            over (default: the default group if torch.distributed is initialized, else none).
            With tensor or context parallelism, pass the group of the data-parallel replicas.
        collective: a :class:`Collective` to reduce with instead of a process group.
        loss_logging: when the logged loss of a count-first step is reduced over the ranks:
            ``"on_read"`` (one all-reduce the first time ``StepResult.loss`` is read) or
            ``"next_step"`` (carried by the next step's reduction, at no extra collective).
        weight_estimate: for scale-after steps, the global weight the first one's provisional
            scales assume; later ones assume the previous step's. Default 1: raw counts, which
            bf16 and fp32 gradients hold; give a rough ``W`` for fp16 ones.
    """

    def __init__(
        self,
        *,
        weight_by: WeightBy = "tokens",
        loss_reduction: LossReduction = "mean",
        grad_reduction: GradReduction | float = "mean",
        group: dist.ProcessGroup | None = None,
        collective: Collective | None = None,
        loss_logging: LossLogging = "on_read",
        weight_estimate: float = 1.0,
    ) -> None:
        _check_choice("weight_by", weight_by, ("tokens", "samples"))
        _check_choice("loss_reduction", loss_reduction, ("mean", "sum"))
        _check_choice("loss_logging", loss_logging, ("on_read", "next_step"))
        _check_positive(
            "grad_reduction",
            grad_reduction,
            "'mean' (the wrapper averages the "
            "ranks' gradients, as DDP and FSDP do), 'sum', or the positive number "
            "it divides their sum by",
            allowed=("mean", "sum"),
        )
        _check_positive(
            "weight_estimate",
            weight_estimate,
            "a positive number, roughly the global count of a step",
        )
        if collective is not None and group is not None:
            raise ValueError(
                f"group={group!r} and collective={collective!r} were both given; pass one: "
                "group for a torch.distributed process group, collective for anything else"
            )
        if collective is not None and not isinstance(collective, Collective):
            raise TypeError(
                f"collective={collective!r} is not a Collective; implement world_size, device, "
                "can_reduce_on() and all_reduce_sum() (see lossweight.Collective)"
            )
        self.weight_by: WeightBy = weight_by
        self.loss_reduction: LossReduction = loss_reduction
        self.loss_logging: LossLogging = loss_logging
        self.collective: Collective = (
            collective if collective is not None else default_collective(group)
        )
        self.divisor = weighting.gradient_divisor(grad_reduction, self.collective.world_size)
        self._weight_estimate = float(weight_estimate)
        self._weight_slot = _TOKENS if weight_by == "tokens" else _SAMPLES
        self._step: _Step | None = None
        self._steps_begun = 0
        self._previous: StepResult | None = None

    def begin(self, *, num_samples: Counts | None = None, num_tokens: Counts | None = None) -> None:
        """Open an optimizer step.

        Count first: pass this rank's counts, one per microbatch it will run in this step (none
        is fine), as a 1-D integer tensor or a sequence of ints or 0-dim integer tensors. The
        count named by ``weight_by`` is required; the other is optional and only reported.
        Counts on the CPU, Python ints included, are copied to the collective's device (CUDA
        for NCCL) without blocking; counts on an accelerator stay there, and the collective
        must reduce on it. One all-reduce starts here and overlaps whatever runs until the
        first scale is needed.

        Scale after: pass no counts, and give each microbatch's counts to ``scale_loss()``.
        """
        if self._step is not None:
            raise RuntimeError(
                f"begin() was called while step {self._step.index} is still open; call end() "
                "to close it first"
            )
        if num_samples is None and num_tokens is None:
            self._steps_begun += 1
            # The weighting count is always given; the other one as the microbatches say.
            declared = (self._weight_slot == _SAMPLES, self._weight_slot == _TOKENS)
            self._step = _Step(self._steps_begun, declared, estimate=self._estimate())
            return
        weight_name = f"num_{self.weight_by}"
        given = {"num_samples": num_samples, "num_tokens": num_tokens}
        if given[weight_name] is None:
            raise ValueError(
                f"{weight_name}=None, but weight_by={self.weight_by!r} weights each microbatch "
                f"by it; pass {weight_name}=[one count per microbatch], or no counts at all to "
                "give them with each loss"
            )
        counts = {
            name: _as_counts(name, value) for name, value in given.items() if value is not None
        }
        lengths = {name: len(value) for name, value in counts.items()}
        if len(set(lengths.values())) > 1:
            raise ValueError(
                f"num_samples has {lengths['num_samples']} counts but num_tokens has "
                f"{lengths['num_tokens']}; give both one count per microbatch"
            )
        totals = self._totals(counts)
        self._steps_begun += 1
        self._step = _Step(
            self._steps_begun,
            ("num_samples" in counts, "num_tokens" in counts),
            weights=counts[weight_name].to(totals.device, non_blocking=True),
            counts=self._reduce(totals, own_loss_sum=None),
        )

    def backward_scale(
        self, *, num_samples: Count | None = None, num_tokens: Count | None = None
    ) -> torch.Tensor:
        """The factor to multiply the next microbatch's loss by before ``backward()``.

        Count first: ``w * D / W`` for mean losses, ``D / W`` for summed ones (``D``:
        ``self.divisor``); 0 for every microbatch of an empty step. Scale after: the same
        against the step's estimate of ``W``, with this microbatch's counts given here, as to
        :meth:`scale_loss`. A 0-dim float64 tensor on the counts' device. Each call takes the
        next microbatch. Prefer :meth:`scale_loss`, which also records the loss for the logged
        value and keeps an empty microbatch's NaN mean out of the gradients.
        """
        step = self._open_step("backward_scale")
        _, scale = self._next_microbatch(step, "backward_scale", num_samples, num_tokens)
        step.missing_losses += 1
        return scale

    def scale_loss(
        self,
        loss: torch.Tensor,
        *,
        num_samples: Count | None = None,
        num_tokens: Count | None = None,
    ) -> torch.Tensor:
        """``loss`` times the next microbatch's factor, ready for ``backward()``.

        ``loss`` is this microbatch's loss: a 0-dim floating-point tensor, the mean or the sum
        (per ``loss_reduction``) of its items' losses. In a scale-after step, also pass its
        counts (an int or a 0-dim integer tensor each; the one named by ``weight_by`` is
        required). A microbatch of weight 0 contributes exactly nothing: its loss is replaced
        by 0 (value and gradient), so the NaN of a mean over zero items reaches neither the
        logged loss nor the gradients through here. Its detached value is recorded for
        ``StepResult.loss``.
        """
        _check_loss(loss)
        step = self._open_step("scale_loss")
        weight, scale = self._next_microbatch(step, "scale_loss", num_samples, num_tokens)
        weight = weight.to(loss.device, non_blocking=True)
        guarded = torch.where(weight > 0, loss, 0.0)
        step.add_loss(
            weighting.loss_contribution(
                guarded.detach().to(torch.float64), weight, self.loss_reduction
            )
        )
        scale = scale.to(
            device=loss.device,
            dtype=torch.promote_types(loss.dtype, torch.float32),
            non_blocking=True,
        )
        return guarded * scale

    def end(self, parameters: Iterable[torch.Tensor] | None = None) -> StepResult:
        """Close the step and return what it reports (see :class:`StepResult`).

        Call it on every rank after the step's last backward, before gradient clipping and
        ``optimizer.step()``. A scale-after step needs ``parameters`` (``model.parameters()``):
        its one all-reduce sums the counts and the loss sums, and every gradient is multiplied
        by the correcting factor in one pass per device and dtype, on the device. Parameters
        without a gradient are skipped; sharded gradients (FSDP2's DTensors) are scaled shard
        by shard. A count-first step's gradients are final already: pass no parameters.
        """
        step = self._open_step("end")
        if step.counts_first:
            assert step.weights is not None and step.counts is not None
            if parameters is not None:
                raise ValueError(
                    "end() got parameters, but this step declared its counts in begin(), so "
                    "its gradients are final already; call end() without them"
                )
            if step.microbatches != len(step.weights):
                raise RuntimeError(
                    f"end() was called after {step.microbatches} of the {len(step.weights)} "
                    f"microbatches that begin() declared for step {step.index}; scale every "
                    "declared microbatch, or declare fewer"
                )
            counts, loss_slot = step.counts, None
        else:
            if parameters is None:
                raise ValueError(
                    "end() needs parameters in a scale-after step (one whose counts came with "
                    "each loss), to rescale their gradients: call end(model.parameters())"
                )
            own_loss_sum = step.loss_sum if step.loss_sum is not None else torch.zeros(())
            counts = self._reduce(self._totals(step.local_totals), own_loss_sum)
            loss_slot = _OWN_LOSS
            assert step.estimate is not None
            correction = weighting.gradient_correction(
                counts.total(self._weight_slot), step.estimate
            )
            _scale_gradients(parameters, correction)
        self._step = None
        result = StepResult(
            counts,
            self._weight_slot,
            step.declared,
            step.loss_sum,
            self.collective,
            step.missing_losses,
            loss_slot,
        )
        self._previous = result
        return result

    def _next_microbatch(
        self,
        step: _Step,
        caller: str,
        num_samples: Count | None,
        num_tokens: Count | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Take the next microbatch of the step: its weight and its (provisional) scale."""
        given = {"num_samples": num_samples, "num_tokens": num_tokens}
        if step.counts_first:
            assert step.weights is not None
            if num_samples is not None or num_tokens is not None:
                raise ValueError(
                    f"{caller}() got counts, but begin() declared the counts of step "
                    f"{step.index} already; call {caller}() without them, or begin() without "
                    "counts to give them here"
                )
            if step.microbatches >= len(step.weights):
                raise RuntimeError(
                    f"{caller}() was called for microbatch {step.microbatches + 1} of step "
                    f"{step.index}, but begin() declared {len(step.weights)} microbatches; "
                    "declare one count per microbatch in begin()"
                )
            weight = step.weights[step.microbatches]
            scales = step.scales(self._weight_slot, self.divisor, self.loss_reduction)
            scale = scales[step.microbatches]
        else:
            weight_name = f"num_{self.weight_by}"
            if given[weight_name] is None:
                raise ValueError(
                    f"{caller}() got {weight_name}=None in a scale-after step (begin() had no "
                    f"counts); pass {weight_name}=<this microbatch's count>, or declare all "
                    "counts in begin()"
                )
            declared = (num_samples is not None, num_tokens is not None)
            if step.microbatches and declared != step.declared:
                raise ValueError(
                    f"{caller}() got {_given(declared)} for microbatch {step.microbatches + 1}"
                    f" but {_given(step.declared)} for the ones before; give the same counts "
                    "for every microbatch of a step"
                )
            counts = {name: _as_count(name, c) for name, c in given.items() if c is not None}
            step.declared = declared
            for name, count in counts.items():
                running = step.local_totals.get(name)
                step.local_totals[name] = count if running is None else running + count
            weight = counts[weight_name]
            assert step.estimate is not None
            scale = weighting.backward_scale(
                weight.to(torch.float64), step.estimate, self.divisor, self.loss_reduction
            )
        step.microbatches += 1
        return weight, scale

    def _estimate(self) -> torch.Tensor:
        """The global weight a scale-after step's provisional scales assume: the previous
        step's, the same on every rank, or ``weight_estimate`` for the first step."""
        if self._previous is None:
            return torch.tensor(self._weight_estimate, dtype=torch.float64)
        return self._previous._global_weight()

    def _totals(self, counts: dict[str, torch.Tensor]) -> torch.Tensor:
        """This rank's (samples, tokens) totals as int64, on the device they are reduced on;
        0 for a count not given."""
        device = self._counts_device(counts)
        return torch.stack(
            [
                counts[name].to(device, non_blocking=True).sum()
                if name in counts
                else torch.zeros((), dtype=torch.int64, device=device)
                for name in ("num_samples", "num_tokens")
            ]
        )

    def _reduce(self, totals: torch.Tensor, own_loss_sum: torch.Tensor | None) -> _Reduction:
        """Start the step's one all-reduce: its count totals, and the loss sums that travel
        with them.

        Its layout depends on the step's mode and ``loss_logging`` only, never on what a rank
        holds, so that every rank reduces a payload of the same shape.
        """
        if own_loss_sum is None and self.loss_logging == "on_read":
            return _Reduction(self.collective, totals)  # two int64 counts
        device = totals.device
        previous = self._previous
        carried = (
            previous
            if self.loss_logging == "next_step"
            and previous is not None
            and previous._loss_source is None
            else None
        )
        carried_sum = (
            torch.zeros(1, dtype=torch.float64, device=device)
            if carried is None
            else carried._loss_sum_to_send().to(device, non_blocking=True)
        )
        # float64 holds every count below 2**53 exactly, so the counts are not rounded.
        parts = [totals.to(torch.float64), carried_sum]
        if own_loss_sum is not None:
            parts.append(own_loss_sum.to(device, torch.float64, non_blocking=True).reshape(1))
        reduction = _Reduction(self.collective, torch.cat(parts))
        if carried is not None:
            carried._loss_source = (reduction, _PREVIOUS_LOSS)
        return reduction

    def _open_step(self, caller: str) -> _Step:
        if self._step is None:
            when = (
                "before the first begin()"
                if self._steps_begun == 0
                else f"after end() closed step {self._steps_begun}"
            )
            raise RuntimeError(
                f"{caller}() was called {when}; call begin(num_{self.weight_by}=[...]) to open "
                "a step first"
            )
        return self._step

    def _counts_device(self, counts: dict[str, torch.Tensor]) -> torch.device:
        """The device the step's counts are reduced on, checked against the collective.

        Counts on the CPU (Python ints included) go to the collective's device with a
        non-blocking copy. Counts on an accelerator stay where they are, since moving them
        elsewhere would wait for the device, so the collective must reduce there.
        """
        device = _accelerator_of("num_samples and num_tokens", [c.device for c in counts.values()])
        if device.type == "cpu":
            return self.collective.device
        if not self.collective.can_reduce_on(device):
            name = next(name for name, c in counts.items() if c.device == device)
            raise ValueError(
                f"{name} is on {device}, where the collective cannot reduce (it reduces on "
                f"{self.collective.device.type}); pass {name} on the CPU (Python ints or a CPU "
                f"tensor), or reduce over a group whose backend handles {device.type} tensors"
            )
        return device


def _accelerator_of(what: str, devices: list[torch.device]) -> torch.device:
    """The one non-CPU device among ``devices``, or the CPU if there is none."""
    accelerators = {device for device in devices if device.type != "cpu"}
    if len(accelerators) > 1:
        raise ValueError(
            f"{what} are on different devices ({sorted(map(str, accelerators))}); put the "
            "counts on one device, or on the CPU"
        )
    return accelerators.pop() if accelerators else torch.device("cpu")


def _as_count(name: str, value: Count) -> torch.Tensor:
    """Check one count the user passed and turn it into a 0-dim int64 tensor."""
    if isinstance(value, torch.Tensor):
        _check_count_tensor(name, value, 0, "each count must be a 0-dim tensor or an int")
        return value.to(torch.int64)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"{name}={value!r} is not an integer count; counts are numbers of samples or "
            "tokens: pass ints, or an integer tensor"
        )
    if value < 0:
        raise ValueError(
            f"{name}={value} is negative; counts are numbers of samples or tokens, 0 or more"
        )
    return torch.tensor(int(value), dtype=torch.int64)


def _as_counts(name: str, value: Counts) -> torch.Tensor:
    """Check the counts of a step the user passed and turn them into a 1-D int64 tensor."""
    if isinstance(value, torch.Tensor):
        _check_count_tensor(name, value, 1, "pass one count per microbatch, as a 1-D tensor")
        return value.to(torch.int64)
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(
            f"{name}={value!r} is not a sequence of counts; pass one count per microbatch, as "
            "a 1-D integer tensor or a list of ints"
        )
    counts = [_as_count(f"{name}[{index}]", count) for index, count in enumerate(value)]
    if not any(isinstance(count, torch.Tensor) for count in value):
        return torch.tensor(list(value), dtype=torch.int64)  # checked ints
    device = _accelerator_of(f"the tensors in {name}", [count.device for count in counts])
    return torch.stack([count.to(device, non_blocking=True) for count in counts])


def _check_count_tensor(name: str, counts: torch.Tensor, dim: int, shape_rule: str) -> None:
    """Check the shape, dtype and sign of counts given as a tensor."""
    if counts.dim() != dim:
        raise ValueError(f"{name} is a tensor of shape {tuple(counts.shape)}; {shape_rule}")
    if counts.is_floating_point() or counts.is_complex() or counts.dtype == torch.bool:
        raise TypeError(
            f"{name} has dtype {counts.dtype}, but counts must be integers; pass an integer "
            "tensor (e.g. mask.sum(-1), which is int64) or Python ints"
        )
    # Checked where the counts live, without reading them back: on the CPU this raises
    # RuntimeError at once; on an accelerator the failure surfaces at the next host sync.
    torch._assert_async(
        (counts >= 0).all(),
        f"{name} holds a negative count; counts are numbers of samples or tokens, 0 or more",
    )


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        options = " or ".join(repr(choice) for choice in choices)
        raise ValueError(f"{name}={value!r} is not supported; pass {options}")


def _check_positive(name: str, value: object, expected: str, allowed: tuple[str, ...] = ()) -> None:
    if value in allowed:
        return
    is_number = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if is_number and 0 < float(value) < math.inf:  # type: ignore[arg-type]
        return
    raise ValueError(f"{name}={value!r} is not supported; pass {expected}")


def _given(declared: tuple[bool, bool]) -> str:
    names = [
        name for name, given in zip(("num_samples", "num_tokens"), declared, strict=True) if given
    ]
    return " and ".join(names) or "no counts"


def _scale_gradients(parameters: Iterable[torch.Tensor], factor: torch.Tensor) -> None:
    """Multiply every gradient by ``factor``: one fused multiply per device and dtype."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for parameter in parameters:
        grad = parameter.grad
        if grad is None:
            continue
        # A DTensor (FSDP2) is scaled through its local shard, which is all this rank holds.
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        groups[(local.device, local.dtype)].append(local)
    for (device, _), grads in groups.items():
        # The float64 factor is applied at the gradients' precision or better, never rounded
        # to bf16 or fp16 first.
        torch._foreach_mul_(grads, factor.to(device, non_blocking=True))


def _check_loss(loss: object) -> None:
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"loss={loss!r} is not a tensor; pass the microbatch's loss tensor")
    if loss.dim() != 0:
        raise ValueError(
            f"loss has shape {tuple(loss.shape)}, but it must be a scalar (0-dim) tensor; "
            "reduce it to the mean or the sum of its items first"
        )
    if not loss.is_floating_point():
        raise TypeError(f"loss has dtype {loss.dtype}; pass a floating-point loss")
