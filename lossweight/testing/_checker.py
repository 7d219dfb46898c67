"""The split-invariance checker: does a training step give the gradient and the logged loss of
the whole batch, however its examples are split into microbatches and ranks?"""

from __future__ import annotations

import copy
import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..collectives import Collective, ProcessGroupCollective, SingleProcess
from ..errors import error
from ..result import StepResult
from ..weighting import GradReduction, gradient_divisor
from ._group import InProcessGroup

Step = Callable[..., Any]
Logged = dict[str, float]
Gradients = list[torch.Tensor]

# The worlds the default splits simulate in one process.
SIMULATED_WORLD_SIZES = (1, 2, 3)
# Modules that draw random numbers in train mode, as many as the microbatch's shape asks for:
# no two splits draw the same, whatever their weighting. Every run puts them in eval mode.
RANDOM_IN_TRAINING = (
    torch.nn.Dropout,
    torch.nn.Dropout1d,
    torch.nn.Dropout2d,
    torch.nn.Dropout3d,
    torch.nn.AlphaDropout,
    torch.nn.FeatureAlphaDropout,
    torch.nn.RReLU,
)
# Modules whose train-mode output depends on which examples share a microbatch, by design: a
# difference between splits would be theirs, not the weighting's, so the checker refuses them.
BATCH_STATISTICS = (torch.nn.modules.batchnorm._BatchNorm,)


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


@dataclass(frozen=True)
class ContextShard:
    """The part of every sequence a simulated context-parallel rank holds: ``rank`` of
    ``size`` ranks, which cut each sequence into ``size`` contiguous pieces, as
    ``tensor_split`` does (the first pieces one position longer where the length does not
    divide). The reference holds the whole sequence: ``ContextShard(0, 1)``."""

    rank: int
    size: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise error("context_shard", rank=self.rank, size=self.size)

    def positions(self, length: int) -> slice:
        """The positions of a sequence of ``length`` this rank holds."""
        quotient, remainder = divmod(length, self.size)
        start = self.rank * quotient + min(self.rank, remainder)
        return slice(start, start + quotient + (self.rank < remainder))


def _minimum_examples(world_size: int | None) -> int:
    """How many examples the default splits need: ``world_size + 2``, for a rank of two
    microbatches of different sizes beside ranks of one example each."""
    return max(_world_sizes(world_size)) + 2


def default_splits(
    counts: Sequence[int], *, world_size: int | None = None, empty_microbatches: bool = True
) -> list[Split]:
    """Splits of ``len(counts)`` examples that break naive weighting, from each example's count
    (the number of items its loss covers: tokens, or 1 for a sample).

    For each world size, 1, 2 and 3 ranks by default or ``world_size`` ranks alone: uneven
    microbatches on one rank, and with several ranks, ranks sorted by count and one rank of a
    single large example beside ranks of many small ones; unless ``empty_microbatches=False``
    (for loops that cannot run an empty microbatch), an empty microbatch, and with several
    ranks a rank with no items and a rank with no microbatch.

    Raises:
        ValueError: with fewer than ``world_size + 2`` examples (5 by default), too few to
            build every split; a split left out would leave its bug unchecked.
    """
    sizes = _world_sizes(world_size)
    needed = _minimum_examples(world_size)
    if len(counts) < needed:
        raise error("too_few_counts", count=len(counts), worlds=_worlds(sizes), needed=needed)
    return [
        Split.of(f"{_worlds([size])}: {name}", ranks)
        for size in sizes
        for name, ranks in _splits_of(counts, size, empty_microbatches)
    ]


def _world_sizes(world_size: int | None) -> tuple[int, ...]:
    if world_size is None:
        return SIMULATED_WORLD_SIZES
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise error("simulated_world_size", value=world_size)
    return (world_size,)


def _worlds(sizes: Sequence[int]) -> str:
    if len(sizes) == 1:
        return f"{sizes[0]} rank{'' if sizes[0] == 1 else 's'}"
    return f"{', '.join(map(str, sizes[:-1]))} and {sizes[-1]} ranks"


