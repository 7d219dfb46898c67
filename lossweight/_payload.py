"""The one payload every reduction of a step sums, and the check that the ranks agree.

Whatever the mode and the options, every all-reduce lossweight issues sums a float64 vector of
the same layout, so that two ranks whose calls are paired wrongly never read each other's
numbers as something else. The vector carries, in this order:

- an agreement code per field (the step index, which call reduces, and each option the ranks
  must share), then the square of each code. Summed over ``R`` ranks, the codes are ``R * c``
  and the squares ``R * c**2`` on every rank if and only if every rank sent the same ``c``
  (equal mean and mean square means zero variance). Codes are below 2**16, so the sums are
  exact for up to 2**21 ranks;
- the two count totals (samples, tokens), each as two limbs of 31 bits, so that any total
  below 2**62 is summed exactly in float64 (each limb sum stays below 2**53);
- how many ranks gave, and how many lacked, the count that does not weight (it is reported
  only if some rank gave it and no rank with a microbatch lacked it);
- the sum of this step's loss contributions and whether it is finite on each rank, and the
  same for the loss of an earlier step that travels with this one (``loss_logging=
  "next_step"``).

A disagreement, or a total count of 2**62 or more, fails the check when the result is first
used: on the CPU as a :class:`DisagreementError` on every rank, at once; on an accelerator
through a device-side assert, so that no host sync is added.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Sequence

import torch
from torch.torch_version import TorchVersion

from .collectives import Collective, Waitable, start_all_reduce

LIMB = 2**31
CALLS = (
    "begin() of a count-first step",
    "end() of a scale-after step",
    "end() of a count-first step (to reduce its loss)",
    "flush()",
)
COUNT_FIRST_BEGIN, SCALE_AFTER_END, COUNT_FIRST_END, FLUSH = range(len(CALLS))

# The fields the ranks must agree on, one code each; the divisor D takes four 16-bit codes
# (its float64 bits), so that two divisors that differ in any bit differ in some code.
FIELDS = (
    "step",
    "call",
    "weight_by",
    "loss_reduction",
    "loss_logging",
    "grad_reduction",
    "grad_reduction",
    "grad_reduction",
    "grad_reduction",
)
_CODES = len(FIELDS)
SAMPLES, TOKENS = 0, 1
_HIGH = 2 * _CODES  # the high limbs of the (samples, tokens) totals, then their low limbs
_CHECKED = _HIGH + 2  # the codes, their squares and the high limbs are checked
_OTHER_GIVEN = _HIGH + 4
_OTHER_LACKING = _OTHER_GIVEN + 1
OWN_LOSS = _OTHER_LACKING + 1  # then whether it is non-finite
PREVIOUS_LOSS = OWN_LOSS + 2  # then whether it is non-finite
LENGTH = PREVIOUS_LOSS + 2
# A checked slot passes when |value - centre| <= radius: equality for the agreement sums, and
# 0 <= high limb <= 2**31 - 1 for a total below 2**62.
_HALF_LIMB = (LIMB - 1) / 2


class DisagreementError(RuntimeError):
    """The data-parallel ranks disagree on a step: its index, the call that reduces it, or an
    option of their Accumulators. Raised on every rank, by the collective call that paired
    them."""


def option_codes(
    weight_by: str, loss_reduction: str, loss_logging: str, divisor: float
) -> tuple[int, ...]:
    """The codes of the options every rank's Accumulator must share."""
    bits = struct.unpack("<4H", struct.pack("<d", divisor))
    return (
        ("tokens", "samples").index(weight_by),
        ("mean", "sum").index(loss_reduction),
        ("end", "next_step").index(loss_logging),
        *bits,
    )


def agreement_codes(step: int, call: int, options: tuple[int, ...]) -> tuple[int, ...]:
    """Every code of one reduction, in the order of ``FIELDS``."""
    return (step % 2**16, call, *options)


CountTotal = int | torch.Tensor | None


