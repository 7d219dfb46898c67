"""A stateful property test of what a scale-after step's ``end()`` rescales, against an exact model.

Hypothesis drives the Accumulators of 1 or 2 data-parallel ranks (simulated in one process by
:class:`lossweight.testing.InProcessGroup`, each rank an Accumulator of its own) and one more
Accumulator with parameters of its own, through steps of both modes in random orders, and checks
the rules of ``begin(parameters=...)``:

- every way of listing the parameters (tensors, ``(name, tensor)`` pairs, a module, an
  optimizer), a parameter listed twice (the same tensor, or a tied weight reached through two
  modules), and two parameters whose gradients are the same memory: each gradient is rescaled
  once;
- a partial list: the listed parameters end exact, and ``end()`` leaves every other gradient as
  it was (bit for bit), the provisional gradient included;
- a loss of another Accumulator (another rank's included) that reaches a gradient that an open
  scale-after step's ``end()`` rescales (a parameter given to its ``begin()``, or one whose
  gradient is the same memory) is refused with the documented error and changes nothing, and the
  step goes on exactly; a loss over other parameters is accepted and exact, in either mode (two
  count-first Accumulators share parameters freely);
- a step whose ranks back-propagated a loss without ``scale_loss()``: ``end()`` refuses it while
  no rank scaled a loss and some rank's listed parameters hold a nonzero gradient, on every
  rank together (through the step's reduction), and changes nothing; after
  ``abandon()`` the next ``begin()`` refuses the gradients left over until they are zeroed, and the
  next step is exact.

Every parameter is a float64 scalar at 0, and each loss is a constant plus ``c * p`` for small
integers ``c``, so a parameter's gradient is ``c`` times the factor of each microbatch that used
it: the model holds each gradient as an exact :class:`fractions.Fraction`, and every gradient is
checked after every rule, within the few float64 roundings its terms take (all terms are
non-negative: no cancellation).
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from lossweight import Accumulator, StepResult
from lossweight.testing import InProcessGroup

F64 = torch.float64
MICROBATCHES = 3  # the most microbatches of one rank in one step
WEIGHTS = st.sampled_from([*range(1, 13), 0, 0])  # uniform: st.integers() would favour 0
COEFFICIENTS = st.sampled_from([0, 0, 1, 2, 3])
CONSTANTS = st.integers(0, 40).map(lambda k: k / 8)
# A rank's parameters as its losses reach them ("left" and "right" are one tied weight), and the
# gradient each adds to ("a" and "b" share their gradient's memory).
SLOTS = ("b0", "b1", "b2", "left", "right", "a", "b")
CELL = {"b0": "b0", "b1": "b1", "b2": "b2", "left": "tied", "right": "tied", "a": "ab", "b": "ab"}
OTHER = "other"  # the owner of the other Accumulator's parameters
OTHER_SLOTS = ("q0", "q1")
FORMS = ("list", "tuple", "iter", "named", "chain", "module", "named_dup", "optimizer", "whole")
ELSEWHERE = "reaches parameters of another Accumulator's open scale-after step"
UNSCALED = "found nonzero gradients that no scale_loss() produced"
STALE = "already hold nonzero gradients"

Owner = int | str  # a rank of the data-parallel Accumulators, or OTHER
CellKey = tuple[Owner, str]


class Toy(torch.nn.Module):
    """One rank's model: three parameters, a weight tied through two modules, and two
    parameters ``a`` and ``b`` whose gradients are the same memory (the one tensor, or two
    views of one flat buffer)."""

    def __init__(self, same_object: bool) -> None:
        super().__init__()
        self.b0, self.b1, self.b2, shared, self.a, self.b = (
            torch.nn.Parameter(torch.zeros((), dtype=F64)) for _ in range(6)
        )
        self.left, self.right = torch.nn.Module(), torch.nn.Module()
        self.left.weight = shared
        self.right.weight = shared
        self.flat = torch.zeros(1, dtype=F64)
        self.a.grad = self.flat[0]
        self.b.grad = self.a.grad if same_object else self.flat[0]

    def slot(self, name: str) -> torch.nn.Parameter:
        owner = getattr(self, name) if name in ("left", "right") else self
        parameter = getattr(owner, "weight" if owner is not self else name)
        assert isinstance(parameter, torch.nn.Parameter)
        return parameter


def parameters_argument(form: str, model: Toy, listing: list[str]) -> Any:
    """``listing`` (slot names, maybe repeated) in one of the forms begin() takes; ``whole``:
    the model itself."""
    tensors = [model.slot(name) for name in listing]
    if form == "whole":
        return model
    if form in ("list", "tuple"):
        return list(tensors) if form == "list" else tuple(tensors)
    if form == "iter":
        return iter(tensors)
    if form == "named":
        return [
            (f"{name}.{index}", t)
            for index, (name, t) in enumerate(zip(listing, tensors, strict=True))
        ]
    if form == "chain":
        return itertools.chain.from_iterable([t] for t in tensors)
    container = torch.nn.Module()
    for index, (name, tensor) in enumerate(zip(listing, tensors, strict=True)):
        container.register_parameter(f"{name}_{index}", tensor)
    if form == "module":  # registered under several names: listed once
        return container
    if form == "named_dup":  # every name: a tensor registered twice is listed twice
        return container.named_parameters(remove_duplicate=False)
    unique = list(container.parameters())
    groups = [
        {"params": unique[: len(unique) // 2 or 1]},
        {"params": unique[len(unique) // 2 or 1 :]},
    ]
    return torch.optim.SGD([group for group in groups if group["params"]], lr=0.1)


@dataclass
class Part:
    """One microbatch's term of a gradient: what it holds now, and ``numerator / W`` is what it
    becomes when ``end()`` of ``step`` rescales it (None: final)."""

    value: Fraction
    numerator: Fraction
    step: tuple[Owner, int] | None


@dataclass
class Cell:
    """One gradient's memory, read through ``tensor.grad``."""

    tensor: torch.Tensor
    exists: bool = False
    parts: list[Part] = field(default_factory=list)

    def exact(self) -> Fraction:
        return sum((part.value for part in self.parts), Fraction(0))


