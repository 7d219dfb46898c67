"""A stateful property test of the Accumulator against an exact model, over 1 to 3 ranks.

Hypothesis drives every public call of :class:`lossweight.Accumulator` in random orders, in
both modes (count first, scale after) and with every option, for ranks simulated in one process
by :class:`lossweight.testing.InProcessGroup` and driven from one thread, in turn (but for
scale-after ``end()`` and ``flush()``, which wait for their own all-reduce: the group runs
them on every rank at once). The ranks of one run share their options. The calls that reduce
over the ranks (``begin()``, ``end()``, ``flush()``, ``abandon()``) are made on every rank in
the same rule; ``scale_loss()`` and ``backward_scale()`` on one rank or all; every misuse on one
rank only: it must raise a clear error (naming the argument or the call) before any
collective, and change nothing, so that the run goes on and later steps still check out
exactly.

The model is exact (:class:`fractions.Fraction`), and every float the library computes from
it is checked within as many ulps as the float64 roundings the documented formula needs, each
worth at most one ulp:

- a count-first factor ``w * D / W`` (or ``D / W``): one correctly rounded division when ``w``,
  ``w * D`` and ``W`` are floats exactly, so the float nearest to the exact value (0.5 ulp);
  counts above 2**53 add up to three roundings (``D`` is the wrapper's divisor times
  ``framework_divides_loss_by``, one rounding more when that product is not a float);
- a scale-after provisional factor ``w * D / E``: the same, with the estimate ``E`` (the
  previous step's ``W`` as a float, or ``weight_estimate``) for ``W``;
- a scale-after gradient after ``end()``: the provisional factor times ``fl(E / fl(W))``, up to
  two roundings more (three in all for exact inputs), fewer where a factor is exact or a power
  of two. It is the exact ``w * D / W`` whatever ``E``. A gradient of 1 on a parameter that no
  microbatch used shows the correction ``E / W`` itself: one division;
- the logged loss: a sum of non-negative terms, one rounding per term and per rank, and more.

It observes a scale-after factor through a gradient: each microbatch's loss is ``p + l`` for a
float64 parameter ``p = 0`` of its own and a constant ``l``, so ``p``'s gradient is the factor.
"""

from __future__ import annotations

import copy
import io
import math
import pickle
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from lossweight import Accumulator, DisagreementError, StepResult, Term
from lossweight.testing import InProcessCollective, InProcessGroup

NAMES = ("num_samples", "num_tokens")
OPTIONS = ("grad_reduction", "loss_logging", "framework_divides_loss_by")  # saved as given
MICROBATCHES = 4  # the most microbatches of one rank in one step
SIZES = st.sampled_from([2, 1, 3, 4, 0])  # uniform: st.integers() would favour 0
NAN = float("nan")
F64 = torch.float64

# Counts: many zeros (empty microbatches, ranks and steps), small ones, and some above 2**53.
# A step's total stays below 2**62: at most 3 ranks x 4 microbatches x 2**57.
COUNTS = st.one_of(
    st.just(0),
    st.integers(1, 3),
    st.integers(1, 3),
    st.integers(4, 1000),
    st.integers(2**50, 2**57),
)
# Non-negative losses, so that the logged loss's sum has no cancellation.
DYADIC = st.integers(0, 80).map(lambda k: k / 8)
LOSS_VALUES = st.one_of(DYADIC, DYADIC, st.floats(1e-6, 1e3))
GRAD_REDUCTIONS = st.one_of(
    st.sampled_from(["mean", "sum"]),
    st.sampled_from([0.5, 2.0, 3.0, 2.5, 0.1, 1 / 3, 4, 7]),
    st.floats(1e-3, 1e3),
)
WEIGHT_ESTIMATES = st.one_of(
    st.just(1.0),
    st.sampled_from([0.5, 3.0, 0.1, 1e6, 2**61 + 2**40]),
    st.floats(1e-3, 1e12),
    st.integers(1, 10**6),
)
OPTION_SETS = st.fixed_dictionaries(
    {
        "loss_reduction": st.sampled_from(["mean", "sum"]),
        "weight_by": st.sampled_from(["tokens", "samples"]),
        "grad_reduction": GRAD_REDUCTIONS,
        "loss_logging": st.sampled_from(["end", "next_step"]),
        "weight_estimate": WEIGHT_ESTIMATES,
        "framework_divides_loss_by": st.one_of(
            st.just(1), st.sampled_from([2, 4, 8, 0.5, 3.0]), st.floats(1e-2, 1e2)
        ),
        # Two terms of the same options, each given the same loss: every scaled value, gradient
        # and logged loss doubles exactly, and each term logs the loss of one.
        "twice": st.booleans(),
    }
)


def ulp32(x: float) -> float:
    """The spacing of float32 numbers at ``x`` (a normal number)."""
    _, exponent = math.frexp(x)
    return math.ldexp(1.0, exponent - 24)


def check_close(actual: float, exact: Fraction, ulps: int, what: str, ulp: Any = math.ulp) -> None:
    """``actual``, computed with ``ulps`` roundings, is within ``ulps`` ulp of the exact value:
    exactly 0 when that is 0, and the float nearest to it after one float64 rounding."""
    assert math.isfinite(actual), f"{what}: {actual!r}, but the exact value is {float(exact)!r}"
    if exact == 0:
        assert actual == 0, f"{what}: {actual!r}, but the exact value is 0"
        return
    if ulps == 1 and ulp is math.ulp:  # one correctly rounded operation
        assert actual == float(exact), (
            f"{what}: {actual!r}, but the exact value {exact} rounds to {float(exact)!r}"
        )
        return
    unit = Fraction(ulp(float(exact)))
    error = abs(Fraction(actual) - exact)
    assert error <= ulps * unit, (
        f"{what}: {actual!r} is {float(error / unit):.3g} ulp from the exact {float(exact)!r} "
        f"(= {exact}), more than {ulps}"
    )


def is_float(value: Fraction) -> bool:
    """Whether float64 holds ``value`` exactly."""
    return Fraction(float(value)) == value


def is_power_of_two(value: Fraction) -> bool:
    """Whether multiplying a float by ``value`` is exact (short of overflow)."""
    numerator, denominator = value.numerator, value.denominator
    return value > 0 and numerator & (numerator - 1) == 0 and denominator & (denominator - 1) == 0


def fitting_dtypes(values: list[int]) -> list[torch.dtype]:
    """The integer dtypes that hold every one of ``values``."""
    largest = max(values, default=0)
    dtypes = [torch.int64]
    for dtype, limit in (
        (torch.int32, 2**31),
        (torch.int16, 2**15),
        (torch.int8, 2**7),
        (torch.uint8, 2**8),
    ):
        if largest < limit:
            dtypes.append(dtype)
    return dtypes


