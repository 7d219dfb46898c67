"""An open step, one class per mode: its tensors, its factors, and its ``end()``, which
reduces and reports through the run's :class:`lossweight.ledger.Ledger`; every number comes
from weighting.py.

:class:`CountFirst` knows every count at ``begin()``: its reduction overlaps the first forward,
and each factor is final. :class:`ScaleAfter` gets the counts with each loss, scales against an
estimate ``E`` of ``W``, and at ``end()`` multiplies every gradient by ``E / W``. The step
machine decides which microbatch a call takes; these classes do the arithmetic, host-sync free.
"""

from __future__ import annotations

import functools
import math
import threading
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from . import _torch, terms, weighting
from .collectives import Collective
from .errors import device_message, error
from .ledger import Ledger
from .machine import Step
from .payload import Counts, Reduction
from .result import StepResult
from .terms import ARGUMENTS, COUNTS, INTEGER, Term

Count = int | float | torch.Tensor
Counted = Mapping[str, Count | None]


class CountFirst:
    """A step whose counts were all given to ``begin()``: for each count, a list of numbers, a
    1-D tensor (an int64 copy, or a float one at its precision), or None. Its losses come one
    per term, in order; each term's weights, factors and losses are a 1-D tensor of their own
    (a "row")."""

    closing: Reduction | None = None  # end()'s reduction of the loss, once made
    refusal: Exception | None = None  # what it carried to the peers

    def __init__(
        self, collective: Collective, ledger: Ledger, step: int, counts: Counts, divisor: float
    ) -> None:
        self._terms, self._divisor, self._declared = ledger.layout.terms, divisor, counts
        self.collective = collective
        self.size = size = len(next(c for c in counts.values() if c is not None))
        self.device = device = reduction_device(collective, counts)
        flags = {n: (counts[n] is not None, counts[n] is None and size > 0) for n in COUNTS}
        codes = ledger.codes(step, terms.COUNT_FIRST_BEGIN)
        # traceable: scale_loss() uses the totals in every case, maybe in a compiled graph.
        self.reduction = Reduction(
            collective, ledger.layout, codes, device, counts, flags, (None, ledger.carried),
            traceable=True, microbatches=counts,
        )  # fmt: skip
        ledger.add(self.reduction, estimates=True)  # its W is the next estimate
        # Each term's weight per microbatch (a constant's term: 1), and where all are numbers,
        # whether each microbatch's are positive, known on the host at no cost.
        rows: list[Any] = [counts[t.count] if t.count else [1] * size for t in self._terms]
        self._host_positive, self._weights = _weights(rows, device)
        self._factors: Rows = ()
        # The factors and whether each weight is positive, by a loss's device and precision.
        self._cast: dict[tuple[torch.device, torch.dtype], tuple[Rows, Rows]] = {}
        # Each microbatch's detached losses (float64, on the losses' device), indexed by its
        # position so that a compiled scale_loss() does not depend on how many came before.
        self._losses: Rows = ()
        # A compiled step counts its microbatches on the device: dynamo specializes a Python
        # int reached from a global, so counting in one would compile a graph per microbatch.
        self.cursor: torch.Tensor | None = None

    def close(self, abandoned: bool) -> None:
        """An ``abandoned`` step waits for its reduction, so that none is left in flight."""
        if abandoned:
            self.reduction.wait()

    def end(
        self, ledger: Ledger, step: Step, refusal: Exception | None, clip: float | None = None
    ) -> StepResult:
        """What the step reports, its loss reduced now or left to wait (``clip``: a scale-after
        step's; a count-first ``end()`` refuses one before it comes here). What its end() refuses
        (``refusal``) it raises here, the step left open; where the step's loss reduction has
        peers to tell, it carries the refusal first (once, however often end() is called), and
        they raise on their next use of it (``peer_refused``)."""
        next_step, collective = ledger.options.loss_logging == "next_step", self.collective
        if refusal is not None and (collective.world_size == 1 or next_step):
            raise refusal
        # A compiled step takes every microbatch through scale_loss(): its reads take none.
        unrecorded = step.unrecorded if step.factored and self.cursor is None else []
        loss_sum = self.loss_sum(known=not unrecorded)
        if next_step:
            pending = ledger.hold(step.number, loss_sum, collective)
            return StepResult(step.number, self.reduction, pending, unrecorded)
        if self.closing is None:
            ledger.settle()
            codes = ledger.codes(step.number, terms.COUNT_FIRST_END)
            self.closing = ledger.reduce_loss(collective, codes, self.device, loss_sum, refusal)
            self.refusal = refusal  # told to the peers: raised again, even once mended
        if self.refusal is not None:
            raise self.refusal
        return StepResult(step.number, self.reduction, self.closing, unrecorded)

    def factors(self) -> Rows:
        """Every term's factor for every microbatch (float64), made once; the first waits."""
        if not self._factors:
            self._factors = tuple(
                weighting.backward_scale(
                    weights, self.reduction.normaliser(term), self._divisor, term.loss_reduction
                )
                for weights, term in zip(self._weights, self._terms, strict=True)
            )
        return self._factors

    def factor(self, index: int) -> torch.Tensor | dict[str, torch.Tensor]:
        """Microbatch ``index``'s factor; by term name where there are several. A copy: one
        that the caller changes in place leaves the factors scale_loss() applies as they are."""
        factors = self.factors()
        if len(factors) == 1:
            return factors[0][index].clone()
        return {term.name: f[index].clone() for term, f in zip(self._terms, factors, strict=True)}

    def scale(
        self, losses: Losses, index: int | None, step: int, given: Counted | None = None
    ) -> torch.Tensor:
        """The terms' losses times microbatch ``index``'s factors, summed; None: at the cursor
        (an eager call in a compiled step, where dynamo fell back). Counts ``given`` with the
        losses must be those begin() declared for the microbatch."""
        cursor = self.cursor if index is None else None
        if index is None:
            index = self.at_cursor("too_many", step)
        if given is not None:
            self._check(index, given, step)
        if cursor is not None:
            cursor.add_(1)
        self.record(index, losses)
        guard = self._host_positive is None or not self._host_positive[index]
        if not guard and len(losses) == 1:  # the common case, kept short: it runs per microbatch
            return losses[0] * self.cast(losses[0])[0][0][index]
        scaled = []
        for term, loss in enumerate(losses):
            factors, positive = self.cast(loss)
            if guard:
                # A microbatch of weight 0 contributes exactly nothing: torch.where takes
                # neither the value nor the gradient of the loss it does not select (a NaN of
                # 0/0 included).
                loss = torch.where(positive[term][index], loss, 0.0)
            scaled.append(loss * factors[term][index])
        return sum(scaled[1:], scaled[0])

    def at_cursor(self, code: str, step: int) -> int:
        """Where a compiled step's cursor is (for an eager call in it, where dynamo fell back):
        ``code``'s error when it is past the microbatches begin() declared."""
        if (index := 0 if self.cursor is None else int(self.cursor)) >= self.size:
            raise error(code, number=index + 1, step=step, declared=self.size)
        return index

    def _check(self, index: int, given: Counted, step: int) -> None:
        """Refuse a count that is not the one declared for microbatch ``index`` (a float
        weight sum to within its precision's round-off, :func:`weights_agree`): the loss then
        covers other items than its weight counts."""
        for name, count in given.items():
            declared, argument = self._declared[name], ARGUMENTS[name]
            if count is not None and declared is None:
                raise error("count_undeclared", name=argument, microbatch=index, step=step)
            if count is None or declared is None:
                continue
            exact = name in INTEGER  # an integer count exactly, as the payload reduces it
            if isinstance(count, torch.Tensor) or isinstance(declared, torch.Tensor):
                if exact:
                    mine = torch.as_tensor(declared[index])
                    same = mine == torch.as_tensor(count).to(mine)
                else:
                    same = weights_agree(declared[index], count)
                _torch.assert_true(same, device_message("count_differs", name=argument))
            elif count != (want := declared[index]) and (exact or not weights_agree(count, want)):
                where = {"microbatch": index, "step": step, "declared": want}
                raise error("count_mismatch", name=argument, value=count, **where)

    def record(self, index: int, losses: Losses) -> None:
        """Keep a copy of microbatch ``index``'s detached losses for the logged loss."""
        buffers = self._losses or self.buffers(losses[0])
        for term, loss in enumerate(losses):
            buffers[term][index] = loss.detach()

    def buffers(self, loss: torch.Tensor) -> Rows:
        """The microbatches' losses, made on the first loss's device."""
        if not self._losses:
            self._losses = tuple(torch.zeros_like(w, device=loss.device) for w in self._weights)
        return self._losses

    def loss_sum(self, known: bool) -> torch.Tensor:
        """This rank's terms of the losses' numerators, after its last microbatch; NaN where a
        loss was not handed over (``known`` False), so that no rank logs a wrong one."""
        if self.cursor is not None:
            _torch.compiled.all_taken(self.cursor, self.size)
        if not self._losses or not known:
            fill = 0.0 if known else torch.nan
            return torch.full((len(self._terms),), fill, dtype=torch.float64, device=self.device)
        weights = [w.to(self._losses[0].device, non_blocking=True) for w in self._weights]
        losses = self._losses
        # An empty microbatch's NaN, left out.
        if self._host_positive is None or not all(self._host_positive):
            losses = tuple(torch.where(w > 0, x, 0.0) for w, x in zip(weights, losses, strict=True))
        return _contributions(losses, weights, self._terms)

    def cast(self, loss: torch.Tensor) -> tuple[Rows, Rows]:
        """The factors at the loss's precision (float32 at least), and whether each weight is
        positive, on the loss's device: made once a step (and a loss device and dtype)."""
        if (key := (loss.device, loss.dtype)) not in self._cast:
            dtype = torch.promote_types(loss.dtype, torch.float32)
            factors = tuple([f.to(loss.device, dtype, non_blocking=True) for f in self.factors()])
            positive = tuple([(w > 0).to(loss.device, non_blocking=True) for w in self._weights])
            self._cast[key] = (factors, positive)
        return self._cast[key]