def start_reduction(
    collective: Collective,
    codes: Sequence[int],
    device: torch.device,
    *,
    samples: CountTotal = None,
    tokens: CountTotal = None,
    other_count: tuple[bool, bool] = (False, False),
    own_loss: torch.Tensor | None = None,
    previous_loss: torch.Tensor | None = None,
    traceable: bool = False,
) -> Reduction:
    """Build this rank's payload on ``device`` and start summing it over the ranks.

    ``samples`` and ``tokens`` are this rank's counts: a Python int (its total), an int64
    tensor (summed here), or None (0). ``other_count`` says whether this rank gave, and
    whether it lacked, the count that does not weight. ``own_loss`` and ``previous_loss`` are
    loss sums, 0 when None. ``traceable``: the result is always used, maybe inside a graph
    that torch.compile traces (see :func:`~lossweight.collectives.start_all_reduce`).
    """
    world_size = collective.world_size
    squares = [code * code for code in codes]
    host = [0.0] * (LENGTH + 2 * _CHECKED)
    host[:_CODES] = codes
    host[_CODES:_HIGH] = squares
    centre, radius = LENGTH, LENGTH + _CHECKED
    host[centre:radius] = [world_size * value for value in (*codes, *squares)]
    host[centre + _HIGH : radius] = [_HALF_LIMB, _HALF_LIMB]
    host[radius + _HIGH :] = [_HALF_LIMB, _HALF_LIMB]
    tensors = []
    for kind, count in ((SAMPLES, samples), (TOKENS, tokens)):
        if isinstance(count, int):
            host[_HIGH + kind], host[_HIGH + 2 + kind] = divmod(count, LIMB)
        elif count is not None:
            tensors.append((kind, count))
    host[_OTHER_GIVEN], host[_OTHER_LACKING] = other_count
    # From a buffer rather than a list: several times faster, and the list is all host values.
    values = torch.frombuffer(array("d", host), dtype=torch.float64).to(device, non_blocking=True)
    payload = values[:LENGTH]
    for kind, count in tensors:
        limbs = torch.stack((count >> 31, count & (LIMB - 1))).reshape(2, -1).sum(1)
        payload[_HIGH + kind : _HIGH + 4 : 2] = limbs
    for slot, loss in ((OWN_LOSS, own_loss), (PREVIOUS_LOSS, previous_loss)):
        if loss is not None:
            # copy_ moves a loss on another device (a GPU loss, a gloo payload) as well.
            payload[slot].copy_(loss)
            payload[slot + 1].copy_(loss - loss != 0)  # True for NaN and for either infinity
    return Reduction(collective, payload, values[centre:radius], values[radius:], codes, traceable)