@dataclass
class OpenStep:
    """The open step of the data-parallel Accumulators (owners 0, 1) or of the other one."""

    mode: str  # "count_first" or "scale_after"
    index: int
    divisor: Fraction  # D
    estimate: Fraction  # the E its provisional factors assume (1 where E is 0)
    weights: dict[Owner, list[int]]  # count first: declared; scale after: given so far
    scaled: dict[Owner, int]
    listed: dict[Owner, set[CellKey]] = field(default_factory=dict)  # what end() rescales
    contexts: dict[Owner, Any] = field(default_factory=dict)
    raw: bool = False  # a loss was back-propagated without scale_loss()

    def total(self) -> int:
        return sum(sum(weights) for weights in self.weights.values())

    def remaining(self, owner: Owner) -> bool:
        if self.raw:
            return False
        if self.mode == "count_first":
            return self.scaled[owner] < len(self.weights[owner])
        return self.scaled[owner] < MICROBATCHES


def expect_error(
    call: Callable[[], object], kind: type[BaseException], text: str, why: str = ""
) -> None:
    """``call()`` raises ``kind`` with ``text`` in its message (``why``: what it should have
    refused)."""
    with pytest.raises(kind) as info:
        call()
        pytest.fail(f"DID NOT RAISE {kind.__name__}: {why}")
    assert text in str(info.value), f"{type(info.value).__name__}({str(info.value)!r})"


def check_close(actual: float, exact: Fraction, ulps: int, what: str) -> None:
    """Exactly 0 where the exact value is, else within ``ulps`` ulp of it."""
    if exact == 0:
        assert actual == 0, f"{what}: {actual!r}, but the exact value is 0"
        return
    error = abs(Fraction(actual) - exact)
    assert math.isfinite(actual) and error <= ulps * Fraction(math.ulp(float(exact))), (
        f"{what}: {actual!r}, but the exact value is {float(exact)!r} (= {exact})"
    )


def weight_total(result: StepResult, weight_by: str) -> int:
    return int(getattr(result, f"num_{weight_by}").item())