class ScaleAfter:
    """A step whose counts come with each loss, and whose gradients ``end()`` rescales. Every
    term is normalised by the same count (``Options.rescalable``), so one factor fits them all.
    ``loss``: whether this rank computes the loss; a pipeline stage before the last one gets
    its gradients from the last one's scaled losses, and rescales them all the same."""

    cursor = None  # its scale_loss() runs eagerly
    reduction: Reduction | None = None
    total: torch.Tensor | None = None  # W, once end() has reduced and rescaled

    def __init__(
        self,
        collective: Collective,
        ledger: Ledger,
        parameters: list[torch.Tensor],
        divisor: float,
        loss: bool = True,
    ) -> None:
        # Gradients left from before the step would be rescaled with this step's: refused on
        # the device where one (a sparse one's values) is nonzero.
        if groups := _torch.gradient_groups(parameters):
            _torch.assert_true(~_torch.nonzero_gradients(groups), device_message("stale_gradients"))
        if held := _torch.fsdp_held(parameters):  # FSDP2's, for its next reduce-scatter
            _torch.assert_true(~_torch.nonzero_gradients(held), device_message("fsdp_held"))
        self.backwards = _torch.Backwards(parameters)  # on this rank, scaled or not
        self.collective, self.parameters, self._divisor = collective, parameters, divisor
        self._estimate, self._loss = ledger.estimated(), loss
        self._layout = layout = ledger.layout
        self._terms, self._count = layout.terms, str(layout.terms[0].count)
        # Which terms' losses are means (each weighted by its microbatch's count), if any.
        means = [term.loss_reduction == "mean" for term in layout.terms]
        self._means = tuple(means) if any(means) else ()
        self._cast: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}
        self._counts: dict[str, list[Count]] = {name: [] for name in COUNTS}
        self._losses: list[tuple[torch.Tensor, ...]] = []  # per microbatch, one per term
        self._rescaled = [False]  # shared with the hooks of the scaled losses (not this step)
        self._given = frozenset(map(id, parameters))
        # Parameters a loss reaches, not given, by id: each with its gradient, and that
        # gradient's version, when the first loss that reached it was scaled.
        self._strays: dict[int, tuple[torch.Tensor, torch.Tensor | None, int]] = {}
        with _OPEN_LOCK:
            _OPEN.add(self)

    def close(self, abandoned: bool) -> None:
        """Leave this process's open scale-after steps, ended or ``abandoned``."""
        with _OPEN_LOCK:
            _OPEN.discard(self)
        self.backwards.close()

    def scale(
        self, losses: Losses, index: int | None, step: int, counts: Counted | None
    ) -> torch.Tensor:
        """The terms' losses times their provisional factors ``w * D / E`` (``D / E``), summed
        (the machine takes the microbatch, and requires its weight)."""
        assert counts is not None
        for number, stray in _not_given(losses, self.parameters, self._given).items():
            # Its gradient as it was before any backward of a loss that reaches it.
            self._strays.setdefault(number, (stray, *_torch.gradient_version(stray)))
        for name, count in counts.items():
            if count is not None:
                self._counts[name].append(count)
        if (key := (losses[0].device, losses[0].dtype)) not in self._cast:
            estimate = torch.as_tensor(self._estimate, dtype=torch.float64).to(key[0])
            # A summed loss's factor D / E is the same for every microbatch: made once.
            shared = weighting.backward_scale(estimate, estimate, self._divisor, "sum")
            self._cast[key] = (estimate, shared.to(torch.promote_types(key[1], torch.float32)))
        estimate, shared = self._cast[key]
        weight = counts[self._count]
        if not isinstance(weight, (int, float)):
            assert weight is not None
            weight = weight.to(key[0], torch.float64, non_blocking=True)
        factor = shared
        if self._means:
            # A Python weight enters through full_like, a fill on the loss's device, so that
            # the factor is a tensor divided by a tensor, rounded once as a count-first one is.
            full = torch.full_like(estimate, weight) if isinstance(weight, (int, float)) else weight
            mean = weighting.backward_scale(full, estimate, self._divisor, "mean")
            factor = mean.to(shared.dtype)
        if len(losses) == 1:  # the common case, kept short: it runs per microbatch
            guarded = _guarded(losses[0], weight)
            self._losses.append((guarded.detach().to(torch.float64, copy=True),))
            return self._before_end(guarded * factor, step)
        guards = [_guarded(loss, weight) for loss in losses]
        self._losses.append(tuple([g.detach().to(torch.float64, copy=True) for g in guards]))
        means = self._means or (False,) * len(guards)
        scaled = [g * (factor if m else shared) for g, m in zip(guards, means, strict=True)]
        return self._before_end(sum(scaled[1:], scaled[0]), step)

    def _before_end(self, scaled: torch.Tensor, step: int) -> torch.Tensor:
        """``scaled``, whose backward is refused once end() has rescaled the gradients: it
        would add a gradient that keeps its provisional factor (a count-first factor is final,
        so a count-first loss may be back-propagated after end())."""
        if scaled.requires_grad:
            _torch.register_hook(scaled, functools.partial(_refuse_after_end, self._rescaled, step))
        return scaled

    def end(
        self, ledger: Ledger, step: Step, refusal: Exception | None, clip: float | None = None
    ) -> StepResult:
        """What the step reports once its reduction has rescaled its gradients (and its ranks
        agreed on the norm ``end()`` then clips to, ``clip``): reduced, then rescaled, each
        once, even after a failure. The reduction carries the loss that waits,
        and gives the next E (the option's where its check fails, on every rank alike), whether
        its check then passes or not. (A scale-after step's refusals travel in its reduction:
        the machine's ``refusal`` is a count-first step's.)"""
        if self.reduction is None:
            ledger.settle()
            codes = ledger.codes(step.number, terms.SCALE_AFTER_END, clip)
            self._groups = _torch.gradient_groups(self.parameters)
            totals = {name: self._sum(name) for name in COUNTS}
            device = reduction_device(self.collective, totals)
            gave = dict(zip(COUNTS, step.given or (False,) * len(COUNTS), strict=True))
            flags = {n: (gave[n], not gave[n] and bool(self._losses)) for n in COUNTS}
            # No loss scaled: the payload's own zeros.
            losses = (self._loss_sum() if self._losses else None, ledger.carried)
            unscaled, own = self._refusals(self.collective.world_size, codes[0])
            self.reduction = Reduction(
                self.collective, self._layout, codes, device, totals, flags, losses, False,
                self._counts, unscaled, own,
            )  # fmt: skip
            ledger.add(self.reduction, estimates=True)
        if self.total is None:
            if clip is not None:  # on an accelerator, the verdict too: no rank may clip alone
                self.reduction.settle(wait=True)
            total = self.reduction.total(self._count)
            # Applied at the gradients' precision or better, never rounded to bf16 first.
            _torch.multiply(self._groups, weighting.gradient_correction(total, self._estimate))
            self.total, self._rescaled[0] = total, True
        return StepResult(step.number, self.reduction, self.reduction, [])

    def _refusals(self, ranks: int, step: int) -> tuple[float | torch.Tensor, Exception | None]:
        """What this rank adds to the reduction's refusal slots, so that every rank refuses
        together: ``-R`` where a loss went through scale_loss(); else, where its gradients are
        nonzero, 1 if no backward reached them here (they may be its peers' scaled losses',
        summed by the loop before end(), unless no rank scaled one) or ``R**2 + 1`` if one did
        (a backward that skipped scale_loss(), refused whatever the peers did); and its own
        error where its scaled losses reached none of the parameters, or gradients that end()
        would leave unscaled (of parameters not given, or FSDP2's sharded ones of a module
        given unsharded), or more backward passes reached a parameter given than losses went
        through scale_loss() (one of them skipped it, and end() would rescale it)."""
        if self._losses:
            refusal = None
            strays = _torch.unscaled(_written(self._strays.values()), self.parameters)
            if strays and (unsharded := _torch.unsharded_given(strays, self.parameters)):
                count, shapes = len(unsharded), _shapes(unsharded)
                refusal = error("fsdp_unsharded", step=step, count=count, shapes=shapes)
            elif not self._groups:
                scaled, parameters = len(self._losses), len(self.parameters)
                refusal = error("no_gradients", parameters=parameters, scaled=scaled, step=step)
            elif strays:
                refusal = error("not_given", step=step, count=len(strays), shapes=_shapes(strays))
            elif (backwards := self.backwards.count) > (scaled := len(self._losses)):
                refusal = error("unscaled_backward", step=step, backwards=backwards, scaled=scaled)
            return -float(ranks), refusal
        if not self._groups or not self._loss:  # a stage before the last scales nothing
            return 0.0, None
        own = ranks * ranks + 1 if self.backwards.count else 1
        return _torch.nonzero_gradients(self._groups) * own, None

    def _sum(self, name: str) -> list[int | float] | torch.Tensor:
        """A count's numbers to sum, or where a microbatch gave a tensor, its counts to sum."""
        tensors = [count for count in self._counts[name] if isinstance(count, torch.Tensor)]
        host = [count for count in self._counts[name] if not isinstance(count, torch.Tensor)]
        if not tensors:
            return host
        device = accelerator_of(ARGUMENTS[name], (t.device for t in tensors))
        held = torch.float64 if tensors[0].is_floating_point() else torch.int64  # as on the host
        tensors = [*tensors, torch.tensor(total, dtype=held)] if (total := sum(host)) else tensors
        return torch.stack([t.to(device, non_blocking=True) for t in tensors])

    def _loss_sum(self) -> torch.Tensor:
        """Each term's sum of loss contributions, weighted by the microbatches' counts as given
        (a Python float made float64 at once: as a float32 tensor first it would be rounded)."""
        losses = torch.stack([torch.stack(term) for term in zip(*self._losses, strict=True)])
        # Each microbatch's weight (the machine requires one), on the losses' device.
        weights = [torch.as_tensor(w, dtype=torch.float64) for w in self._counts[self._count]]
        weights = [w.to(losses.device, non_blocking=True) for w in weights]
        return _contributions(losses, torch.stack(weights).expand_as(losses), self._terms)


