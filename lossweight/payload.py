"""The one payload every reduction of a step sums, and the check that the ranks agree.

Every all-reduce sums a float64 vector laid out by :class:`lossweight.terms.Layout`, so that
ranks whose calls are paired wrongly never read each other's numbers as something else.
Agreement codes are summed with their squares: over ``R`` ranks the sums are ``R * c`` and
``R * c**2`` if and only if every rank sent the same ``c``. Count totals travel as two 31-bit
limbs, exact below 2**62. A failed check raises :class:`DisagreementError` on every rank: at
once on the CPU, as an assert in a compiled graph, and without a host sync on an accelerator
(docs/errors.md says how).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from . import _torch, terms
from .collectives import Collective, Microbatches, Waitable, parallel_layout, start_all_reduce
from .errors import device_message, error
from .terms import ARGUMENTS, COUNTS, FIELDS, Layout, Term

LIMB = 2**31
_CODES = len(FIELDS)
CHECKED_ON_HOST = ("cpu",)  # device types whose checks read their verdict at once
Counts = Mapping[str, Sequence[float] | torch.Tensor | None]
Flags = Mapping[str, tuple[bool, bool]]


class Reduction:
    """One all-reduce of this rank's payload, made on ``device`` from each count's numbers to
    sum (a sequence of ints or floats, an int64 or float tensor, or None for 0), whether this
    rank gave and lacked each count (a count left out: neither, and no total), and the terms'
    loss sums, this step's and an earlier one's (a pair of 1-D tensors or None): started when
    made, waited on and checked when first used. ``traceable``: the result is always used,
    maybe in a graph torch.compile traces. A scale-after ``end()`` adds what it refuses, on
    every rank: its ``unscaled`` slot, and ``refusal``, this rank's own error (see
    :func:`_host`)."""

    _error: Exception | None = None
    _verdict: _torch.Verdict | None = None
    _checked = settled = False  # settled: checked, its verdict known on the host

    def __init__(
        self,
        collective: Collective,
        layout: Layout,
        codes: tuple[int, ...],
        device: torch.device,
        counts: Counts,
        flags: Flags,
        losses: tuple[torch.Tensor | None, torch.Tensor | None],
        traceable: bool = False,
        microbatches: Microbatches | None = None,
        unscaled: float | torch.Tensor = 0.0,
        refusal: Exception | None = None,
    ) -> None:
        host = _host(layout, codes, collective.world_size, counts, flags)
        host[layout.refused] = refusal is not None
        host[layout.unscaled] = 0.0 if isinstance(unscaled, torch.Tensor) else unscaled
        values = _torch.float64s(host, device)
        payload, self._bounds = values[: layout.length], values[layout.length :].view(2, -1)
        if isinstance(unscaled, torch.Tensor):
            payload[layout.unscaled].copy_(unscaled)
        for name, count in counts.items():
            if isinstance(count, torch.Tensor):  # int64, or a weight sum, summed in float64
                count = count.double() if count.is_floating_point() else count
                high = count.floor_divide(LIMB) if count.is_floating_point() else count >> 31
                summed = torch.stack((high, count - high * LIMB)).reshape(2, -1).sum(1)
                payload[layout.high[name] : layout.low[name] + 1 : len(COUNTS)] = summed
        for (sums, nonfinite), loss in zip(layout.losses, losses, strict=True):
            if loss is not None:  # each term's sum, then whether it is NaN or infinite
                payload[sums].copy_(loss)  # copy_ moves a loss's device too
                payload[nonfinite].copy_(loss - loss != 0)
        if (parallel := parallel_layout(collective)) is not None:  # ranks of the same data too
            payload = parallel.extend(payload, layout, microbatches or {})
        # The layout's agreement is read where it added checks of its own.
        self._parallel = parallel if len(payload) > layout.length else None
        self.layout, self._payload, self._codes, self._refusal = layout, payload, codes, refusal
        self._world_size, self._collective = collective.world_size, type(collective).__name__
        self._handle: Waitable | None = start_all_reduce(collective, payload, traceable)

    @property
    def device(self) -> torch.device:
        return self._payload.device

    @property
    def awaiting(self) -> bool:
        """Whether an accelerator's verdict on the check is on its way to the host."""
        return self._verdict is not None

    def wait(self) -> None:
        """Wait for the all-reduce (once), without checking it."""
        if self._handle is not None:
            # Forgotten only once it returns: a wait that raised is tried again by the next
            # use, which would otherwise check this rank's own, unsummed payload.
            summed = self._handle.wait()
            self._handle = None
            if isinstance(summed, torch.Tensor):  # a functional collective's result
                self._payload = summed

    def result(self) -> torch.Tensor:
        """The summed payload, once every rank's agreement is checked."""
        if self._error is not None:
            raise self._error
        if not self._checked:
            self.wait()
            self._check()
        return self._payload

    def settle(self, wait: bool = False) -> None:
        """Check the reduction, raising its DisagreementError once; on an accelerator, once its
        verdict has reached the host (until then ``settled`` stays False), or waiting for it."""
        if self._error is None:
            self.result()
        verdict = self._verdict
        if verdict is not None and verdict.ready(wait):
            self._verdict = None
            if bool(verdict.failed.any()):  # a host tensor: no sync
                self._fail(~verdict.failed, self._unsummed)
        self.settled = self._verdict is None

    def total(self, count: str, payload: torch.Tensor | None = None) -> torch.Tensor:
        """One count total over every rank as float64, such as the step's global weight W."""
        payload, layout = self.result() if payload is None else payload, self.layout
        # low + LIMB * high: the product is exact, the sum is rounded once above 2**53.
        return torch.add(payload[layout.low[count]], payload[layout.high[count]], alpha=LIMB)

    def agreed_total(self, count: str, otherwise: float) -> torch.Tensor:
        """:meth:`total`, or ``otherwise`` where it is 0 or the ranks' agreement fails, raising
        nothing: the same on every rank, whether it has checked the reduction yet or not (its
        use raises)."""
        self.wait()
        total = self.total(count, self._payload)
        return torch.where(self._agreement().all() & (total > 0), total, otherwise)

    def normaliser(self, term: Term) -> torch.Tensor:
        """A term's ``W``: its count's total over every rank, or its constant, which waits for
        the ranks' agreement on it as a total does (on an accelerator, NaN where it failed)."""
        constant = float(term.weight_by) if term.count is None else 0.0
        return self.total(term.count) if term.count else self.result()[0] * 0 + constant

    def count(self, count: str) -> torch.Tensor:
        """One count total over every rank, as int64 (exact) or, for ``weight_sum``, float64;
        -1 for a reported count unless some rank gave it and no rank with a microbatch lacked
        it."""
        payload, layout = self.result(), self.layout
        limbs = payload[[layout.high[count], layout.low[count]]]
        high, low = limbs.to(torch.int64) if count in terms.INTEGER else limbs  # exact: as total()
        known = limbs[0] == limbs[0]  # False where a failed check on a device made it NaN
        if count in layout.reported:
            gave, lacked = payload[layout.flags[count]], payload[layout.flags[count] + 1]
            known = known & (gave > 0) & (lacked == 0)
        return torch.where(known, high * LIMB + low, -1)

    def loss(self, previous: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(each term's loss sum over every rank, whether any rank's was non-finite)."""
        payload, (sums, nonfinite) = self.result(), self.layout.losses[previous]
        return payload[sums], payload[nonfinite] > 0

    def _agreement(self) -> torch.Tensor:
        """Whether each checked slot of the summed payload holds what agreeing ranks sum to."""
        centre, radius = self._bounds
        checked: torch.Tensor = (self._payload[: self.layout.checked] - centre).abs() <= radius
        if (parallel := self._parallel) is not None:
            checked = torch.cat((checked, parallel.agreement(self._payload[self.layout.length :])))
        return checked

    def _check(self) -> None:
        self._checked, checked, parallel = True, self._agreement(), self._parallel
        if torch.compiler.is_compiling():
            messages = [] if parallel is None else parallel.messages()
            _torch.needs_compiled()
            _torch.compiled.check(checked, messages, lambda: self._check_on_host(checked))
        elif self.device.type in CHECKED_ON_HOST:
            self._check_on_host(checked)
        elif self.device.type != "meta":  # a meta tensor has no values to check
            self._verdict, self._unsummed = _torch.Verdict(~checked), self._payload
            self._payload = torch.where(checked.all(), self._payload, torch.nan)
        self.settled = self._verdict is None

    def _check_on_host(self, checked: torch.Tensor) -> None:
        try:
            _torch.assert_true(checked.all(), device_message("disagree", field="a check"))
        except RuntimeError:
            self._fail(checked, self._payload)

    def _fail(self, checked: torch.Tensor, payload: torch.Tensor) -> None:
        """Raise, and keep for every later use, the error that says what differs."""
        passed, values, layout = checked.tolist(), payload.tolist(), self.layout  # by slot
        ranks, codes = self._world_size, self._codes
        problems = []
        for field in dict.fromkeys(FIELDS):  # a number's four codes say one thing
            where = [i for i, name in enumerate(FIELDS) if name == field]
            if not all(passed[i] and passed[_CODES + i] for i in where):
                mean, square = values[where[0]] / ranks, values[_CODES + where[0]] / ranks
                own = tuple(codes[i] for i in where)
                problems.append(_problem(field, mean, square, own, layout))
        if problems and (ranks == 1 or values[:_CODES] == list(codes)):
            # One rank, or ranks that each got back their own codes: nothing was summed.
            self._error = error("not_summed", collective=self._collective, ranks=ranks)
        elif problems:
            text = "; ".join(problems)
            self._error = error("cannot_be_reduced", step=codes[0], ranks=ranks, problems=text)
        elif not passed[layout.unscaled]:
            self._error = error("unscaled_gradients")
        elif not passed[layout.refused]:
            refused = round(values[layout.refused])
            self._error = self._refusal or error("peer_refused", count=refused, ranks=ranks)
        elif names := [n for n in COUNTS if not passed[layout.high[n]]]:
            fix = "; ".join(dict.fromkeys(terms.TOO_LARGE[n] for n in names))
            name = " and ".join(ARGUMENTS[n] for n in names)
            self._error = error("total_too_large", name=name, fix=fix)
        else:  # only the last checks failed: the parallel layout's
            assert self._parallel is not None
            self._error = self._parallel.refusal(passed)
        raise self._error from None


def _host(
    layout: Layout, codes: tuple[int, ...], ranks: int, counts: Counts, flags: Flags
) -> list[float]:
    """The payload's numbers known on the host, then each checked slot's centre and radius.
    The sums of the codes must be ``R * c`` and ``R * c**2``; of the refusal slots, ``unscaled``
    at most 0 (a rank that scaled a loss adds ``-R``; one that scaled none, where its gradients
    are nonzero, 1, or ``R**2 + 1`` if a backward reached them there: the sum is positive where
    no rank scaled a loss or a rank back-propagated one unscaled) and ``refused`` 0; each high
    limb's in ``[0, LIMB)``."""
    limbs, agreement = [(LIMB - 1) / 2] * len(COUNTS), [*codes, *(c * c for c in codes)]
    centre = [ranks * code for code in agreement] + [-(ranks**2) / 2, 0.0] + limbs
    radius = [0.0] * len(agreement) + [ranks**2 / 2, 0.0] + limbs
    host = [*agreement, *[0.0] * (layout.length - len(agreement)), *centre, *radius]
    for name, (gave, lacked) in flags.items():  # a count with a total has its flags
        host[layout.flags[name]], host[layout.flags[name] + 1] = gave, lacked
        if (count := counts.get(name)) is not None and not isinstance(count, torch.Tensor):
            host[layout.high[name]], host[layout.low[name]] = divmod(sum(count), LIMB)
    return host


def _problem(field: str, mean: float, square: float, own: tuple[int, ...], layout: Layout) -> str:
    if field == "step":
        return device_message("differ_step", own=own[0], mean=mean)
    if field == "call":
        others = "; ".join(f"{code}: {name}" for code, name in enumerate(terms.CALLS))
        problem = device_message("differ_call", call=terms.CALLS[own[0]], mean=mean, codes=others)
        # Codes that are all 0 or 1 have a mean square equal to their mean: every rank is in
        # begin() of a count-first step or end() of a scale-after one, so the modes differ.
        if own[0] in (terms.COUNT_FIRST_BEGIN, terms.SCALE_AFTER_END) and square == mean:
            problem += device_message("differ_mode")
        return problem
    if field == "terms":
        return device_message("differ_terms", own=", ".join(map(str, layout.terms)))
    share = round(mean * 100)
    if field == "carried":
        return device_message("differ_carried", own="does" if own[0] else "does not", share=share)
    if field in terms.CHOICES:
        first, second = choices = terms.CHOICES[field]
        fields = {"field": field, "own": choices[own[0]], "first": first, "second": second}
        return device_message("differ_choice", share=share, **fields)
    number = terms.number_of(own)
    if field == "max_grad_norm":
        return device_message("differ_clip", own="None" if math.isnan(number) else repr(number))
    if field == "weight_estimate":
        shown = f"the W its last step reduced, or {-number!r} where that is 0"
        return device_message("differ_estimate", own=repr(number) if number > 0 else shown)
    return device_message("differ_divisor", divisor=number)