def _splits_of(
    counts: Sequence[int], world_size: int, empty_microbatches: bool
) -> list[tuple[str, list[list[list[int]]]]]:
    n = len(counts)
    order = list(range(n))
    small_first = sorted(order, key=lambda index: counts[index])
    # Rank 0 holds what the other ranks, of one example each, leave: 3 examples or more.
    kept = n - (world_size - 1)
    others = _spread(order[kept:], world_size - 1)
    cases = [("uneven microbatches", [[order[:1], order[1:kept]], *others])]
    if world_size > 1:
        cases.append(("sorted by count", _spread(small_first, world_size)))
        singles = [[[i] for i in part] for [part] in _spread(small_first[:-1], world_size - 1)]
        cases.append(
            ("one large example, the other ranks single ones", [[small_first[-1:]], *singles])
        )
    if empty_microbatches:
        half = kept // 2
        cases.append(("an empty microbatch", [[order[:half], [], order[half:kept]], *others]))
    if empty_microbatches and world_size > 1:
        empty = [i for i in order if counts[i] == 0]
        full = [i for i in order if counts[i] != 0]
        if empty and len(full) >= world_size - 1:
            cases.append(("a rank with no items", [*_spread(full, world_size - 1), [empty]]))
        else:
            cases.append(("a rank with no items", [*_spread(order, world_size - 1), [[]]]))
        cases.append(("a rank with no microbatch", [*_spread(order, world_size - 1), []]))
    return cases


def _spread(items: list[int], ranks: int) -> list[list[list[int]]]:
    """``items`` in order over ``ranks`` ranks of one microbatch each, the later ones larger by
    at most one."""
    if ranks == 0:
        return []
    size, larger = divmod(len(items), ranks)
    parts, start = [], 0
    for rank in range(ranks):
        end = start + size + (rank >= ranks - larger)
        parts.append([items[start:end]])
        start = end
    return parts


@dataclass
class _Run:
    gradients: Gradients
    losses: list[Logged | None]