Losses = tuple[torch.Tensor, ...]
Rows = tuple[torch.Tensor, ...]


def _not_given(
    losses: Losses, parameters: list[torch.Tensor], given: frozenset[int]
) -> dict[int, torch.Tensor]:
    """The parameters whose gradients ``losses`` reach and ``parameters`` (``given``: their
    ids) lacks, which end() would leave unscaled, by id. Every loss is walked: a later
    microbatch may take a branch, or route to an expert, that the first did not. FSDP2's graph
    reaches the unsharded parameters that it swaps into its modules, and reduces their
    gradients into the sharded ones: those are looked for. Where FSDP2 is imported but its
    parameters are not found (a torch that keeps them elsewhere), a list of DTensors is not
    checked."""
    shards = _torch.fsdp_shards()
    if shards is None and any(hasattr(p, "to_local") for p in parameters):
        return {}
    reached = [p for p in _torch.leaves(losses) if isinstance(p, torch.nn.Parameter)]
    holders = [(shards or {}).get(id(p), p) for p in reached]  # an unsharded one's: its shard
    return {id(p): p for p in holders if id(p) not in given}


def _refuse_after_end(rescaled: list[bool], step: int, _: torch.Tensor) -> None:
    if rescaled[0]:
        raise error("backward_after_end", step=step)


