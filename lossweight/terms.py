"""What a step carries, as plain data: its options, its loss terms, and the layout they give.

It imports only the pure weighting.py and errors.py, and is the one place where the option
vocabulary is written (:data:`CHOICES`, :data:`COUNTS`, :data:`OPTIONS`). From a step's
:class:`Term` tuple comes the :class:`Layout` of the one payload every reduction sums: a term
is a name, a loss reduction and a normaliser (a count or a constant), not a code path.
"""

from __future__ import annotations

import math
import numbers
import struct
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import ClassVar

from . import weighting
from .errors import error

CHOICES = {"loss_reduction": ("mean", "sum"), "loss_logging": ("end", "next_step")}
COUNTS = ("samples", "tokens", "weight_sum")
"""The counts a microbatch may give, in payload order: integers, then a sum of float weights."""
ARGUMENTS = {"samples": "num_samples", "tokens": "num_tokens", "weight_sum": "weight_sum"}
"""The argument of ``begin()`` and ``scale_loss()`` (and field of StepResult) of each count."""
INTEGER = ("samples", "tokens")
TOO_LARGE = {  # the fix of a step's total of 2**62 or more, by count
    **dict.fromkeys(INTEGER, "count the items of one optimizer step only"),
    "weight_sum": "scale the weights down (a weighted mean does not depend on their scale)",
}
MOST_TERMS = 8  # every payload has as many loss slots: a length that no rank's terms change
_POSITIVE = {
    "grad_reduction": "'mean' (the wrapper averages the ranks' gradients, as DDP and FSDP do), "
    "'sum', or the positive number it divides their sum by",
    "weight_estimate": "a positive number, roughly the global count of a step",
    "framework_divides_loss_by": "the positive number your framework divides each loss by "
    "before its backward (its gradient accumulation steps), or 1",
}
OPTIONS = ("weight_by", "terms", "grad_reduction", "loss_logging", "framework_divides_loss_by")
"""The options a state is saved with; only ``weight_by`` must match where it is loaded."""
CALLS = (
    "begin() of a count-first step",
    "end() of a scale-after step",
    "end() of a count-first step (to reduce its loss)",
    "flush()",
)
COUNT_FIRST_BEGIN, SCALE_AFTER_END, COUNT_FIRST_END, FLUSH = range(len(CALLS))
# What the ranks agree on in every reduction, one code each: the step, the call, whether it
# carries an earlier step's loss, the logging option, a 32-bit digest of the terms; a number
# (the divisor D, the estimate E that a scale-after step's factors assume, the norm its end()
# clips to) takes four 16-bit codes, its float64 bits, so that two numbers that differ in any
# bit differ in a code.
FIELDS = (
    "step", "call", "carried", "loss_logging", *["terms"] * 2,
    *["grad_reduction"] * 4, *["weight_estimate"] * 4, *["max_grad_norm"] * 4,
)  # fmt: skip


@dataclass(frozen=True)
class Term:
    """One loss term of a step: its ``name``; whether each loss given for it is the ``"mean"``
    or the ``"sum"`` of its items' (``loss_reduction``); and what normalises it over the whole
    step (``weight_by``): a count each microbatch gives (``"tokens"``, ``"samples"``, or
    ``"weight_sum"``, a sum of float weights), or a positive number, a constant that the sum of
    the term's (summed) losses is divided by, as Dr. GRPO divides by a fixed length. ``count``
    is the count, None for a constant."""

    name: str
    loss_reduction: weighting.LossReduction
    weight_by: str | float = "tokens"
    count: str | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise error("bad_term_name", value=self.name)
        choose("loss_reduction", self.loss_reduction)
        constant = not isinstance(self.weight_by, str) and positive(self.weight_by)
        if not constant and self.weight_by not in COUNTS:
            raise error("bad_weight_by", value=self.weight_by)
        if constant and self.loss_reduction == "mean":
            raise error("constant_mean", name=self.name, value=self.weight_by)
        if constant:  # one number however written (4096, 4096.0, a numpy scalar): a float
            object.__setattr__(self, "weight_by", float(self.weight_by))
        object.__setattr__(self, "count", None if constant else self.weight_by)

    def __str__(self) -> str:
        return f"{self.name!r} ({self.loss_reduction}, by {self.weight_by!r})"


@dataclass(frozen=True)
class Options:
    """An Accumulator's options, checked when made. ``weight_by`` is the count a scale-after
    step's estimate ``E`` is of (the first term's that has one); ``counts``, those that
    normalise a term, which every step must give; ``rescalable``, whether every term is
    normalised by ``weight_by``, so that one factor ``E / W`` rescales the sum of their
    gradients exactly, as a scale-after step does."""

    terms: tuple[Term, ...]
    grad_reduction: str | float = "mean"
    loss_logging: str = "end"
    weight_estimate: float = 1.0
    framework_divides_loss_by: float = 1.0
    weight_by: str = field(init=False, repr=False)
    counts: tuple[str, ...] = field(init=False, repr=False)
    rescalable: bool = field(init=False, repr=False)

    def __post_init__(self) -> None:
        terms = self.terms
        if not isinstance(terms, tuple) or not terms or not all(isinstance(t, Term) for t in terms):
            raise error("bad_terms", value=self.terms)
        if len({term.name for term in self.terms}) < len(self.terms):
            raise error("terms_named_twice", names=[term.name for term in self.terms])
        if len(self.terms) > MOST_TERMS:
            raise error("too_many_terms", count=len(self.terms), most=MOST_TERMS)
        choose("loss_logging", self.loss_logging)
        for name, expected in _POSITIVE.items():
            value = getattr(self, name)
            named = name == "grad_reduction" and value in ("mean", "sum")
            if not named and not positive(value):
                raise error("bad_option", name=name, value=value, expected=expected)
        counts = [term.count for term in self.terms]
        weight_by = next((count for count in counts if count is not None), "tokens")
        object.__setattr__(self, "weight_by", weight_by)
        object.__setattr__(self, "counts", tuple(c for c in COUNTS if c in counts))
        object.__setattr__(self, "rescalable", set(counts) == {weight_by})

    def divisor(self, world_size: int) -> float:
        """``D``, times what a framework divides each loss by: the factors undo both."""
        wrapper = weighting.gradient_divisor(self.grad_reduction, world_size)  # type: ignore[arg-type]
        return wrapper * float(self.framework_divides_loss_by)

    def codes(self, divisor: float) -> tuple[int, ...]:
        """The agreement codes of the options, in the order of :data:`FIELDS`."""
        described = repr([(t.name, t.loss_reduction, t.weight_by) for t in self.terms])
        digest = zlib.crc32(described.encode())
        logging = CHOICES["loss_logging"].index(self.loss_logging)
        return (logging, digest >> 16, digest & 0xFFFF, *number_codes(divisor))