MAIN_OPTIONS = st.fixed_dictionaries(
    {
        "loss_reduction": st.sampled_from(["mean", "sum"]),
        "weight_by": st.sampled_from(["tokens", "samples"]),
        "grad_reduction": st.sampled_from(["mean", "sum", 2.0, 0.5, 3.0]),
        "weight_estimate": st.sampled_from([1.0, 3.0, 0.5, 10.0, 1000.0]),
        "framework_divides_loss_by": st.sampled_from([1, 2, 0.5]),
    }
)
OTHER_OPTIONS = st.fixed_dictionaries(
    {
        "loss_reduction": st.sampled_from(["mean", "sum"]),
        "weight_by": st.sampled_from(["tokens", "samples"]),
        "weight_estimate": st.sampled_from([1.0, 4.0, 7.0]),
    }
)


class ScaleAfterMachine(RuleBasedStateMachine):
    @initialize(
        world_size=st.integers(1, 2),
        options=MAIN_OPTIONS,
        other_options=OTHER_OPTIONS,
        same_object=st.booleans(),
    )
    def setup(
        self,
        world_size: int,
        options: dict[str, Any],
        other_options: dict[str, Any],
        same_object: bool,
    ) -> None:
        self.world_size, self.options, self.other_options = world_size, options, other_options
        self.group = InProcessGroup(world_size)
        self.accs = [
            Accumulator(**options, collective=self.group.collective(rank))
            for rank in range(world_size)
        ]
        self.other = Accumulator(**other_options)
        self.models = [Toy(same_object) for _ in range(world_size)]
        self.q = {name: torch.nn.Parameter(torch.zeros((), dtype=F64)) for name in OTHER_SLOTS}
        self.cells: dict[CellKey, Cell] = {}
        for rank, model in enumerate(self.models):
            for slot in SLOTS:
                self.cells.setdefault((rank, CELL[slot]), Cell(model.slot(slot)))
            self.cells[(rank, "ab")].exists = True  # the flat buffer's views
        for name, tensor in self.q.items():
            self.cells[(OTHER, name)] = Cell(tensor)
        self.main: OpenStep | None = None
        self.side: OpenStep | None = None  # the other Accumulator's
        self.steps = {"main": 0, OTHER: 0}
        self.estimates = {
            "main": Fraction(options["weight_estimate"]),
            OTHER: Fraction(other_options["weight_estimate"]),
        }
        self.defaults = dict(self.estimates)  # E after a step whose W was 0

    def teardown(self) -> None:  # leave no scale-after step open for the next example
        for acc in [*getattr(self, "accs", []), getattr(self, "other", None)]:
            if acc is not None:
                acc.abandon()

    # The model's bookkeeping.

    def _acc(self, owner: Owner) -> Accumulator:
        return self.other if owner == OTHER else self.accs[owner]  # type: ignore[index]

    def _step(self, owner: Owner) -> OpenStep | None:
        return self.side if owner == OTHER else self.main

    def _options(self, owner: Owner) -> dict[str, Any]:
        return self.other_options if owner == OTHER else self.options

    def _slots(self, owner: Owner) -> tuple[str, ...]:
        return OTHER_SLOTS if owner == OTHER else SLOTS

    def _tensor(self, owner: Owner, slot: str) -> torch.Tensor:
        return self.q[slot] if owner == OTHER else self.models[owner].slot(slot)  # type: ignore[index]

    def _cell(self, owner: Owner, slot: str) -> CellKey:
        return (owner, slot if owner == OTHER else CELL[slot])

    def _divisor(self, owner: Owner) -> Fraction:
        if owner == OTHER:  # grad_reduction="mean" over one process
            return Fraction(1)
        reduction = self.options["grad_reduction"]
        wrapper = {"mean": self.world_size, "sum": 1}.get(reduction, reduction)
        return Fraction(wrapper) * Fraction(self.options["framework_divides_loss_by"])

    def _snapshot(self) -> dict[CellKey, torch.Tensor | None]:
        return {
            key: None if cell.tensor.grad is None else cell.tensor.grad.clone()
            for key, cell in self.cells.items()
        }

    def _unchanged(
        self,
        before: dict[CellKey, torch.Tensor | None],
        rescaled: set[CellKey] | frozenset[CellKey] = frozenset(),
    ) -> None:
        """Every gradient but those of ``rescaled`` is as it was, bit for bit."""
        for key, cell in self.cells.items():
            if key in rescaled:
                continue
            grad, old = cell.tensor.grad, before[key]
            assert (grad is None) == (old is None), f"the gradient of {key} appeared or went"
            assert grad is None or torch.equal(grad, old), (  # type: ignore[arg-type]
                f"the gradient of {key} changed from {old} to {grad}"
            )

    def _zero_grad(self, owner: Owner, how: str) -> None:
        """``optimizer.zero_grad()``: ``how`` is "none" (set_to_none) or "zeros"."""
        for key, cell in self.cells.items():
            if key[0] != owner:
                continue
            if key[1] == "ab":  # views of a buffer stay views: zeroed in place
                self.models[owner].flat.zero_()  # type: ignore[index]
            elif how == "none":
                cell.tensor.grad, cell.exists = None, False
            elif cell.tensor.grad is not None:
                cell.tensor.grad.zero_()
            cell.parts = []

    def _settle(self, owner: Owner, step: OpenStep) -> None:
        """What end() of ``owner``'s part of ``step`` makes of the terms it scaled: final where
        it rescales the gradient, provisional (as they are) elsewhere."""
        key, total = (owner, step.index), Fraction(step.total() or 1)
        for cell_key, cell in self.cells.items():
            for part in cell.parts:
                if part.step == key:
                    if cell_key in step.listed[owner]:
                        part.value = part.numerator / total
                    part.step = None

    def _guarded(self, scaler: Owner, owner: Owner, slot: str) -> bool:
        """Whether a loss of ``scaler`` that reaches ``owner``'s ``slot`` is refused: its
        gradient is one that end() of another Accumulator's open scale-after step rescales (a
        parameter given to begin(), or one whose gradient is the same memory)."""
        step = self._step(owner)
        return (
            owner != scaler
            and step is not None
            and step.mode == "scale_after"
            and self._cell(owner, slot) in step.listed[owner]
        )

    # Scaling a loss, in either mode, by either kind of Accumulator.

    def _scale(self, data: st.DataObject, owner: Owner, foreign: bool = True) -> None:
        step = self._step(owner)
        assert step is not None and step.remaining(owner)
        acc, options = self._acc(owner), self._options(owner)
        slots = self._slots(owner)
        usable = [
            slot
            for slot in slots
            if step.mode == "count_first" or self._cell(owner, slot) in step.listed[owner]
        ]  # each loss reaches a listed parameter: else end() finds no gradient to rescale
        anchor = data.draw(st.sampled_from(usable), label="anchor")
        # A scale-after step's losses reach only parameters given to its begin(): end() refuses
        # one that reaches another (tests/test_scale_after.py), and so do these, where another
        # open scale-after step's end() would rescale it (at scale_loss()).
        reachable = slots if step.mode == "count_first" else usable
        coefficients = {(owner, slot): data.draw(COEFFICIENTS) for slot in reachable}
        coefficients[(owner, anchor)] = data.draw(st.integers(1, 3))
        if foreign and data.draw(st.integers(0, 2), label="foreign") == 0:
            owners: list[Owner] = [*range(self.world_size), OTHER]
            targets = [(o, s) for o in owners if o != owner for s in self._slots(o)]
            if step.mode != "count_first":
                targets = [(o, s) for o, s in targets if self._guarded(owner, o, s)]
            if targets:
                target = data.draw(st.sampled_from(targets), label="foreign target")
                coefficients[target] = data.draw(st.integers(1, 3))
        loss = torch.tensor(data.draw(CONSTANTS), dtype=F64)
        for (o, slot), c in coefficients.items():
            if c:
                loss = loss + c * self._tensor(o, slot)
        if step.mode == "count_first":
            weight, counts = step.weights[owner][step.scaled[owner]], {}
        else:
            weight = data.draw(WEIGHTS, label="weight")
            counts = {f"num_{options['weight_by']}": weight}
        guarded = [(o, s) for (o, s), c in coefficients.items() if c and self._guarded(owner, o, s)]
        if guarded:
            state, before = acc.state, self._snapshot()
            why = (
                f"scale_loss() of {owner!r} took a loss that reaches {guarded}, whose gradient "
                "end() of another Accumulator's open scale-after step rescales"
            )
            expect_error(lambda: acc.scale_loss(loss, **counts), RuntimeError, ELSEWHERE, why)
            assert acc.state == state, "a refused loss changed the Accumulator's state"
            self._unchanged(before)
            return
        acc.scale_loss(loss, **counts).backward()
        divisor = self._divisor(owner)
        numerator = weight * divisor if options["loss_reduction"] == "mean" else divisor
        numerator = numerator if weight else Fraction(0)
        for (o, slot), c in coefficients.items():
            if c:
                cell = self.cells[self._cell(o, slot)]
                cell.exists = True
                if step.mode == "count_first":
                    cell.parts.append(Part(c * numerator / (step.total() or 1), Fraction(0), None))
                else:
                    value = c * numerator / step.estimate
                    cell.parts.append(Part(value, c * numerator, (owner, step.index)))
        step.scaled[owner] += 1
        if step.mode == "scale_after":
            step.weights[owner].append(weight)

    # The data-parallel Accumulators.

    def _open(self, owner: Owner, mode: str, weights: dict[Owner, list[int]]) -> OpenStep:
        name = "main" if owner != OTHER else OTHER
        estimate = self.estimates[name] or Fraction(1)
        scaled: dict[Owner, int] = dict.fromkeys(weights, 0)
        return OpenStep(mode, self.steps[name] + 1, self._divisor(owner), estimate, weights, scaled)

    # Two rules, valid in every state, each choosing what comes next for its Accumulators:
    # rules with preconditions leave states where every rule is invalid or swarm-disabled.

    @rule(data=st.data())
    def ranks_call(self, data: st.DataObject) -> None:
        """The data-parallel Accumulators' next call."""
        step = self.main
        if step is None:
            scale_after = data.draw(st.integers(0, 3), label="scale after") > 0
            (self._begin_scale_after if scale_after else self._begin_count_first)(data)
            return
        actions = ["scale"] * 5 if self._main_ranks() else []
        if step.mode == "scale_after" and not step.raw and not any(step.scaled.values()):
            actions.append("backward")
        action = data.draw(st.sampled_from([*actions, "end", "end", "abandon"]), label="action")
        if action == "scale":
            for _ in range(data.draw(st.integers(1, 3), label="microbatches")):
                if self._main_ranks():
                    self._scale(data, data.draw(st.sampled_from(self._main_ranks()), label="rank"))
        elif action == "backward":
            self._backward_without_scale_loss(data)
        elif action == "end":
            self._end(data)
        else:
            self._abandon(data)

    @rule(data=st.data())
    def other_call(self, data: st.DataObject) -> None:
        """The other Accumulator's next call."""
        step = self.side
        if step is None:
            self._other_begin(data)
            return
        actions = ["scale", "scale"] if step.remaining(OTHER) else []
        action = data.draw(st.sampled_from([*actions, "end", "end", "abandon"]), label="action")
        if action == "scale":
            self._scale(data, OTHER)
        elif action == "end":
            self._other_end(data)
        else:
            self.other.abandon()
            self.side = None

    def _begin_scale_after(self, data: st.DataObject) -> None:
        form = data.draw(st.sampled_from(FORMS), label="form")
        listing = list(SLOTS)
        if form != "whole":
            listing = data.draw(st.lists(st.sampled_from(SLOTS), min_size=1, max_size=6))
        zeroing = data.draw(st.sampled_from(["none", "zeros", "skip"]), label="zero_grad")
        step = self._open(0, "scale_after", {rank: [] for rank in range(self.world_size)})
        for rank, (acc, model) in enumerate(zip(self.accs, self.models, strict=True)):
            if zeroing != "skip":
                self._zero_grad(rank, zeroing)
            listed: set[CellKey] = {(rank, CELL[slot]) for slot in listing}

            def begin(a: Accumulator = acc, m: Toy = model) -> Any:
                return a.begin(parameters=parameters_argument(form, m, listing))

            if any(self.cells[key].exact() != 0 for key in listed):
                state, before = acc.state, self._snapshot()
                expect_error(begin, RuntimeError, STALE)
                assert acc.state == state and not acc.step_open
                self._unchanged(before)
                self._zero_grad(rank, data.draw(st.sampled_from(["none", "zeros"])))
            step.contexts[rank] = begin()
            assert step.contexts[rank].index == step.index
            step.listed[rank] = listed
        self.steps["main"] += 1
        self.main = step

    def _begin_count_first(self, data: st.DataObject) -> None:
        # Count first rescales nothing: gradients left over are allowed (and kept).
        zeroing = data.draw(st.sampled_from(["none", "zeros", "skip"]), label="zero_grad")
        weights: dict[Owner, list[int]] = {
            rank: data.draw(st.lists(WEIGHTS, max_size=MICROBATCHES))
            for rank in range(self.world_size)
        }
        step = self._open(0, "count_first", weights)
        name = f"num_{self.options['weight_by']}"
        for rank, acc in enumerate(self.accs):
            if zeroing != "skip":
                self._zero_grad(rank, zeroing)
            kwargs: dict[str, Any] = {name: list(weights[rank])}
            step.contexts[rank] = acc.begin(**kwargs)
        self.steps["main"] += 1
        self.main = step
        # Its W is the next estimate from begin() on, whether the step ends or is abandoned.
        self.estimates["main"] = Fraction(step.total()) or self.defaults["main"]

    def _main_ranks(self) -> list[int]:
        step = self.main
        if step is None:
            return []
        return [rank for rank in range(self.world_size) if step.remaining(rank)]

    def _backward_without_scale_loss(self, data: st.DataObject) -> None:
        """Every rank back-propagates a loss as it is, the same on each."""
        step = self.main
        assert step is not None
        coefficients = {slot: data.draw(COEFFICIENTS) for slot in SLOTS}
        coefficients[data.draw(st.sampled_from(SLOTS))] = data.draw(st.integers(1, 3))
        for rank, model in enumerate(self.models):
            loss = torch.tensor(1.0, dtype=F64)
            for slot, c in coefficients.items():
                if c:
                    loss = loss + c * model.slot(slot)
                    cell = self.cells[(rank, CELL[slot])]
                    cell.exists = True
                    cell.parts.append(Part(Fraction(c), Fraction(0), None))
            loss.backward()
        step.raw = True

    def _end(self, data: st.DataObject) -> None:
        step = self.main
        assert step is not None
        weight_by = self.options["weight_by"]
        if step.mode == "count_first":
            for rank in range(self.world_size):
                while step.remaining(rank):
                    self._scale(data, rank, foreign=False)
            before = self._snapshot()
            results = [acc.end() for acc in self.accs]
            self._unchanged(before)  # count first rescales nothing
        else:
            # Refused, on every rank together, where no rank scaled a loss and some rank's
            # listed gradients are nonzero (a rank may hold its peers' scaled gradients).
            nonzero = [
                any(self.cells[k].exact() != 0 for k in step.listed[rank])
                for rank in range(self.world_size)
            ]
            if not any(step.scaled.values()) and any(nonzero):
                before, states = self._snapshot(), [acc.state for acc in self.accs]
                tries = data.draw(st.integers(1, 2), label="tries")

                def refuse(rank: int, _: object) -> None:
                    for _ in range(tries):  # a second end() reduces no more: the same error
                        expect_error(self.accs[rank].end, RuntimeError, UNSCALED)

                self.group.run(refuse)
                for acc, state in zip(self.accs, states, strict=True):
                    assert acc.state == state and acc.step_open
                self._unchanged(before)
                # A refused reduction gives no W: the next estimate is the option's.
                self.estimates["main"] = Fraction(self.options["weight_estimate"])
                self._abandon(data)  # the gradients stay: zero_grad before the next begin()
                return
            before = self._snapshot()
            results = self.group.run(lambda rank, _: self.accs[rank].end())
            rescaled = set().union(*step.listed.values())
            self._unchanged(before, rescaled)
            for rank in range(self.world_size):
                self._settle(rank, step)
        total = step.total()
        for result in results:
            assert result.step == step.index and weight_total(result, weight_by) == total
        self.estimates["main"] = Fraction(total) or self.defaults["main"]
        self.main = None

    def _abandon(self, data: st.DataObject) -> None:
        step = self.main
        assert step is not None
        before = self._snapshot()
        if data.draw(st.booleans(), label="with"):  # an exception leaves `with acc.begin(...):`
            for context in step.contexts.values():
                context.__exit__(RuntimeError, RuntimeError("out of memory"), None)
        else:
            for acc in self.accs:
                acc.abandon()
        self._unchanged(before)
        self.main = None

    # The other Accumulator: no data-parallel group, but in the same process as the ranks'.

    def _other_begin(self, data: st.DataObject) -> None:
        if data.draw(st.booleans(), label="other scales after"):
            self._zero_grad(OTHER, "none")
            step = self._open(OTHER, "scale_after", {OTHER: []})
            step.contexts[OTHER] = self.other.begin(parameters=list(self.q.values()))
            step.listed[OTHER] = {(OTHER, name) for name in OTHER_SLOTS}
        else:
            weights = data.draw(st.lists(WEIGHTS, min_size=1, max_size=MICROBATCHES))
            step = self._open(OTHER, "count_first", {OTHER: weights})
            name = f"num_{self.other_options['weight_by']}"
            kwargs: dict[str, Any] = {name: list(weights)}
            step.contexts[OTHER] = self.other.begin(**kwargs)
            self.estimates[OTHER] = Fraction(step.total()) or self.defaults[OTHER]  # ended or not
        self.steps[OTHER] += 1
        self.side = step

    def _other_end(self, data: st.DataObject) -> None:
        step = self.side
        assert step is not None
        while step.mode == "count_first" and step.remaining(OTHER):
            self._scale(data, OTHER, foreign=False)
        before = self._snapshot()
        result = self.other.end()
        self._unchanged(before, step.listed.get(OTHER, set()))
        if step.mode == "scale_after":
            self._settle(OTHER, step)
        assert weight_total(result, self.other_options["weight_by"]) == step.total()
        self.estimates[OTHER] = Fraction(step.total()) or self.defaults[OTHER]
        self.side = None

    # What holds after every rule.

    @invariant()
    def gradients_are_exact(self) -> None:
        for key, cell in self.cells.items():
            grad = cell.tensor.grad
            if not cell.exists:
                assert grad is None, f"{key} has a gradient {grad}, but no loss reached it"
                continue
            assert grad is not None, f"{key} has no gradient"
            terms = [(float(part.value), part.step) for part in cell.parts]
            what = f"the gradient of {key} (terms {terms})"
            check_close(grad.item(), cell.exact(), 8 + 2 * len(cell.parts), what)
        for model in self.models:  # the two views still share one buffer
            assert model.a.grad is not None and model.b.grad is not None
            assert model.a.grad.data_ptr() == model.b.grad.data_ptr() == model.flat.data_ptr()

    @invariant()
    def accumulators_agree_with_the_model(self) -> None:
        for acc in self.accs:
            assert acc.step_open == (self.main is not None)
            assert acc.steps == self.steps["main"]
        assert self.other.step_open == (self.side is not None)
        assert self.other.steps == self.steps[OTHER]


