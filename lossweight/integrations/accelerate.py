"""An Accumulator bound to an ``accelerate.Accelerator``.

:class:`AcceleratorAccumulator` reads the gradient accumulation steps from the Accelerator and
undoes the division by them that ``accelerator.backward()`` applies to every loss (through the
Accumulator's ``framework_divides_loss_by``), checks that the process group it reduces over is
the Accelerator's world, and ends each optimizer step when ``accelerator.sync_gradients`` is
true. It runs either mode of the Accumulator.

Scale after, for a streaming loop that sees one microbatch at a time: each ``scale_loss()``
that finds no step open begins one, and ``accelerate``'s own ``accumulate()`` decides where the
step ends (every ``gradient_accumulation_steps`` microbatches, and at the end of a prepared
dataloader)::

    lw = AcceleratorAccumulator(accelerator, model, loss_reduction="sum")
    for batch in dataloader:
        with lw.accumulate():
            loss_sum, count = lossweight.token_cross_entropy(model(batch["x"]), batch["y"])
            accelerator.backward(lw.scale_loss(loss_sum, num_tokens=count))
            lw.end_if_sync()          # the StepResult at the step's last microbatch, else None
            optimizer.step()          # accelerate steps only when sync_gradients is true
            optimizer.zero_grad()

Count first, when the counts of a step's microbatches are known before it runs (they come from
the labels): give them to ``begin()``, whose one all-reduce overlaps the first forward. The step
then ends at its last declared microbatch: ``accumulate()`` sets ``sync_gradients`` there, and
skips the gradient synchronization before it, whatever accelerate's own counter says::

    for window in lw.windows(dataloader):         # gradient_accumulation_steps batches each
        lw.begin(num_tokens=[count(batch) for batch in window])
        for batch in window:
            with lw.accumulate():
                accelerator.backward(lw.scale_loss(loss_of(batch)))
                lw.end_if_sync()
                optimizer.step()
                optimizer.zero_grad()

A scale-after step's gradients are provisional until ``end_if_sync()`` rescales them, so the
helper refuses each way of using them before: ``end_if_sync()`` called before the backward of a
loss that ``scale_loss()`` returned, an optimizer that ``accelerator.prepare()`` returned
stepping while the step is still open, and the next ``accumulate()`` block of a step whose last
microbatch ran without ``end_if_sync()``.

Relies on these ``Accelerator`` attributes: ``gradient_accumulation_steps`` (what ``backward``
divides by, and what DeepSpeed's engine divides by), ``sync_gradients`` (read, and set in a
count-first step), ``accumulate()``, ``no_sync()``, ``num_processes``, ``distributed_type``
and ``_optimizers`` (the optimizers ``prepare()`` returned, whose steps are watched). Under
DeepSpeed, ``accelerator.backward()`` steps the optimizer itself at the step's last
microbatch, before ``end()``: count first there (scaling after is refused). DeepSpeed is not
covered by the tests.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import weakref
from collections.abc import Iterable, Iterator
from typing import Any, Literal, TypeVar

import torch
import torch.distributed as dist
from accelerate import Accelerator  # type: ignore[import-untyped]  # ships no py.typed
from accelerate.utils import DistributedType  # type: ignore[import-untyped]

from ..accumulator import Accumulator, Count, Counts, StepContext
from ..errors import add_messages, error
from ..machine import COUNT_FIRST, SCALE_AFTER
from ..result import StepResult
from ..weighting import GradReduction, LossReduction

# The rows of this module's errors, added to lossweight.errors.MESSAGES when it is imported.
# fmt: off
_MESSAGES: dict[str, tuple[type[Exception], str]] = {
    "accelerate_deepspeed": (RuntimeError, "under DeepSpeed, accelerator.backward() steps the optimizer at the step's last microbatch, before end() could rescale the gradients; count first: give the step's counts to begin() before its first microbatch"),
    "accelerate_backward_missing": (RuntimeError, "end_if_sync() was called in step {step} when only {backpropagated} of the {scaled} losses that scale_loss() returned had gone through accelerator.backward(): ending the step now rescales the gradients without the later ones, which keep their provisional factors; call end_if_sync() after accelerator.backward(lw.scale_loss(...)), before clipping and optimizer.step()"),
    "accelerate_no_model": (ValueError, "AcceleratorAccumulator needs the prepared model, to skip its gradient synchronization and to rescale its gradients: pass it to the constructor (AcceleratorAccumulator(accelerator, model, ...)) or to accumulate(model)"),
    "accelerate_window_changed": (RuntimeError, "accelerator.gradient_accumulation_steps changed from {before} to {now}; build a new AcceleratorAccumulator after changing it"),
    "accelerate_world": (RuntimeError, "the default process group has {world} ranks but the Accelerator {processes} processes; lossweight reduces over the default group, which must be the Accelerator's data-parallel world"),
    "accelerate_unended": (RuntimeError, "the gradients of step {step} are still provisional: accelerate synchronized them at its last microbatch, and end_if_sync() was not called to rescale them; call lw.end_if_sync() after accelerator.backward() in every microbatch, before clipping and optimizer.step()"),
}
# fmt: on
add_messages(_MESSAGES)

__all__ = ["AcceleratorAccumulator"]

T = TypeVar("T")


class AcceleratorAccumulator:
    """A :class:`lossweight.Accumulator` for a loop driven by ``accelerator``.

    Args:
        accelerator: the ``Accelerator``; its ``gradient_accumulation_steps`` is read now.
        model: the model as ``accelerator.prepare()`` returned it: its parameters are rescaled
            by a scale-after step, and its gradient synchronization is skipped before a
            count-first step's last microbatch. Needed for both, unless passed to
            :meth:`accumulate`.

    ``loss_reduction``, ``weight_by``, ``grad_reduction``, ``loss_logging`` and
    ``weight_estimate`` are those of :class:`lossweight.Accumulator`.

    Attributes:
        accumulator: the :class:`lossweight.Accumulator`.
        result: the :class:`lossweight.StepResult` of the last step that ended, or None.
    """

    def __init__(
        self,
        accelerator: Accelerator,
        model: torch.nn.Module | None = None,
        *,
        loss_reduction: LossReduction,
        weight_by: Literal["tokens", "samples"] = "tokens",
        grad_reduction: GradReduction | float = "mean",
        loss_logging: Literal["end", "next_step"] = "end",
        weight_estimate: float = 1.0,
    ) -> None:
        self.accelerator = accelerator
        self.model = model
        self.gradient_accumulation_steps = int(accelerator.gradient_accumulation_steps)
        self.accumulator = Accumulator(
            loss_reduction=loss_reduction,
            weight_by=weight_by,
            grad_reduction=grad_reduction,
            loss_logging=loss_logging,
            weight_estimate=weight_estimate,
            framework_divides_loss_by=self.gradient_accumulation_steps,
        )
        self.result: StepResult | None = None
        self._windows = 0  # the accumulate() blocks of the open count-first step
        # The losses scale_loss() returned in the open scale-after step that a backward went
        # through (a hook on each counts it).
        self._backpropagated = 0
        # The scale-after step whose last microbatch's accumulate() block ended with it open.
        self._unended = 0
        self._watched: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()

    @property
    def step_open(self) -> bool:
        """Whether a step is open (begun, and not yet ended)."""
        return self.accumulator.step_open

    def begin(
        self, *, num_samples: Counts | None = None, num_tokens: Counts | None = None
    ) -> StepContext:
        """Begin a count-first step: this rank's counts, one per microbatch it will run in it
        (normally ``gradient_accumulation_steps`` of them, fewer at the end of the data)."""
        self._check_world()
        context = self.accumulator.begin(num_samples=num_samples, num_tokens=num_tokens)
        self._windows = 0
        return context

    @contextlib.contextmanager
    def accumulate(self, model: torch.nn.Module | None = None) -> Iterator[None]:
        """Use in place of ``accelerator.accumulate(model)`` around each microbatch.

        In a count-first step it sets ``accelerator.sync_gradients`` to whether this is the
        step's last declared microbatch, and skips the gradient synchronization before it;
        otherwise it is ``accelerator.accumulate(model)``.
        """
        model = self._model(model)
        step = self.accumulator.state.step  # the step machine's state: read, never copied
        if step is None or step.mode != COUNT_FIRST:
            if step is not None and step.number == self._unended:
                raise error("accelerate_unended", step=step.number)
            with self.accelerator.accumulate(model):
                yield
            step = self.accumulator.state.step
            if step is not None and self.accelerator.sync_gradients:
                self._unended = step.number
            return
        # This microbatch's position is the number of accumulate() blocks the step opened
        # before it: the machine's count of scaled microbatches stays 0 where scale_loss() runs
        # compiled (the device counts them), and a step there would never end.
        last = self._windows == step.declared - 1
        self._windows += 1
        self.accelerator.sync_gradients = last
        with contextlib.nullcontext() if last else self.accelerator.no_sync(model):
            yield

    def scale_loss(
        self,
        loss: torch.Tensor,
        *,
        num_samples: Count | None = None,
        num_tokens: Count | None = None,
    ) -> torch.Tensor:
        """The loss to give ``accelerator.backward()``. With no step open, this begins a
        scale-after step (so the counts are required here); see
        :meth:`lossweight.Accumulator.scale_loss`."""
        if not self.accumulator.step_open:
            self._check_world()
            if self.accelerator.distributed_type == DistributedType.DEEPSPEED:
                raise error("accelerate_deepspeed")
            self.accumulator.begin(parameters=self._model(None).parameters())
            self._backpropagated = 0
            self._watch_optimizers()
        step = self.accumulator.state.step
        scaled = self.accumulator.scale_loss(loss, num_samples=num_samples, num_tokens=num_tokens)
        if step is not None and step.mode == SCALE_AFTER and scaled.requires_grad:
            scaled.register_hook(self._count_backpropagated)  # type: ignore[no-untyped-call]
        return scaled

    def end_if_sync(self) -> StepResult | None:
        """End the step if ``accelerator.sync_gradients`` is true (the step's last microbatch):
        after its ``backward()``, before clipping and ``optimizer.step()``. Returns the
        :class:`lossweight.StepResult`, also kept in :attr:`result`; None otherwise."""
        step = self.accumulator.state.step
        if not self.accelerator.sync_gradients or step is None:
            return None
        if step.mode == SCALE_AFTER and self._backpropagated < step.scaled:
            raise error(
                "accelerate_backward_missing",
                step=step.number,
                backpropagated=self._backpropagated,
                scaled=step.scaled,
            )
        self.result = self.accumulator.end()
        return self.result

    def abandon(self) -> None:
        """Drop the open step (on every rank), as :meth:`lossweight.Accumulator.abandon`."""
        self.accumulator.abandon()

    def flush(self) -> None:
        """Reduce the last step's loss that ``loss_logging="next_step"`` left waiting (on every
        rank, after the last step), as :meth:`lossweight.Accumulator.flush`."""
        self.accumulator.flush()

    def windows(self, batches: Iterable[T]) -> Iterator[list[T]]:
        """``batches`` in lists of ``gradient_accumulation_steps`` (the last may be shorter):
        the microbatches of each count-first step."""
        iterator = iter(batches)
        while window := list(itertools.islice(iterator, self.gradient_accumulation_steps)):
            yield window

    def _count_backpropagated(self, grad: torch.Tensor) -> None:
        self._backpropagated += 1

    def _watch_optimizers(self) -> None:
        """Hook the step of each prepared optimizer of the model's parameters, once: it must
        not step on a scale-after step's provisional gradients. An optimizer of another model
        may step while this one's step is open."""
        # The torch optimizers that accelerate wraps: theirs is the step that updates.
        optimizers = [getattr(o, "optimizer", o) for o in self.accelerator._optimizers]
        new = [optimizer for optimizer in optimizers if optimizer not in self._watched]
        if not new:
            return
        parameters = {id(parameter) for parameter in self._model(None).parameters()}
        reference = weakref.ref(self)
        for optimizer in new:
            self._watched.add(optimizer)
            if any(
                id(p) in parameters for group in optimizer.param_groups for p in group["params"]
            ):
                optimizer.register_step_pre_hook(functools.partial(_before_step, reference))

    def _model(self, model: torch.nn.Module | None) -> Any:
        model = model if model is not None else self.model
        if model is None:
            raise error("accelerate_no_model")
        return model

    def _check_world(self) -> None:
        if self.accelerator.gradient_accumulation_steps != self.gradient_accumulation_steps:
            raise error(
                "accelerate_window_changed",
                before=self.gradient_accumulation_steps,
                now=self.accelerator.gradient_accumulation_steps,
            )
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if world != self.accelerator.num_processes:
            raise error("accelerate_world", world=world, processes=self.accelerator.num_processes)


def _before_step(reference: weakref.ref[AcceleratorAccumulator], optimizer: Any, *_: Any) -> None:
    """A prepared optimizer's step pre-hook: the step of the model's lossweight step must have
    ended. Holds the helper weakly, so that one dropped does not outlive its loop."""
    helper = reference()
    step = helper.accumulator.state.step if helper is not None else None
    if step is not None and step.mode == SCALE_AFTER:
        raise error("accelerate_unended", step=step.number)
