"""The Accumulator on one process, and on ranks simulated by threads (see ranks.py)."""

from __future__ import annotations

import copy
import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from lossweight import Accumulator

from .problem import (
    IGNORE,
    Batch,
    make_batch,
    make_model,
    max_relative_error,
    microbatch_loss,
    reference,
    split,
)
from .ranks import run_ranks


@st.composite
def layouts(draw: st.DrawFn, weight_by: str) -> tuple[list[int], list[list[int]]]:
    """Row lengths of a step, and its rows split into ranks x microbatches (sizes in rows).

    Rows may be all padding (weighting by tokens), microbatches may hold no row, ranks may
    hold no microbatch or only empty ones, and the whole step may be empty.
    """
    min_length = 1 if weight_by == "samples" else 0  # a sample's loss is a mean over its tokens
    lengths = draw(st.lists(st.integers(min_length, 6), max_size=10))
    world_size = draw(st.integers(1, 4))
    per_rank = [draw(st.integers(0, 3)) for _ in range(world_size)]
    per_rank[0] = max(per_rank[0], 1)  # the rows must go somewhere
    slots = sum(per_rank)
    cuts = draw(st.lists(st.integers(0, len(lengths)), min_size=slots - 1, max_size=slots - 1))
    bounds = [0, *sorted(cuts), len(lengths)]
    sizes = [b - a for a, b in itertools.pairwise(bounds)]
    layout, first = [], 0
    for count in per_rank:
        layout.append(sizes[first : first + count])
        first += count
    return lengths, layout


def divisor_of(grad_reduction: object, world_size: int) -> float:
    return {"mean": world_size, "sum": 1}.get(grad_reduction, grad_reduction)  # type: ignore


def run_step(
    model: torch.nn.Module,
    batch: Batch,
    layout: list[list[int]],
    scale_after: bool = False,
    **options: object,
) -> tuple[list[torch.Tensor], list[float]]:
    """One step over simulated ranks: (the combined gradient, the loss each rank logged).

    Count first, or scale after: then each rank's gradients are rescaled by end() before they
    are combined, which is equivalent since every rank applies the same factor.
    """
    weight_by = str(options.get("weight_by", "tokens"))
    loss_reduction = str(options.get("loss_reduction", "mean"))
    world_size = len(layout)
    starts = split(batch.num_samples, [sum(sizes) for sizes in layout])

    def rank_step(rank: int, collective: object) -> tuple[list[torch.Tensor], float]:
        replica = copy.deepcopy(model)
        acc = Accumulator(collective=collective, **options)  # type: ignore[arg-type]
        begin, stop = starts[rank]
        microbatches = [
            batch.rows(begin + a, begin + b) for a, b in split(stop - begin, layout[rank])
        ]
        if scale_after:
            acc.begin()
        else:
            acc.begin(
                num_samples=[mb.num_samples for mb in microbatches],
                num_tokens=[mb.num_tokens for mb in microbatches],
            )
        for mb in microbatches:
            loss = microbatch_loss(replica, mb, weight_by, loss_reduction)
            counts = {"num_samples": mb.num_samples, "num_tokens": mb.num_tokens}
            acc.scale_loss(loss, **(counts if scale_after else {})).backward()
        result = acc.end(replica.parameters()) if scale_after else acc.end()
        grads = [
            p.grad if p.grad is not None else torch.zeros_like(p) for p in replica.parameters()
        ]
        return grads, result.loss.item()

    results = run_ranks(world_size, rank_step)
    divisor = divisor_of(options.get("grad_reduction", "mean"), world_size)
    combined = [
        sum(grads) / divisor for grads in zip(*(grads for grads, _ in results), strict=True)
    ]
    return combined, [loss for _, loss in results]