ScaleAfterMachine.TestCase.settings = settings(
    max_examples=600,
    stateful_step_count=25,
    deadline=None,
    report_multiple_bugs=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestScaleAfterMachine = ScaleAfterMachine.TestCase


# A minimal reproduction of what the machine found, on a single process.


def test_a_loss_over_a_parameter_whose_gradient_a_step_rescales_is_refused() -> None:
    # a and b share their gradient's memory (views of one flat buffer); begin() got only a,
    # so end() rescales that memory. Another Accumulator's loss over b was accepted, and end()
    # multiplied its gradient by E / W = 4: 3.0 instead of 1 + 0.5.
    a, b = (torch.nn.Parameter(torch.zeros((), dtype=F64)) for _ in range(2))
    flat = torch.zeros(1, dtype=F64)
    a.grad, b.grad = flat[0], flat[0]
    first = Accumulator(loss_reduction="sum", weight_estimate=4.0)
    second = Accumulator(loss_reduction="sum")
    try:
        first.begin(parameters=[a])
        first.scale_loss(a * 1.0, num_tokens=1).backward()
        second.begin(num_tokens=[2])
        with pytest.raises(RuntimeError, match=re.escape(ELSEWHERE)):
            second.scale_loss(b * 1.0)
        first.end()
        assert flat.item() == 1.0
    finally:
        first.abandon()
        second.abandon()