class _Checker:
    """Runs a user's step on splits of their examples, and explains a difference."""

    def __init__(
        self,
        step: Step,
        model: torch.nn.Module,
        examples: Sequence[Any],
        weights: list[int],
        collate: Callable[[list[Any]], Any],
        grad_reduction: GradReduction | float,
        rtol: float,
        context_parallel: int | None = None,
    ) -> None:
        self.step, self.model, self.examples, self.collate = step, model, examples, collate
        self.weights, self.context_parallel = weights, context_parallel
        self.grad_reduction, self.rtol = grad_reduction, rtol
        # Frozen parameters get no gradient in any run: there is nothing of theirs to compare.
        self.names = [name for name, p in model.named_parameters() if p.requires_grad]
        self.random = [
            f"{name!r} ({type(module).__name__})"
            for name, module in model.named_modules()
            if isinstance(module, RANDOM_IN_TRAINING) and module.training
        ]
        self.distributed = _distributed()
        self._before = _state(model)

    def run(self, split: Split, whole_sequences: bool = False) -> _Run:
        """The split's step: each rank on its own copy of the model, the ranks' gradients
        combined as a data-parallel wrapper combines them (summed, then divided by ``D``);
        ``whole_sequences``: each rank holds whole sequences, however many context-parallel
        ranks the check simulates."""
        if self.distributed:
            return self._run_distributed(split)
        # Each data-parallel rank of the split as `cp` ranks that hold the same microbatches,
        # each its shard of every sequence; the wrapper reduces over all of them.
        cp = 1 if whole_sequences else self.context_parallel or 1
        if len(split.ranks) * cp == 1:
            ranks = [self.rank(split.ranks[0], SingleProcess())]
        else:
            group = InProcessGroup(len(split.ranks) * cp)
            ranks = group.run(
                lambda rank, collective: self.rank(
                    split.ranks[rank // cp], collective, ContextShard(rank % cp, cp)
                )
            )
        return _Run(self._combine([grads for grads, _ in ranks]), [loss for _, loss in ranks])

    def rank(
        self,
        microbatches: Sequence[Sequence[int]],
        collective: Collective,
        shard: ContextShard = ContextShard(0, 1),
    ) -> tuple[Gradients, Logged | None]:
        """One rank's step on a copy of the model (given its ``shard`` of every sequence if
        the ranks are context-parallel): its gradients (float64) and logged loss."""
        replica = copy.deepcopy(self.model)
        for module in replica.modules():
            if isinstance(module, RANDOM_IN_TRAINING):
                module.eval()
        replica.zero_grad(set_to_none=True)
        batches = [self.collate([self.examples[i] for i in mb]) for mb in microbatches]
        shards = () if self.context_parallel is None else (shard,)
        logged = _logged(self.step(replica, batches, collective, *shards))
        parameters = dict(replica.named_parameters())
        grads = [
            (p.grad if p.grad is not None else torch.zeros_like(p)).detach().to(torch.float64)
            for p in (parameters[name] for name in self.names)
        ]
        return grads, logged

    def reference(self) -> tuple[_Run, Exception | None]:
        """The whole batch in one microbatch on one rank, run twice; and why nothing can be
        compared to it, if so."""
        whole = [list(range(len(self.examples)))]
        runs = []
        for _ in range(2):
            grads, logged = self.rank(whole, SingleProcess())
            changed = self.changed()
            if changed:
                return _Run(grads, [logged]), changed
            runs.append(_Run(grads, [logged]))
        first, second = runs
        if not all(bool(torch.isfinite(g).all()) for g in first.gradients):
            return first, error("reference_not_finite")
        if not any(bool(g.ne(0).any()) for g in first.gradients):
            return first, error("reference_no_gradient")
        difference = _difference(self, second, first)
        if difference:
            known = (
                f" (the checker already runs {', '.join(self.random)} in eval mode)"
                if self.random
                else ""
            )
            return first, error("not_deterministic", difference=difference, known=known)
        return first, None

    def changed(self) -> Exception | None:
        """Why the model given to the checker is no longer as it was, if it is not."""
        for (what, before), (_, now) in zip(self._before, _state(self.model), strict=True):
            if not _same(before, now):
                return error("model_changed", what=what)
        return None

    def agreed(self, problem: Exception | None) -> Exception | None:
        """``problem``, or under torch.distributed the first one any process found: all fail
        together, where one failing alone would leave the others waiting in a collective."""
        if not self.distributed:
            return problem
        return next((found for found in _gathered(problem) if found is not None), None)

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
        return _Run(grads, _gathered(logged))


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
    context_parallel: int | None = None,
) -> None:
    """Check that ``step`` gives the gradient and the logged loss of the whole batch however
    ``examples`` are split into microbatches and data-parallel ranks.

    Args:
        step: ``step(model, microbatches, collective)`` runs one optimizer step's forward and
            backward passes on one rank (not ``optimizer.step()``) on the model it is given
            and returns its logged loss: a number, a 0-dim tensor, a
            :class:`~lossweight.StepResult` (with several terms, each term's loss is checked
            too), a dict of numbers or tensors by name (each checked), or None to check the
            gradient only. A step that uses lossweight reduces over ``collective``:
            ``Accumulator(..., collective=collective)``.
        model: the model at the start of the step; each run uses a copy, and the step must
            leave ``model`` itself as it is.
        examples: the examples of one step: at least ``W + 2`` for the default splits of
            ``W`` ranks (5 for the simulated ones, of 1, 2 and 3 ranks), at least 2 for
            ``splits`` of one's own.
        collate: makes one microbatch from a list of examples (an empty list included, unless
            the splits have no empty microbatch).
        counts: each example's count, the number of items its loss covers (its tokens); by
            default 1 each (samples). The default splits are built from them.
        splits: the splits to check, each holding every example once; by default
            :func:`default_splits` of the counts.
        grad_reduction: how the data-parallel wrapper combines the ranks' gradients:
            ``"mean"`` (DDP and FSDP), ``"sum"``, or the number it divides their sum by.
        rtol: the largest relative difference allowed, of the gradient (relative to its
            largest entry) and of the logged loss.
        context_parallel: simulate each data-parallel rank as this many context-parallel
            ranks, which hold the same microbatches and each a :class:`ContextShard` of every
            sequence: the step is then called as ``step(model, microbatches, collective,
            shard)``, and keeps the positions ``shard.positions(length)`` of each sequence (the
            reference gets them all). ``collective`` spans every rank of the data and context
            dimensions, whose gradients are combined as DDP over both flattened combines
            them. In one process only.

    The reference is ``step`` on one rank with every example in one microbatch, run twice:
    it must give the same gradient twice, and a nonzero one, else nothing could be compared.
    The gradients compared are those of the parameters that require one (a frozen layer has
    none). Dropout and RReLU draw random numbers as the microbatch's shape asks, so every run
    puts them in eval mode (a report of a difference names them); batch norm in train mode
    normalizes each microbatch by its own statistics, so the step's gradient depends on the
    split by design and the checker refuses it.

    A split's ranks are simulated in this process (an :class:`InProcessGroup`), or, when
    torch.distributed is initialized with ``W > 1`` processes (under torchrun), are the real
    ranks: then every split has ``W`` ranks (the default ones are :func:`default_splits` of
    ``world_size=W``), and every process calls this with the same arguments. It works on any
    loop, with or without lossweight, so it can diagnose an existing trainer.

    Raises:
        ValueError: on arguments that cannot make a check: too few examples, not one count
            (0 or more) per example, an ``rtol`` that is not a finite number of 0 or more, an
            empty list of splits or splits that all are the reference, a split that does not
            hold every example once or (under torch.distributed) has other than ``W`` ranks,
            batch norm in train mode, no parameter requiring a gradient, or processes called
            with different examples, counts or splits.
        AssertionError: when the check compares nothing (the step leaves no gradient on the
            model it is given, or trains the ``model`` argument itself), when the step is not
            deterministic, and with a report of every split that differs: how far off the
            gradient is and where, what each rank logged, and the likely cause.
    """
    weights = _counts(counts, examples)
    world_size = dist.get_world_size() if _distributed() else None
    _check_context_parallel(context_parallel, world_size)
    if world_size is not None:
        _agree(examples, weights, splits)
    chosen = _chosen(splits, weights, world_size)
    _check_model(model, rtol)
    checker = _Checker(
        step, model, examples, weights, collate, grad_reduction, rtol, context_parallel
    )
    reference, problem = checker.reference()
    problem = checker.agreed(problem)
    if problem:
        raise problem
    problems = []
    for split in chosen:
        run = checker.run(split)
        problem = checker.agreed(checker.changed())
        if problem:
            raise problem
        difference = _difference(checker, run, reference)
        sharded = True
        if difference and (checker.context_parallel or 1) > 1:
            # Blamed on the sharding only where the same split of whole sequences passes.
            whole = checker.run(split, whole_sequences=True)
            if _difference(checker, whole, reference):
                run, sharded = whole, False
                difference += "; so with each rank holding whole sequences too"
        if difference:
            cause = _likely_cause(checker, split, run, reference, sharded)
            problems.append(f"- {split}:\n    {difference}\n    likely cause: {cause}")
    if problems:
        logged = reference.losses[0]
        loss = "" if logged is None else f" (logged loss {_shown(logged)})"
        random = (
            f"\n{', '.join(checker.random)} ran in eval mode in every run: dropout's mask "
            "depends on the microbatch's shape, so no two splits would draw the same"
            if checker.random
            else ""
        )
        raise error(
            "split_dependent",
            examples=len(examples),
            differing=len(problems),
            splits=len(chosen),
            loss=loss,
            problems="\n".join(problems),
            random=random,
        )


