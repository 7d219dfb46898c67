"""An Accumulator bound to a DeepSpeed engine.

DeepSpeed divides every loss of a step by its gradient accumulation steps: ``engine.backward``
divides the loss, and a plain ``loss.backward()`` on an engine-wrapped model divides each
gradient instead. It then averages the gradients over the data-parallel ranks, and at ZeRO
stages 1 to 3 keeps them in its partitions. :class:`DeepSpeedAccumulator` reads the
accumulation steps from the engine and undoes that division (through the Accumulator's
``framework_divides_loss_by``), and it makes DeepSpeed's accumulation boundary fall on the last
microbatch that ``begin()`` declared, so that a window shorter or longer than the accumulation
steps (the last one of an epoch) is reduced and stepped as one optimizer step::

    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    lw = DeepSpeedAccumulator(engine, loss_reduction="sum")
    for window in windows:                        # a step's microbatches
        lw.begin(num_tokens=[lossweight.count_tokens(y, shift=True) for _, y in window])
        for x, y in window:
            loss_sum, _ = lossweight.token_cross_entropy(engine(x), y, shift=True)
            engine.backward(lw.scale_loss(loss_sum))   # or lw.scale_loss(loss_sum).backward()
            if engine.is_gradient_accumulation_boundary():
                result = lw.end()
            engine.step()

Count first works at every ZeRO stage with ``engine.backward``, and with a plain backward at
stages 1 to 3 (DeepSpeed refuses it at stage 0). Scaling after rescales the
gradients once after the last backward, which only ZeRO stage 0 keeps in ``param.grad``: at
stages 1 to 3 ``begin(parameters=...)`` is refused with an error that names count first.

What the engine does is checked, not assumed. Before each microbatch's backward, the engine's
own boundary for it (its count of ``engine.step()`` calls, ``micro_steps``, unless
``scale_loss()`` placed it) must be the step's last microbatch and no other, and no optimizer
update (``global_steps``) may have happened since ``begin()``: a loop that scales with
``backward_scale(i)`` over a window that DeepSpeed's count does not end where the step ends is
refused before that backward, and a scale-after step (whose microbatches are not declared) at
``end()``, where ``end()`` after the ``engine.step()`` that updated is refused too (a count-first
step's update is exact then). ``engine.backward(loss, scale_wrt_gas=False)`` during a step is
refused before its backward, and so is an engine with ``managed_gradient_accumulation: false``,
whose every ``engine.step()`` updates. Every rank must give a count-first step as many
microbatches, as DeepSpeed's reductions pair one microbatch of each rank: ``begin()`` starts
an all-reduce of the number, checked before the first backward, so that uneven numbers are an
error on every rank rather than mismatched collectives.
DeepSpeed clips the gradients in ``engine.step()`` (``gradient_clipping``, 1.0 unless the config
says otherwise), after ``end()``: it clips the exact gradient.

Relies on these engine methods and attributes: ``gradient_accumulation_steps()``,
``zero_optimization_stage()``, ``set_gradient_accumulation_boundary()``,
``is_gradient_accumulation_boundary()``, ``managed_gradient_accumulation()``, ``backward()``
(wrapped, to see its ``scale_wrt_gas``), ``micro_steps`` and ``global_steps``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import Accumulator, compiled, machine
from ..accumulator import Count, Counts, Factors, Losses, StepContext
from ..collectives import Waitable, start_all_reduce
from ..errors import add_messages, device_message, error
from ..result import StepResult
from ..weighting import GradReduction

# The rows of this module's errors, added to lossweight.errors.MESSAGES when it is imported.
# fmt: off
_MESSAGES: dict[str, tuple[type[Exception], str]] = {
    "deepspeed_engine_decides": (ValueError, "DeepSpeedAccumulator got {name}={value!r}, which the engine decides: it divides each loss by its gradient accumulation steps ({steps}) and averages the ranks' gradients; drop {name}"),
    "deepspeed_pipeline": (ValueError, "DeepSpeedAccumulator got a PipelineEngine, whose train_batch() runs the whole step itself; weight a pipeline's loss inside its loss function instead"),
    "deepspeed_sequence_parallel": (ValueError, "DeepSpeedAccumulator does not support sequence parallelism yet (sequence_parallel_size={size}): DeepSpeed averages the gradients over the sequence-data-parallel group, not the world"),
    "deepspeed_unmanaged": (ValueError, "DeepSpeedAccumulator got an engine with managed_gradient_accumulation false, whose every engine.step() reduces and updates with the gradients it has, and whose boundary cannot be placed on a step's last microbatch; set \"managed_gradient_accumulation\": true (the default) in the DeepSpeed config"),
    "deepspeed_stranded": (RuntimeError, "step {step} was abandoned after its backward, and ZeRO stage {stage} keeps that step's partial gradients, which the next step would add to; restart from a checkpoint with a new engine and DeepSpeedAccumulator, or end() a step instead of abandoning it"),
    "deepspeed_window_changed": (ValueError, "the engine's gradient accumulation steps changed from {before:g} to {now} (set_train_batch_size()); make a new DeepSpeedAccumulator for the engine, and load this one's state_dict() into it"),
    "deepspeed_scale_after": (ValueError, "begin(parameters=...) scales after, but ZeRO stage {stage} moves the gradients into its partitions during the backward, where end() cannot rescale them; count first: begin(num_tokens=[...]) with every microbatch's count"),
    "deepspeed_compiled": (RuntimeError, "DeepSpeedAccumulator.scale_loss() runs eagerly: it tells the engine where the step ends, which a compiled graph cannot; compile the model, not scale_loss()"),
    "deepspeed_uneven": (RuntimeError, "this rank declared {declared} microbatches for step {step}, and the {ranks:g} ranks declared {mean:g} on average: DeepSpeed reduces the gradients of one microbatch of every rank at a time, so every rank must give a step as many microbatches; pad a rank with microbatches of count 0, or split each step's rows evenly over the ranks"),
    "deepspeed_updated_within": (RuntimeError, "DeepSpeed updated the parameters during step {step}, at the engine.step() after microbatch {after}, before microbatch {index}: that update had part of the step's gradients. Count first with scale_loss(), which puts DeepSpeed's boundary on the step's last microbatch, or give each step {every} microbatches, each followed by one engine.step(), with backward_scale(i) read just before microbatch i's backward"),
    "deepspeed_boundary_early": (RuntimeError, "in step {step}, DeepSpeed's own count of microbatches (micro step {micro}, {every} accumulation steps) makes microbatch {index} of the step's {declared} its boundary, where it would reduce and update with part of the step's gradients. Count first with scale_loss(), which puts DeepSpeed's boundary on the step's last microbatch, or give each step {every} microbatches, each followed by one engine.step(), with backward_scale(i) read just before microbatch i's backward"),
    "deepspeed_boundary_missed": (RuntimeError, "in step {step}, DeepSpeed's own count of microbatches (micro step {micro}, {every} accumulation steps) does not make the step's last microbatch ({index}) its boundary, so it would not reduce the step's gradients there, and would add the next step's. Count first with scale_loss(), which puts DeepSpeed's boundary on the step's last microbatch, or give each step {every} microbatches, each followed by one engine.step(), with backward_scale(i) read just before microbatch i's backward"),
    "deepspeed_after_boundary": (RuntimeError, "in step {step}, microbatch {boundary} was DeepSpeed's accumulation boundary, where it reduced part of the step's gradients, and microbatch {index} came after it. Count first with scale_loss(), which puts DeepSpeed's boundary on the step's last microbatch, or give each step {every} microbatches, each followed by one engine.step(), with backward_scale(i) read just before microbatch i's backward"),
    "deepspeed_before_boundary": (RuntimeError, "end() of step {step} came before DeepSpeed's gradient accumulation boundary: its last microbatch ({last}) was not the boundary of DeepSpeed's own count (micro step {micro}, {every} accumulation steps), so DeepSpeed has not reduced this step's gradients, and would add the next microbatches to them. Count first with scale_loss(), which puts DeepSpeed's boundary on the step's last microbatch, or give each step {every} microbatches, each followed by one engine.step(), with backward_scale(i) read just before microbatch i's backward"),
    "deepspeed_ended_after_step": (RuntimeError, "end() of step {step} came after the engine.step() that updated the parameters, with the gradients end() rescales in a scale-after step; call end() after the last backward and before engine.step()"),
    "deepspeed_unscaled_backward": (ValueError, "engine.backward(loss, scale_wrt_gas=False) in step {step}: DeepSpeedAccumulator's scale_loss() multiplies each loss by the engine's {every} accumulation steps, to undo the division that scale_wrt_gas=True makes; call engine.backward(loss)"),
}
# fmt: on
add_messages(_MESSAGES)

_ENGINE_DECIDES = ("framework_divides_loss_by", "grad_reduction")


@dataclass
class _Window:
    """A step as the engine saw it: its optimizer updates (``global_steps``) when it began,
    the microbatches whose backward was DeepSpeed's accumulation boundary, and the all-reduce
    of the ranks' numbers of microbatches, until it is checked."""

    updates: int
    declared: int
    boundaries: list[int] = field(default_factory=list)
    last: int = -1  # the last microbatch that went to a backward
    agreement: tuple[torch.Tensor, Waitable | None] | None = None


