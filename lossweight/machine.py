"""The rules of an optimizer step, as a pure state machine.

A :class:`State` is a frozen value: the step counter, the open :class:`Step` if any, and
whether a logged loss waits for a later reduction. Each transition takes a state and what a
call asked for, and returns the next state, or raises the coded usage error of the rule it
breaks (:mod:`lossweight.errors`); a call that raises changes nothing. This module imports
nothing but ``errors``, so its rules can be driven and property-tested without torch. The
:class:`~lossweight.Accumulator` applies a transition, then runs its effects on tensors;
integrations read ``accumulator.state`` rather than keep copies of their own.

Which calls take a microbatch of a count-first step: ``scale_loss()`` takes the next one;
``backward_scale(i)`` gives microbatch ``i`` its factor (reading it again changes nothing);
``record_loss(i, loss)`` hands over the loss of a microbatch that took its factor that way.
``end()`` requires every declared microbatch to be taken by one of the first two.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, replace

from .errors import error

COUNT_FIRST, SCALE_AFTER = "count_first", "scale_after"
_FIXES = {
    "begin": "call end() to close it, or abandon() to drop it",
    "flush": "call it after end() or abandon()",
    "state_dict": "save the state between end() and the next begin()",
    "load_state_dict": "load the state before the first begin(), or between steps",
}


@dataclass(frozen=True)
class Step:
    """The open step. ``declared``: the microbatches a count-first ``begin()`` declared;
    ``scaled``: those ``scale_loss()`` took in eager code; ``factored`` and ``recorded``: those
    ``backward_scale(i)`` and ``record_loss(i, ...)`` took; ``given``: which counts (samples,
    tokens) a scale-after step's microbatches give. A step whose ``scale_loss()`` runs compiled
    counts its microbatches on the device instead (``traced``, told by the caller: a graph
    must not depend on a state that changes with each step)."""

    index: int
    mode: str
    declared: int = 0
    scaled: int = 0
    factored: frozenset[int] = frozenset()
    recorded: frozenset[int] = frozenset()
    given: tuple[bool, bool] | None = None

    @property
    def unrecorded(self) -> list[int]:
        """Microbatches that took their factor from backward_scale() and whose loss this rank
        does not know."""
        taken = self.factored - self.recorded
        return sorted(i for i in taken if i >= self.scaled)


@dataclass(frozen=True)
class State:
    """``weight_by`` and ``loss_logging`` are the options the rules depend on."""

    weight_by: str = "tokens"
    loss_logging: str = "end"
    steps: int = 0
    step: Step | None = None
    pending: bool = False  # a count-first step's loss waits for the next reduction


def begin(state: State, count_first: bool, declared: int = 0) -> State:
    idle(state, "begin")
    step = Step(state.steps + 1, COUNT_FIRST if count_first else SCALE_AFTER, declared)
    # A count-first begin() reduces a waiting loss; a scale-after step's end() does.
    return replace(state, steps=step.index, step=step, pending=state.pending and not count_first)


def scale(state: State, given: tuple[bool, bool], traced: bool) -> tuple[State, int | None]:
    """``scale_loss()`` with the counts it was given: the next state and the microbatch it
    takes (None: compiled, the position is on the device)."""
    step = open_step(state, "scale_loss")
    if step.mode == SCALE_AFTER:
        name = f"num_{state.weight_by}"
        if not given[("num_samples", "num_tokens").index(name)]:
            raise error("weight_missing_here", name=name)
        if step.given is not None and given != step.given:
            now, before = _names(given), _names(step.given)
            raise error("counts_differ", now=now, number=step.scaled + 1, before=before)
        return replace(state, step=replace(step, scaled=step.scaled + 1, given=given)), None
    if any(given):
        raise error("counts_declared", step=step.index)
    if traced:
        return state, None
    index = step.scaled
    if index >= step.declared:
        raise error("too_many", number=index + 1, step=step.index, declared=step.declared)
    if index in step.recorded:
        raise error("loss_twice", caller="scale_loss()", microbatch=index, step=step.index)
    return replace(state, step=replace(step, scaled=index + 1)), index


def trace(state: State) -> None:
    """A compiled ``scale_loss()``: from the step's first microbatch on, or not at all. It reads
    only what is the same in every step, so that one graph serves them all."""
    step = open_step(state, "scale_loss")
    if step.scaled:
        raise error("traced_after_eager", step=step.index, scaled=step.scaled)


def factor(state: State, microbatch: object, traced: bool) -> tuple[State, int | None]:
    """``backward_scale(microbatch)``: the microbatch whose factor it gives, by default the
    next one ``scale_loss()`` takes (None: a compiled step's, whose position is a tensor)."""
    step = _count_first(state, "backward_scale")
    if microbatch is None:
        if traced:
            return state, None
        if step.scaled >= step.declared:
            raise error("no_next", declared=step.declared, step=step.index)
        return state, step.scaled
    index = _index(step, "backward_scale", microbatch)
    return replace(state, step=replace(step, factored=step.factored | {index})), index


def record(state: State, microbatch: object) -> tuple[State, int]:
    """``record_loss(microbatch, loss)``: hand over the loss of a microbatch that took its
    factor from ``backward_scale(microbatch)``."""
    step = _count_first(state, "record_loss")
    index = _index(step, "record_loss", microbatch)
    if index not in step.factored:
        raise error("loss_unfactored", microbatch=index, step=step.index)
    if index < step.scaled or index in step.recorded:
        raise error("loss_twice", caller="record_loss()", microbatch=index, step=step.index)
    return replace(state, step=replace(step, recorded=step.recorded | {index})), index


def end(state: State, traced: bool) -> State:
    step = open_step(state, "end")
    missing = [i for i in range(step.scaled, step.declared) if i not in step.factored]
    if step.mode == COUNT_FIRST and not traced and missing:
        raise error(
            "too_few", scaled=step.scaled, declared=step.declared, step=step.index, missing=missing
        )
    # A count-first step's loss may wait for the next reduction; a scale-after step's end()
    # reduced its own loss and any that waited.
    waits = step.mode == COUNT_FIRST and state.loss_logging == "next_step"
    return replace(state, step=None, pending=waits)


def abandon(state: State) -> State:
    return replace(state, step=None)


def flush(state: State) -> tuple[State, bool]:
    """``flush()``: the next state, and whether a loss waits to be reduced."""
    idle(state, "flush")
    return replace(state, pending=False), state.pending


def load(state: State, steps: int) -> State:
    idle(state, "load_state_dict")
    return replace(state, steps=steps, pending=False)


def idle(state: State, caller: str) -> None:
    """Refuse ``caller`` while a step is open."""
    if state.step is not None:
        still = "still " if caller == "begin" else ""
        fix = _FIXES[caller]
        raise error("step_open", caller=caller, step=state.step.index, still=still, fix=fix)


def open_step(state: State, caller: str) -> Step:
    if state.step is None:
        when = (
            "before the first begin()"
            if state.steps == 0
            else f"after step {state.steps} was closed"
        )
        raise error("no_step", caller=caller, when=when, weight_by=state.weight_by)
    return state.step


def _count_first(state: State, caller: str) -> Step:
    step = open_step(state, caller)
    if step.mode == SCALE_AFTER:
        raise error("scale_after_factor", caller=caller, step=step.index)
    return step


def _index(step: Step, caller: str, microbatch: object) -> int:
    try:
        index = None if isinstance(microbatch, bool) else operator.index(microbatch)  # type: ignore[arg-type]
    except TypeError:
        index = None
    if index is None or not 0 <= index < step.declared:
        raise error(
            "bad_microbatch",
            caller=caller,
            microbatch=microbatch,
            step=step.index,
            declared=step.declared,
            last=step.declared - 1,
        )
    return index


def _names(given: tuple[bool, bool]) -> str:
    names = [name for name, on in zip(("num_samples", "num_tokens"), given, strict=True) if on]
    return " and ".join(names) or "no counts"