@settings(max_examples=400)
@given(
    st.sampled_from(["tokens", "samples"]).flatmap(
        lambda weight_by: st.tuples(st.just(weight_by), layouts(weight_by))
    ),
    st.sampled_from(["mean", "sum"]),
    st.sampled_from(["mean", "sum", 0.5, 3.0]),
    st.sampled_from(["on_read", "next_step"]),
    st.booleans(),
    st.integers(0, 2**16),
    st.booleans(),
    st.sampled_from([1.0, 7.0, 1e6]),
)
def test_gradient_and_logged_loss_do_not_depend_on_the_split(
    case: tuple[str, tuple[list[int], list[list[int]]]],
    loss_reduction: str,
    grad_reduction: object,
    loss_logging: str,
    left_padding: bool,
    seed: int,
    scale_after: bool,
    weight_estimate: float,
) -> None:
    weight_by, (lengths, layout) = case
    batch = make_batch(lengths, max_length=6, seed=seed, left_padding=left_padding)
    model = make_model(seed)
    expected_loss, expected_grads = reference(model, batch, weight_by)
    grads, losses = run_step(
        model,
        batch,
        layout,
        weight_by=weight_by,
        loss_reduction=loss_reduction,
        grad_reduction=grad_reduction,
        loss_logging=loss_logging,
        scale_after=scale_after,
        weight_estimate=weight_estimate,
    )
    assert max_relative_error(grads, expected_grads) < 1e-10
    assert all(math.isfinite(loss) for loss in losses)
    assert len(set(losses)) == 1, losses  # the same number on every rank
    assert losses[0] == pytest.approx(expected_loss, rel=1e-12, abs=1e-12)


def test_uneven_split_with_an_empty_microbatch_and_an_all_padding_rank() -> None:
    # A fixed case beside the generated ones: rank 1's rows are all padding, rank 0 has an
    # empty microbatch, and the plain loss / accumulation_steps would get it wrong.
    batch = make_batch([5, 1, 0, 0, 3, 2], max_length=6, seed=3, left_padding=False)
    batch.labels[2:4] = IGNORE
    model = make_model(3)
    expected_loss, expected_grads = reference(model, batch, "tokens")
    grads, losses = run_step(model, batch, [[2, 0], [2], [1, 1]], loss_reduction="mean")
    assert max_relative_error(grads, expected_grads) < 1e-12
    assert losses == [pytest.approx(expected_loss, rel=1e-12)] * 3


def one_param_step(acc: Accumulator, token_counts: list[int], loss_reduction: str) -> torch.Tensor:
    """Each microbatch's loss is ``k * x`` (k items of loss x, summed) or ``x`` (their mean)."""
    x = torch.zeros((), dtype=torch.float64, requires_grad=True)
    acc.begin(num_tokens=token_counts)
    for count in token_counts:
        loss = x * count if loss_reduction == "sum" else x * 1.0
        acc.scale_loss(loss).backward()
    return x.grad


@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
def test_scales_of_a_known_step(loss_reduction: str) -> None:
    acc = Accumulator(loss_reduction=loss_reduction)  # type: ignore[arg-type]
    acc.begin(num_tokens=[3, 0, 1])
    scales = [acc.backward_scale() for _ in range(3)]
    acc.end()
    expected = [0.75, 0.0, 0.25] if loss_reduction == "mean" else [0.25, 0.25, 0.25]
    assert [s.item() for s in scales] == expected
    assert all(s.dtype == torch.float64 and s.dim() == 0 for s in scales)
    # d/dx of the step's mean loss over 4 items of loss x is 1.
    assert one_param_step(acc, [3, 0, 1], loss_reduction).item() == pytest.approx(1.0)


def test_an_empty_mean_microbatch_leaks_no_nan() -> None:
    # torch's cross_entropy returns NaN for a microbatch whose targets are all ignored.
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3).double()
    acc = Accumulator(loss_reduction="mean")
    targets = [torch.tensor([0, 2, 1]), torch.full((3,), IGNORE), torch.tensor([IGNORE, 1, 1])]
    acc.begin(num_tokens=[(t != IGNORE).sum() for t in targets])
    for t in targets:
        loss = F.cross_entropy(model(torch.randn(3, 4, dtype=torch.float64)), t)
        scaled = acc.scale_loss(loss)
        assert torch.isfinite(scaled)
        scaled.backward()
    result = acc.end()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    assert torch.isfinite(result.loss)
    assert result.num_tokens.item() == 5


