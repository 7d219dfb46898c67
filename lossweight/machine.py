"""The rules of an optimizer step, as a pure state machine.

A :class:`State` is a frozen value. A transition takes a state and what a call asked for, and
returns the next state or raises the coded error of the rule it breaks (changing nothing). It
imports only the pure errors.py and terms.py, so its rules are property-tested without torch;
integrations read ``accumulator.state`` instead of keeping copies.

In a count-first step, ``scale_loss()`` takes the next microbatch, ``backward_scale(i)`` gives
microbatch ``i`` its factor, and ``record_loss(i, loss)`` hands over that microbatch's loss;
``end()`` wants every declared microbatch taken. A compiled ``scale_loss()`` counts on the
device: the caller says so (``traced``), since a graph must not read a per-step value.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import NamedTuple, TypeVar

from .errors import error
from .terms import ARGUMENTS, COUNTS, Options, natural

COUNT_FIRST, SCALE_AFTER = "count_first", "scale_after"
T = TypeVar("T", bound=tuple[object, ...])
_OPEN = {
    "begin": ("still ", "call end() to close it, or abandon() to drop it"),
    "flush": ("", "call it after end() or abandon()"),
    "state_dict": ("", "save the state between end() and the next begin()"),
    "load_state_dict": ("", "load the state before the first begin(), or between steps"),
}


class Step(NamedTuple):
    """The open step: ``declared``, the microbatches a count-first ``begin()`` declared;
    ``scaled``, those ``scale_loss()`` took in eager code; ``factored`` and ``recorded``, those
    ``backward_scale(i)`` and ``record_loss(i, ...)`` took; ``given``, which counts (in the
    order of :data:`lossweight.terms.COUNTS`) a scale-after step's microbatches give;
    ``loss``, whether this rank computes the loss (not a pipeline stage before the last)."""

    number: int
    mode: str
    declared: int = 0
    scaled: int = 0
    factored: frozenset[int] = frozenset()
    recorded: frozenset[int] = frozenset()
    given: tuple[bool, ...] | None = None
    loss: bool = True

    @property
    def unrecorded(self) -> list[int]:
        """Microbatches that took a factor from backward_scale() and whose loss is unknown."""
        return sorted(i for i in self.factored - self.recorded if i >= self.scaled)


class State(NamedTuple):
    """The machine's state; ``weight_by`` and ``loss_logging`` are the options its rules
    read, ``pending`` whether a count-first step's loss waits for the next reduction."""

    weight_by: str = "tokens"
    loss_logging: str = "end"
    steps: int = 0
    step: Step | None = None
    pending: bool = False


_SCALED, _GIVEN = Step._fields.index("scaled"), Step._fields.index("given")
_STEP = State._fields.index("step")


def _set(value: T, field: int, new: object) -> T:
    """``value`` with one field replaced, as ``_replace()`` does at a fraction of its cost:
    this runs once a microbatch."""
    return tuple.__new__(type(value), (*value[:field], new, *value[field + 1 :]))


def begin(
    state: State,
    options: Options,
    lengths: Mapping[str, int | None],
    parameters: bool,
    number: object = None,
    loss: bool = True,
) -> State:
    """Open a step: count first where counts are given (``lengths``: how many each has, by
    count, None where one is not given), else scale after, with ``parameters``. ``number`` is
    the loop's own (the ranks agree on it), by default the next; ``loss``: whether this rank
    computes the loss (a pipeline's last stage does, no other)."""
    idle(state, "begin")
    given = {name: length for name, length in lengths.items() if length is not None}
    if not given and not parameters:
        raise error("neither", argument=ARGUMENTS[options.weight_by])
    if not given and not options.rescalable:
        needed = ", ".join(ARGUMENTS[c] for c in options.counts) or "num_tokens"
        raise error("scale_after_terms", terms=", ".join(map(str, options.terms)), arguments=needed)
    if given and parameters:
        raise error("counts_and_parameters")
    for count in [c for c in options.counts if c not in given] if given else []:
        term = next(t.name for t in options.terms if t.count == count)
        raise error("weight_missing", name=ARGUMENTS[count], term=term, weight_by=count)
    if len(set(given.values())) > 1:
        raise error("lengths_differ", lengths={ARGUMENTS[n]: size for n, size in given.items()})
    if (index := state.steps + 1 if number is None else natural(number)) is None:
        raise error("bad_step", value=number)
    mode, declared = COUNT_FIRST if given else SCALE_AFTER, next(iter(given.values()), 0)
    step = Step(index, mode, declared, loss=loss)
    # A count-first begin() carries a waiting loss; a scale-after step's end() does.
    return state._replace(steps=step.number, step=step, pending=state.pending and not given)


def scale(state: State, given: tuple[bool, ...], traced: bool) -> tuple[State, int | None]:
    """``scale_loss()`` given these counts: the next state, and the microbatch it takes (None
    where the device counts them)."""
    step = _loss_stage(state, "scale_loss")
    if step.mode == SCALE_AFTER:
        if not given[COUNTS.index(state.weight_by)]:
            raise error("weight_missing_here", name=ARGUMENTS[state.weight_by])
        if step.given is not None and given != step.given:
            now, before = _names(given), _names(step.given)
            raise error("counts_differ", now=now, number=step.scaled + 1, before=before)
        step = _set(_set(step, _SCALED, step.scaled + 1), _GIVEN, given)
        return _set(state, _STEP, step), None
    if traced:
        return state, None
    index = step.scaled
    if index >= step.declared:
        raise error("too_many", number=index + 1, step=step.number, declared=step.declared)
    if index in step.recorded:
        raise error("loss_twice", caller="scale_loss()", microbatch=index, step=step.number)
    return _set(state, _STEP, _set(step, _SCALED, index + 1)), index


