"""The split-invariance checker: does a training step give the gradient and the logged loss of
the whole batch, however its examples are split into microbatches and ranks?"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..collectives import Collective, ProcessGroupCollective, SingleProcess
from ..result import StepResult
from ..weighting import GradReduction, gradient_divisor
from ._group import InProcessGroup

Step = Callable[[torch.nn.Module, list[Any], Collective], Any]
Gradients = list[torch.Tensor]


@dataclass(frozen=True)
class Split:
    """How one step's examples are split: ``ranks[r][i]`` lists the indices of the examples in
    microbatch ``i`` of rank ``r``. A microbatch may be empty, and a rank may have none."""

    name: str
    ranks: tuple[tuple[tuple[int, ...], ...], ...]

    @classmethod
    def of(cls, name: str, ranks: Sequence[Sequence[Sequence[int]]]) -> Split:
        return cls(name, tuple(tuple(tuple(mb) for mb in rank) for rank in ranks))

    def __str__(self) -> str:
        sizes = " ".join(f"[{', '.join(str(len(mb)) for mb in rank)}]" for rank in self.ranks)
        return f"{self.name!r}, examples per microbatch of each rank: {sizes}"


def default_splits(counts: Sequence[int], *, empty_microbatches: bool = True) -> list[Split]:
    """Splits of ``len(counts)`` examples that break naive weighting, from each example's count
    (the number of items its loss covers: tokens, or 1 for a sample).

    Uneven microbatches on one rank, ranks holding very different numbers of items, and, unless
    ``empty_microbatches=False`` (for loops that cannot run an empty microbatch), an empty
    microbatch, a rank with no items and a rank with no microbatch. Splits that need more
    examples than there are are left out.
    """
    n = len(counts)
    order = list(range(n))
    small_first = sorted(order, key=lambda index: counts[index])
    candidates = []
    if n >= 3:
        candidates.append(("uneven microbatches", [[order[:1], order[1:-1], order[-1:]]]))
        candidates.append(
            (
                "one large rank, one of single examples",
                [[small_first[-1:]], [[i] for i in small_first[:-1]]],
            )
        )
    if n >= 2:
        half = n // 2
        candidates.append(
            ("2 ranks, sorted by count", [[small_first[:half]], [small_first[half:]]])
        )
    if n >= 4:
        candidates.append(
            (
                "3 ranks, uneven",
                [[small_first[:1], small_first[1:2]], [small_first[2:-1]], [small_first[-1:]]],
            )
        )
    if empty_microbatches and n >= 2:
        candidates.append(("an empty microbatch", [[order[: n // 2], [], order[n // 2 :]]]))
        empty = [i for i in order if counts[i] == 0]
        full = [i for i in order if counts[i] != 0]
        no_items = [empty] if empty and full else [[]]
        rest = full if empty and full else order
        candidates.append(("a rank with no items", [[rest[:1], rest[1:]], no_items]))
        candidates.append(("a rank with no microbatch", [[order[1:], order[:1]], []]))
    return [Split.of(name, ranks) for name, ranks in candidates]


@dataclass
class _Run:
    gradients: Gradients
    losses: list[float | None]


class _Checker:
    """Runs a user's step on splits of their examples, and explains a difference."""

    def __init__(
        self,
        step: Step,
        model: torch.nn.Module,
        examples: Sequence[Any],
        collate: Callable[[list[Any]], Any],
        grad_reduction: GradReduction | float,
        rtol: float,
    ) -> None:
        self.step, self.model, self.examples, self.collate = step, model, examples, collate
        self.grad_reduction, self.rtol = grad_reduction, rtol
        self.names = [name for name, _ in model.named_parameters()]
        self.distributed = (
            dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        )

    def run(self, split: Split) -> _Run:
        """The split's step: each rank on its own copy of the model, the ranks' gradients
        combined as a data-parallel wrapper combines them (summed, then divided by ``D``)."""
        if self.distributed:
            return self._run_distributed(split)
        if len(split.ranks) == 1:
            ranks = [self.rank(split.ranks[0], SingleProcess())]
        else:
            group = InProcessGroup(len(split.ranks))
            ranks = group.run(lambda rank, collective: self.rank(split.ranks[rank], collective))
        return _Run(self._combine([grads for grads, _ in ranks]), [loss for _, loss in ranks])

    def rank(
        self, microbatches: Sequence[Sequence[int]], collective: Collective
    ) -> tuple[Gradients, float | None]:
        """One rank's step on a copy of the model: its gradients (float64) and logged loss."""
        replica = copy.deepcopy(self.model)
        replica.zero_grad(set_to_none=True)
        batches = [self.collate([self.examples[i] for i in mb]) for mb in microbatches]
        logged = _as_float(self.step(replica, batches, collective))
        grads = [
            (p.grad if p.grad is not None else torch.zeros_like(p)).detach().to(torch.float64)
            for p in replica.parameters()
        ]
        return grads, logged

    def alone(self, microbatches: Sequence[Sequence[int]]) -> Gradients:
        """The gradient of these microbatches as a step of their own, on one rank; zero where
        it is not finite (the mean of an empty microbatch)."""
        grads, _ = self.rank(microbatches, SingleProcess())
        return [torch.nan_to_num(g, nan=0.0, posinf=0.0, neginf=0.0) for g in grads]

    def _combine(self, per_rank: list[Gradients]) -> Gradients:
        divisor = gradient_divisor(self.grad_reduction, len(per_rank))
        return [torch.stack(parts).sum(0) / divisor for parts in zip(*per_rank, strict=True)]

    def _run_distributed(self, split: Split) -> _Run:
        grads, logged = self.rank(split.ranks[dist.get_rank()], ProcessGroupCollective())
        divisor = gradient_divisor(self.grad_reduction, dist.get_world_size())
        for grad in grads:
            dist.all_reduce(grad)
            grad /= divisor
        losses: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(losses, logged)
        return _Run(grads, losses)


