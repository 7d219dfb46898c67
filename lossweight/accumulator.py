"""The Accumulator: one object per training loop that weights each microbatch's loss.

It holds the options, finds the data-parallel world when a step begins, opens one step object
per optimizer step (:mod:`lossweight._steps`: count first or scale after) and delegates to it,
and carries what travels from one step to the next: the step counter, scale-after's estimate of
the global weight, and a logged loss waiting for a reduction to ride on.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from types import TracebackType
from typing import Any, Literal

import torch
import torch.distributed as dist

from . import weighting
from ._checks import (
    Count,
    Counts,
    check_choice,
    check_loss,
    check_positive,
    microbatch_count,
    parameter_list,
    step_counts,
)
from ._payload import COUNT_FIRST_END, FLUSH, OWN_LOSS, PREVIOUS_LOSS, Reduction, start_reduction
from ._steps import COUNT_NAMES, CountFirstStep, ScaleAfterStep, Settings
from .collectives import Collective, CollectiveResolver
from .result import StepResult
from .weighting import GradReduction, LossReduction

WeightBy = Literal["samples", "tokens"]
LossLogging = Literal["end", "next_step"]
_STATE_FORMAT = 1
_OPTIONS = (
    "weight_by",
    "loss_reduction",
    "grad_reduction",
    "loss_logging",
    "framework_divides_loss_by",
)


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

    The gradient of the step, after the data-parallel wrapper has combined the ranks, is the
    gradient of ``sum(w * l) / W`` (mean losses) or ``sum(l) / W`` (summed losses) over every
    microbatch of every rank, where ``w`` is a microbatch's count and ``W`` the global count:
    the same however the step's items are split into ranks and microbatches.

    An Accumulator belongs to one training loop, like an optimizer: it is not thread-safe, and
    every rank of the data-parallel group calls ``begin()``, ``end()``, ``abandon()`` and
    ``flush()`` for the same steps. Ranks that disagree (on a step, a mode or an option) get a
    :class:`DisagreementError` from the reduction that paired them, never wrong numbers.

    Args:
        loss_reduction: whether each loss you pass is the ``"mean"`` or the ``"sum"`` of its
            items' losses. Required: :func:`lossweight.token_cross_entropy` returns a sum,
            ``F.cross_entropy`` a mean by default. ``"sum"`` is exact for empty microbatches
            whatever the loss; a hand-written mean over zero items has a NaN backward of its
            own (docs/usage.md).
        weight_by: which count weights a microbatch: ``"tokens"`` or ``"samples"``.
        grad_reduction: how the data-parallel wrapper combines the ranks' gradients:
            ``"mean"`` (DDP and FSDP by default), ``"sum"`` (e.g. FSDP2 with
            ``set_gradient_divide_factor(1.0)``), or the number it divides their sum by.
        group: the data-parallel ``torch.distributed`` process group to reduce the counts
            over. Default: the default group, looked up at each ``begin()`` (a single process
            while torch.distributed is not initialized). With tensor or context parallelism,
            pass the group of the data-parallel replicas.
        collective: a :class:`Collective` to reduce with instead of a process group.
        loss_logging: when a count-first step's logged loss is reduced: ``"end"`` (by its
            ``end()``, one more all-reduce; ``result.loss`` is ready at once) or
            ``"next_step"`` (with the next reduction, at no extra collective). Scale-after
            steps reduce their loss with their counts either way.
        weight_estimate: for scale-after steps, the global weight the first one's provisional
            factors assume; later ones assume the previous step's. Default 1: raw counts, which
            bf16 and fp32 gradients hold; give a rough ``W`` for fp16 ones.
        framework_divides_loss_by: what a training framework divides each loss by before its
            backward, on its own (Accelerate's ``accelerator.backward`` and Lightning's
            automatic optimization divide by the gradient accumulation steps). The factors are
            multiplied by it, so the gradient comes out the same. Default 1: nothing.
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
            raise TypeError(
                "Accumulator() needs loss_reduction: 'sum' if each loss you pass is the sum of "
                "its items' losses (lossweight.token_cross_entropy returns a sum), 'mean' if it "
                "is their mean (F.cross_entropy's default reduction)"
            )
        check_choice("loss_reduction", loss_reduction, ("mean", "sum"))
        check_choice("weight_by", weight_by, ("tokens", "samples"))
        check_choice("loss_logging", loss_logging, ("end", "next_step"))
        check_positive(
            "grad_reduction",
            grad_reduction,
            "'mean' (the wrapper averages the ranks' gradients, as DDP and FSDP do), 'sum', or "
            "the positive number it divides their sum by",
            allowed=("mean", "sum"),
        )
        check_positive(
            "weight_estimate",
            weight_estimate,
            "a positive number, roughly the global count of a step",
        )
        check_positive(
            "framework_divides_loss_by",
            framework_divides_loss_by,
            "the positive number your framework divides each loss by before its backward "
            "(its gradient accumulation steps), or 1",
        )
        self._resolver = CollectiveResolver(group, collective)
        self._options: dict[str, Any] = {
            "weight_by": weight_by,
            "loss_reduction": loss_reduction,
            "grad_reduction": grad_reduction,
            "loss_logging": loss_logging,
            "framework_divides_loss_by": framework_divides_loss_by,
        }
        self._initial_estimate = float(weight_estimate)
        self._estimate: float | torch.Tensor = self._initial_estimate
        self._steps = 0
        self._step: CountFirstStep | ScaleAfterStep | None = None
        self._unsettled: list[Reduction] = []
        self._pending: tuple[StepResult, torch.Tensor] | None = None
        self._collective: Collective | None = None
        self._last_settings: Settings | None = None

    @property
    def weight_by(self) -> WeightBy:
        return self._options["weight_by"]  # type: ignore[no-any-return]

    @property
    def loss_reduction(self) -> LossReduction:
        return self._options["loss_reduction"]  # type: ignore[no-any-return]

    @property
    def grad_reduction(self) -> GradReduction | float:
        return self._options["grad_reduction"]  # type: ignore[no-any-return]

    @property
    def loss_logging(self) -> LossLogging:
        return self._options["loss_logging"]  # type: ignore[no-any-return]

    @property
    def step_open(self) -> bool:
        """Whether a step is open: ``begin()`` was called and neither ``end()`` nor
        ``abandon()`` has closed it yet."""
        return self._step is not None

    @property
    def steps(self) -> int:
        """How many steps have begun (the index of the last one)."""
        return self._steps

    def begin(
        self,
        *,
        num_samples: Counts | None = None,
        num_tokens: Counts | None = None,
        parameters: Iterable[Any] | None = None,
    ) -> StepContext:
        """Open an optimizer step; every rank calls it.

        Count first: pass this rank's counts, one per microbatch it will run in this step (none
        is fine), as a 1-D integer tensor or a sequence of ints or 0-dim integer tensors. The
        count named by ``weight_by`` is required; the other one is optional and only reported.
        Counts are copied: refilling their buffer afterwards changes nothing. Counts on the
        CPU, Python ints included, are copied to the collective's device (CUDA for NCCL)
        without blocking; counts on an accelerator stay there, and the collective must reduce
        on it. One all-reduce starts here and overlaps whatever runs until the first factor is
        needed.

        Scale after: pass the ``parameters`` whose gradients ``end()`` rescales
        (``model.parameters()`` or ``model.named_parameters()``), and each microbatch's counts
        to :meth:`scale_loss`. Their gradients must be None or zero now (checked on their
        device).

        Returns a context manager: ``with acc.begin(...):`` abandons the step if an exception
        leaves the block before ``end()``.
        """
        if self._step is not None:
            raise RuntimeError(
                f"begin() was called while step {self._step.index} is still open; call end() "
                "to close it, or abandon() to drop it"
            )
        counts_given = num_samples is not None or num_tokens is not None
        if counts_given and parameters is not None:
            raise ValueError(
                "begin() got counts and parameters; pass counts to count first "
                "(begin(num_tokens=[...])), or parameters to scale after "
                "(begin(parameters=model.parameters())), not both"
            )
        if not counts_given and parameters is None:
            raise ValueError(
                f"begin() got neither counts nor parameters; pass this rank's counts to count "
                f"first (begin(num_{self.weight_by}=[one count per microbatch])), or the "
                "parameters whose gradients end() rescales to scale after "
                "(begin(parameters=model.parameters()))"
            )
        if counts_given:
            counts = self._checked_step_counts(num_samples, num_tokens)
        else:
            params = parameter_list(parameters)
        collective = self._resolver.resolve()
        settings = self._settings(collective)
        self._settle()
        index = self._steps + 1
        step: CountFirstStep | ScaleAfterStep
        if counts_given:
            carried = self._pending[1] if self._pending is not None else None
            step = CountFirstStep(index, settings, collective, counts, carried)
            self._carry_pending(step.reduction)
            self._unsettled.append(step.reduction)
        else:
            step = ScaleAfterStep(index, settings, params, self._estimate)
        self._steps, self._step, self._collective = index, step, collective
        return StepContext(self, index)

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
        logged loss nor the gradients through here. A copy of its detached value is kept for
        ``StepResult.loss``. Every microbatch of a step goes through here.
        """
        check_loss(loss)
        step = self._open_step("scale_loss")
        if isinstance(step, CountFirstStep):
            if num_samples is not None or num_tokens is not None:
                raise ValueError(
                    f"scale_loss() got counts, but begin() declared the counts of step "
                    f"{step.index} already; call scale_loss() without them, or begin() with "
                    "parameters instead of counts to give them here"
                )
            return step.scale_loss(loss)
        weight_name = f"num_{self.weight_by}"
        given = {"num_samples": num_samples, "num_tokens": num_tokens}
        if given[weight_name] is None:
            raise ValueError(
                f"scale_loss() got {weight_name}=None in a scale-after step (begin() had no "
                f"counts); pass {weight_name}=<this microbatch's count>, or declare all counts "
                "in begin()"
            )
        counts = tuple(
            None if given[name] is None else microbatch_count(name, given[name])
            for name in COUNT_NAMES
        )
        return step.scale_loss(loss, counts)  # type: ignore[arg-type]

    def backward_scale(self, microbatch: int | None = None) -> torch.Tensor:
        """The factor of a microbatch of this count-first step, without taking it.

        ``microbatch`` is its index among the counts given to ``begin()`` (from 0); by default,
        the microbatch the next :meth:`scale_loss` will take. Reading a factor does not move
        the step on, however often it is read. It is ``w * D / W`` for mean losses and
        ``D / W`` for summed ones (0 for a mean loss of weight 0, and for every microbatch of
        an empty step with mean losses; with summed losses an empty step's factor is ``D``,
        which multiplies a loss of 0): a 0-dim float64 tensor on the device the counts are
        reduced on. The first read waits for the count reduction. A scale-after step's factors
        are provisional until ``end()``, so it has none to read.
        """
        step = self._open_step("backward_scale")
        if isinstance(step, ScaleAfterStep):
            raise RuntimeError(
                f"backward_scale() was called in step {step.index}, which scales after: its "
                "factors are provisional until end() learns the global count; pass each loss "
                "to scale_loss(), or give every count to begin() to count first"
            )
        return step.backward_scale(microbatch)

    def end(self) -> StepResult:
        """Close the step and return what it reports (see :class:`StepResult`).

        Call it on every rank after the step's last backward, before gradient clipping and
        ``optimizer.step()``. A count-first step's gradients are final already; with
        ``loss_logging="end"`` it starts one all-reduce of the loss. A scale-after step's one
        all-reduce sums the counts and the loss sums, then every gradient of the parameters
        given to ``begin()`` is multiplied by the correcting factor, in one pass per device
        and dtype, on the device (FSDP2's sharded gradients shard by shard). If ``end()``
        raises, calling it again issues no second all-reduce.
        """
        step = self._open_step("end")
        if isinstance(step, CountFirstStep):
            loss_sum = step.loss_sum()
            if self.loss_logging == "end":
                self._settle()
                assert self._collective is not None
                codes = step.settings.codes(step.index, COUNT_FIRST_END)
                loss_reduction = start_reduction(
                    self._collective, codes, step.reduction.device, own_loss=loss_sum
                )
                self._unsettled.append(loss_reduction)
                result = StepResult(
                    step.index,
                    step.reduction,
                    step.settings.weight_kind,
                    (loss_reduction, OWN_LOSS),
                )
            else:
                result = StepResult(step.index, step.reduction, step.settings.weight_kind, None)
                self._pending = (result, loss_sum)
            counts = step.reduction
        else:
            assert self._collective is not None
            self._settle()
            carried = self._pending[1] if self._pending is not None else None
            counts = step.finish(self._collective, carried)
            self._carry_pending(counts)
            result = StepResult(step.index, counts, step.settings.weight_kind, (counts, OWN_LOSS))
        self._estimate = counts.total(step.settings.weight_kind)
        self._step = None
        return result

    def abandon(self) -> None:
        """Drop the open step, if any, and keep the Accumulator for the next one.

        For a step that failed half-way (an out-of-memory microbatch, say). Every rank must
        abandon the same step, as every rank ends the same steps; a rank that abandons alone
        makes the next reduction fail with a :class:`DisagreementError` on every rank. The
        gradients are left as they are: call ``optimizer.zero_grad()`` before the next step.
        The step keeps its index, so the next one is counted after it on every rank. A
        count-first step's reduction, which every rank started in ``begin()``, is waited for
        here, so that none is left in flight.
        """
        step, self._step = self._step, None
        if isinstance(step, CountFirstStep):
            step.reduction.wait()

    def flush(self) -> None:
        """Reduce the loss that ``loss_logging="next_step"`` left waiting, if any.

        The last count-first step of a run has no next step to carry its loss: call this on
        every rank, after its ``end()``, to read it. It issues one all-reduce when a loss is
        waiting (the same on every rank) and nothing otherwise, and waits for it (on an
        accelerator, a stream dependency), so that the run may destroy its process group
        right after.
        """
        if self._step is not None:
            raise RuntimeError(
                f"flush() was called while step {self._step.index} is open; call it after "
                "end() or abandon()"
            )
        if self._pending is None:
            return
        collective = self._resolver.resolve()
        settings = self._settings(collective)
        self._settle()
        _, loss_sum = self._pending
        reduction = start_reduction(
            collective,
            settings.codes(self._steps, FLUSH),
            collective.device,
            previous_loss=loss_sum,
        )
        self._carry_pending(reduction)
        self._unsettled.append(reduction)
        # Nothing left in flight: the run may end right after. Waited on once the reduction
        # is recorded, so that a wait that fails is retried by the next read, never by a
        # second all-reduce.
        reduction.wait()

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to continue with the factors of an uninterrupted one.

        A plain dict (ints, floats, strings), loadable with ``torch.load(weights_only=True)``:
        the step counter, the estimate of ``W`` that the next scale-after step assumes, and the
        options. No process group: the world is found again when the next step begins, so the
        state may be loaded at another world size. A loss still waiting for
        ``loss_logging="next_step"`` is not saved: call :meth:`flush` first to log it.
        Reading the estimate waits for the last step's reduction.
        """
        if self._step is not None:
            raise RuntimeError(
                f"state_dict() was called while step {self._step.index} is open; save the "
                "state between end() and the next begin()"
            )
        estimate = self._estimate
        return {
            "format": _STATE_FORMAT,
            "steps": self._steps,
            "weight_estimate": estimate if isinstance(estimate, float) else estimate.item(),
            "options": dict(self._options),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from ``state_dict()``'s value, which must come from an Accumulator of the
        same ``weight_by``, ``loss_reduction``, ``grad_reduction`` and ``loss_logging``."""
        if self._step is not None:
            raise RuntimeError(
                f"load_state_dict() was called while step {self._step.index} is open; load "
                "the state before the first begin(), or between steps"
            )
        expected = {"format", "steps", "weight_estimate", "options"}
        if not isinstance(state_dict, dict) or set(state_dict) != expected:
            keys = sorted(state_dict) if isinstance(state_dict, dict) else state_dict
            raise ValueError(
                f"state_dict has {keys!r}, not the keys {sorted(expected)} of "
                "Accumulator.state_dict(); pass the value it returned"
            )
        if state_dict["format"] != _STATE_FORMAT:
            raise ValueError(
                f"state_dict has format {state_dict['format']!r}, but this version of "
                f"lossweight reads format {_STATE_FORMAT}"
            )
        options = state_dict["options"]
        if not isinstance(options, dict):
            raise ValueError(
                f"state_dict has options={options!r}, not a dict of the Accumulator's options; "
                "pass the value state_dict() returned"
            )
        for name in _OPTIONS:
            if options.get(name) != self._options[name]:
                raise ValueError(
                    f"state_dict was saved with {name}={options.get(name)!r}, but this "
                    f"Accumulator has {name}={self._options[name]!r}; construct it with the "
                    f"options of the run it continues"
                )
        steps, estimate = state_dict["steps"], state_dict["weight_estimate"]
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"state_dict has steps={steps!r}; it must be an int, 0 or more")
        is_number = isinstance(estimate, (int, float)) and not isinstance(estimate, bool)
        if not is_number or not math.isfinite(estimate) or estimate < 0:
            raise ValueError(
                f"state_dict has weight_estimate={estimate!r}; it must be a finite number, 0 "
                "or more"
            )
        self._steps, self._estimate = steps, float(estimate)
        self._pending = None

    def __getstate__(self) -> dict[str, Any]:
        if self._resolver.explicit:
            raise TypeError(
                "an Accumulator given a group or a collective cannot be pickled, since a process "
                "group cannot; save acc.state_dict() and load it into a new Accumulator with "
                "load_state_dict()"
            )
        options = {**self._options, "weight_estimate": self._initial_estimate}
        return {"options": options, "state": self.state_dict()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state["options"])  # type: ignore[misc]
        self.load_state_dict(state["state"])

    def _settings(self, collective: Collective) -> Settings:
        # A framework that divides the loss by N before the backward divides the gradient by N
        # as the wrapper divides it by D: the factors undo both.
        divisor = weighting.gradient_divisor(self.grad_reduction, collective.world_size) * float(
            self._options["framework_divides_loss_by"]
        )
        if self._last_settings is None or self._last_settings.divisor != divisor:
            self._last_settings = Settings(
                self.weight_by, self.loss_reduction, self.loss_logging, divisor
            )
        return self._last_settings

    def _checked_step_counts(
        self, num_samples: Counts | None, num_tokens: Counts | None
    ) -> list[list[int] | torch.Tensor | None]:
        weight_name = f"num_{self.weight_by}"
        given = {"num_samples": num_samples, "num_tokens": num_tokens}
        if given[weight_name] is None:
            raise ValueError(
                f"{weight_name}=None, but weight_by={self.weight_by!r} weights each microbatch "
                f"by it; pass {weight_name}=[one count per microbatch], or parameters instead "
                "of counts to give them with each loss"
            )
        counts = [None if given[n] is None else step_counts(n, given[n]) for n in COUNT_NAMES]
        if counts[0] is not None and counts[1] is not None and len(counts[0]) != len(counts[1]):
            raise ValueError(
                f"num_samples has {len(counts[0])} counts but num_tokens has "
                f"{len(counts[1])}; give both one count per microbatch"
            )
        return counts

    def _settle(self) -> None:
        """Wait for and check every reduction started so far, before a new one starts, so
        that a disagreement surfaces at the reduction that paired it."""
        while self._unsettled:
            reduction = self._unsettled.pop()
            if not reduction.failed:  # an error already raised is not raised again
                reduction.result()

    def _carry_pending(self, reduction: Reduction) -> None:
        if self._pending is not None:
            self._pending[0]._carried_by(reduction, PREVIOUS_LOSS)
            self._pending = None

    def _open_step(self, caller: str) -> CountFirstStep | ScaleAfterStep:
        if self._step is None:
            when = (
                "before the first begin()"
                if self._steps == 0
                else f"after step {self._steps} was closed"
            )
            raise RuntimeError(
                f"{caller}() was called {when}; call begin(num_{self.weight_by}=[...]) or "
                "begin(parameters=...) to open a step first"
            )
        return self._step


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
        step = self._accumulator._step
        if exc_type is not None and step is not None and step.index == self.index:
            self._accumulator.abandon()