def _check_context_parallel(context_parallel: object, world_size: int | None) -> None:
    if context_parallel is None:
        return
    if isinstance(context_parallel, bool) or not isinstance(context_parallel, int):
        raise error("context_parallel_type", value=context_parallel)
    if context_parallel < 1:
        raise error("context_parallel_size", value=context_parallel)
    if world_size is not None:
        raise error("context_parallel_processes", value=context_parallel, world_size=world_size)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _counts(counts: Sequence[int] | None, examples: Sequence[Any]) -> list[int]:
    weights = list(counts) if counts is not None else [1] * len(examples)
    if len(weights) != len(examples):
        raise error("counts_per_example", counts=len(weights), examples=len(examples))
    negative = [(i, c) for i, c in enumerate(weights) if c < 0]
    if negative:
        index, count = negative[0]
        raise error("example_count_negative", index=index, value=count)
    return weights


def _chosen(
    splits: Sequence[Split] | None, weights: list[int], world_size: int | None
) -> list[Split]:
    """The splits to run, checked: each can run, and together they compare something."""
    n = len(weights)
    if splits is None:
        needed = _minimum_examples(world_size)
        if n < needed:
            worlds = _worlds(_world_sizes(world_size))
            raise error("too_few_examples", count=n, worlds=worlds, needed=needed)
        return default_splits(weights, world_size=world_size)
    if n < 2:
        raise error("one_example", count=n)
    chosen = list(splits)
    if not chosen:
        raise error("no_splits")
    for index, split in enumerate(chosen):
        _check_split(index, split, n, world_size)
    if all(len(split.ranks) == 1 and len(split.ranks[0]) == 1 for split in chosen):
        raise error("only_the_reference")
    return chosen