def terms_of(loss_reduction: object, weight_by: object, terms: object) -> tuple[Term, ...]:
    """An Accumulator's terms: ``terms``, or one named ``"loss"``, of the ``loss_reduction``
    and ``weight_by`` given instead."""
    if terms is None and loss_reduction is None:
        raise error("no_loss_reduction")
    if terms is None:
        return (Term("loss", loss_reduction, "tokens" if weight_by is None else weight_by),)  # type: ignore[arg-type]
    given = {"loss_reduction": loss_reduction, "weight_by": weight_by}
    if names := " and ".join(name for name, value in given.items() if value is not None):
        raise error("terms_and_options", names=names)
    if isinstance(terms, Term):
        return (terms,)
    unordered = (str, bytes, Mapping, set, frozenset)  # a set's order differs between ranks
    iterable = isinstance(terms, Iterable) and not isinstance(terms, unordered)
    return tuple(terms) if iterable else terms  # type: ignore[arg-type, return-value]


def choose(name: str, value: object) -> None:
    if value not in CHOICES[name]:
        expected = " or ".join(map(repr, CHOICES[name]))
        raise error("bad_option", name=name, value=value, expected=expected)


def finite(value: object) -> bool:
    """Whether ``value`` is a finite real number (a bool is not)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def positive(value: object) -> bool:
    return finite(value) and value > 0  # type: ignore[operator]


def natural(value: object) -> int | None:
    """``value`` as an int where it is an integer 0 or more (numpy's included, a bool not)."""
    integral = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    return int(value) if integral and value >= 0 else None  # type: ignore[operator,call-overload]


def number_codes(value: float) -> tuple[int, ...]:
    """A float64's bits as four 16-bit agreement codes."""
    return struct.unpack("<4H", struct.pack("<d", value))


def number_of(codes: tuple[int, ...]) -> float:
    return struct.unpack("<d", struct.pack("<4H", *codes))[0]  # type: ignore[no-any-return]


NO_NUMBER = number_codes(math.nan)
"""A number's codes where there is none: the clip's where ``end()`` does not clip."""


_START, _SIZE = 2 * len(FIELDS) + 2, len(COUNTS)  # the first of the counts' slots; how many
_SUMS = _START + 4 * _SIZE  # the first loss slot: a count takes two limbs and two flags


@dataclass(frozen=True, eq=False)
class Layout:
    """Where each number sits in the payload of a step with ``terms``, in order: an agreement
    code per field, then their squares; the two refusal slots (``unscaled``: gradients that no
    rank's scale_loss() produced; ``refused``: ranks that refuse the step, each with an error
    of its own); the high 31-bit limb of each count total (0 for the
    float ``weight_sum``), then the low limbs (the float total itself); for each count, whether
    this rank gave it and whether it had a microbatch that lacked it; then each term's loss sum
    of this step and whether each was non-finite (the slices ``losses[False]``, in blocks of
    MOST_TERMS slots), and the same two for an earlier step's loss (``losses[True]``).
    The first ``checked`` slots are checked after the sum; ``counts`` are the counts' slots."""

    terms: tuple[Term, ...]
    reported: tuple[str, ...] = field(init=False)
    losses: tuple[tuple[slice, slice], ...] = field(init=False)
    # The slots before the losses are the same for any terms.
    unscaled: ClassVar[int] = _START - 2
    refused: ClassVar[int] = _START - 1
    high: ClassVar[dict[str, int]] = {count: _START + i for i, count in enumerate(COUNTS)}
    low: ClassVar[dict[str, int]] = {count: _START + _SIZE + i for i, count in enumerate(COUNTS)}
    flags: ClassVar[dict[str, int]] = {c: _START + 2 * _SIZE + 2 * i for i, c in enumerate(COUNTS)}
    checked: ClassVar[int] = _START + _SIZE
    counts: ClassVar[slice] = slice(_START, _SUMS)
    length: ClassVar[int] = _SUMS + 4 * MOST_TERMS

    def __post_init__(self) -> None:
        reported = tuple(c for c in COUNTS if all(t.count != c for t in self.terms))
        object.__setattr__(self, "reported", reported)
        sums, most, used = (_SUMS, _SUMS + 2 * MOST_TERMS), MOST_TERMS, len(self.terms)
        losses = tuple((slice(s, s + used), slice(s + most, s + most + used)) for s in sums)
        object.__setattr__(self, "losses", losses)