@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
@pytest.mark.parametrize("loss_logging", ["on_read", "next_step"])
def test_an_empty_step_gives_zero_gradients_a_zero_loss_and_a_flag(
    loss_reduction: str, loss_logging: str
) -> None:
    model = torch.nn.Linear(4, 3).double()
    acc = Accumulator(loss_reduction=loss_reduction, loss_logging=loss_logging)  # type: ignore[arg-type]
    acc.begin(num_tokens=torch.zeros(2, dtype=torch.int64), num_samples=[2, 2])
    for _ in range(2):
        loss = F.cross_entropy(
            model(torch.randn(2, 4, dtype=torch.float64)),
            torch.full((2,), IGNORE),
            reduction=loss_reduction,
        )
        acc.scale_loss(loss).backward()
    result = acc.end()
    assert result.is_empty.item() is True
    assert result.is_empty.dtype == torch.bool
    assert result.loss.item() == 0.0
    assert result.num_tokens.item() == 0 and result.num_samples.item() == 4
    assert all((p.grad == 0).all() for p in model.parameters())


def test_a_rank_may_declare_no_microbatch() -> None:
    def rank_step(rank: int, collective: object) -> tuple[int, float, bool]:
        acc = Accumulator(collective=collective)  # type: ignore[arg-type]
        x = torch.ones((), dtype=torch.float64, requires_grad=True)
        counts = [] if rank == 0 else [2, 2]
        acc.begin(num_tokens=counts)
        for _ in counts:
            acc.scale_loss(x * 3.0).backward()
        result = acc.end()
        return int(result.num_tokens), result.loss.item(), bool(result.is_empty)

    assert run_ranks(2, rank_step) == [(4, 3.0, False), (4, 3.0, False)]


@pytest.mark.parametrize(
    "counts",
    [
        [3, 1],
        torch.tensor([3, 1]),
        torch.tensor([3, 1], dtype=torch.int32),
        [torch.tensor(3), 1],
        [torch.tensor(3, dtype=torch.uint8), torch.tensor(1)],
    ],
    ids=["ints", "tensor", "int32-tensor", "mixed", "0-dim-tensors"],
)
def test_counts_in_every_accepted_form(counts: object) -> None:
    acc = Accumulator()
    acc.begin(num_tokens=counts)  # type: ignore[arg-type]
    assert [acc.backward_scale().item() for _ in range(2)] == [0.75, 0.25]
    result = acc.end()
    assert result.num_tokens.dtype == torch.int64 and result.num_tokens.item() == 4
    assert result.num_samples is None


@pytest.mark.parametrize("loss_logging", ["on_read", "next_step"])
def test_counts_are_exact_beyond_float32_and_bf16(loss_logging: str) -> None:
    acc = Accumulator(weight_by="samples", loss_logging=loss_logging)  # type: ignore[arg-type]
    big = 2**52 + 1
    acc.begin(num_samples=[big, 2], num_tokens=[big, big])
    acc.scale_loss(torch.tensor(1.0))
    acc.scale_loss(torch.tensor(1.0))
    result = acc.end()
    assert result.num_samples.item() == big + 2
    assert result.num_tokens.item() == 2 * big


def step_with_losses(acc: Accumulator, losses: list[float]) -> object:
    acc.begin(num_tokens=[1] * len(losses))
    for value in losses:
        acc.scale_loss(torch.tensor(value, dtype=torch.float64))
    return acc.end()