def expect_error(
    call: Any, types: type[BaseException] | tuple[type[BaseException], ...], *names: str
) -> BaseException:
    """``call()`` raises one of ``types``, with a message that names every one of ``names``."""
    with pytest.raises(types) as info:
        call()
    message = str(info.value)
    for name in names:
        assert name in message, f"{type(info.value).__name__}({message!r}) does not name {name}"
    if types is not DisagreementError:  # a misuse is not a disagreement of the ranks
        assert not isinstance(info.value, DisagreementError), message
    return info.value


def clobber(value: object) -> None:
    """Overwrite counts after handing them over: the Accumulator must have copied them."""
    if isinstance(value, torch.Tensor):
        value.fill_(77)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            if isinstance(item, torch.Tensor):
                item.fill_(77)
            else:
                value[index] = 12345


def _factors(factors: torch.Tensor | dict[str, torch.Tensor], twice: int) -> torch.Tensor:
    """``backward_scale()``'s factor, or with two terms its two by name, stacked in order."""
    if not twice:
        assert isinstance(factors, torch.Tensor) and factors.shape == ()
        return factors
    assert isinstance(factors, dict) and list(factors) == ["loss", "again"]
    return torch.stack([factors["loss"], factors["again"]])


@dataclass
class RankStep:
    """One rank's part of the open step."""

    weights: list[int]  # count first: declared by begin(); scale after: given so far
    others: list[int] | None  # the count that does not weight, if this rank gave it
    losses: list[float] = field(default_factory=list)  # the values given to scale_loss()
    params: list[torch.Tensor] = field(default_factory=list)  # scale after: one per microbatch
    gives_other: bool | None = None  # scale after: what its first microbatch chose
    context: Any = None  # what begin() returned
    factored: set[int] = field(default_factory=set)  # count first: backward_scale(i) took them

    @property
    def taken_by_factors(self) -> bool:
        """Every microbatch took its factor from backward_scale(i) in a step that used no
        scale_loss(): a loop that scales by itself, which end() accepts."""
        return not self.losses and self.factored >= set(range(len(self.weights)))

    @property
    def remaining(self) -> int:
        return len(self.weights) - len(self.losses)


@dataclass
class StepModel:
    index: int
    mode: str  # "count_first" or "scale_after"
    divisor: Fraction  # D
    estimate: Fraction  # E: what a scale-after step's provisional factors assume
    ranks: list[RankStep]
    target: int = 0  # scale after: the microbatches (over all ranks) before end() is tried

    def total(self) -> int:
        return sum(sum(rank.weights) for rank in self.ranks)

    def microbatches(self) -> int:
        return sum(len(rank.weights) for rank in self.ranks)


@dataclass
class Outcome:
    """An ended step: every rank's result, and what they must say."""

    index: int
    results: list[StepResult]
    counts: dict[str, int]  # num_samples and num_tokens (-1 when not known)
    weight_total: int
    loss: Fraction | None  # None: some loss of positive weight was NaN
    terms: int
    status: str  # "ready", "pending" (next_step), "orphaned" (never reduced), "dropped" (by a
    # load), "poisoned"


class AccumulatorMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.accs: list[Accumulator] = []
        self.step: StepModel | None = None
        self.pending: Outcome | None = None  # its loss waits for loss_logging="next_step"
        self.outcomes: list[Outcome] = []
        self.stale_contexts: list[Any] = []
        self.stale: list[str | None] = []  # per rank: a failed reduction not yet settled

    @initialize(world_size=st.integers(1, 3), options=OPTION_SETS)
    def setup(self, world_size: int, options: dict[str, Any]) -> None:
        self.options = options
        self.weight_name = f"num_{options['weight_by']}"
        self.other_name = NAMES[1 - NAMES.index(self.weight_name)]
        self.mean = options["loss_reduction"] == "mean"
        self.steps = 0
        self.estimate = Fraction(float(options["weight_estimate"]))
        self._new_group(world_size, options["weight_estimate"])
        for name in OPTIONS:
            assert getattr(self.accs[0].options, name) == options[name]
        assert self.accs[0].options.terms == self._terms()

    def _new_group(self, world_size: int, weight_estimate: float) -> None:
        self.world_size = world_size
        self.default_estimate = Fraction(float(weight_estimate))  # after a failed or empty one
        self.group = InProcessGroup(world_size)
        self.calls = 0  # the all-reduces each rank has issued
        chosen = {name: self.options[name] for name in (*OPTIONS, "weight_estimate")}
        self.accs = [
            Accumulator(
                terms=self._terms(),
                **{**chosen, "weight_estimate": weight_estimate},
                collective=self.group.collective(rank),
            )
            for rank in range(world_size)
        ]
        self.stale = [None] * world_size
        # flush() reduces on every rank though no loss waits here: a count-first step was
        # abandoned under next_step (a rank that ended it would hold its loss).
        self.flush_waits = False
        self.stale_contexts = []

    def _terms(self) -> tuple[Term, ...]:
        loss = Term("loss", self.options["loss_reduction"], self.options["weight_by"])
        return (loss, Term("again", loss.loss_reduction, loss.weight_by))[: 1 + self.twice]

    @property
    def twice(self) -> int:
        return int(self.options["twice"])

    def _given(self, loss: object) -> Any:
        """What scale_loss() and record_loss() take: the loss, or the same for both terms."""
        return {"loss": loss, "again": loss} if self.twice else loss

    # The exact model.

    def _divisor(self) -> Fraction:
        """``D``: what the wrapper divides the summed gradients by, times what the framework
        divides each loss by."""
        grad_reduction = self.options["grad_reduction"]
        framework = Fraction(float(self.options["framework_divides_loss_by"]))
        if grad_reduction == "mean":
            return self.world_size * framework
        if grad_reduction == "sum":
            return framework
        return Fraction(float(grad_reduction)) * framework

    def _factor(self, step: StepModel, weight: int, total: Fraction | int) -> Fraction:
        """``w * D / W`` or ``D / W``, dividing by 1 for an empty step."""
        total = total or 1
        if self.mean:
            return weight * step.divisor / total
        return step.divisor / total

    def _weight_roundings(self, step: StepModel, weight: int) -> int:
        """The roundings of ``fl(fl(w) * fl(D))`` (a summed loss's factor has no weight)."""
        divisor = Fraction(float(step.divisor))
        roundings = divisor != step.divisor  # the wrapper's divisor times the framework's
        if not self.mean:
            return roundings
        as_float = Fraction(float(weight))
        return roundings + (as_float != weight) + (not is_float(as_float * divisor))

    def _factor_ulps(self, step: StepModel, weight: int, total: Fraction | int) -> int:
        """The roundings of ``fl(w * D) / fl(W)``, one for the division."""
        return self._weight_roundings(step, weight) + (not is_float(Fraction(total or 1))) + 1

    def _effective_ulps(self, step: StepModel, weight: int, total: int) -> int:
        """The roundings of ``fl(provisional * fl(E / fl(W)))``, none where a value is exact."""
        estimate = step.estimate or Fraction(1)
        provisional = self._factor(step, weight, estimate)
        roundings = self._factor_ulps(step, weight, estimate)
        if roundings == 1 and is_float(provisional):  # exact inputs, and an exact quotient
            roundings = 0
        divisor = Fraction(total or 1)
        correction = estimate / divisor
        correction_roundings = (not is_float(divisor)) + (not is_float(correction))
        if roundings == 0 and correction_roundings == 0:
            product = not is_float(provisional * correction)
        else:
            product = not (
                (roundings == 0 and is_power_of_two(provisional))
                or (correction_roundings == 0 and is_power_of_two(correction))
            )
        return roundings + correction_roundings + product

    def _outcome(self, step: StepModel, results: list[StepResult], status: str) -> Outcome:
        total = step.total()
        # The count that does not weight is known if some rank gave it and no rank with a
        # microbatch lacked it.
        gave = any(part.others is not None for part in step.ranks)
        lacked = any(part.others is None and part.weights for part in step.ranks)
        other = sum(sum(part.others or []) for part in step.ranks) if gave and not lacked else -1
        terms: list[Fraction] = []
        nonfinite = False
        for part in step.ranks:
            for weight, value in zip(part.weights, part.losses, strict=True):
                if weight == 0:  # contributes nothing, NaN included
                    continue
                if math.isnan(value):
                    nonfinite = True
                    continue
                terms.append(weight * Fraction(value) if self.mean else Fraction(value))
        return Outcome(
            step.index,
            results,
            {self.weight_name: total, self.other_name: other},
            total,
            None if nonfinite else sum(terms, Fraction(0)) / (total or 1),
            len(terms),
            status,
        )

    def _check_outcome(self, outcome: Outcome) -> None:
        seen = []
        for result in outcome.results:
            assert result.step == outcome.index
            counts = {}
            for name in NAMES:
                value = getattr(result, name)
                assert value.dtype == torch.int64 and value.dim() == 0, value
                counts[name] = value.item()
            assert counts == outcome.counts, (counts, outcome.counts)
            empty = result.is_empty
            assert empty.dtype == torch.bool and empty.item() == (outcome.weight_total == 0)
            if outcome.status == "ready":
                loss, nonfinite = result.loss, result.nonfinite_loss
                assert loss.dtype == F64 and loss.dim() == 0
                if outcome.loss is None:
                    assert math.isnan(loss.item()) and nonfinite.item() is True
                else:
                    ulps = outcome.terms + 2 * self.world_size + 4
                    doubled = outcome.loss * (1 + self.twice)
                    check_close(loss.item(), doubled, ulps, f"loss of step {outcome.index}")
                    assert set(result.losses) == {term.name for term in self._terms()}
                    assert len({value.item() for value in result.losses.values()}) == 1
                    assert nonfinite.item() is False
                seen.append((counts, loss.item().hex()))
            else:
                error = ValueError if outcome.status == "poisoned" else RuntimeError
                for name in ("loss", "nonfinite_loss"):
                    raised = expect_error(lambda r=result, n=name: getattr(r, n), error)
                    if outcome.status == "dropped":
                        assert "replaced by load_state_dict()" in str(raised)
                    elif outcome.status != "poisoned":
                        assert "loss_logging" in str(raised)
                seen.append((counts, None))
        assert all(item == seen[0] for item in seen), seen  # the same on every rank

    def _carry(self) -> None:
        """A reduction that every rank issued carried the loss that waited for it."""
        if self.pending is not None:
            self.pending.status = "ready"
            self._check_outcome(self.pending)
            self.pending = None

    def _settling(self, rank: int, call: Any) -> Any:
        """``call()`` on a rank that may hold the failed reduction of a step that could not be
        reduced: if nothing reported its error yet, the first call that settles it raises it,
        once; an error already reported is not raised again."""
        stale, self.stale[rank] = self.stale[rank], None
        if stale != "unreported":
            return call()
        with pytest.raises(ValueError, match=r"2\*\*62 or more"):
            call()
        return call()

    def _draw_loss(self, data: st.DataObject, weight: int) -> float:
        # A NaN loss is what a mean over zero items gives: common in empty microbatches, rare
        # in others (it makes the step's logged loss NaN).
        if data.draw(st.integers(0, 3 if weight == 0 else 19)) == 0:
            return NAN
        return data.draw(LOSS_VALUES)

    # Count first.

    @precondition(lambda self: self.step is None)
    @rule(data=st.data())
    def begin_count_first(self, data: st.DataObject) -> None:
        if data.draw(st.integers(0, 9), label="overflow") == 0:
            self._overflow(data, count_first=True)
            return
        # Mostly every rank gives the count that does not weight, or none does; sometimes
        # they differ.
        other_given = data.draw(st.sampled_from([True, False, None]), label="other_given")
        ranks = []
        for _ in range(self.world_size):
            size = data.draw(SIZES)
            weights = data.draw(st.lists(COUNTS, min_size=size, max_size=size))
            give_other = data.draw(st.booleans()) if other_given is None else other_given
            others = (
                data.draw(st.lists(COUNTS, min_size=size, max_size=size)) if give_other else None
            )
            ranks.append(RankStep(weights, others))
        for rank, (acc, part) in enumerate(zip(self.accs, ranks, strict=True)):
            kwargs = {self.weight_name: self._count_format(data, part.weights)}
            if part.others is not None:
                kwargs[self.other_name] = self._count_format(data, part.others)
            part.context = self._settling(rank, lambda a=acc, k=kwargs: a.begin(**k))
            assert part.context.index == self.steps + 1
            for value in kwargs.values():
                clobber(value)
        self.steps += 1
        self.calls += 1
        self.step = StepModel(self.steps, "count_first", self._divisor(), self.estimate, ranks)
        self.flush_waits = False
        # A count-first step's W is the next estimate from its begin() on, on every rank,
        # whether the step then ends or is abandoned; a W of 0, the option's.
        self.estimate = Fraction(float(self.step.total())) or self.default_estimate
        self._carry()

    def _count_format(self, data: st.DataObject, counts: list[int]) -> object:
        """``counts`` in one of the forms begin() takes."""
        kind = data.draw(st.sampled_from(["list", "tuple", "tensor", "mixed"]))
        if kind == "list":
            return list(counts)
        if kind == "tuple":
            return tuple(counts)
        if kind == "tensor":
            dtype = data.draw(st.sampled_from(fitting_dtypes(counts)))
            return torch.tensor(counts, dtype=dtype)
        return [
            torch.tensor(count, dtype=data.draw(st.sampled_from(fitting_dtypes([count]))))
            if data.draw(st.booleans())
            else count
            for count in counts
        ]

    def _count_first_ranks(self, remaining: bool) -> list[int]:
        step = self.step
        if step is None or step.mode != "count_first":
            return []
        return [
            rank
            for rank, part in enumerate(step.ranks)
            if (part.remaining > 0 if remaining else len(part.weights) > 0)
        ]

    def _scale_count_first(self, data: st.DataObject, rank: int) -> None:
        step = self.step
        assert step is not None
        acc, part = self.accs[rank], step.ranks[rank]
        index = len(part.losses)
        weight = part.weights[index]
        exact = self._factor(step, weight, step.total())
        ulps = self._factor_ulps(step, weight, step.total())
        dtype = data.draw(st.sampled_from([F64, F64, torch.float32, torch.bfloat16]))
        loss = torch.tensor(self._draw_loss(data, weight), dtype=dtype)
        value = loss.item()
        if data.draw(st.booleans()):
            peeked = _factors(acc.backward_scale(), self.twice)
            first = peeked.flatten()[0]
            assert bool((peeked == first).all())
            check_close(first.item(), exact, ulps, f"backward_scale() of rank {rank}")
        scaled = acc.scale_loss(self._given(loss))
        exact *= 1 + self.twice  # sums of two equal numbers are exact
        # The factor is cast to the loss's precision, float32 at least.
        assert scaled.dtype == torch.promote_types(dtype, torch.float32) and scaled.dim() == 0
        what = f"scale_loss() of microbatch {index} of rank {rank}"
        if weight == 0:
            assert scaled.item() == 0, f"{what}: {scaled.item()} for a weight-0 microbatch"
        elif math.isnan(value):
            assert math.isnan(scaled.item()), what
        elif dtype == F64:
            check_close(scaled.item(), Fraction(value) * exact, ulps + 1, what)
        else:  # two float32 roundings: the factor's and the product's
            check_close(scaled.item(), Fraction(value) * exact, 2, what, ulp=ulp32)
        part.losses.append(value)

    @precondition(lambda self: self._count_first_ranks(remaining=True))
    @rule(data=st.data())
    def scale_loss_count_first(self, data: st.DataObject) -> None:
        ranks = self._count_first_ranks(remaining=True)
        self._scale_count_first(data, data.draw(st.sampled_from(ranks), label="rank"))

    @precondition(lambda self: self._count_first_ranks(remaining=True))
    @rule(data=st.data())
    def scale_all_count_first(self, data: st.DataObject) -> None:
        step = self.step
        assert step is not None
        for rank, part in enumerate(step.ranks):
            while part.remaining:
                self._scale_count_first(data, rank)

    @precondition(lambda self: self._count_first_ranks(remaining=False))
    @rule(data=st.data())
    def backward_scale(self, data: st.DataObject) -> None:
        step = self.step
        assert step is not None
        rank = data.draw(st.sampled_from(self._count_first_ranks(remaining=False)), label="rank")
        part = step.ranks[rank]
        choices = list(range(len(part.weights)))
        index = data.draw(st.sampled_from([None, *choices] if part.remaining else choices))
        weight = part.weights[len(part.losses) if index is None else index]
        exact = self._factor(step, weight, step.total())
        ulps = self._factor_ulps(step, weight, step.total())
        if index is not None:
            part.factored.add(index)
        for _ in range(2):  # reading a factor again changes nothing
            factor = _factors(self.accs[rank].backward_scale(index), self.twice)
            assert factor.dtype == F64
            assert bool((factor == factor[0]).all()) if self.twice else True
            check_close(
                factor[0].item() if self.twice else factor.item(),
                exact,
                ulps,
                f"backward_scale({index}) of rank {rank}",
            )

    # Scale after.

    @precondition(lambda self: self.step is None)
    @rule(data=st.data())
    def begin_scale_after(self, data: st.DataObject) -> None:
        if data.draw(st.integers(0, 9), label="overflow") == 0:
            self._overflow(data, count_first=False)
            return
        ranks = []
        for rank, acc in enumerate(self.accs):
            params = [torch.zeros((), dtype=F64, requires_grad=True) for _ in range(MICROBATCHES)]
            if data.draw(st.booleans()):  # zero gradients are allowed
                for param in params:
                    param.grad = torch.zeros((), dtype=F64)
            kind = data.draw(st.sampled_from(["list", "tuple", "iter", "named"]))
            given = {
                "list": list,
                "tuple": tuple,
                "iter": iter,
                "named": lambda ps: [(f"p{index}", p) for index, p in enumerate(ps)],
            }[kind]
            part = RankStep([], None, params=params)
            part.context = self._settling(
                rank, lambda a=acc, g=given, ps=params: a.begin(parameters=g(ps))
            )
            assert part.context.index == self.steps + 1
            ranks.append(part)
        self.steps += 1
        # Some steps end with no microbatch at all, most after a few.
        target = data.draw(SIZES, label="target")
        self.step = StepModel(
            self.steps, "scale_after", self._divisor(), self.estimate, ranks, target
        )

    def _scale_after_ranks(self) -> list[int]:
        step = self.step
        if step is None or step.mode != "scale_after":
            return []
        return [rank for rank, part in enumerate(step.ranks) if len(part.weights) < MICROBATCHES]

    def _microbatch_count(self, data: st.DataObject, count: int) -> int | torch.Tensor:
        if data.draw(st.booleans()):
            return count
        return torch.tensor(count, dtype=data.draw(st.sampled_from(fitting_dtypes([count]))))

    def _scale_scale_after(self, data: st.DataObject, rank: int) -> None:
        step = self.step
        assert step is not None
        acc, part = self.accs[rank], step.ranks[rank]
        index = len(part.weights)
        weight = data.draw(COUNTS)
        kwargs = {self.weight_name: self._microbatch_count(data, weight)}
        if part.gives_other is None:  # a rank gives the same counts for all its microbatches
            part.gives_other = data.draw(st.booleans(), label="gives_other")
            part.others = [] if part.gives_other else None
        other = data.draw(COUNTS) if part.gives_other else None
        if other is not None:
            kwargs[self.other_name] = self._microbatch_count(data, other)
        value = self._draw_loss(data, weight)
        param = part.params[index]
        scaled = acc.scale_loss(self._given(param + torch.tensor(value, dtype=F64)), **kwargs)
        for count in kwargs.values():
            clobber(count)
        assert scaled.dtype == F64 and scaled.dim() == 0
        scaled.backward()
        provisional = self._factor(step, weight, step.estimate) * (1 + self.twice)
        ulps = self._factor_ulps(step, weight, step.estimate)
        what = f"scale_loss() of microbatch {index} of rank {rank} (provisional)"
        if weight == 0:
            assert scaled.item() == 0, f"{what}: {scaled.item()} for a weight-0 microbatch"
            assert param.grad is not None and param.grad.item() == 0, what
        else:
            if math.isnan(value):
                assert math.isnan(scaled.item()), what
            else:
                check_close(scaled.item(), Fraction(value) * provisional, ulps + 1, what)
            assert param.grad is not None
            check_close(param.grad.item(), provisional, ulps, f"{what}: the gradient")
        part.weights.append(weight)
        if other is not None:
            assert part.others is not None
            part.others.append(other)
        part.losses.append(value)

    @precondition(lambda self: self._scale_after_ranks())
    @rule(data=st.data())
    def scale_loss_scale_after(self, data: st.DataObject) -> None:
        rank = data.draw(st.sampled_from(self._scale_after_ranks()), label="rank")
        self._scale_scale_after(data, rank)

    @precondition(lambda self: self._scale_after_ranks())
    @rule(data=st.data())
    def scale_some_scale_after(self, data: st.DataObject) -> None:
        step = self.step
        assert step is not None
        for rank, part in enumerate(step.ranks):
            for _ in range(data.draw(st.integers(0, MICROBATCHES - len(part.weights)))):
                self._scale_scale_after(data, rank)

    # Closing steps.

    @precondition(lambda self: self.step is not None)
    @rule(data=st.data())
    def end(self, data: st.DataObject) -> None:
        """Run the microbatches the step still needs on every rank, then end it."""
        step = self.step
        assert step is not None
        if step.mode == "count_first":
            self.scale_all_count_first(data)
        while step.microbatches() < step.target and self._scale_after_ranks():
            rank = data.draw(st.sampled_from(self._scale_after_ranks()), label="rank")
            self._scale_scale_after(data, rank)
        total = step.total()
        if step.mode == "count_first":
            results = [acc.end() for acc in self.accs]
            reduced = self.options["loss_logging"] == "end"
            self.calls += reduced
        else:
            # A gradient of 1 on a parameter that no microbatch used shows the correction
            # E / W itself: end() multiplies every gradient of the parameters by it.
            # A step where no rank scaled a loss and a gradient is nonzero is refused on every
            # rank: tests/test_state_machine_scale_after.py drives that rule, with the others
            # of what end() rescales.
            probes = [
                0 < len(part.weights) < MICROBATCHES and data.draw(st.booleans(), label="probe")
                for part in step.ranks
            ]
            for part, probe in zip(step.ranks, probes, strict=True):
                if probe:
                    part.params[len(part.weights)].grad = torch.ones((), dtype=F64)
            # end() of a scale-after step waits for its own all-reduce: every rank at once.
            results = self.group.run(lambda rank, _: self.accs[rank].end())
            self.calls += 1
            reduced = True
            divisor = Fraction(total or 1)
            correction = (step.estimate or Fraction(1)) / divisor
            for rank, part in enumerate(step.ranks):
                for index, param in enumerate(part.params):
                    what = f"the gradient of microbatch {index} of rank {rank} after end()"
                    if index == len(part.weights) and probes[rank]:
                        assert param.grad is not None
                        ulps = (not is_float(divisor)) + 1
                        check_close(param.grad.item(), correction, ulps, f"{what}: E / W")
                        continue
                    if index >= len(part.weights):  # not used in this step
                        assert param.grad is None or param.grad.item() == 0, what
                        continue
                    weight = part.weights[index]
                    assert param.grad is not None, what
                    exact = self._factor(step, weight, total) if weight else Fraction(0)
                    exact *= 1 + self.twice
                    ulps = self._effective_ulps(step, weight, total)
                    check_close(param.grad.item(), exact, ulps, what)
        outcome = self._outcome(step, results, "ready" if reduced else "pending")
        self._check_outcome(outcome)
        self.estimate = Fraction(float(total)) or self.default_estimate  # W of 0: the option's
        self.stale_contexts = [part.context for part in step.ranks]
        self.step, self.flush_waits = None, False
        if step.mode == "scale_after":
            self._carry()  # the previous step's loss rode on this step's reduction
        elif not reduced:
            self.pending = outcome
        if self.outcomes:  # an earlier step's result reads the same as before
            self._check_outcome(data.draw(st.sampled_from(self.outcomes), label="earlier"))
        self.outcomes = [*self.outcomes[-2:], outcome]

    @precondition(lambda self: self.step is not None and self.step.microbatches() > 0)
    @rule(data=st.data())
    def abandon(self, data: st.DataObject) -> None:
        step = self.step
        assert step is not None
        if data.draw(st.booleans()):
            # What `with acc.begin(...):` does when an exception leaves the block.
            for part in step.ranks:
                part.context.__exit__(RuntimeError, RuntimeError("out of memory"), None)
        else:
            for acc in self.accs:
                acc.abandon()
        # The step keeps its index; its gradients are left as they are.
        self.stale_contexts = [part.context for part in step.ranks]
        self.step = None
        self.flush_waits |= step.mode == "count_first" and self._next_step()

    def _next_step(self) -> bool:
        return self.options["loss_logging"] == "next_step"

    @precondition(lambda self: self.step is None and (self.pending is not None or self.flush_waits))
    @rule()
    def flush(self) -> None:
        # flush() waits for the all-reduce it starts: every rank at once.
        self.group.run(lambda rank, _: self._settling(rank, self.accs[rank].flush))
        self.calls += 1
        self.flush_waits = False
        self._carry()

    # Saving and loading.

    @precondition(lambda self: self.step is None)
    @rule(
        world_size=st.integers(1, 3),
        fresh=st.booleans(),
        via_bytes=st.booleans(),
        ctor_estimate=st.sampled_from([1.0, 7.0]),
    )
    def state_round_trip(
        self, world_size: int, fresh: bool, via_bytes: bool, ctor_estimate: float
    ) -> None:
        """Save, then load into fresh Accumulators (at any world size) or the same ones."""
        states = [acc.state_dict() for acc in self.accs]
        expected = {
            "format": 1,
            "steps": self.steps,
            "weight_estimate": float(self.estimate),
            "options": {
                "weight_by": self.options["weight_by"],
                "terms": [[t.name, t.loss_reduction, t.weight_by] for t in self._terms()],
                **{name: self.options[name] for name in OPTIONS},
            },
        }
        for state in states:
            assert state == expected, (state, expected)
            assert type(state["weight_estimate"]) is float
        state = states[0]
        if via_bytes:
            buffer = io.BytesIO()
            torch.save(state, buffer)
            buffer.seek(0)
            state = torch.load(buffer, weights_only=True)
        if fresh:
            self._new_group(world_size, ctor_estimate)
        for acc in self.accs:
            acc.load_state_dict(copy.deepcopy(state))
            assert acc.state_dict() == expected
        # A loss still waiting for loss_logging="next_step" is not saved, and loading drops it:
        # its result says so (an Accumulator made afresh leaves the old one's waiting).
        if self.pending is not None:
            self.pending.status = "orphaned" if fresh else "dropped"
            self._check_outcome(self.pending)
            self.pending = None
        self.flush_waits = False

    # A step that cannot be reduced (a rare variant of begin_count_first and
    # begin_scale_after).

    def _overflow(self, data: st.DataObject, count_first: bool) -> None:
        """Every count is valid, but a total of the step reaches 2**62: every rank gets a
        ValueError that names the count instead of numbers, and abandon() recovers."""
        weighting = data.draw(st.booleans(), label="weighting")
        name = self.weight_name if weighting else self.other_name
        big = [2**61, data.draw(st.integers(2**61, 2**62 - 1))]
        if count_first:
            for rank, acc in enumerate(self.accs):
                counts = {self.weight_name: [1, 1], self.other_name: [1, 1], name: big}
                kwargs = {key: self._count_format(data, value) for key, value in counts.items()}
                self._settling(rank, lambda a=acc, k=kwargs: a.begin(**k))
            self.calls += 1
            # Reading the loss that rode on the failed reduction reports its error, as reading
            # a factor of the step does: then it is not raised again when settled.
            reported = self.pending is not None
            if self.pending is not None:  # its loss rode on the failed reduction
                self.pending.status = "poisoned"
                self._check_outcome(self.pending)
                self.pending = None
            self.estimate = self.default_estimate  # W is not known: the option's estimate
            self.flush_waits = self._next_step()  # abandoned below
            read = data.draw(st.booleans(), label="read")
            for rank, acc in enumerate(self.accs):
                if read:
                    with pytest.raises(ValueError, match=rf"total {name} .* 2\*\*62"):
                        acc.scale_loss(self._given(torch.tensor(1.0)))
                self.stale[rank] = "reported" if read or reported else "unreported"
        else:
            params = []
            for rank, acc in enumerate(self.accs):
                param = torch.zeros((), dtype=F64, requires_grad=True)
                params.append(param)
                self._settling(rank, lambda a=acc, p=param: a.begin(parameters=[p]))
                for count in big:
                    counts = {self.weight_name: 1, self.other_name: 1, name: count}
                    acc.scale_loss(self._given(param * 1.0), **counts).backward()
            before = [param.grad.clone() for param in params]  # type: ignore[union-attr]

            def refused_end(rank: int, _: InProcessCollective) -> ValueError:
                with pytest.raises(ValueError) as refused:
                    self.accs[rank].end()
                return refused.value

            errors = self.group.run(refused_end)
            self.calls += 1
            # The failed reduction carried the loss that waited, and its W is unknown: the next
            # estimate is the option's; end() raised, so flush() still reduces on every rank.
            self.estimate = self.default_estimate
            self.flush_waits |= self.pending is not None
            if self.pending is not None:
                self.pending.status = "poisoned"
                self._check_outcome(self.pending)
                self.pending = None
            for error in errors:
                assert f"total {name}" in str(error) and "2**62" in str(error)
            for param, grad in zip(params, before, strict=True):  # not rescaled
                assert torch.equal(param.grad, grad)  # type: ignore[arg-type]
            for acc in self.accs:
                assert acc.step_open
        self.steps += 1
        for acc in self.accs:
            acc.abandon()

    # Misuse, on one rank: an error that names what is wrong, and nothing changes.

    @rule(data=st.data())
    def misuse(self, data: st.DataObject) -> None:
        rank = data.draw(st.integers(0, self.world_size - 1), label="rank")
        if self.step is None:
            self._misuse_between_steps(data, rank)
        else:
            self._misuse_in_step(data, rank)

    def _misuse_between_steps(self, data: st.DataObject, rank: int) -> None:
        acc = self.accs[rank]
        weight, other = self.weight_name, self.other_name
        kinds = [] if self.pending is not None or self.flush_waits else ["flush"]
        kind = data.draw(
            st.sampled_from(
                [
                    *kinds,
                    "scale_loss",
                    "end",
                    "backward_scale",
                    "abandon",
                    "bad_counts",
                    "missing_weight",
                    "lengths",
                    "neither",
                    "both",
                    "bad_parameters",
                    "nonzero_grad",
                    "load_state_dict",
                    "constructor",
                    "pickle",
                ]
            ),
            label="kind",
        )
        if kind == "scale_loss":
            counts = data.draw(st.sampled_from([{}, {weight: 1}]))
            expect_error(
                lambda: acc.scale_loss(self._given(torch.tensor(1.0)), **counts),
                RuntimeError,
                "scale_loss()",
            )
        elif kind == "end":
            expect_error(acc.end, RuntimeError, "end()")
        elif kind == "backward_scale":
            index = data.draw(st.sampled_from([None, 0]))
            expect_error(lambda: acc.backward_scale(index), RuntimeError, "backward_scale()")
        elif kind == "abandon":
            acc.abandon()  # no step is open: nothing to do
        elif kind == "flush":
            acc.flush()  # no loss waits: nothing to do, and no collective
        elif kind == "bad_counts":
            name = data.draw(st.sampled_from([weight, other]))
            value, error = data.draw(bad_step_counts())
            kwargs = {weight: [1], other: [1], name: value}
            expect_error(lambda: acc.begin(**kwargs), error, name)
        elif kind == "missing_weight":
            expect_error(lambda: acc.begin(**{other: [1, 2]}), ValueError, weight)
        elif kind == "lengths":
            kwargs = {weight: [1, 2], other: data.draw(st.sampled_from([[1], [1, 2, 3], []]))}
            expect_error(lambda: acc.begin(**kwargs), ValueError, "num_samples", "num_tokens")
        elif kind == "neither":
            expect_error(acc.begin, ValueError, "begin()")
        elif kind == "both":
            param = torch.zeros((), requires_grad=True)
            expect_error(
                lambda: acc.begin(**{weight: [1]}, parameters=[param]), ValueError, "begin()"
            )
        elif kind == "bad_parameters":
            value, error = data.draw(bad_parameters())
            expect_error(lambda: acc.begin(parameters=value), error, "parameters")
        elif kind == "nonzero_grad":
            param = torch.zeros((), dtype=F64, requires_grad=True)
            param.grad = torch.tensor(0.5, dtype=F64)
            expect_error(
                lambda: self._settling(rank, lambda: acc.begin(parameters=[param])),
                RuntimeError,
                "parameters",
            )
        elif kind == "load_state_dict":
            self._bad_state(data, acc)
        elif kind == "constructor":
            self._bad_constructor(data)
        else:
            expect_error(lambda: pickle.dumps(acc), TypeError, "state_dict")

    def _bad_state(self, data: st.DataObject, acc: Accumulator) -> None:
        state = acc.state_dict()
        bad: Any = copy.deepcopy(state)
        kind = data.draw(
            st.sampled_from(
                [
                    "option",
                    "options_not_dict",
                    "format",
                    "missing",
                    "extra",
                    "not_dict",
                    "steps",
                    "estimate",
                ]
            )
        )
        if kind == "option":  # the one option a saved state must match: the rest is configuration
            name = "weight_by"
            bad["options"][name] = "samples" if bad["options"][name] == "tokens" else "tokens"
            names: tuple[str, ...] = (name,)
        elif kind == "options_not_dict":
            bad["options"] = data.draw(st.sampled_from([None, "options", list(OPTIONS)]))
            names = ("options",)
        elif kind == "format":
            bad["format"], names = 2, ("format",)
        elif kind == "missing":
            del bad[data.draw(st.sampled_from(sorted(bad)))]
            names = ("state_dict",)
        elif kind == "extra":
            bad["weight_by"], names = "tokens", ("state_dict",)
        elif kind == "not_dict":
            bad = data.draw(st.sampled_from([None, list(state.items()), "state"]))
            names = ("state_dict",)
        elif kind == "steps":
            bad["steps"] = data.draw(st.sampled_from([-1, True, 1.5, "3", None]))
            names = ("steps",)
        else:
            estimates = [-1.0, True, "1", None, NAN, math.inf]
            bad["weight_estimate"] = data.draw(st.sampled_from(estimates))
            names = ("weight_estimate",)
        expect_error(lambda: acc.load_state_dict(bad), ValueError, *names)
        assert acc.state_dict() == state

    def _bad_constructor(self, data: st.DataObject) -> None:
        name, value, error = data.draw(
            st.sampled_from(
                [
                    ("loss_reduction", None, TypeError),
                    ("loss_reduction", "avg", ValueError),
                    ("weight_by", "words", ValueError),
                    ("grad_reduction", 0, ValueError),
                    ("grad_reduction", -2.0, ValueError),
                    ("grad_reduction", math.inf, ValueError),
                    ("grad_reduction", NAN, ValueError),
                    ("grad_reduction", True, ValueError),
                    ("grad_reduction", "avg", ValueError),
                    ("grad_reduction", None, ValueError),
                    ("loss_logging", "on_read", ValueError),
                    ("weight_estimate", 0.0, ValueError),
                    ("weight_estimate", -1, ValueError),
                    ("weight_estimate", NAN, ValueError),
                    ("weight_estimate", math.inf, ValueError),
                    ("weight_estimate", True, ValueError),
                    ("weight_estimate", "1", ValueError),
                    ("framework_divides_loss_by", 0, ValueError),
                    ("framework_divides_loss_by", -4, ValueError),
                    ("framework_divides_loss_by", NAN, ValueError),
                    ("framework_divides_loss_by", math.inf, ValueError),
                    ("framework_divides_loss_by", True, ValueError),
                    ("framework_divides_loss_by", "4", ValueError),
                    ("collective", object(), TypeError),
                    ("group", object(), ValueError),
                    ("world_size", None, ValueError),
                ]
            )
        )
        options = {k: v for k, v in self.options.items() if k != "twice"}
        if name == "world_size":  # found when a step begins
            acc = Accumulator(**{**options, "collective": NoRanks()})
            expect_error(lambda: acc.begin(**{self.weight_name: [1]}), error, name)
            return
        kwargs = {**options, name: value}
        if name == "group":
            kwargs["collective"] = self.group.collective(0)
        expect_error(lambda: Accumulator(**kwargs), error, name)

    def _misuse_in_step(self, data: st.DataObject, rank: int) -> None:
        step = self.step
        assert step is not None
        acc, part = self.accs[rank], step.ranks[rank]
        weight, other = self.weight_name, self.other_name
        kinds = ["begin", "flush", "state_dict", "load_state_dict", "bad_loss", "contexts"]
        if step.mode == "count_first":
            kinds += ["counts_to_scale_loss", "bad_index"]
            # Where ranks must be told, a rank that ends too early refuses the step on every
            # rank (tests/test_faults.py): here it is one rank's misuse that the step survives.
            told = self.world_size > 1 and self.options["loss_logging"] == "end"
            if part.remaining and not part.taken_by_factors and not told:
                kinds += ["too_few"]
            elif not part.remaining:
                kinds += ["too_many", "no_next"]
        else:
            kinds += ["missing_count", "bad_count", "backward_scale"]
            kinds += ["inconsistent"] if part.weights else []
        kind = data.draw(st.sampled_from(kinds), label="kind")
        if kind == "begin":
            param = torch.zeros((), requires_grad=True)
            kwargs = data.draw(st.sampled_from([{weight: [1]}, {"parameters": [param]}]))
            expect_error(lambda: acc.begin(**kwargs), RuntimeError, "begin()")
        elif kind in ("flush", "state_dict"):
            expect_error(getattr(acc, kind), RuntimeError, f"{kind}()")
        elif kind == "load_state_dict":
            state = {"format": 1, "steps": 0, "weight_estimate": 1.0, "options": {}}
            expect_error(lambda: acc.load_state_dict(state), RuntimeError, "load_state_dict()")
        elif kind == "bad_loss":
            loss, error = data.draw(
                st.sampled_from(
                    [
                        (1.0, TypeError),
                        (None, TypeError),
                        (torch.tensor([1.0]), ValueError),
                        (torch.ones(2, 2), ValueError),
                        (torch.tensor(1), TypeError),
                        (torch.tensor(True), TypeError),
                    ]
                )
            )
            counts = {weight: 1} if step.mode == "scale_after" else {}
            expect_error(lambda: acc.scale_loss(self._given(loss), **counts), error, "loss")
        elif kind == "contexts":
            # Leaving the step's context without an exception, or an earlier step's context
            # with one, leaves the step open.
            part.context.__exit__(None, None, None)
            if self.stale_contexts:
                self.stale_contexts[rank].__exit__(ValueError, ValueError("late"), None)
        elif kind == "counts_to_scale_loss":
            # Counts given with a count-first loss must be those begin() declared for its
            # microbatch (a difference found on the host: ValueError; on a device: the assert's
            # RuntimeError) and of a kind begin() was given; with no microbatch left, the call
            # is one too many.
            at = min(len(part.losses), len(part.weights) - 1)
            wrong = {weight: part.weights[at] + 1 if part.weights else 1}
            if part.others is not None and part.others:
                wrong[other] = part.others[at] + 1
            elif part.others is None:
                wrong = data.draw(st.sampled_from([wrong, {other: 1}]))
            expect_error(
                lambda: acc.scale_loss(self._given(torch.tensor(1.0)), **wrong),
                (ValueError, RuntimeError),
                "scale_loss()",
            )
        elif kind == "bad_index":
            size = len(part.weights)
            index = data.draw(st.sampled_from([size, size + 5, -1, True, 0.0, "0"]))
            expect_error(lambda: acc.backward_scale(index), ValueError, "backward_scale(")
        elif kind == "too_few":
            expect_error(acc.end, RuntimeError, "end()")
        elif kind == "too_many":
            expect_error(
                lambda: acc.scale_loss(self._given(torch.tensor(1.0))), RuntimeError, "scale_loss()"
            )
        elif kind == "no_next":
            expect_error(acc.backward_scale, RuntimeError, "backward_scale()")
        elif kind == "missing_count":
            counts = data.draw(st.sampled_from([{}, {other: 1}]))
            expect_error(
                lambda: acc.scale_loss(self._given(torch.tensor(1.0)), **counts), ValueError, weight
            )
        elif kind == "bad_count":
            name = data.draw(st.sampled_from([weight, other]))
            value, error = data.draw(bad_microbatch_count())
            counts = {weight: 1, name: value}
            expect_error(
                lambda: acc.scale_loss(self._given(torch.tensor(1.0)), **counts), error, name
            )
        elif kind == "backward_scale":
            index = data.draw(st.sampled_from([None, 0]))
            expect_error(lambda: acc.backward_scale(index), RuntimeError, "backward_scale()")
        else:  # counts unlike those of the rank's earlier microbatches
            counts = {weight: 1} if part.gives_other else {weight: 1, other: 1}
            expect_error(
                lambda: acc.scale_loss(self._given(torch.tensor(1.0)), **counts),
                ValueError,
                "scale_loss()",
            )

    # What holds after every rule.

    @invariant()
    def ranks_agree_with_the_model(self) -> None:
        for acc in self.accs:
            assert acc.step_open == (self.step is not None)
            assert acc.steps == self.steps
        issued = self.group.calls
        assert issued == [self.calls] * self.world_size, (
            f"the ranks issued {issued} all-reduces, not {self.calls} each"
        )