def _written(
    strays: Iterable[tuple[torch.Tensor, torch.Tensor | None, int]],
) -> list[torch.Tensor]:
    """The strays whose gradient the step wrote: one made, replaced or changed in place since
    a loss that reached them was scaled. A gradient left from before the step, which a
    backward that skips them (``backward(inputs=...)``) does not touch, is not the step's."""
    written = []
    for stray, grad, version in strays:
        now, now_version = _torch.gradient_version(stray)
        if now is not grad or now_version != version:
            written.append(stray)
    return written


def _shapes(tensors: list[torch.Tensor]) -> str:
    """The shapes of ``tensors`` (a DTensor's: the whole tensor's), for an error message."""
    return ", ".join(str(tuple(p.shape)) for p in tensors)


def _weights(rows: list[Any], device: torch.device) -> tuple[list[bool] | None, Rows]:
    """Each term's weights (numbers, or a 1-D tensor) as a float64 tensor on ``device``;
    where all are numbers, also whether each microbatch's are positive."""
    if not all(isinstance(row, list) for row in rows):
        return None, tuple(
            torch.as_tensor(r).to(device, torch.float64, non_blocking=True) for r in rows
        )
    positive = [all(weights) for weights in zip(*rows, strict=True)]  # a weight is 0 or more
    return positive, tuple(_torch.float64s(row, device) for row in rows)