def trace(state: State) -> int:
    """A compiled ``scale_loss()``: where its device counter starts, after the eager ones."""
    return _loss_stage(state, "scale_loss").scaled


def factor(state: State, microbatch: object, traced: bool) -> tuple[State, int | None]:
    """``backward_scale(microbatch)``: the microbatch whose factor it gives, by default the
    next one ``scale_loss()`` takes (None where the device counts them)."""
    step = _count_first(state, "backward_scale")
    if microbatch is None:
        if not traced and step.scaled >= step.declared:
            raise error("no_next", declared=step.declared, step=step.number)
        return state, None if traced else step.scaled
    if (index := _index(step, "backward_scale", microbatch)) in step.factored:
        return state, index  # read again: nothing changes
    return state._replace(step=step._replace(factored=step.factored | {index})), index


def record(state: State, microbatch: object) -> tuple[State, int]:
    """``record_loss(microbatch, loss)``, after ``backward_scale(microbatch)``."""
    step = _count_first(state, "record_loss")
    index = _index(step, "record_loss", microbatch)
    if index not in step.factored:
        raise error("loss_unfactored", microbatch=index, step=step.number)
    if index < step.scaled or index in step.recorded:
        raise error("loss_twice", caller="record_loss()", microbatch=index, step=step.number)
    return state._replace(step=step._replace(recorded=step.recorded | {index})), index


def end(state: State, traced: bool) -> tuple[State, Exception | None]:
    """The state once the step is closed, and what its end() refuses: a declared microbatch
    that no loss took, which the caller raises, or carries to every rank first."""
    step = open_step(state, "end")
    # A microbatch is taken by scale_loss(), or by backward_scale(i) in a loop that scales by
    # itself. Where scale_loss() took some, a factor read is no proof that its loss was
    # scaled: record_loss(i, loss) is.
    taken = set(range(step.scaled)) | (step.recorded if step.scaled else step.factored)
    missing = [i for i in range(step.declared) if i not in taken]
    refusal = None
    if step.mode == COUNT_FIRST and step.loss and not traced and missing:
        where = {"declared": step.declared, "step": step.number, "missing": missing}
        refusal = error("too_few", scaled=step.scaled, **where)
    # A scale-after step's end() reduces its own loss and any that waited.
    waits = step.mode == COUNT_FIRST and state.loss_logging == "next_step"
    return state._replace(step=None, pending=waits), refusal


def abandon(state: State) -> State:
    """Drop the open step. A count-first one under ``loss_logging="next_step"`` leaves
    ``flush()`` a reduction to make: a rank that ended it holds its loss, which only a
    reduction every rank makes can carry, or find that the ranks differ."""
    step, next_step = state.step, state.loss_logging == "next_step"
    waits = step is not None and step.mode == COUNT_FIRST and next_step
    return state._replace(step=None, pending=state.pending or waits)


def flush(state: State) -> tuple[State, bool]:
    """``flush()``: the next state, and whether a loss waits to be reduced."""
    idle(state, "flush")
    return state._replace(pending=False), state.pending


def load(state: State, steps: int) -> State:
    """``load_state_dict()``: the state at a saved step count, no loss waiting."""
    idle(state, "load_state_dict")
    return state._replace(steps=steps, pending=False)


def idle(state: State, caller: str) -> None:
    """Refuse ``caller`` while a step is open."""
    if state.step is not None:
        still, fix = _OPEN[caller]
        raise error("step_open", caller=caller, step=state.step.number, still=still, fix=fix)


def open_step(state: State, caller: str) -> Step:
    if state.step is None:
        when = f"after step {state.steps} was closed" if state.steps else "before the first begin()"
        raise error("no_step", caller=caller, when=when, argument=ARGUMENTS[state.weight_by])
    return state.step


def _loss_stage(state: State, caller: str) -> Step:
    """The open step, where this rank computes the loss."""
    step = open_step(state, caller)
    if not step.loss:
        raise error("not_the_loss_stage", caller=caller, step=step.number)
    return step


def _count_first(state: State, caller: str) -> Step:
    step = _loss_stage(state, caller)
    if step.mode == SCALE_AFTER:
        raise error("scale_after_factor", caller=caller, step=step.number)
    return step


def _index(step: Step, caller: str, microbatch: object) -> int:
    """A microbatch index: an int or an integer-like (numpy's included), not a bool."""
    try:
        index = -1 if isinstance(microbatch, bool) else operator.index(microbatch)  # type: ignore[arg-type]
    except TypeError:
        index = -1
    if not 0 <= index < step.declared:
        where = {"step": step.number, "declared": step.declared, "last": step.declared - 1}
        raise error("bad_microbatch", caller=caller, microbatch=microbatch, **where)
    return index


def _names(given: tuple[bool, ...]) -> str:
    names = [ARGUMENTS[name] for name, on in zip(COUNTS, given, strict=True) if on]
    return " and ".join(names) or "no counts"