def test_next_step_logging_carries_the_loss_in_the_next_count_reduction() -> None:
    def rank_steps(rank: int, collective: object) -> tuple[list[float], int]:
        acc = Accumulator(collective=collective, loss_logging="next_step")  # type: ignore[arg-type]
        first = step_with_losses(acc, [1.0 + rank, 3.0])
        second = step_with_losses(acc, [10.0 * (rank + 1)])
        calls_after_two_steps = collective._issued  # type: ignore[attr-defined]
        logged = [first.loss.item()]  # arrived with the second step's counts
        calls_for_free_read = collective._issued - calls_after_two_steps  # type: ignore[attr-defined]
        logged.append(second.loss.item())  # no next step yet: an all-reduce of its own
        return logged, calls_after_two_steps * 10 + calls_for_free_read

    results = run_ranks(2, rank_steps)
    # Step 1: losses (1, 3) on rank 0 and (2, 3) on rank 1, one token each.
    assert results == [([9.0 / 4, 15.0], 20), ([9.0 / 4, 15.0], 20)]


def test_on_read_logging_reduces_once_when_first_read() -> None:
    def rank_step(rank: int, collective: object) -> tuple[float, float, int]:
        acc = Accumulator(collective=collective)  # type: ignore[arg-type]
        result = step_with_losses(acc, [2.0 * (rank + 1)])
        before = collective._issued  # type: ignore[attr-defined]
        first, again = result.loss.item(), result.loss.item()
        return first, again, collective._issued - before  # type: ignore[attr-defined]

    assert run_ranks(3, rank_step) == [(4.0, 4.0, 1)] * 3


def test_the_loss_is_unknown_when_a_microbatch_bypassed_scale_loss() -> None:
    acc = Accumulator()
    acc.begin(num_tokens=[1, 1])
    acc.backward_scale()
    acc.scale_loss(torch.tensor(1.0))
    result = acc.end()
    assert result.num_tokens.item() == 2
    with pytest.raises(RuntimeError, match=r"1 of its microbatches went through backward_scale"):
        _ = result.loss


def test_the_hot_path_reads_no_tensor_back_to_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    # On a GPU each of these would wait for the device; counting them on the CPU shows that
    # none is called between begin() and the result's tensors.
    reads = []
    for name in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__"):
        original = getattr(torch.Tensor, name)

        def counting(self: torch.Tensor, *args: object, _name=name, _original=original) -> object:
            reads.append(_name)
            return _original(self, *args)

        monkeypatch.setattr(torch.Tensor, name, counting)
    for loss_logging in ("on_read", "next_step"):
        acc = Accumulator(loss_logging=loss_logging)  # type: ignore[arg-type]
        model = torch.nn.Linear(4, 3)
        for _ in range(2):
            labels = torch.tensor([[0, IGNORE], [IGNORE, IGNORE]])
            acc.begin(num_tokens=(labels != IGNORE).sum(dim=1), num_samples=[1, 1])
            for row in labels:
                loss = F.cross_entropy(model(torch.randn(2, 4)), row, reduction="sum")
                acc.scale_loss(loss).backward()
            result = acc.end()
            torch.stack([result.loss, result.num_tokens, result.is_empty])
    assert reads == []


def test_cpu_counts_go_to_the_collective_device() -> None:
    # A collective that reduces on "meta" only: CPU counts (ints or tensors) are moved there.
    class MetaCollective:
        world_size = 1
        device = torch.device("meta")

        def can_reduce_on(self, device: torch.device) -> bool:
            return device.type == "meta"

        def all_reduce_sum(self, tensor: torch.Tensor) -> None:
            assert tensor.device.type == "meta"

    acc = Accumulator(collective=MetaCollective())
    acc.begin(num_tokens=torch.tensor([3, 1]), num_samples=[1, 1])
    assert acc.backward_scale().device.type == "meta"


def test_cpu_items_join_the_accelerator_items_of_a_list() -> None:
    acc = Accumulator()
    acc.begin(num_tokens=[torch.tensor(3, device="meta"), torch.tensor(1), 2])
    assert acc.backward_scale().device.type == "meta"