def _guarded(loss: torch.Tensor, weight: Count) -> torch.Tensor:
    """``loss``, or where ``weight`` is 0, exactly nothing of it (not even a NaN of 0/0)."""
    if not isinstance(weight, (int, float)):
        return torch.where(weight > 0, loss, 0.0)
    return loss if weight > 0 else torch.where(torch.zeros_like(loss, dtype=torch.bool), loss, 0.0)


def _contributions(
    losses: Iterable[torch.Tensor], weights: Iterable[torch.Tensor], terms: tuple[Term, ...]
) -> torch.Tensor:
    """Each term's sum of loss contributions over its microbatches, one row each."""
    rows = [
        weighting.loss_contribution(loss, weight, term.loss_reduction).sum()
        for loss, weight, term in zip(losses, weights, terms, strict=True)
    ]
    return rows[0].reshape(1) if len(rows) == 1 else torch.stack(rows)


def weights_agree(first: Count, second: Count) -> Any:
    """Whether two weight sums of one microbatch agree to within the round-off of the less
    precise: a relative tolerance of the square root of its machine epsilon (1.5e-8 for
    float64 and Python numbers, 3.5e-4 for float32, 0.031 for float16, 0.088 for bfloat16),
    which a sum taken in another order or at another precision stays within. A bool of two
    numbers, else a 0-dim tensor on the tensor's device."""
    tensors = [t for t in (first, second) if isinstance(t, torch.Tensor)]
    eps = max([torch.finfo(t.dtype).eps for t in tensors], default=0.0)
    tolerance = max(eps, torch.finfo(torch.float64).eps) ** 0.5
    if not tensors:
        return math.isclose(first, second, rel_tol=tolerance)
    device = tensors[0].device
    mine, theirs = (torch.as_tensor(t, dtype=torch.float64).to(device) for t in (first, second))
    return torch.isclose(mine, theirs, rtol=tolerance, atol=0)