def _check_split(index: int, split: object, n: int, world_size: int | None) -> None:
    if not isinstance(split, Split):
        raise error("not_a_split", index=index, kind=type(split).__name__)
    held = Counter(i for rank in split.ranks for mb in rank for i in mb)
    wrong = [
        f"{what} {found}"
        for what, found in (
            ("misses", [i for i in range(n) if i not in held]),
            ("holds more than once", sorted(i for i in held if held[i] > 1 and 0 <= i < n)),
            ("holds what is no example", sorted(i for i in held if not 0 <= i < n)),
        )
        if found
    ]
    if wrong:
        raise error(
            "split_examples", index=index, name=split.name, last=n - 1, wrong=", ".join(wrong)
        )
    if world_size is not None and len(split.ranks) != world_size:
        worlds = _worlds([len(split.ranks)])
        raise error(
            "split_ranks", index=index, name=split.name, worlds=worlds, world_size=world_size
        )


def _check_model(model: torch.nn.Module, rtol: float) -> None:
    if isinstance(rtol, bool) or not isinstance(rtol, int | float) or not 0 <= rtol < math.inf:
        raise error("bad_rtol", value=rtol)
    normalized = [
        f"{name!r} ({type(module).__name__})"
        for name, module in model.named_modules()
        if isinstance(module, BATCH_STATISTICS) and module.training
    ]
    if normalized:
        raise error("batch_norm", modules=", ".join(normalized))
    if not any(p.requires_grad for p in model.parameters()):
        raise error("nothing_trainable")


def _agree(examples: Sequence[Any], weights: list[int], splits: Sequence[Split] | None) -> None:
    """Every process must check the same splits of as many examples: else their collectives
    would pair up wrongly, or hang."""
    mine = {
        "examples": len(examples),
        "counts": weights,
        "splits": None if splits is None else list(splits),
    }
    for rank, theirs in enumerate(_gathered(mine)):
        differ = [name for name in mine if theirs[name] != mine[name]]
        if differ:
            raise error(
                "checks_differ", rank=rank, differ=" and ".join(differ), own=dist.get_rank()
            )


def _gathered(value: Any) -> list[Any]:
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def _state(model: torch.nn.Module) -> list[tuple[str, torch.Tensor | None]]:
    """Copies of everything of the model a step could change."""
    return [
        *((f"parameter {n!r}", p.detach().clone()) for n, p in model.named_parameters()),
        *((f"buffer {n!r}", b.detach().clone()) for n, b in model.named_buffers()),
        *(
            (f"the .grad of {n!r}", None if p.grad is None else p.grad.detach().clone())
            for n, p in model.named_parameters()
        ),
    ]


def _same(before: torch.Tensor | None, now: torch.Tensor | None) -> bool:
    if before is None or now is None:
        return before is None and now is None
    return (
        before.shape == now.shape
        and before.dtype == now.dtype
        and bool(torch.isclose(before, now, rtol=0.0, atol=0.0, equal_nan=True).all())
    )