class DeepSpeedAccumulator(Accumulator):
    """An :class:`~lossweight.Accumulator` for the DeepSpeed ``engine``: every option but
    ``framework_divides_loss_by`` and ``grad_reduction``, which the engine decides (it divides
    each loss by its accumulation steps, and averages the ranks' gradients)."""

    def __init__(self, engine: Any, **options: Any) -> None:
        for name in _ENGINE_DECIDES:
            if name in options:
                raise error(
                    "deepspeed_engine_decides",
                    name=name,
                    value=options[name],
                    steps=engine.gradient_accumulation_steps(),
                )
        if type(engine).__name__ == "PipelineEngine":
            raise error("deepspeed_pipeline")
        if getattr(engine, "sequence_parallel_size", 1) > 1:
            raise error("deepspeed_sequence_parallel", size=engine.sequence_parallel_size)
        managed = getattr(engine, "managed_gradient_accumulation", lambda: True)()
        if not managed:
            raise error("deepspeed_unmanaged")
        steps = engine.gradient_accumulation_steps()
        # gradient_allreduce_op "sum" makes the engine sum the ranks' gradients.
        reduction: GradReduction = "mean" if getattr(engine, "gradient_average", True) else "sum"
        super().__init__(framework_divides_loss_by=steps, grad_reduction=reduction, **options)
        self.engine = engine
        self._stranded: int | None = None  # a step abandoned with gradients DeepSpeed keeps
        self._window: _Window | None = None
        engine.backward = _refusing_unscaled(engine.backward, self)

    def begin(
        self,
        *,
        num_samples: Counts | None = None,
        num_tokens: Counts | None = None,
        weight_sum: Counts | None = None,
        parameters: Iterable[Any] | None = None,
        step: int | None = None,
    ) -> StepContext:
        """:meth:`Accumulator.begin`; scaling after only at ZeRO stage 0. DeepSpeed's own
        count of microbatches places the step's boundary until ``scale_loss()`` does."""
        if self._stranded is not None:
            raise error(
                "deepspeed_stranded",
                step=self._stranded,
                stage=self.engine.zero_optimization_stage(),
            )
        steps = self.engine.gradient_accumulation_steps()
        if steps != self.options.framework_divides_loss_by:
            raise error(
                "deepspeed_window_changed", before=self.options.framework_divides_loss_by, now=steps
            )
        stage = self.engine.zero_optimization_stage()
        if parameters is not None and stage > 0:
            raise error("deepspeed_scale_after", stage=stage)
        counts = {"num_samples": num_samples, "num_tokens": num_tokens, "weight_sum": weight_sum}
        context = super().begin(**counts, parameters=parameters, step=step)
        self.engine.set_gradient_accumulation_boundary(None)  # a boundary left by a step before
        step_state = self.state.step
        assert step_state is not None
        window = _Window(self.engine.global_steps, step_state.declared)
        if step_state.mode == machine.COUNT_FIRST:
            window.agreement = self._count_microbatches(step_state.declared)
        self._window = window
        if step_state.mode == machine.COUNT_FIRST and not step_state.declared:
            self._agree(window)  # no microbatch: no backward to check it before
        return context

    def scale_loss(
        self,
        loss: Losses,
        *,
        num_samples: Count | None = None,
        num_tokens: Count | None = None,
        weight_sum: Count | None = None,
    ) -> torch.Tensor:
        """:meth:`Accumulator.scale_loss`; counting first, it also tells the engine whether
        this microbatch ends the step, where DeepSpeed reduces and steps."""
        if torch.compiler.is_compiling():
            if not compiled.GRAPH_BREAK_MESSAGE:  # torch 2.6 reports a raise without its message
                compiled.graph_break(device_message("deepspeed_compiled"))
            raise error("deepspeed_compiled")
        counts = {"num_samples": num_samples, "num_tokens": num_tokens, "weight_sum": weight_sum}
        scaled = super().scale_loss(loss, **counts)
        step = self.state.step
        if step is not None:
            if step.mode == machine.COUNT_FIRST:
                last = step.scaled == step.declared
                self.engine.set_gradient_accumulation_boundary(last)
                self._before_backward(step.scaled - 1, last)
            else:  # how many microbatches a scale-after step has is known at its end()
                self._before_backward(step.scaled - 1, None)
        return scaled

    def backward_scale(self, microbatch: int | None = None) -> Factors:
        """:meth:`Accumulator.backward_scale`. Microbatch ``i``'s, read just before its
        backward: DeepSpeed's own count of microbatches must end its accumulation at the step's
        last microbatch and no other, since nothing tells the engine where the step ends."""
        factors = super().backward_scale(microbatch)
        step = self.state.step
        if microbatch is not None and step is not None:  # () reads the next scale_loss()'s
            index = int(microbatch)
            self._before_backward(index, index == step.declared - 1)
        return factors

    def end(self, *, max_grad_norm: float | None = None) -> StepResult:
        """:meth:`Accumulator.end`, after the step's last backward, where DeepSpeed's
        accumulation boundary must have been, and before its ``engine.step()``, where DeepSpeed
        steps (a count-first step may end after it too). ``scale_loss()`` puts the boundary
        there in a count-first step; a scale-after step, or a loop that scales with
        ``backward_scale(i)``, must have as many microbatches as DeepSpeed's count gives it
        (``gradient_accumulation_steps``, starting at a multiple of them)."""
        window, step = self._window, self.state.step
        if window is not None and step is not None:
            self._agree(window)
            self._check_end(window, step)
        result = super().end(max_grad_norm=max_grad_norm)
        self._window = None
        return result

    def _count_microbatches(self, declared: int) -> tuple[torch.Tensor, Waitable | None] | None:
        """Start the sum, over the ranks, of 1, this rank's microbatches and their square."""
        collective = self._resolver.resolve()
        if collective.world_size == 1:
            return None
        numbers = [1.0, float(declared), float(declared * declared)]
        summed = torch.tensor(numbers, dtype=torch.float64, device=collective.device)
        return summed, start_all_reduce(collective, summed)

    def _agree(self, window: _Window) -> None:
        """Check, once a step, that every rank declared as many microbatches as this one: each
        DeepSpeed reduction pairs one microbatch of every rank."""
        pending, window.agreement = window.agreement, None
        if pending is None:
            return
        summed, handle = pending
        if handle is not None:
            handle.wait()
        ranks, total, squares = summed.tolist()  # once a step, before its first backward
        if ranks * squares != total * total:
            raise error(
                "deepspeed_uneven",
                declared=window.declared,
                step=self.state.steps,
                ranks=ranks,
                mean=total / ranks,
            )

    def _before_backward(self, index: int, last: bool | None) -> None:
        """Check what the engine will do at microbatch ``index``'s backward: ``last``, whether
        it ends the step (None: not known before ``end()``)."""
        window = self._window
        if window is None:
            return
        self._agree(window)
        engine, steps = self.engine, self.state.steps
        if engine.global_steps != window.updates:
            after = window.boundaries[-1] if window.boundaries else "?"
            raise error(
                "deepspeed_updated_within",
                step=steps,
                after=after,
                index=index,
                every=engine.gradient_accumulation_steps(),
            )
        boundary = bool(engine.is_gradient_accumulation_boundary())
        if last is not None and boundary != last:
            every, micro = engine.gradient_accumulation_steps(), engine.micro_steps
            if boundary:
                declared = window.declared
                raise error(
                    "deepspeed_boundary_early",
                    step=steps,
                    micro=micro,
                    every=every,
                    index=index,
                    declared=declared,
                )
            raise error(
                "deepspeed_boundary_missed", step=steps, micro=micro, every=every, index=index
            )
        if window.boundaries and window.boundaries[-1] != index:
            raise error(
                "deepspeed_after_boundary",
                step=steps,
                boundary=window.boundaries[-1],
                index=index,
                every=engine.gradient_accumulation_steps(),
            )
        if boundary and index not in window.boundaries:
            window.boundaries.append(index)
        window.last = index

    def _check_end(self, window: _Window, step: machine.Step) -> None:
        updates = self.engine.global_steps - window.updates
        if window.last < 0 and step.declared == 0:
            return  # no microbatch on any rank: nothing reached DeepSpeed
        if window.boundaries != [window.last]:
            every = self.engine.gradient_accumulation_steps()
            raise error(
                "deepspeed_before_boundary",
                step=self.state.steps,
                last=window.last,
                micro=self.engine.micro_steps,
                every=every,
            )
        if updates and step.mode != machine.COUNT_FIRST:
            raise error("deepspeed_ended_after_step", step=self.state.steps)

    def abandon(self) -> None:
        """:meth:`Accumulator.abandon`. At ZeRO stage 0 the step's gradients are dropped too
        (``engine.optimizer.zero_grad()``). At stages 1 to 3, once a microbatch went through
        ``scale_loss()``, DeepSpeed holds part of the step's gradients where they cannot be
        dropped, and would add them to the next step's: the next ``begin()`` refuses."""
        step, window, self._window = self.state.step, self._window, None
        super().abandon()
        if window is not None and window.agreement is not None:
            _, handle = window.agreement
            if handle is not None:  # started on every rank: none is left in flight
                handle.wait()
        if step is None:
            return
        self.engine.set_gradient_accumulation_boundary(None)
        if self.engine.zero_optimization_stage() == 0:
            self.engine.optimizer.zero_grad()
        elif step.scaled or step.factored:
            self._stranded = step.number


def _refusing_unscaled(backward: Callable[..., Any], owner: DeepSpeedAccumulator) -> Any:
    """``engine.backward``, refusing ``scale_wrt_gas=False`` during a step of ``owner``: the
    engine would not divide the loss that ``scale_loss()`` multiplied by its accumulation
    steps to undo that division."""

    @functools.wraps(backward)
    def checked(loss: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        scale_wrt_gas = kwargs.get("scale_wrt_gas", args[1] if len(args) > 1 else True)
        if not scale_wrt_gas and owner.step_open:
            every = owner.engine.gradient_accumulation_steps()
            raise error("deepspeed_unscaled_backward", step=owner.steps, every=every)
        return backward(loss, *args, **kwargs)

    return checked