class NoRanks:
    """A Collective without ranks."""

    world_size = 0
    device = torch.device("cpu")

    def can_reduce_on(self, device: torch.device) -> bool:
        return True

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        return None


@st.composite
def bad_step_counts(draw: Any) -> tuple[object, type[BaseException]]:
    """Counts that begin() must refuse for a step of one microbatch, and its error."""
    return draw(  # type: ignore[no-any-return]
        st.sampled_from(
            [
                ([-1], ValueError),
                ([2**62], ValueError),
                ([2**70], ValueError),
                ([1.0], TypeError),
                ([True], TypeError),
                ([None], TypeError),
                (["1"], TypeError),
                (1, TypeError),
                ("1", TypeError),
                ({1}, TypeError),
                (torch.tensor([-1]), RuntimeError),
                (torch.tensor([2**62]), RuntimeError),
                (torch.tensor([[1]]), ValueError),
                (torch.tensor(1), ValueError),
                (torch.tensor([1], dtype=torch.uint64), TypeError),
                (torch.tensor([1], dtype=torch.uint32), TypeError),
                (torch.tensor([1.0]), TypeError),
                (torch.tensor([True]), TypeError),
                ([torch.tensor(-1)], RuntimeError),
                ([torch.tensor([1])], ValueError),
                ([torch.tensor(1.0)], TypeError),
                ([torch.tensor(1, dtype=torch.uint64)], TypeError),
            ]
        )
    )