def assert_split_invariant(
    step: Step,
    model: torch.nn.Module,
    examples: Sequence[Any],
    collate: Callable[[list[Any]], Any],
    *,
    counts: Sequence[int] | None = None,
    splits: Sequence[Split] | None = None,
    grad_reduction: GradReduction | float = "mean",
    rtol: float = 1e-5,
) -> None:
    """Check that ``step`` gives the gradient and the logged loss of the whole batch however
    ``examples`` are split into microbatches and data-parallel ranks.

    Args:
        step: ``step(model, microbatches, collective)`` runs one optimizer step's forward and
            backward passes on one rank (not ``optimizer.step()``) and returns its logged loss:
            a number, a 0-dim tensor, a :class:`~lossweight.StepResult`, or None to check the
            gradient only. A step that uses lossweight reduces over ``collective``:
            ``Accumulator(..., collective=collective)``.
        model: the model at the start of the step; each run uses a copy.
        examples: the examples of one step.
        collate: makes one microbatch from a list of examples (an empty list included, unless
            the splits have no empty microbatch).
        counts: each example's count, the number of items its loss covers (its tokens); by
            default 1 each (samples). The default splits are built from them.
        splits: the splits to check; by default :func:`default_splits` of the counts.
        grad_reduction: how the data-parallel wrapper combines the ranks' gradients:
            ``"mean"`` (DDP and FSDP), ``"sum"``, or the number it divides their sum by.
        rtol: the largest relative difference allowed, of the gradient (relative to its
            largest entry) and of the logged loss.

    The reference is ``step`` on one rank with every example in one microbatch. A split's ranks
    are simulated in this process (an :class:`InProcessGroup`), or, when torch.distributed is
    initialized with more than one process (under torchrun), are the real ranks: then only the
    splits with that many ranks run, and every process calls this with the same arguments.
    It works on any loop, with or without lossweight, so it can diagnose an existing trainer.

    Raises:
        AssertionError: with a report of every split that differs: how far off the gradient
            is and where, what each rank logged, and the likely cause.
    """
    weights = list(counts) if counts is not None else [1] * len(examples)
    if len(weights) != len(examples):
        raise ValueError(
            f"counts has {len(weights)} entries but examples has {len(examples)}; give one "
            "count per example"
        )
    checker = _Checker(step, model, examples, collate, grad_reduction, rtol)
    chosen = list(splits) if splits is not None else default_splits(weights)
    if checker.distributed:
        chosen = [split for split in chosen if len(split.ranks) == dist.get_world_size()]
    grads, logged = checker.rank([list(range(len(examples)))], SingleProcess())
    reference = _Run(grads, [logged])
    problems = []
    for split in chosen:
        run = checker.run(split)
        difference = _difference(checker, run, reference)
        if difference:
            cause = _likely_cause(checker, split, run, reference)
            problems.append(f"- {split}:\n    {difference}\n    likely cause: {cause}")
    if problems:
        loss = "" if logged is None else f" (logged loss {logged:.6g})"
        raise AssertionError(
            f"the step depends on how its {len(examples)} examples are split: "
            f"{len(problems)} of {len(chosen)} splits differ from one microbatch on one "
            f"rank{loss}:\n" + "\n".join(problems)
        )


def _as_float(logged: object) -> float | None:
    if logged is None:
        return None
    if isinstance(logged, StepResult):
        logged = logged.loss
    if isinstance(logged, torch.Tensor):
        return float(logged.detach())
    return float(logged)  # type: ignore[arg-type]


