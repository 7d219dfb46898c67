"""What a step carries, as plain data: its options, its loss terms, and the layout they give.

It imports only the pure :mod:`lossweight.weighting` and :mod:`lossweight.errors`, and is the
one place where the option vocabulary is written: validation, the ranks' agreement codes, the
saved state and the messages of a disagreement all read :data:`CHOICES` and :data:`OPTIONS`.
From a step's :class:`Term` list comes the :class:`Layout` of the one payload every reduction
sums, and from that the fields :class:`~lossweight.StepResult` reports. A new kind of term
(another normaliser, a second loss) is a new entry here, not a new code path.
"""

from __future__ import annotations

import functools
import math
import numbers
import struct
from dataclasses import dataclass

from . import weighting
from .errors import error

CHOICES: dict[str, tuple[str, ...]] = {
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
"""The options every rank shares and a saved state must match."""
COUNTS = ("samples", "tokens")
"""The counts a step reports, ``StepResult.num_<count>``, in payload order."""
CALLS = (
    "begin() of a count-first step",
    "end() of a scale-after step",
    "end() of a count-first step (to reduce its loss)",
    "flush()",
)
COUNT_FIRST_BEGIN, SCALE_AFTER_END, COUNT_FIRST_END, FLUSH = range(len(CALLS))
# What the ranks must agree on in every reduction, one code each; the divisor D takes four
# 16-bit codes (its float64 bits), so that two divisors that differ in any bit differ in a code.
FIELDS = ("step", "call", *CHOICES, *["grad_reduction"] * 4)


@dataclass(frozen=True)
class Options:
    """An Accumulator's options, checked when made."""

    loss_reduction: str
    weight_by: str = "tokens"
    grad_reduction: str | float = "mean"
    loss_logging: str = "end"
    weight_estimate: float = 1.0
    framework_divides_loss_by: float = 1.0

    def __post_init__(self) -> None:
        for name, choices in CHOICES.items():
            value = getattr(self, name)
            if value not in choices:
                expected = " or ".join(map(repr, choices))
                raise error("bad_option", name=name, value=value, expected=expected)
        for name, expected in _POSITIVE.items():
            value = getattr(self, name)
            is_number = isinstance(value, numbers.Real) and not isinstance(value, bool)
            if not (value in ("mean", "sum") and name == "grad_reduction") and not (
                is_number and 0 < float(value) < math.inf
            ):
                raise error("bad_option", name=name, value=value, expected=expected)

    @property
    def terms(self) -> tuple[Term, ...]:
        return (Term("loss", self.weight_by),)

    def divisor(self, world_size: int) -> float:
        """``D``, times what a framework divides each loss by: the factors undo both."""
        wrapper = weighting.gradient_divisor(self.grad_reduction, world_size)  # type: ignore[arg-type]
        return wrapper * float(self.framework_divides_loss_by)

    def codes(self, step: int, call: int, divisor: float) -> tuple[int, ...]:
        """Every agreement code of one reduction, in the order of :data:`FIELDS`."""
        return (
            step % 2**16,
            call,
            *_option_codes(self.weight_by, self.loss_reduction, self.loss_logging, divisor),
        )


@functools.lru_cache(maxsize=64)
def _option_codes(
    weight_by: str, loss_reduction: str, logging: str, divisor: float
) -> tuple[int, ...]:
    chosen = (weight_by, loss_reduction, logging)
    indices = (
        choices.index(value) for choices, value in zip(CHOICES.values(), chosen, strict=True)
    )
    return (*indices, *struct.unpack("<4H", struct.pack("<d", divisor)))


@dataclass(frozen=True)
class Term:
    """One loss term of a step: its name and the count that normalises it."""

    name: str
    normaliser: str


@dataclass(frozen=True)
class Layout:
    """Where each number sits in the payload of a step with ``terms``.

    In order: an agreement code per field, then their squares; the high 31-bit limb of each
    count total, then the low limbs; for each count that normalises no term, how many ranks
    gave it and how many lacked it; for each term, this step's loss sum and whether it was
    non-finite, then the same for an earlier step's loss travelling with this one.
    """

    terms: tuple[Term, ...]

    @property
    def reported(self) -> tuple[str, ...]:
        """The counts that normalise no term: reported only where every rank knows them."""
        return tuple(c for c in COUNTS if c not in {t.normaliser for t in self.terms})

    def high(self, count: str) -> int:
        return 2 * len(FIELDS) + COUNTS.index(count)

    def low(self, count: str) -> int:
        return self.high(count) + len(COUNTS)

    @property
    def checked(self) -> int:
        """The slots checked after the sum: the codes, their squares and the high limbs."""
        return 2 * len(FIELDS) + len(COUNTS)

    def flags(self, count: str) -> int:
        """(ranks that gave ``count``, ranks with a microbatch that lacked it)."""
        return self.checked + len(COUNTS) + 2 * self.reported.index(count)

    def loss(self, term: str, previous: bool = False) -> int:
        """The loss sum of ``term``; the slot after it says whether it was non-finite."""
        start = self.checked + len(COUNTS) + 2 * len(self.reported)
        index = [t.name for t in self.terms].index(term)
        return start + 4 * index + 2 * previous

    @property
    def length(self) -> int:
        return self.loss(self.terms[-1].name, previous=True) + 2