@st.composite
def bad_microbatch_count(draw: Any) -> tuple[object, type[BaseException]]:
    """A count that scale_loss() must refuse for one microbatch, and its error."""
    return draw(  # type: ignore[no-any-return]
        st.sampled_from(
            [
                (-1, ValueError),
                (2**62, ValueError),
                (1.0, TypeError),
                (True, TypeError),
                ("1", TypeError),
                ([1], TypeError),
                (torch.tensor(-1), RuntimeError),
                (torch.tensor(2**62), RuntimeError),
                (torch.tensor([1]), ValueError),
                (torch.tensor(1.0), TypeError),
                (torch.tensor(1, dtype=torch.uint64), TypeError),
                (torch.tensor(True), TypeError),
            ]
        )
    )


@st.composite
def bad_parameters(draw: Any) -> tuple[object, type[BaseException]]:
    """Parameters that begin() must refuse, and its error."""
    param = torch.zeros((), requires_grad=True)
    return draw(  # type: ignore[no-any-return]
        st.sampled_from(
            [
                ([], ValueError),
                (iter([]), ValueError),
                (param, TypeError),
                (1.0, TypeError),
                ([param, 1.0], TypeError),
                ([("w", "not a tensor")], TypeError),
            ]
        )
    )


# About 50 s on 2 CPU cores. One failure at a time: shrinking a run of 20 steps is slow, and
# the tests below reproduce each bug the machine found on its own.
AccumulatorMachine.TestCase.settings = settings(
    max_examples=2000,
    stateful_step_count=20,
    deadline=None,
    report_multiple_bugs=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestAccumulatorMachine = AccumulatorMachine.TestCase


# Minimal reproductions of what the machine found, each on a single process.

W_ODD = 3979044686524069  # a W below 2**53 where D / W rounded twice misses by one ulp


def test_a_summed_loss_factor_is_one_correctly_rounded_division() -> None:
    # D / W with D a Python float and W a tensor: torch computes W.reciprocal() * D, rounding
    # twice (1.23 ulp from 3 / W here) instead of once.
    acc = Accumulator(loss_reduction="sum", grad_reduction=3.0)
    acc.begin(num_tokens=[W_ODD])
    assert acc.backward_scale().item() == 3.0 / W_ODD


def test_a_provisional_factor_is_one_correctly_rounded_division() -> None:
    # The second step assumes E = the first step's W, a tensor: w * D / E must round once too.
    acc = Accumulator(loss_reduction="mean", grad_reduction=3.0)
    grads = []
    for count in (W_ODD, 1):
        param = torch.zeros((), dtype=F64, requires_grad=True)
        acc.begin(parameters=[param])
        acc.scale_loss(param + 1.0, num_tokens=count).backward()
        assert param.grad is not None
        grads.append(param.grad.item())
        acc.end()
    assert grads[1] == 3.0 / W_ODD


def test_the_gradient_correction_is_one_correctly_rounded_division() -> None:
    # E / W with E a Python float (weight_estimate, or a loaded state) and W a tensor rounds
    # twice. The provisional factor of the first microbatch is 1 * 3 / 3 = 1 exactly, so its
    # gradient after end() is the correction E / W itself.
    acc = Accumulator(loss_reduction="mean", grad_reduction=3.0, weight_estimate=3.0)
    first, second = (torch.zeros((), dtype=F64, requires_grad=True) for _ in range(2))
    acc.begin(parameters=[first, second])
    acc.scale_loss(first + 1.0, num_tokens=1).backward()
    acc.scale_loss(second + 1.0, num_tokens=W_ODD - 1).backward()
    acc.end()
    assert first.grad is not None and first.grad.item() == 3.0 / W_ODD


@pytest.mark.parametrize("estimate", [NAN, math.inf])
def test_load_state_dict_refuses_a_non_finite_estimate(estimate: float) -> None:
    # Accepted, it makes every gradient of the next scale-after step NaN.
    acc = Accumulator(loss_reduction="mean")
    state = {**acc.state_dict(), "weight_estimate": estimate}
    with pytest.raises(ValueError, match="weight_estimate"):
        acc.load_state_dict(state)


def test_load_state_dict_refuses_options_that_are_not_a_dict() -> None:
    # Raises AttributeError: 'NoneType' object has no attribute 'get'.
    acc = Accumulator(loss_reduction="mean")
    state = {**acc.state_dict(), "options": None}
    with pytest.raises(ValueError, match="options"):
        acc.load_state_dict(state)