class Reduction:
    """One all-reduce of a payload: started when made, waited on and checked once, when its
    result is first used."""

    def __init__(
        self,
        collective: Collective,
        payload: torch.Tensor,
        centre: torch.Tensor,
        radius: torch.Tensor,
        codes: Sequence[int],
        traceable: bool = False,
    ) -> None:
        self._payload = payload
        self._centre, self._radius = centre, radius
        self._codes = tuple(codes)
        self._world_size = collective.world_size
        self._handle: Waitable | None = start_all_reduce(collective, payload, traceable=traceable)
        self._totals: torch.Tensor | None = None
        self._counts: torch.Tensor | None = None
        self._error: DisagreementError | None = None

    @property
    def failed(self) -> bool:
        """Whether the check failed (and raised) already."""
        return self._error is not None

    @property
    def device(self) -> torch.device:
        return self._payload.device

    def wait(self) -> None:
        """Wait for the all-reduce to complete (once), without checking it: on an accelerator
        a stream dependency, on the CPU a wait for the other ranks."""
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
        if self._totals is None:
            self.wait()
            self._check()
            payload = self._payload
            # low + LIMB * high: the product is exact, the sum is rounded once above 2**53.
            self._totals = torch.add(
                payload[_HIGH + 2 : _HIGH + 4], payload[_HIGH : _HIGH + 2], alpha=LIMB
            )
        return self._payload

    def total(self, kind: int) -> torch.Tensor:
        """One count total as float64, such as the step's global weight W."""
        self.result()
        assert self._totals is not None
        return self._totals[kind]

    def count(self, kind: int, weighting: bool) -> torch.Tensor:
        """One count total over every rank as int64, exact. The count that does not weight
        is -1 unless some rank gave it and no rank with a microbatch lacked it."""
        if self._counts is None:
            high, low = self.result()[_HIGH : _HIGH + 4].view(2, 2).to(torch.int64)
            self._counts = high * LIMB + low
        if weighting:
            return self._counts[kind]
        payload = self._payload
        known = (payload[_OTHER_GIVEN] > 0) & (payload[_OTHER_LACKING] == 0)
        return torch.where(known, self._counts[kind], -1)

    def loss(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(a loss sum over every rank, whether any rank's was non-finite)."""
        payload = self.result()
        return payload[slot], payload[slot + 1] > 0

    def _check(self) -> None:
        checked = (self._payload[:_CHECKED] - self._centre).abs() <= self._radius
        if self.device.type == "cpu" and not torch.compiler.is_compiling():
            try:
                torch._assert_async(checked.all(), "lossweight: the ranks disagree")
            except RuntimeError:
                self._error = DisagreementError(self._describe(checked.tolist()))
                raise self._error from None
            return
        # On an accelerator, and in a graph torch.compile traces, each failure is its own
        # assert with a fixed message: the values cannot be read without waiting for the
        # device, nor inside a graph.
        if torch.compiler.is_compiling() and not _GRAPH_ASSERTS:
            # Raised while tracing: with fullgraph=True the compile fails with this message,
            # without it the function falls back to eager code, which checks on the host.
            raise RuntimeError(
                f"lossweight: scale_loss() inside torch.compile needs torch 2.9 or newer on "
                f"CPU or CUDA (this is torch {torch.__version__}"
                f"{', ROCm' if torch.version.hip else ''}), whose compiled graphs keep the "
                "asserts of the ranks' agreement check; upgrade torch, or call scale_loss() "
                "outside the compiled function"
            )
        for passed, message in zip(checked, _ASSERT_MESSAGES, strict=True):
            torch._assert_async(passed, message)

    def _describe(self, passed: list[bool]) -> str:
        values = self._payload.tolist()
        step, ranks = self._codes[0], self._world_size
        problems, reported = [], set()
        for index, field in enumerate(FIELDS):
            if (passed[index] and passed[_CODES + index]) or field in reported:
                continue
            reported.add(field)
            own = self._codes[index]
            mean, mean_square = values[index] / ranks, values[_CODES + index] / ranks
            problems.append(_field_problem(field, own, mean, mean_square, self._codes))
        for kind, name in ((SAMPLES, "num_samples"), (TOKENS, "num_tokens")):
            if not passed[_HIGH + kind]:
                problems.append(
                    f"the total {name} of the step over all ranks is 2**62 or more, beyond "
                    "what is reduced exactly; count the items of one optimizer step only"
                )
        return (
            f"lossweight step {step} (mod 2**16) cannot be reduced over {ranks} ranks: "
            + "; ".join(problems)
            + ". Every rank must make the same calls (begin(), end(), flush(), abandon()) "
            "for the same steps, with Accumulators of the same options."
        )


def _field_problem(
    field: str, own: int, mean: float, mean_square: float, codes: Sequence[int]
) -> str:
    if field == "step":
        return (
            f"this rank is at step {own} but the ranks' mean step is {mean:g}: a rank "
            "skipped, abandoned or added a step alone"
        )
    if field == "call":
        others = "; ".join(f"{code}: {name}" for code, name in enumerate(CALLS))
        problem = (
            f"this rank reduces for {CALLS[own]}, but the ranks' mean call code is {mean:g} "
            f"(codes {others})"
        )
        # Codes that are all 0 or 1 have a mean square equal to their mean: every rank is in
        # begin() of a count-first step or end() of a scale-after one, so the modes differ.
        if own in (COUNT_FIRST_BEGIN, SCALE_AFTER_END) and mean_square == mean:
            problem += (
                ": some ranks count first and others scale after. On a rank with no "
                "microbatch in a scale-after step, call begin(parameters=...) and end() as "
                "the other ranks do"
            )
        return problem
    choices = {
        "weight_by": ("tokens", "samples"),
        "loss_reduction": ("mean", "sum"),
        "loss_logging": ("end", "next_step"),
    }
    if field in choices:
        first, second = choices[field]
        share = round(mean * 100)
        return (
            f"the ranks differ in {field}: this rank has {choices[field][own]!r}; "
            f"{share}% of the ranks have {second!r} and the others {first!r}"
        )
    divisor = struct.unpack("<d", struct.pack("<4H", *codes[5:9]))[0]
    return (
        f"the ranks differ in grad_reduction (or framework_divides_loss_by): this rank's "
        f"factors undo a division of the gradients by {divisor:g}, another rank's by another "
        "number"
    )


def _assert_message(index: int) -> str:
    if index < 2 * _CODES:
        return (
            f"lossweight: the data-parallel ranks disagree on {FIELDS[index % _CODES]} in one "
            "reduction of a step; every rank must make the same calls (begin(), end(), "
            "flush(), abandon()) for the same steps, with Accumulators of the same options"
        )
    name = ("num_samples", "num_tokens")[index - 2 * _CODES]
    return f"lossweight: the step's total {name} over all ranks is 2**62 or more"


# Before torch 2.9, inductor removed _assert_async from compiled graphs, and on ROCm its
# device asserts are compiled out: a compiled check there would pass whatever the ranks sent.
_GRAPH_ASSERTS = torch.version.hip is None and TorchVersion(torch.__version__) >= "2.9"

# Fixed, so that the assert of each checked slot neither formats a string per reduction nor
# reads a number that torch.compile may have made symbolic.
_ASSERT_MESSAGES = tuple(_assert_message(index) for index in range(_CHECKED))