def accelerator_of(what: str, devices: Iterable[torch.device]) -> torch.device:
    """The one non-CPU device among ``devices``, or the CPU if there is none."""
    accelerators = {device for device in devices if device.type != "cpu"}
    if len(accelerators) > 1:
        raise error("devices_differ", what=what, devices=sorted(map(str, accelerators)))
    return accelerators.pop() if accelerators else torch.device("cpu")


def reduction_device(collective: Collective, counts: Mapping[str, object]) -> torch.device:
    """Where a step's counts are reduced: on the accelerator that holds count tensors (moving
    them would wait for it), else on the collective's device."""
    tensors = {name: c for name, c in counts.items() if isinstance(c, torch.Tensor)}
    device = accelerator_of("num_samples and num_tokens", (c.device for c in tensors.values()))
    if device.type == "cpu":
        return collective.device
    if not collective.can_reduce_on(device):
        name = next(ARGUMENTS[n] for n, c in tensors.items() if c.device == device)
        raise error("cannot_reduce_on", name=name, device=device, reduces=collective.device.type)
    return device


# This process's open scale-after steps, whose parameters' gradients end() rescales: no other
# Accumulator's loss may reach one. A step leaves when it closes or is collected.
_OPEN: weakref.WeakSet[ScaleAfter] = weakref.WeakSet()
_OPEN_LOCK = threading.Lock()  # other threads' steps open and close meanwhile


def not_into_another_step(losses: Losses, own: object) -> None:
    """Refuse a loss whose backward reaches the parameters of another Accumulator's open
    scale-after step: that step's end() would rescale its gradient too."""
    # Never in a graph: dynamo would guard on the set, and a graph has no autograd graph.
    if torch.compiler.is_compiling() or len(_OPEN) <= isinstance(own, ScaleAfter):
        return
    with _OPEN_LOCK:
        steps = list(_OPEN)
    for step in steps:
        if step is not own and _torch.reaches(losses, step.parameters):
            raise error("into_another_step")