def _logged(logged: object) -> Logged | None:
    """What a step logged, by name: ``{"loss": value}`` for a number or a 0-dim tensor; a
    StepResult's loss, and each term's where it has several; a dict's values, by its keys."""
    if logged is None:
        return None
    if isinstance(logged, StepResult):
        terms = logged.losses if len(logged.losses) > 1 else {}
        logged = {"loss": logged.loss, **{f"losses[{n!r}]": v for n, v in terms.items()}}
    if not isinstance(logged, Mapping):
        logged = {"loss": logged}
    return {
        str(name): float(value.detach() if isinstance(value, torch.Tensor) else value)  # type: ignore[arg-type]
        for name, value in logged.items()
    }


def _shown(logged: Logged | None) -> str:
    if logged is None or set(logged) == {"loss"}:
        return "None" if logged is None else f"{logged['loss']:.6g}"
    return "{" + ", ".join(f"{name}: {value:.6g}" for name, value in logged.items()) + "}"


def _close(logged: Logged | None, expected: Logged, rtol: float) -> bool:
    return (
        logged is not None
        and logged.keys() == expected.keys()
        and all(
            math.isclose(logged[name], value, rel_tol=rtol, abs_tol=1e-12)
            for name, value in expected.items()
        )
    )


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
    if expected is not None and not all(
        _close(loss, expected, checker.rtol) for loss in run.losses
    ):
        shown = ", ".join(map(_shown, run.losses))
        found.append(f"the ranks logged {shown} instead of {_shown(expected)}")
    return "; ".join(found)


def _likely_cause(
    checker: _Checker, split: Split, run: _Run, reference: _Run, sharded: bool = True
) -> str:
    if not all(bool(torch.isfinite(g).all()) for g in run.gradients):
        return (
            "an empty microbatch's mean over zero items (0 / 0) reached the gradient; guard "
            "it, or use a summed loss (lossweight's scale_loss() guards it)"
        )
    if _relative_error(run.gradients, reference.gradients)[0] <= checker.rtol:
        return (
            "the gradient agrees, the logged loss does not: it is not the step's loss over "
            "every microbatch and rank (log lossweight's result.loss, or reduce the loss sum "
            "and the count over the ranks before dividing one by the other)"
        )
    world_size, cp = len(split.ranks), (checker.context_parallel or 1) if sharded else 1
    factor = _proportion(run.gradients, reference.gradients)
    if cp > 1 and factor is not None and math.isclose(factor * cp, 1.0, rel_tol=1e-3):
        return (
            f"the gradient is 1/{cp} of the reference: each context-parallel rank counts the "
            "items of whole sequences, where it holds a shard of each (count the positions "
            "this rank holds)"
        )
    if cp > 1 and not (factor is not None and math.isclose(factor, 1.0, rel_tol=checker.rtol)):
        return (
            "the context-parallel ranks' shards do not add up to the whole sequences: each "
            "rank must count and weigh what it holds of each sequence (a mean over a "
            "sequence's tokens divides by the whole sequence's count, as "
            "lossweight.aggregate(..., positions=...) does), or the gradient of the shards "
            "is not reduced over the context-parallel ranks"
        )
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
    # A loop that reduces nothing over the ranks looks rank-local whatever it does within a
    # rank; where a rank's microbatches hold different counts, a naive one shows itself.
    uneven = any(
        len({sum(checker.weights[i] for i in mb) for mb in rank}) > 1 for rank in split.ranks
    )
    if looks_naive and (uneven or not looks_local):
        return (
            "every microbatch weighs the same whatever its count: this is what "
            "loss / accumulation_steps gives (weight each microbatch by its count against "
            "the step's total)"
        )
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
    return (
        "the microbatches are weighted by counts other than those of the items their losses "
        "cover (padding counted, or the first position of shifted rows, counted without the "
        "loss's shift), or a summed loss passed with loss_reduction='mean' (or a mean with "
        "'sum'), or by something else that depends on the split"
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
