"""The Accumulator on one process, and on ranks simulated by threads (see ranks.py)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from lossweight import Accumulator, StepResult, count_tokens, token_cross_entropy
from lossweight.testing import InProcessCollective, InProcessGroup, strategies

from .problem import (
    IGNORE,
    Batch,
    make_batch,
    make_model,
    max_relative_error,
    microbatch_loss,
    reference,
)


@st.composite
def steps(draw: st.DrawFn, weight_by: str) -> tuple[list[int], list[list[list[int]]]]:
    """Row lengths of a step, and its rows split into ranks of microbatches (row indices).

    Rows may be all padding (weighting by tokens), microbatches may hold no row, ranks may
    hold no microbatch or only empty ones, and the whole step may be empty.
    """
    min_length = 1 if weight_by == "samples" else 0  # a sample's loss is a mean over its tokens
    lengths = draw(st.lists(st.integers(min_length, 6), max_size=10))
    return lengths, draw(strategies.splits(len(lengths), max_microbatches=3))


def divisor_of(grad_reduction: object, world_size: int) -> float:
    return {"mean": world_size, "sum": 1}.get(grad_reduction, grad_reduction)  # type: ignore


def run_step(
    model: torch.nn.Module,
    batch: Batch,
    ranks: list[list[list[int]]],
    scale_after: bool = False,
    **options: object,
) -> tuple[list[torch.Tensor], list[float]]:
    """One step over simulated ranks: (the combined gradient, the loss each rank logged).

    Count first, or scale after: then each rank's gradients are rescaled by end() before they
    are combined, which is equivalent since every rank applies the same factor.
    """
    weight_by = str(options.get("weight_by", "tokens"))
    loss_reduction = str(options.get("loss_reduction", "mean"))
    world_size = len(ranks)

    def rank_step(rank: int, collective: InProcessCollective) -> tuple[list[torch.Tensor], float]:
        replica = copy.deepcopy(model)
        acc = Accumulator(collective=collective, **options)  # type: ignore[arg-type]
        microbatches = [batch.take(rows) for rows in ranks[rank]]
        if scale_after:
            acc.begin(parameters=replica.parameters())
        else:
            acc.begin(
                num_samples=[mb.num_samples for mb in microbatches],
                num_tokens=[mb.num_tokens for mb in microbatches],
            )
        for mb in microbatches:
            loss = microbatch_loss(replica, mb, weight_by, loss_reduction)
            counts = {"num_samples": mb.num_samples, "num_tokens": mb.num_tokens}
            acc.scale_loss(loss, **(counts if scale_after else {})).backward()
        result = acc.end()
        acc.flush()  # with loss_logging="next_step", the last count-first loss travels now
        grads = [
            p.grad if p.grad is not None else torch.zeros_like(p) for p in replica.parameters()
        ]
        return grads, result.loss.item()

    results = InProcessGroup(world_size).run(rank_step)
    divisor = divisor_of(options.get("grad_reduction", "mean"), world_size)
    combined = [
        sum(grads) / divisor for grads in zip(*(grads for grads, _ in results), strict=True)
    ]
    return combined, [loss for _, loss in results]


@settings(max_examples=400)
@given(
    st.sampled_from(["tokens", "samples"]).flatmap(
        lambda weight_by: st.tuples(st.just(weight_by), steps(weight_by))
    ),
    st.sampled_from(["mean", "sum"]),
    st.sampled_from(["mean", "sum", 0.5, 3.0]),
    st.sampled_from(["end", "next_step"]),
    st.booleans(),
    st.integers(0, 2**16),
    st.booleans(),
    st.sampled_from([1.0, 7.0, 1e6]),
)
def test_gradient_and_logged_loss_do_not_depend_on_the_split(
    case: tuple[str, tuple[list[int], list[list[list[int]]]]],
    loss_reduction: str,
    grad_reduction: object,
    loss_logging: str,
    left_padding: bool,
    seed: int,
    scale_after: bool,
    weight_estimate: float,
) -> None:
    weight_by, (lengths, ranks) = case
    batch = make_batch(lengths, max_length=6, seed=seed, left_padding=left_padding)
    model = make_model(seed)
    expected_loss, expected_grads = reference(model, batch, weight_by)
    grads, losses = run_step(
        model,
        batch,
        ranks,
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
    ranks = [[[0, 1], []], [[2, 3]], [[4], [5]]]
    grads, losses = run_step(model, batch, ranks, loss_reduction="mean")
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
    scales = [acc.backward_scale(index) for index in range(3)]
    for _ in range(3):
        acc.scale_loss(torch.tensor(1.0))
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
@pytest.mark.parametrize("loss_logging", ["end", "next_step"])
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
    acc.flush()
    assert result.is_empty.item() is True
    assert result.is_empty.dtype == torch.bool
    assert result.loss.item() == 0.0
    assert result.num_tokens.item() == 0 and result.num_samples.item() == 4
    assert all((p.grad == 0).all() for p in model.parameters())


def test_a_rank_may_declare_no_microbatch() -> None:
    def rank_step(rank: int, collective: InProcessCollective) -> tuple[int, float, bool]:
        acc = Accumulator(loss_reduction="mean", collective=collective)  # type: ignore[arg-type]
        x = torch.ones((), dtype=torch.float64, requires_grad=True)
        counts = [] if rank == 0 else [2, 2]
        acc.begin(num_tokens=counts)
        for _ in counts:
            acc.scale_loss(x * 3.0).backward()
        result = acc.end()
        return int(result.num_tokens), result.loss.item(), bool(result.is_empty)

    assert InProcessGroup(2).run(rank_step) == [(4, 3.0, False), (4, 3.0, False)]


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
    acc = Accumulator(loss_reduction="mean")
    acc.begin(num_tokens=counts)  # type: ignore[arg-type]
    assert [acc.backward_scale(index).item() for index in range(2)] == [0.75, 0.25]
    acc.scale_loss(torch.tensor(1.0))
    acc.scale_loss(torch.tensor(1.0))
    result = acc.end()
    assert result.num_tokens.dtype == torch.int64 and result.num_tokens.item() == 4
    assert result.num_samples.item() == -1  # not given


@pytest.mark.parametrize("loss_logging", ["end", "next_step"])
def test_counts_are_exact_beyond_float32_and_bf16(loss_logging: str) -> None:
    acc = Accumulator(weight_by="samples", loss_reduction="mean", loss_logging=loss_logging)  # type: ignore[arg-type]
    big = 2**52 + 1
    acc.begin(num_samples=[big, 2], num_tokens=[big, big])
    acc.scale_loss(torch.tensor(1.0))
    acc.scale_loss(torch.tensor(1.0))
    result = acc.end()
    assert result.num_samples.item() == big + 2
    assert result.num_tokens.item() == 2 * big


def step_with_losses(acc: Accumulator, losses: list[float]) -> StepResult:
    acc.begin(num_tokens=[1] * len(losses))
    for value in losses:
        acc.scale_loss(torch.tensor(value, dtype=torch.float64))
    return acc.end()


def test_next_step_logging_carries_the_loss_in_the_next_reduction() -> None:
    def rank_steps(rank: int, collective: InProcessCollective) -> tuple[list[float], list[int]]:
        acc = Accumulator(loss_reduction="mean", collective=collective, loss_logging="next_step")  # type: ignore[arg-type]
        first = step_with_losses(acc, [1.0 + rank, 3.0])
        with pytest.raises(RuntimeError, match=r"the loss of step 1 is not reduced yet"):
            _ = first.loss  # its ride has not left: no collective is issued for it
        calls = [collective.calls]
        second = step_with_losses(acc, [10.0 * (rank + 1)])
        calls.append(collective.calls)
        logged = [first.loss.item()]  # arrived with the second step's counts
        acc.flush()  # the last step's loss: one all-reduce, on every rank
        calls.append(collective.calls)
        logged.append(second.loss.item())
        acc.flush()  # nothing waits any more: no collective
        calls.append(collective.calls)
        return logged, calls

    results = InProcessGroup(2).run(rank_steps)
    # Step 1: losses (1, 3) on rank 0 and (2, 3) on rank 1, one token each.
    assert results == [([9.0 / 4, 15.0], [1, 2, 3, 3])] * 2


def test_end_logging_reduces_the_loss_in_end_and_reads_issue_nothing() -> None:
    def rank_step(rank: int, collective: InProcessCollective) -> tuple[float, float, int, int]:
        acc = Accumulator(loss_reduction="mean", collective=collective)  # type: ignore[arg-type]
        result = step_with_losses(acc, [2.0 * (rank + 1)])
        after_end = collective.calls
        first, again = result.loss.item(), result.loss.item()
        return first, again, after_end, collective.calls

    assert InProcessGroup(3).run(rank_step) == [(4.0, 4.0, 2, 2)] * 3


def test_reading_a_factor_does_not_take_the_microbatch() -> None:
    acc = Accumulator(loss_reduction="mean")
    acc.begin(num_tokens=[3, 1])
    assert acc.backward_scale().item() == 0.75  # the next microbatch's, read twice
    assert acc.backward_scale().item() == 0.75
    assert acc.backward_scale(1).item() == 0.25
    x = torch.ones((), requires_grad=True)
    assert acc.scale_loss(x * 2.0).item() == 1.5  # still microbatch 0
    assert acc.backward_scale().item() == 0.25
    acc.scale_loss(x * 2.0)
    assert acc.end().loss.item() == 2.0


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
    for loss_logging in ("end", "next_step"):
        for scale_after in (False, True):
            acc = Accumulator(loss_reduction="sum", loss_logging=loss_logging)  # type: ignore[arg-type]
            model = torch.nn.Linear(4, 3)
            for _ in range(2):
                labels = torch.tensor([[0, IGNORE], [IGNORE, IGNORE]])
                counts = (labels != IGNORE).sum(dim=1)
                if scale_after:
                    acc.begin(parameters=model.parameters())
                else:
                    acc.begin(num_tokens=counts, num_samples=[1, 1])
                for row, count in zip(labels, counts, strict=True):
                    loss = F.cross_entropy(model(torch.randn(2, 4)), row, reduction="sum")
                    given = {"num_tokens": count, "num_samples": 1} if scale_after else {}
                    acc.scale_loss(loss, **given).backward()
                result = acc.end()
                acc.flush()
                torch.stack([result.loss, result.num_tokens, result.is_empty])
                model.zero_grad()
    assert reads == []


class MetaCollective:
    """Reduces on "meta" only: tensors there have shapes but no values, so any read of a value
    on the way would raise."""

    world_size = 2
    device = torch.device("meta")

    def can_reduce_on(self, device: torch.device) -> bool:
        return device.type == "meta"

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        assert tensor.device.type == "meta"


@pytest.mark.parametrize("loss_logging", ["end", "next_step"])
def test_a_whole_step_on_a_device_whose_values_cannot_be_read(loss_logging: str) -> None:
    # CPU counts (ints or tensors) move to the collective's device; every check there is a
    # device-side assert, as on a GPU, so nothing on the path needs a value on the host.
    acc = Accumulator(loss_reduction="mean", collective=MetaCollective(), loss_logging=loss_logging)  # type: ignore[arg-type]
    x = torch.ones((), device="meta", requires_grad=True)
    for _ in range(2):
        acc.begin(num_tokens=torch.tensor([3, 1]), num_samples=[1, 1])
        assert acc.backward_scale().device.type == "meta"
        for _ in range(2):
            acc.scale_loss(x * 2.0).backward()
        result = acc.end()
    acc.flush()
    assert result.loss.device.type == "meta" and result.num_tokens.device.type == "meta"
    acc.begin(parameters=[x])
    acc.scale_loss(x * 2.0, num_tokens=torch.tensor(3, device="meta")).backward()
    assert acc.end().nonfinite_loss.device.type == "meta"


def test_cpu_items_join_the_accelerator_items_of_a_list() -> None:
    acc = Accumulator(loss_reduction="mean", collective=MetaCollective())  # type: ignore[arg-type]
    acc.begin(num_tokens=[torch.tensor(3, device="meta"), torch.tensor(1), 2])
    assert acc.backward_scale().device.type == "meta"


@pytest.mark.parametrize("scale_after", [False, True], ids=["count-first", "scale-after"])
def test_a_framework_that_divides_the_loss_is_accounted_for(scale_after: bool) -> None:
    # A framework (Accelerate, Lightning) divides each loss by its accumulation steps before
    # the backward; the factors undo that, so the gradient is the step's mean again.
    x = torch.ones((), dtype=torch.float64, requires_grad=True)
    acc = Accumulator(loss_reduction="sum", framework_divides_loss_by=4)
    counts = [3, 0, 1, 4]
    if scale_after:
        acc.begin(parameters=[x])
    else:
        acc.begin(num_tokens=counts)
        assert acc.backward_scale(0).item() == 4 / 8
    for count in counts:
        given = {"num_tokens": count} if scale_after else {}
        (acc.scale_loss(x * 2.0 * count, **given) / 4).backward()  # what the framework does
    result = acc.end()
    assert x.grad.item() == pytest.approx(2.0, rel=1e-15)  # d/dx of 8 items of loss 2x, mean
    assert result.loss.item() == 2.0


def test_factors_read_for_a_log_do_not_take_microbatches_that_scale_loss_missed() -> None:
    # Every factor read up front, then one loss scaled by hand without record_loss() and one
    # through scale_loss(), which takes microbatch 0 again: the gradient is wrong (8.25 for
    # 3.25), and end() says so instead of accepting the step.
    p = torch.zeros((), dtype=torch.float64, requires_grad=True)
    acc = Accumulator(loss_reduction="mean")
    acc.begin(num_tokens=[3, 1])
    factors = [acc.backward_scale(i) for i in range(2)]
    ((p + 2) * factors[0]).backward()
    acc.scale_loss((p + 2) * 10).backward()
    with pytest.raises(RuntimeError, match=r"microbatches \[1\] were not taken"):
        acc.end()
    acc.abandon()
    # Read for a log, then every loss through scale_loss(): a step as before.
    p.grad = None
    acc.begin(num_tokens=[3, 1])
    assert [acc.backward_scale(i).item() for i in range(2)] == [0.75, 0.25]
    for value in (1.0, 5.0):
        acc.scale_loss(p + value).backward()
    assert acc.end().loss.item() == 2.0 and p.grad.item() == 1.0


def test_a_count_handed_with_its_loss_is_checked_against_begin() -> None:
    # The loop counts every labelled token while its loss covers the shifted targets only
    # (126 for 122, say): handing token_cross_entropy's own count to scale_loss() catches it.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(11, 4), torch.nn.Linear(4, 11)).double()
    tokens = torch.randint(11, (3, 6))
    labels = tokens.masked_fill(torch.arange(6) >= torch.tensor([[6], [2], [4]]), -100)
    for as_tensors in (False, True):
        declared = [count_tokens(labels[i : i + 1]) for i in range(3)]  # no shift: wrong
        declared = declared if as_tensors else [int(c) for c in declared]
        acc = Accumulator(loss_reduction="sum")
        acc.begin(num_tokens=declared)
        loss, count = token_cross_entropy(model(tokens[:1]), labels[:1], shift=True)
        error = RuntimeError if as_tensors else ValueError
        with pytest.raises(error, match=r"scale_loss\(\) got .*num_tokens.* begin\(\) declared"):
            acc.scale_loss(loss, num_tokens=count if as_tensors else int(count))
        assert acc.state.step is not None and acc.state.step.scaled == 0  # nothing taken
        acc.abandon()
    # Counted with the loss's shift, the same counts pass, and the step is as without them.
    grads = []
    for hand_over in (False, True):
        model.zero_grad()
        acc = Accumulator(loss_reduction="sum")
        acc.begin(num_tokens=[count_tokens(labels[i : i + 1], shift=True) for i in range(3)])
        for i in range(3):
            loss, count = token_cross_entropy(
                model(tokens[i : i + 1]), labels[i : i + 1], shift=True
            )
            acc.scale_loss(loss, **({"num_tokens": count} if hand_over else {})).backward()
        assert acc.end().num_tokens.item() == 9  # 5 + 1 + 3 shifted targets
        grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
