"""The one payload every reduction of a step sums, and the check that the ranks agree.

Whatever the mode and the options, every all-reduce sums a float64 vector laid out by
:class:`lossweight.terms.Layout`, so that two ranks whose calls are paired wrongly never read
each other's numbers as something else. Agreement codes are summed with their squares: over
``R`` ranks the sums are ``R * c`` and ``R * c**2`` on every rank if and only if every rank
sent the same ``c`` (codes are below 2**16, exact for up to 2**21 ranks). Count totals travel
as two 31-bit limbs, exact below 2**62.

A disagreement, or a total of 2**62 or more, fails the check when the result is first used:
on the CPU as a :class:`DisagreementError` on every rank, at once; in a compiled graph as an
assert with the fixed message of :mod:`lossweight.errors`; on an accelerator the reduced
numbers become NaN on the device and :meth:`Reduction.settle`, at a later call every rank
makes, raises the same DisagreementError as the CPU once the verdict reaches the host.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence

import torch

from . import _torch
from .collectives import Collective, Waitable, start_all_reduce
from .errors import device_message, error
from .terms import CALLS, CHOICES, COUNT_FIRST_BEGIN, COUNTS, FIELDS, SCALE_AFTER_END, Layout

LIMB = 2**31
_HALF_LIMB = (LIMB - 1) / 2
_CODES = len(FIELDS)
CountTotal = int | torch.Tensor | None


def start(
    collective: Collective,
    layout: Layout,
    codes: Sequence[int],
    device: torch.device,
    counts: Mapping[str, CountTotal],
    flags: Mapping[str, tuple[bool, bool]],
    losses: Mapping[tuple[str, bool], torch.Tensor | None],
    traceable: bool = False,
) -> Reduction:
    """Build this rank's payload on ``device`` and start summing it over the ranks.

    ``counts``: this rank's total of each count (an int, an int64 tensor summed here, or None
    for 0). ``flags``: for each reported count, whether this rank gave it and whether it lacked
    it. ``losses``: each (term, previous step's?) loss sum. ``traceable``: the result is always
    used, maybe inside a graph torch.compile traces.
    """
    checked, length = layout.checked, layout.length
    host = [0.0] * (length + 2 * checked)
    host[:_CODES] = codes
    host[_CODES : 2 * _CODES] = [code * code for code in codes]
    centre, radius = length, length + checked
    host[centre : centre + 2 * _CODES] = [collective.world_size * v for v in host[: 2 * _CODES]]
    host[centre + 2 * _CODES : radius] = [_HALF_LIMB] * len(COUNTS)
    host[radius + 2 * _CODES :] = [_HALF_LIMB] * len(COUNTS)
    for name, count in counts.items():
        if isinstance(count, int):
            host[layout.high(name)], host[layout.low(name)] = divmod(count, LIMB)
    for name, (gave, lacked) in flags.items():
        host[layout.flags(name)], host[layout.flags(name) + 1] = gave, lacked
    values = _torch.float64(host, device)
    payload = values[:length]
    for name, count in counts.items():
        if isinstance(count, torch.Tensor):
            limbs = torch.stack((count >> 31, count & (LIMB - 1))).reshape(2, -1).sum(1)
            payload[layout.high(name) : layout.low(name) + 1 : len(COUNTS)] = limbs
    for (term, previous), loss in losses.items():
        if loss is not None:
            slot = layout.loss(term, previous)
            payload[slot].copy_(loss)  # copy_ moves a loss on another device as well
            payload[slot + 1].copy_(loss - loss != 0)  # True for NaN and for either infinity
    return Reduction(collective, layout, payload, values[centre:], codes, traceable)


class Reduction:
    """One all-reduce of a payload: started when made, waited on and checked once, when its
    result is first used."""

    def __init__(
        self,
        collective: Collective,
        layout: Layout,
        payload: torch.Tensor,
        bounds: torch.Tensor,
        codes: Sequence[int],
        traceable: bool,
    ) -> None:
        self.layout = layout
        self._payload = payload
        self._centre, self._radius = bounds[: layout.checked], bounds[layout.checked :]
        self._codes = tuple(codes)
        self._world_size = collective.world_size
        self._handle: Waitable | None = start_all_reduce(collective, payload, traceable)
        self._checked = False
        self._error: Exception | None = None
        self._verdict: _torch.Verdict | None = None

    @property
    def device(self) -> torch.device:
        return self._payload.device

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
            self._checked = True
        return self._payload

    def settle(self) -> bool:
        """Check the reduction, raising its DisagreementError once; False while the verdict
        of an accelerator's check has not reached the host yet."""
        if self._error is not None:
            return True
        self.result()
        if self._verdict is None or not self._verdict.ready():
            return self._verdict is None
        failed, self._verdict = self._verdict.failed, None
        if bool(failed.any()):  # a host tensor: no sync
            self._error = error("cannot_be_reduced", **self._describe(~failed, self._unpoisoned))
            raise self._error
        return True

    def total(self, count: str) -> torch.Tensor:
        """One count total over every rank as float64, such as the step's global weight W."""
        payload = self.result()
        layout = self.layout
        # low + LIMB * high: the product is exact, the sum is rounded once above 2**53.
        return torch.add(payload[layout.low(count)], payload[layout.high(count)], alpha=LIMB)

    def count(self, count: str) -> torch.Tensor:
        """One count total over every rank as int64, exact; -1 for a reported count unless
        some rank gave it and no rank with a microbatch lacked it."""
        payload, layout = self.result(), self.layout
        limbs = payload[[layout.high(count), layout.low(count)]].to(torch.int64)
        total = limbs[0] * LIMB + limbs[1]
        if count not in layout.reported:
            return total
        gave, lacked = payload[layout.flags(count)], payload[layout.flags(count) + 1]
        return torch.where((gave > 0) & (lacked == 0), total, -1)

    def loss(self, term: str, previous: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(a loss sum over every rank, whether any rank's was non-finite)."""
        slot = self.layout.loss(term, previous)
        payload = self.result()
        return payload[slot], payload[slot + 1] > 0

    def _check(self) -> None:
        checked = (self._payload[: self.layout.checked] - self._centre).abs() <= self._radius
        if _torch.is_compiling() and not _torch.GRAPH_ASSERTS:
            message = device_message("graph_asserts", version=torch.__version__)
            _torch.untraced(message, lambda: self._check_on_host(checked))
        elif _torch.is_compiling():
            for index, passed in enumerate(checked):
                _torch.assert_true(passed, _ASSERT_MESSAGES[index])
        elif self.device.type == "cpu":
            self._check_on_host(checked)
        elif self.device.type != "meta":  # a meta tensor has no values to check
            self._verdict = _torch.Verdict(~checked)
            self._unpoisoned = self._payload
            self._payload = torch.where(checked.all(), self._payload, torch.nan)

    def _check_on_host(self, checked: torch.Tensor) -> None:
        try:
            _torch.assert_true(checked.all(), "lossweight: the ranks disagree")
        except RuntimeError:
            self._error = error("cannot_be_reduced", **self._describe(checked, self._payload))
            raise self._error from None

    def _describe(self, checked: torch.Tensor, payload: torch.Tensor) -> dict[str, object]:
        passed, values = checked.tolist(), payload.tolist()
        problems, reported = [], set()
        for index, field in enumerate(FIELDS):
            if (passed[index] and passed[_CODES + index]) or field in reported:
                continue
            reported.add(field)
            mean = values[index] / self._world_size
            problems.append(
                _problem(field, mean, values[_CODES + index] / self._world_size, self._codes)
            )
        for index, name in enumerate(COUNTS):
            if not passed[2 * _CODES + index]:
                problems.append(device_message("differ_total", name=f"num_{name}"))
        return {"step": self._codes[0], "ranks": self._world_size, "problems": "; ".join(problems)}


def _problem(field: str, mean: float, mean_square: float, codes: tuple[int, ...]) -> str:
    own = codes[FIELDS.index(field)]
    if field == "step":
        return device_message("differ_step", own=own, mean=mean)
    if field == "call":
        others = "; ".join(f"{code}: {name}" for code, name in enumerate(CALLS))
        problem = device_message("differ_call", call=CALLS[own], mean=mean, codes=others)
        # Codes that are all 0 or 1 have a mean square equal to their mean: every rank is in
        # begin() of a count-first step or end() of a scale-after one, so the modes differ.
        if own in (COUNT_FIRST_BEGIN, SCALE_AFTER_END) and mean_square == mean:
            problem += device_message("differ_mode")
        return problem
    if field in CHOICES:
        first, second = CHOICES[field]
        return device_message(
            "differ_choice",
            field=field,
            own=CHOICES[field][own],
            share=round(mean * 100),
            second=second,
            first=first,
        )
    divisor = struct.unpack("<d", struct.pack("<4H", *codes[-4:]))[0]
    return device_message("differ_divisor", divisor=divisor)


def _assert_message(index: int) -> str:
    if index < 2 * _CODES:
        return device_message("disagree", field=FIELDS[index % _CODES])
    return device_message("total_too_large", name=f"num_{COUNTS[index - 2 * _CODES]}")


# Fixed, so that an assert in a compiled graph neither formats a string per reduction nor reads
# a number that torch.compile may have made symbolic.
_ASSERT_MESSAGES = tuple(_assert_message(index) for index in range(2 * _CODES + len(COUNTS)))