def _relative_error(actual: Gradients, expected: Gradients) -> tuple[float, int]:
    """The largest difference relative to the largest expected entry, and the tensor where."""
    scale = max((float(e.abs().max()) for e in expected if e.numel()), default=0.0) or 1.0
    errors = [
        float((a - e).abs().max()) if e.numel() else 0.0
        for a, e in zip(actual, expected, strict=True)
    ]
    worst = max(range(len(errors)), key=errors.__getitem__)
    return errors[worst] / scale, worst


def _difference(checker: _Checker, run: _Run, reference: _Run) -> str:
    found = []
    if not all(bool(torch.isfinite(g).all()) for g in run.gradients):
        found.append("the gradient holds NaN or inf")
    else:
        error, worst = _relative_error(run.gradients, reference.gradients)
        if error > checker.rtol:
            found.append(
                f"the gradient is off by {error:.3g} of the reference's largest entry, most in "
                f"{checker.names[worst]!r}"
            )
    expected = reference.losses[0]
    if expected is not None and any(
        loss is None or not math.isclose(loss, expected, rel_tol=checker.rtol, abs_tol=1e-12)
        for loss in run.losses
    ):
        shown = ", ".join("None" if loss is None else f"{loss:.6g}" for loss in run.losses)
        found.append(f"the ranks logged {shown} instead of {expected:.6g}")
    return "; ".join(found)


def _likely_cause(checker: _Checker, split: Split, run: _Run, reference: _Run) -> str:
    if not all(bool(torch.isfinite(g).all()) for g in run.gradients):
        return (
            "an empty microbatch's mean over zero items (0 / 0) reached the gradient; guard "
            "it, or use a summed loss (lossweight's scale_loss() guards it)"
        )
    world_size = len(split.ranks)
    factor = _proportion(run.gradients, reference.gradients)
    if factor is not None and not math.isclose(factor, 1.0, rel_tol=checker.rtol):
        if world_size > 1 and math.isclose(factor * world_size, 1.0, rel_tol=1e-3):
            return (
                f"the gradient is 1/{world_size} of the reference: the data-parallel average "
                "over the ranks is not undone (with lossweight: grad_reduction must say how the "
                "wrapper combines the ranks)"
            )
        if world_size > 1 and math.isclose(factor, world_size, rel_tol=1e-3):
            return (
                f"the gradient is {world_size} times the reference: the ranks' gradients are "
                "summed where they are averaged, or the average is undone twice"
            )
        return f"the gradient is {factor:.4g} times the reference: a constant factor is wrong"
    divisor = gradient_divisor(checker.grad_reduction, world_size)
    naive = [
        torch.stack(parts).sum(0) / divisor
        for parts in zip(
            *(
                [g / len(rank) for g in _sum(checker.alone([mb]) for mb in rank)]
                for rank in split.ranks
                if rank
            ),
            strict=True,
        )
    ]
    local = [
        torch.stack(parts).sum(0) / divisor
        for parts in zip(*(checker.alone(rank) for rank in split.ranks if rank), strict=True)
    ]
    tolerance = max(checker.rtol, 1e-6)
    looks_naive = _relative_error(run.gradients, naive)[0] <= tolerance
    looks_local = world_size > 1 and _relative_error(run.gradients, local)[0] <= tolerance
    if looks_local:
        also = (
            " (with these microbatches, loss / accumulation_steps gives the same)"
            if looks_naive
            else ""
        )
        return (
            "each rank weights its microbatches against its own total: the count is not "
            f"reduced over the data-parallel ranks{also}"
        )
    if looks_naive:
        return (
            "every microbatch weighs the same whatever its count: this is what "
            "loss / accumulation_steps gives (weight each microbatch by its count against "
            "the step's total)"
        )
    return (
        "the microbatches are weighted by counts other than those of the items their losses "
        "cover (padding counted, or the first position of shifted rows), or by something else "
        "that depends on the split"
    )


def _sum(gradients: Any) -> Gradients:
    total: Gradients | None = None
    for grads in gradients:
        total = grads if total is None else [a + b for a, b in zip(total, grads, strict=True)]
    assert total is not None
    return total


def _proportion(actual: Gradients, expected: Gradients) -> float | None:
    """``c`` if ``actual`` is ``c * expected`` (to 1e-6), else None."""
    a = torch.cat([g.flatten() for g in actual])
    e = torch.cat([g.flatten() for g in expected])
    norm = float(e @ e)
    if norm == 0.0:
        return None
    factor = float(a @ e) / norm
    residual = float((a - factor * e).norm()) / math.sqrt(norm)
    return factor if residual <= 1e-6 else None
