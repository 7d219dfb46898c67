"""What a step carries, as plain data: its options, its loss terms, and the layout they give.

It imports only the pure weighting.py and errors.py, and is the one place where the option
vocabulary is written (:data:`CHOICES`, :data:`OPTIONS`). From a step's :class:`Term` list
comes the :class:`Layout` of the one payload every reduction sums: a new kind of term (another
normaliser, a second loss) is a new entry here, not a new code path.
"""

from __future__ import annotations

import math
import numbers
import struct
from dataclasses import dataclass, field

from . import weighting
from .errors import error

CHOICES = {
    "weight_by": ("tokens", "samples"),
    "loss_reduction": ("mean", "sum"),
    "loss_logging": ("end", "next_step"),
}
_POSITIVE = {
    "grad_reduction": "'mean' (the wrapper averages the ranks' gradients, as DDP and FSDP do), "
    "'sum', or the positive number it divides their sum by",
    "weight_estimate": "a positive number, roughly the global count of a step",
    "framework_divides_loss_by": "the positive number your framework divides each loss by "
    "before its backward (its gradient accumulation steps), or 1",
}
OPTIONS = (
    "weight_by",
    "loss_reduction",
    "grad_reduction",
    "loss_logging",
    "framework_divides_loss_by",
)
"""The options every rank shares, which a saved state must match."""
COUNTS = ("samples", "tokens")
"""The counts a step reports (``StepResult.num_samples``, ``.num_tokens``), in payload order."""
CALLS = (
    "begin() of a count-first step",
    "end() of a scale-after step",
    "end() of a count-first step (to reduce its loss)",
    "flush()",
)
COUNT_FIRST_BEGIN, SCALE_AFTER_END, COUNT_FIRST_END, FLUSH = range(len(CALLS))
# What the ranks agree on in every reduction, one code each: the step, the call, whether it
# carries an earlier step's loss, the options; a number (the divisor D, the estimate E that a
# scale-after step's factors assume) takes four 16-bit codes, its float64 bits, so that two
# numbers that differ in any bit differ in a code.
FIELDS = ("step", "call", "carried", *CHOICES, *["grad_reduction"] * 4, *["weight_estimate"] * 4)


@dataclass(frozen=True)
class Options:
    """An Accumulator's options, checked when made."""

    loss_reduction: weighting.LossReduction
    weight_by: str = "tokens"
    grad_reduction: str | float = "mean"
    loss_logging: str = "end"
    weight_estimate: float = 1.0
    framework_divides_loss_by: float = 1.0

    def __post_init__(self) -> None:
        for name, choices in CHOICES.items():
            if getattr(self, name) not in choices:
                expected = " or ".join(map(repr, choices))
                raise error("bad_option", name=name, value=getattr(self, name), expected=expected)
        for name, expected in _POSITIVE.items():
            value = getattr(self, name)
            named = name == "grad_reduction" and value in ("mean", "sum")
            if not named and not (finite(value) and value > 0):
                raise error("bad_option", name=name, value=value, expected=expected)

    @property
    def terms(self) -> tuple[Term, ...]:
        return (Term("loss", self.weight_by, self.loss_reduction),)

    def divisor(self, world_size: int) -> float:
        """``D``, times what a framework divides each loss by: the factors undo both."""
        wrapper = weighting.gradient_divisor(self.grad_reduction, world_size)  # type: ignore[arg-type]
        return wrapper * float(self.framework_divides_loss_by)

    def codes(self, divisor: float) -> tuple[int, ...]:
        """The agreement codes of the options, in the order of :data:`FIELDS`."""
        chosen = [CHOICES[name].index(getattr(self, name)) for name in CHOICES]
        return (*chosen, *number_codes(divisor))


def finite(value: object) -> bool:
    """Whether ``value`` is a finite real number (a bool is not)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def number_codes(value: float) -> tuple[int, ...]:
    """A float64's bits as four 16-bit agreement codes."""
    return struct.unpack("<4H", struct.pack("<d", value))


def number_of(codes: tuple[int, ...]) -> float:
    return struct.unpack("<d", struct.pack("<4H", *codes))[0]  # type: ignore[no-any-return]


REDUCED = number_codes(math.nan)
"""The estimate's codes where it is the last step's reduced ``W``, the same on every rank."""


@dataclass(frozen=True)
class Term:
    """One loss term of a step: its name, the count that normalises it, and whether each of its
    losses is the mean or the sum of its items'."""

    name: str
    normaliser: str
    reduction: weighting.LossReduction


@dataclass(frozen=True, eq=False)
class Layout:
    """Where each number sits in the payload of a step with ``terms``, in order: an agreement
    code per field, then their squares; the high 31-bit limb of each count total, then the low
    limbs; for each count that normalises no term (``reported``), how many ranks gave it and
    how many with a microbatch lacked it; for each term, this step's loss sum and whether it
    was non-finite, then the same for an earlier step's loss that travels with this one. The
    first ``checked`` slots are checked after the sum."""

    terms: tuple[Term, ...]
    reported: tuple[str, ...] = field(init=False)
    high: dict[str, int] = field(init=False)
    low: dict[str, int] = field(init=False)
    flags: dict[str, int] = field(init=False)
    loss: dict[tuple[str, bool], int] = field(init=False)
    checked: int = field(init=False)
    length: int = field(init=False)

    def __post_init__(self) -> None:
        normalisers = {term.normaliser for term in self.terms}
        reported = tuple(count for count in COUNTS if count not in normalisers)
        start = 2 * len(FIELDS)
        values = {
            "reported": reported,
            "high": {count: start + i for i, count in enumerate(COUNTS)},
            "low": {count: start + len(COUNTS) + i for i, count in enumerate(COUNTS)},
            "checked": start + len(COUNTS),
        }
        start += 2 * len(COUNTS)
        values["flags"] = {count: start + 2 * i for i, count in enumerate(reported)}
        start += 2 * len(reported)
        values["loss"] = {
            (term.name, previous): start + 4 * i + 2 * previous
            for i, term in enumerate(self.terms)
            for previous in (False, True)
        }
        values["length"] = start + 4 * len(self.terms)
        for name, value in values.items():
            object.__setattr__(self, name, value)
