"""Every error the Accumulator raises at its boundary, matched by its message."""

from __future__ import annotations

import pytest
import torch

from lossweight import Accumulator
from lossweight.steps import accelerator_of
from lossweight.testing import InProcessGroup


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        (
            {"weight_by": "rows"},
            ValueError,
            r"weight_by='rows' is not supported; pass 'tokens', 'samples', 'weight_sum'",
        ),
        (
            {"loss_reduction": "avg"},
            ValueError,
            r"loss_reduction='avg' is not supported; pass 'mean' or 'sum'",
        ),
        ({"loss_logging": "never"}, ValueError, r"loss_logging='never' is not supported"),
        (
            {"grad_reduction": "max"},
            ValueError,
            r"grad_reduction='max' is not supported; pass 'mean'",
        ),
        ({"grad_reduction": -2.0}, ValueError, r"grad_reduction=-2.0 is not supported"),
        ({"grad_reduction": 0}, ValueError, r"grad_reduction=0 is not supported"),
        ({"grad_reduction": float("inf")}, ValueError, r"grad_reduction=inf is not supported"),
        ({"grad_reduction": float("nan")}, ValueError, r"grad_reduction=nan is not supported"),
        ({"grad_reduction": True}, ValueError, r"grad_reduction=True is not supported"),
        (
            {"collective": object()},
            TypeError,
            r"collective=<object .*> is not a Collective; implement",
        ),
    ],
)
def test_bad_options(options: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        Accumulator(**{"loss_reduction": "mean", **options})


def test_group_and_collective_together() -> None:
    with pytest.raises(ValueError, match=r"were both given; pass one"):
        Accumulator(
            loss_reduction="mean", group=object(), collective=InProcessGroup(1).collective(0)
        )  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("counts", "error", "message"),
    [
        (
            [3, -1],
            ValueError,
            r"num_tokens\[1\]=-1 is negative; counts are numbers of samples or tokens",
        ),
        (
            [2.5],
            TypeError,
            r"num_tokens\[0\]=2.5 is not an integer count; .* pass ints, or an integer tensor",
        ),
        ([float("nan")], TypeError, r"num_tokens\[0\]=nan is not an integer count"),
        ([float("inf")], TypeError, r"num_tokens\[0\]=inf is not an integer count"),
        ([True], TypeError, r"num_tokens\[0\]=True is not an integer count"),
        (
            torch.tensor([1.0, 2.0]),
            TypeError,
            r"num_tokens has dtype torch.float32, but counts must be integers",
        ),
        (
            torch.tensor([True]),
            TypeError,
            r"num_tokens has dtype torch.bool, but counts must be integers",
        ),
        ([torch.tensor(2.0)], TypeError, r"num_tokens\[0\] has dtype torch.float32"),
        (
            torch.tensor([[1, 2]]),
            ValueError,
            r"num_tokens is a tensor of shape \(1, 2\); pass one count per microbatch, as a 1-D tensor",
        ),
        (
            [torch.tensor([1, 2])],
            ValueError,
            r"num_tokens\[0\] is a tensor of shape \(2,\); each count must be a 0-dim",
        ),
        (
            torch.tensor([4, -3]),
            RuntimeError,
            r"num_tokens holds a count that is negative or not below 2\*\*62",
        ),
        ([torch.tensor(-3)], RuntimeError, r"num_tokens holds a count that is negative"),
        (7, TypeError, r"num_tokens=7 is not a sequence of counts; pass one count per microbatch"),
        ("12", TypeError, r"num_tokens='12' is not a sequence of counts"),
    ],
)
def test_bad_counts(counts: object, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        Accumulator(loss_reduction="mean").begin(num_tokens=counts)  # type: ignore[arg-type]


def test_the_weighting_count_is_required() -> None:
    with pytest.raises(ValueError, match=r"num_samples=None, but weight_by='samples' weights"):
        Accumulator(weight_by="samples", loss_reduction="mean").begin(num_tokens=[3])


def test_counts_of_different_lengths() -> None:
    lengths = r"\{'num_samples': 2, 'num_tokens': 3\}"
    with pytest.raises(ValueError, match=rf"got counts of different lengths \({lengths}\)"):
        Accumulator(loss_reduction="mean").begin(num_samples=[1, 1], num_tokens=[1, 2, 3])
    with pytest.raises(ValueError, match=r"\{'num_tokens': 2, 'weight_sum': 1\}"):
        Accumulator(loss_reduction="mean").begin(num_tokens=[1, 1], weight_sum=[0.5])


def test_counts_on_a_device_the_collective_cannot_reduce() -> None:
    # This collective reduces CPU tensors only (as gloo does); "meta" stands for any other.
    acc = Accumulator(loss_reduction="mean", collective=InProcessGroup(1).collective(0))
    with pytest.raises(
        ValueError,
        match=r"num_tokens is on meta, where the collective cannot reduce \(it reduces on cpu\); pass num_tokens on the CPU \(Python ints or a CPU tensor\), or reduce over a group whose backend handles meta tensors",
    ):
        acc.begin(num_tokens=torch.ones(2, dtype=torch.int64, device="meta"))


def test_scaling_more_microbatches_than_declared() -> None:
    acc = Accumulator(loss_reduction="mean")
    acc.begin(num_tokens=[4])
    acc.scale_loss(torch.tensor(1.0))
    with pytest.raises(
        RuntimeError,
        match=r"scale_loss\(\) was called for microbatch 2 of step 1, but begin\(\) declared 1 microbatches",
    ):
        acc.scale_loss(torch.tensor(1.0))
    with pytest.raises(RuntimeError, match=r"backward_scale\(\) has no next microbatch: all 1"):
        acc.backward_scale()


def test_ending_before_every_declared_microbatch_was_scaled() -> None:
    acc = Accumulator(loss_reduction="mean")
    acc.begin(num_tokens=[4, 4, 4])
    acc.scale_loss(torch.tensor(1.0))
    with pytest.raises(
        RuntimeError,
        match=r"end\(\) was called after 1 of the 3 microbatches that begin\(\) declared for step 1",
    ):
        acc.end()


def test_scaling_outside_a_step() -> None:
    acc = Accumulator(loss_reduction="mean")
    with pytest.raises(
        RuntimeError,
        match=r"backward_scale\(\) was called before the first begin\(\); call begin\(num_tokens=\[...\]\) or begin\(parameters=...\)",
    ):
        acc.backward_scale()
    with pytest.raises(RuntimeError, match=r"end\(\) was called before the first begin\(\)"):
        acc.end()
    acc.begin(num_tokens=[1])
    acc.scale_loss(torch.tensor(1.0))
    acc.end()
    with pytest.raises(RuntimeError, match=r"scale_loss\(\) was called after step 1 was closed"):
        acc.scale_loss(torch.tensor(1.0))


def test_beginning_a_step_while_one_is_open() -> None:
    acc = Accumulator(loss_reduction="mean")
    acc.begin(num_tokens=[1])
    with pytest.raises(
        RuntimeError, match=r"begin\(\) was called while step 1 is still open; call end\(\)"
    ):
        acc.begin(num_tokens=[1])


@pytest.mark.parametrize(
    ("loss", "error", "message"),
    [
        (
            torch.ones(4),
            ValueError,
            r"scale_loss\(\) got a loss of shape \(4,\), but it must be a scalar \(0-dim\)",
        ),
        (torch.tensor(3), TypeError, r"got a loss of dtype torch.int64; pass a floating-point"),
        (1.5, TypeError, r"scale_loss\(\) got loss=1.5, which is not a tensor"),
    ],
)
def test_bad_losses(loss: object, error: type, message: str) -> None:
    acc = Accumulator(loss_reduction="mean")
    acc.begin(num_tokens=[1])
    with pytest.raises(error, match=message):
        acc.scale_loss(loss)  # type: ignore[arg-type]


def test_counts_on_two_accelerators_are_refused_naming_them() -> None:
    # A machine with two accelerators makes it with counts on each; the check sees devices only.
    devices = [torch.device("cuda", 1), torch.device("cpu"), torch.device("meta")]
    with pytest.raises(ValueError) as refused:
        accelerator_of("num_tokens", devices)
    assert str(refused.value) == (
        "num_tokens are on different devices (['cuda:1', 'meta']); put the counts on one device, "
        "or on the CPU"
    )
