"""The Accumulator: a thin front over the step machine and the tensors of each mode.

Each public call checks its inputs (:mod:`lossweight.validate`), applies a transition of the
pure step machine (:mod:`lossweight.machine`), then runs its effects: it starts a reduction,
scales a loss or rescales the gradients (:mod:`lossweight.steps`), or builds a
:class:`~lossweight.StepResult`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from types import TracebackType
from typing import Any, Literal

import torch
import torch.distributed as dist

from . import _torch, machine, payload, terms, validate
from .collectives import Collective, CollectiveResolver
from .errors import error
from .payload import Reduction
from .result import PendingLoss, StepResult
from .steps import CountFirst, ScaleAfter
from .validate import Count, Counts
from .weighting import GradReduction, LossReduction

WeightBy = Literal["samples", "tokens"]
LossLogging = Literal["end", "next_step"]
_STATE_FORMAT = 1


class Accumulator:
    """Weights each microbatch's loss so that an optimizer step optimises the global mean.

    One step, on every data-parallel rank, counting first (the counts come from the batch)::

        acc.begin(num_tokens=[...])         # this rank's count per microbatch
        for batch in microbatches:
            acc.scale_loss(loss_of(batch)).backward()
        result = acc.end()                  # result.loss, .num_tokens, .is_empty

    or scaling after (the counts are known only as the microbatches come)::

        acc.begin(parameters=model.parameters())
        for batch in microbatches:
            acc.scale_loss(loss_of(batch), num_tokens=count_of(batch)).backward()
        result = acc.end()                  # rescales the gradients once

    The step's gradient, once the data-parallel wrapper has combined the ranks, is that of
    ``sum(w * l) / W`` (mean losses) or ``sum(l) / W`` (summed losses) over every microbatch of
    every rank, ``w`` a microbatch's count and ``W`` the global count: the same however the
    step is split. Every rank calls ``begin()``, ``end()``, ``abandon()`` and ``flush()`` for
    the same steps; ranks that disagree get a :class:`DisagreementError`, never wrong numbers.
    Not thread-safe, like an optimizer. docs/usage.md explains each argument at length.

    Args:
        loss_reduction: whether each loss you pass is the ``"mean"`` or the ``"sum"`` of its
            items' losses (required).
        weight_by: which count weights a microbatch: ``"tokens"`` or ``"samples"``.
        grad_reduction: how the data-parallel wrapper combines the ranks' gradients:
            ``"mean"`` (DDP, FSDP), ``"sum"``, or the number it divides their sum by.
        group: the data-parallel process group (default: the default group, looked up at each
            ``begin()``; a single process without torch.distributed).
        collective: a :class:`Collective` to reduce with instead of a process group.
        loss_logging: ``"end"`` (``end()`` reduces a count-first step's loss, one more
            all-reduce) or ``"next_step"`` (it travels with the next reduction).
        weight_estimate: the global weight the first scale-after step's provisional factors
            assume (later ones assume the previous step's).
        framework_divides_loss_by: what a training framework divides each loss by before its
            backward (Accelerate, Lightning: the accumulation steps); the factors undo it.
    """

    def __init__(
        self,
        *,
        loss_reduction: LossReduction | None = None,
        weight_by: WeightBy = "tokens",
        grad_reduction: GradReduction | float = "mean",
        group: dist.ProcessGroup | None = None,
        collective: Collective | None = None,
        loss_logging: LossLogging = "end",
        weight_estimate: float = 1.0,
        framework_divides_loss_by: float = 1,
    ) -> None:
        if loss_reduction is None:
            raise error("no_loss_reduction")
        self.options = terms.Options(
            loss_reduction, weight_by, grad_reduction, loss_logging, weight_estimate,
            framework_divides_loss_by,
        )  # fmt: skip
        self.layout = terms.Layout(self.options.terms)
        self._resolver = CollectiveResolver(group, collective)
        self.state = machine.State(weight_by, loss_logging)
        self._estimate: float | torch.Tensor = float(weight_estimate)
        self._tensors: CountFirst | ScaleAfter | None = None
        self._collective: Collective | None = None
        self._divisor = 1.0
        self._unsettled: list[Reduction] = []
        self._pending: PendingLoss | None = None

    @property
    def weight_by(self) -> WeightBy:
        return self.options.weight_by  # type: ignore[return-value]

    @property
    def loss_reduction(self) -> LossReduction:
        return self.options.loss_reduction  # type: ignore[return-value]

    @property
    def grad_reduction(self) -> GradReduction | float:
        return self.options.grad_reduction  # type: ignore[return-value]

    @property
    def loss_logging(self) -> LossLogging:
        return self.options.loss_logging  # type: ignore[return-value]

    @property
    def step_open(self) -> bool:
        """Whether ``begin()`` opened a step that neither ``end()`` nor ``abandon()`` closed."""
        return self.state.step is not None

    @property
    def steps(self) -> int:
        """How many steps have begun (the index of the last one)."""
        return self.state.steps

    def begin(
        self,
        *,
        num_samples: Counts | None = None,
        num_tokens: Counts | None = None,
        parameters: Iterable[Any] | None = None,
    ) -> StepContext:
        """Open an optimizer step; every rank calls it.

        Count first: this rank's counts, one per microbatch it will run (none is fine), as a
        1-D integer tensor or a sequence of ints or 0-dim integer tensors; the ``weight_by``
        count is required, the other only reported. One all-reduce starts here and overlaps
        whatever runs until the first factor is needed. Scale after: the ``parameters`` whose
        gradients ``end()`` rescales; their gradients must be None or zero now. Returns a
        context manager that abandons the step if an exception leaves its block.
        """
        given = {"num_samples": num_samples, "num_tokens": num_tokens}
        counted = num_samples is not None or num_tokens is not None
        machine.idle(self.state, "begin")
        if counted and parameters is not None:
            raise error("counts_and_parameters")
        if not counted and parameters is None:
            raise error("neither", weight_by=self.weight_by)
        if counted:
            counts = self._step_counts(given)
        else:
            params = validate.parameter_list(parameters)
        collective = self._resolver.resolve()
        self._divisor = self.options.divisor(collective.world_size)
        self._settle()
        declared = len(counts[self.weight_by]) if counted else 0
        state = machine.begin(self.state, counted, declared)
        tensors: CountFirst | ScaleAfter
        if counted:
            codes = self._codes(state.steps, terms.COUNT_FIRST_BEGIN)
            carried = self._pending.loss_sum if self._pending is not None else None
            tensors = CountFirst(collective, self.layout, codes, counts, self._divisor, carried)
            self._carry(tensors.reduction)
        else:
            tensors = ScaleAfter(params, self._estimate, self._divisor)
        self.state, self._tensors, self._collective = state, tensors, collective
        return StepContext(self, state.steps)

    def scale_loss(
        self,
        loss: torch.Tensor,
        *,
        num_samples: Count | None = None,
        num_tokens: Count | None = None,
    ) -> torch.Tensor:
        """``loss`` times the next microbatch's factor, ready for ``backward()``.

        ``loss`` is the microbatch's loss, a 0-dim floating-point tensor (its items' mean or
        sum, per ``loss_reduction``). In a scale-after step, also pass its counts (an int or a
        0-dim integer tensor each). A microbatch of weight 0 contributes exactly nothing: its
        loss (a NaN of 0/0 included) reaches neither the gradients nor the logged loss.
        """
        validate.loss(loss)
        given = (num_samples is not None, num_tokens is not None)
        tensors = self._tensors
        if not isinstance(tensors, ScaleAfter):  # count first, or no step (the machine says)
            if _torch.is_compiling() and tensors is not None and not any(given):
                machine.trace(self.state)
                return tensors.scale_traced(loss, self.loss_reduction)
            state, index = machine.scale(self.state, given, self._traced)
            assert tensors is not None
            scaled = tensors.scale(loss, index, self.loss_reduction, state.steps)
        else:
            counts = {"samples": num_samples, "tokens": num_tokens}
            checked = {
                n: None if c is None else validate.microbatch_count(f"num_{n}", c)
                for n, c in counts.items()
            }
            state, _ = machine.scale(self.state, given, traced=False)
            scaled = tensors.scale(loss, checked, self.weight_by, self.loss_reduction)
        self.state = state
        return scaled

    def backward_scale(self, microbatch: int | None = None) -> torch.Tensor:
        """The factor of a count-first step's microbatch: ``w * D / W`` for mean losses,
        ``D / W`` for summed ones (0 for a mean loss of weight 0), a 0-dim float64 tensor.

        ``backward_scale(i)`` gives microbatch ``i`` its factor: a loop that back-propagates
        ``loss * acc.backward_scale(i)`` itself takes the microbatch this way, and hands its
        detached loss over with :meth:`record_loss` for the logged loss. ``backward_scale()``
        reads the factor the next :meth:`scale_loss` will apply, taking nothing. Reading a
        factor again changes nothing; the first read waits for the count reduction.
        """
        self.state, index = machine.factor(self.state, microbatch, self._traced)
        tensors = self._count_first
        if index is None:  # the next microbatch of a compiled step: its position is a tensor
            index = int(tensors.cursor) if tensors.cursor is not None else 0
            if index >= tensors.size:
                raise error("no_next", declared=tensors.size, step=self.state.steps)
        return tensors.factors(self.loss_reduction)[index]

    def record_loss(self, microbatch: int, loss: torch.Tensor) -> None:
        """Hand over the loss of microbatch ``microbatch``, back-propagated with
        ``backward_scale(microbatch)``, so that ``StepResult.loss`` covers it: the loss as
        given to the factor (the mean or the sum of its items' losses), copied detached."""
        validate.loss(loss)
        self.state, index = machine.record(self.state, microbatch)
        self._count_first.record(index, loss)

    def end(self) -> StepResult:
        """Close the step and return what it reports (see :class:`StepResult`).

        Call it on every rank after the step's last backward, before gradient clipping and
        ``optimizer.step()``. A count-first step's gradients are final already; a scale-after
        step's one all-reduce sums its counts and losses, then every gradient of the parameters
        given to ``begin()`` is multiplied by the correcting factor, once, on its device. If
        ``end()`` raises, calling it again issues no second all-reduce.
        """
        state, step = machine.end(self.state, self._traced), self.state.step
        tensors = self._tensors
        assert step is not None and tensors is not None and self._collective is not None
        if isinstance(tensors, CountFirst):
            result = self._end_count_first(state, step, tensors)
        else:
            self._settle()
            codes = self._codes(step.index, terms.SCALE_AFTER_END)
            carried = self._pending.loss_sum if self._pending is not None else None
            reduction = tensors.finish(
                self._collective, self.layout, codes, step.given, self.loss_reduction, carried
            )
            self._carry(reduction)
            result = StepResult(step.index, reduction, reduction, [])
        self._estimate = result._counts.total(self.weight_by)
        self.state, self._tensors = state, None
        return result

    def abandon(self) -> None:
        """Drop the open step, if any, on every rank, keeping the Accumulator for the next.

        The gradients are left as they are: call ``optimizer.zero_grad()`` before the next
        step. A count-first step's reduction is waited for here, so none is left in flight.
        """
        tensors, self._tensors = self._tensors, None
        self.state = machine.abandon(self.state)
        if isinstance(tensors, CountFirst):
            tensors.reduction.wait()

    def flush(self) -> None:
        """Reduce the loss ``loss_logging="next_step"`` left waiting, if any, on every rank
        after the last step: one all-reduce when a loss waits, waited for before returning."""
        state, waits = machine.flush(self.state)
        if waits and self._pending is not None:
            collective = self._resolver.resolve()
            self._divisor = self.options.divisor(collective.world_size)
            self._settle()
            codes = self._codes(state.steps, terms.FLUSH)
            reduction = self._start_loss(collective, codes, collective.device, previous=True)
            self.state = state
            # Waited on once recorded: a wait that fails is retried, never a second all-reduce.
            reduction.wait()
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        """The step counter, the estimate of ``W`` the next scale-after step assumes, and the
        options, as plain values (``torch.load(weights_only=True)`` loads them). No process
        group: the state may be loaded at another world size. Call :meth:`flush` first to log
        a waiting loss; reading the estimate waits for the last step's reduction."""
        machine.idle(self.state, "state_dict")
        estimate = self._estimate
        return {
            "format": _STATE_FORMAT,
            "steps": self.state.steps,
            "weight_estimate": estimate if isinstance(estimate, float) else estimate.item(),
            "options": {name: getattr(self.options, name) for name in terms.OPTIONS},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from ``state_dict()``'s value, saved with the same options."""
        machine.idle(self.state, "load_state_dict")
        steps, estimate = _checked_state(state_dict, self.options)
        self.state, self._estimate, self._pending = machine.load(self.state, steps), estimate, None

    def __getstate__(self) -> dict[str, Any]:
        if self._resolver.explicit:
            raise error("not_picklable")
        options = {name: getattr(self.options, name) for name in self.options.__dataclass_fields__}
        return {"options": options, "state": self.state_dict()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state["options"])  # type: ignore[misc]
        self.load_state_dict(state["state"])

    @property
    def _traced(self) -> bool:
        """Whether the open step's scale_loss() runs compiled (counting on the device)."""
        return isinstance(self._tensors, CountFirst) and self._tensors.cursor is not None

    @property
    def _count_first(self) -> CountFirst:
        assert isinstance(self._tensors, CountFirst)
        return self._tensors

    def _codes(self, step: int, call: int) -> tuple[int, ...]:
        return self.options.codes(step, call, self._divisor)

    def _end_count_first(
        self, state: machine.State, step: machine.Step, tensors: CountFirst
    ) -> StepResult:
        unrecorded = step.unrecorded
        loss_sum = tensors.loss_sum(self.loss_reduction, known=not unrecorded)
        if self.loss_logging == "next_step":
            self._pending = PendingLoss(loss_sum)
            return StepResult(step.index, tensors.reduction, self._pending, unrecorded)
        assert self._collective is not None
        self._settle()
        codes = self._codes(step.index, terms.COUNT_FIRST_END)
        device = tensors.reduction.device
        reduction = self._start_loss(self._collective, codes, device, own=loss_sum)
        return StepResult(step.index, tensors.reduction, reduction, unrecorded)

    def _start_loss(
        self,
        collective: Collective,
        codes: tuple[int, ...],
        device: torch.device,
        own: torch.Tensor | None = None,
        previous: bool = False,
    ) -> Reduction:
        """A reduction of loss sums alone: a count-first step's own, or the waiting one."""
        carried = self._pending.loss_sum if previous and self._pending is not None else None
        losses = {("loss", False): own, ("loss", True): carried}
        flags = {name: (False, False) for name in self.layout.reported}
        reduction = payload.start(collective, self.layout, codes, device, {}, flags, losses)
        if previous:
            self._carry(reduction)
        else:
            self._unsettled.append(reduction)
        return reduction

    def _step_counts(self, given: dict[str, Counts | None]) -> dict[str, Any]:
        name = f"num_{self.weight_by}"
        if given[name] is None:
            raise error("weight_missing", name=name, weight_by=self.weight_by)
        counts = {
            n[4:]: None if c is None else validate.step_counts(n, c) for n, c in given.items()
        }
        samples, tokens = counts["samples"], counts["tokens"]
        if samples is not None and tokens is not None and len(samples) != len(tokens):
            raise error("lengths_differ", samples=len(samples), tokens=len(tokens))
        return counts

    def _settle(self) -> None:
        """Check every reduction started so far before a new one starts, so that a
        disagreement surfaces at the reduction that paired it (on an accelerator, at the first
        call after its verdict reached the host)."""
        unsettled, self._unsettled = self._unsettled, []
        for index, reduction in enumerate(unsettled):
            try:
                if not reduction.settle():
                    self._unsettled.append(reduction)
            except BaseException:
                self._unsettled.extend(unsettled[index + 1 :])
                raise

    def _carry(self, reduction: Reduction) -> None:
        """``reduction`` carries the loss that waited, and is checked with the next call."""
        if self._pending is not None:
            self._pending.reduction = reduction
            self._pending = None
        self._unsettled.append(reduction)


def _checked_state(state_dict: object, options: terms.Options) -> tuple[int, float]:
    expected = {"format", "steps", "weight_estimate", "options"}
    if not isinstance(state_dict, dict) or set(state_dict) != expected:
        keys = sorted(state_dict) if isinstance(state_dict, dict) else state_dict
        raise error("state_keys", keys=keys, expected=sorted(expected))
    if state_dict["format"] != _STATE_FORMAT:
        raise error("state_format", value=state_dict["format"], format=_STATE_FORMAT)
    saved = state_dict["options"]
    if not isinstance(saved, dict):
        raise error("state_options", value=saved)
    for name in terms.OPTIONS:
        if saved.get(name) != getattr(options, name):
            value = getattr(options, name)
            raise error("state_option", name=name, saved=saved.get(name), value=value)
    steps, estimate = state_dict["steps"], state_dict["weight_estimate"]
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise error("state_steps", value=steps)
    is_number = isinstance(estimate, (int, float)) and not isinstance(estimate, bool)
    if not is_number or not math.isfinite(estimate) or estimate < 0:
        raise error("state_estimate", value=estimate)
    return steps, float(estimate)


class StepContext:
    """What ``begin()`` returns: ``with acc.begin(...):`` abandons the step if an exception
    leaves the block while it is open. Without ``with``, it can be ignored."""

    def __init__(self, accumulator: Accumulator, index: int) -> None:
        self._accumulator = accumulator
        self.index = index

    def __enter__(self) -> StepContext:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        step = self._accumulator.state.step
        if exc_type is not None and step is not None and step.index == self.index:
            self._accumulator.abandon()
