"""An Accumulator bound to a DeepSpeed engine.

DeepSpeed divides every loss of a step by its gradient accumulation steps: ``engine.backward``
divides the loss, and a plain ``loss.backward()`` on an engine-wrapped model divides each
gradient instead. It then averages the gradients over the data-parallel ranks, and at ZeRO
stages 1 to 3 keeps them in its partitions. :class:`DeepSpeedAccumulator` reads the
accumulation steps from the engine and undoes that division (through the Accumulator's
``framework_divides_loss_by``), and it makes DeepSpeed's accumulation boundary fall on the last
microbatch that ``begin()`` declared, so that a window shorter than the accumulation steps (the
last one of an epoch) is reduced and stepped as one optimizer step::

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
``end()`` before DeepSpeed's boundary is refused: a scale-after step, or a loop that scales
with ``backward_scale(i)``, must have ``gradient_accumulation_steps`` microbatches.
DeepSpeed clips the gradients in ``engine.step()`` (``gradient_clipping``, 1.0 unless the config
says otherwise), after ``end()``: it clips the exact gradient.

Relies on these engine methods: ``gradient_accumulation_steps()``, ``zero_optimization_stage()``,
``set_gradient_accumulation_boundary()`` and ``is_gradient_accumulation_boundary()``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from .. import Accumulator, _torch, machine
from ..accumulator import Count, Counts, Losses, StepContext
from ..result import StepResult
from ..weighting import GradReduction

_ENGINE_DECIDES = ("framework_divides_loss_by", "grad_reduction")


class DeepSpeedAccumulator(Accumulator):
    """An :class:`~lossweight.Accumulator` for the DeepSpeed ``engine``: every option but
    ``framework_divides_loss_by`` and ``grad_reduction``, which the engine decides (it divides
    each loss by its accumulation steps, and averages the ranks' gradients)."""

    def __init__(self, engine: Any, **options: Any) -> None:
        for name in _ENGINE_DECIDES:
            if name in options:
                raise ValueError(
                    f"DeepSpeedAccumulator got {name}={options[name]!r}, which the engine "
                    "decides: it divides each loss by its gradient accumulation steps "
                    f"({engine.gradient_accumulation_steps()}) and averages the ranks' "
                    f"gradients; drop {name}"
                )
        if type(engine).__name__ == "PipelineEngine":
            raise ValueError(
                "DeepSpeedAccumulator got a PipelineEngine, whose train_batch() runs the whole "
                "step itself; weight a pipeline's loss inside its loss function instead"
            )
        if getattr(engine, "sequence_parallel_size", 1) > 1:
            raise ValueError(
                f"DeepSpeedAccumulator does not support sequence parallelism yet "
                f"(sequence_parallel_size={engine.sequence_parallel_size}): DeepSpeed averages "
                "the gradients over the sequence-data-parallel group, not the world"
            )
        steps = engine.gradient_accumulation_steps()
        # gradient_allreduce_op "sum" makes the engine sum the ranks' gradients.
        reduction: GradReduction = "mean" if getattr(engine, "gradient_average", True) else "sum"
        super().__init__(framework_divides_loss_by=steps, grad_reduction=reduction, **options)
        self.engine = engine
        self._stranded: int | None = None  # a step abandoned with gradients DeepSpeed keeps

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
            raise RuntimeError(
                f"step {self._stranded} was abandoned after its backward, and ZeRO stage "
                f"{self.engine.zero_optimization_stage()} keeps that step's partial gradients, "
                "which the next step would add to; restart from a checkpoint with a new engine "
                "and DeepSpeedAccumulator, or end() a step instead of abandoning it"
            )
        steps = self.engine.gradient_accumulation_steps()
        if steps != self.options.framework_divides_loss_by:
            raise ValueError(
                f"the engine's gradient accumulation steps changed from "
                f"{self.options.framework_divides_loss_by:g} to {steps} "
                "(set_train_batch_size()); make a new DeepSpeedAccumulator for the engine, and "
                "load this one's state_dict() into it"
            )
        stage = self.engine.zero_optimization_stage()
        if parameters is not None and stage > 0:
            raise ValueError(
                f"begin(parameters=...) scales after, but ZeRO stage {stage} moves the "
                "gradients into its partitions during the backward, where end() cannot rescale "
                "them; count first: begin(num_tokens=[...]) with every microbatch's count"
            )
        counts = {"num_samples": num_samples, "num_tokens": num_tokens, "weight_sum": weight_sum}
        context = super().begin(**counts, parameters=parameters, step=step)
        self.engine.set_gradient_accumulation_boundary(None)  # a boundary left by a step before
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
            message = (
                "DeepSpeedAccumulator.scale_loss() runs eagerly: it tells the engine where the "
                "step ends, which a compiled graph cannot; compile the model, not scale_loss()"
            )
            if not _torch.GRAPH_BREAK_MESSAGE:  # torch 2.6 reports a raise without its message
                _torch.graph_break(message)
            raise RuntimeError(message)
        counts = {"num_samples": num_samples, "num_tokens": num_tokens, "weight_sum": weight_sum}
        scaled = super().scale_loss(loss, **counts)
        step = self.state.step
        if step is not None and step.mode == machine.COUNT_FIRST:
            self.engine.set_gradient_accumulation_boundary(step.scaled == step.declared)
        return scaled

    def end(self, *, max_grad_norm: float | None = None) -> StepResult:
        """:meth:`Accumulator.end`, after the step's last backward and before its
        ``engine.step()``, which must be DeepSpeed's accumulation boundary: there it reduces
        the gradients and steps. ``scale_loss()`` puts the boundary there in a count-first
        step; a scale-after step, or a loop that scales with ``backward_scale(i)``, must have
        ``gradient_accumulation_steps`` microbatches."""
        if self.state.step is not None and not self.engine.is_gradient_accumulation_boundary():
            every = self.engine.gradient_accumulation_steps()
            raise RuntimeError(
                f"end() of step {self.state.steps} came before DeepSpeed's gradient accumulation "
                "boundary, so DeepSpeed has not reduced this step's gradients, and would add "
                "the next microbatches to them; end a step after the backward of its last "
                "microbatch, where engine.is_gradient_accumulation_boundary() is true: count "
                f"first with scale_loss(), which puts it there, or give each step {every} "
                "microbatches"
            )
        return super().end(max_grad_norm=max_grad_norm)

    def abandon(self) -> None:
        """:meth:`Accumulator.abandon`. At ZeRO stage 0 the step's gradients are dropped too
        (``engine.optimizer.zero_grad()``). At stages 1 to 3, once a microbatch went through
        ``scale_loss()``, DeepSpeed holds part of the step's gradients where they cannot be
        dropped, and would add them to the next step's: the next ``begin()`` refuses."""
        step = self.state.step
        super().abandon()
        if step is None:
            return
        self.engine.set_gradient_accumulation_boundary(None)
        if self.engine.zero_optimization_stage() == 0:
            self.engine.optimizer.zero_grad()
        elif step.scaled or step.factored:
            self._stranded = step.number
