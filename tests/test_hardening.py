"""Scale-after steps and several Accumulators in one process are exact, or refused.

The toy problem: a float64 parameter ``p`` and microbatch losses ``p * count`` (summed), so
that the exact token-mean gradient is 1.0 whatever the counts; a refusal leaves nothing
half-done.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import pytest
import torch

from lossweight import Accumulator
from lossweight.testing import InProcessCollective, InProcessGroup

F64 = torch.float64


def _parameter() -> torch.Tensor:
    return torch.zeros((), dtype=F64, requires_grad=True)


def test_a_sparse_embedding_scales_after_exactly() -> None:
    torch.manual_seed(0)
    sparse = torch.nn.Embedding(10, 3, sparse=True, dtype=F64)
    head = torch.nn.Linear(3, 1, dtype=F64)
    reference = [p.detach().clone().requires_grad_() for p in (sparse.weight, head.weight)]
    microbatches = [
        torch.tensor([1, 2, 2]),
        torch.tensor([2, 7]),
        torch.tensor([], dtype=torch.long),
    ]
    acc = Accumulator(loss_reduction="sum", weight_estimate=100.0)
    for _ in range(2):  # the second step assumes the first one's W
        acc.begin(parameters=[*sparse.parameters(), *head.parameters()])
        for tokens in microbatches:
            loss = head(sparse(tokens)).sum()
            acc.scale_loss(loss, num_tokens=len(tokens)).backward()
        result = acc.end()
        assert result.num_tokens.item() == 5
        every = torch.cat(microbatches)
        expected = torch.autograd.grad(
            (reference[0][every] @ reference[1].T + head.bias).sum() / 5, reference
        )
        torch.testing.assert_close(sparse.weight.grad.to_dense(), expected[0])  # type: ignore[union-attr]
        torch.testing.assert_close(head.weight.grad, expected[1])
        sparse.zero_grad(set_to_none=True)
        head.zero_grad(set_to_none=True)


def test_a_sparse_gradient_left_from_before_is_refused() -> None:
    sparse = torch.nn.Embedding(4, 2, sparse=True)
    sparse(torch.tensor([1])).sum().backward()
    acc = Accumulator(loss_reduction="sum")
    with pytest.raises(RuntimeError, match="already hold nonzero gradients"):
        acc.begin(parameters=sparse.parameters())


@pytest.mark.parametrize("other_mode", ["scale_after", "count_first"])
def test_a_loss_into_another_accumulator_s_scale_after_step_is_refused(other_mode: str) -> None:
    # A token-weighted main loss scaled after, and an auxiliary loss over the same parameter
    # weighted by another Accumulator: the first one's end() would rescale the second's
    # gradient too (0.633 or 1.3 where 4.0 is right, before this was refused).
    p = _parameter()
    main, aux = Accumulator(loss_reduction="sum"), Accumulator(loss_reduction="sum")
    main.begin(parameters=[p])
    if other_mode == "scale_after":
        aux.begin(parameters=[p])
    else:
        aux.begin(num_tokens=[2])
    refused = "reaches parameters of another Accumulator's open scale-after step"
    if other_mode == "scale_after":  # each step refuses the other's losses
        with pytest.raises(RuntimeError, match=refused):
            main.scale_loss(p * 3, num_tokens=3)
        with pytest.raises(RuntimeError, match=refused):
            aux.scale_loss(p * 2, num_tokens=2)
    else:
        main.scale_loss(p * 3, num_tokens=3).backward()
        with pytest.raises(RuntimeError, match=refused):
            aux.scale_loss(p * 2)
    aux.abandon()
    main.scale_loss(p * 5, num_tokens=5).backward()  # once the other step is gone, it goes on
    main.end()
    assert p.grad.item() == 1.0  # type: ignore[union-attr]


def test_two_count_first_accumulators_over_one_model_are_exact() -> None:
    # The fix the refusal names: count first in each Accumulator, which rescales nothing.
    p = _parameter()
    main = Accumulator(loss_reduction="sum", weight_by="tokens")
    aux = Accumulator(loss_reduction="sum", weight_by="samples")
    main.begin(num_tokens=[3, 5])
    aux.begin(num_samples=[1, 1])
    for tokens in (3, 5):
        (main.scale_loss(p * tokens) + aux.scale_loss(p * 3)).backward()
    main.end(), aux.end()
    assert p.grad.item() == pytest.approx(1.0 + 3.0)  # type: ignore[union-attr]


def test_accumulators_over_disjoint_parameters_interleave() -> None:
    # A generator scaled after and a discriminator counted first, microbatch by microbatch:
    # neither loss reaches the other's parameters, so both are exact.
    generator, discriminator = _parameter(), _parameter()
    g_acc, d_acc = Accumulator(loss_reduction="sum"), Accumulator(loss_reduction="sum")
    g_acc.begin(parameters=[generator])
    d_acc.begin(num_tokens=[2, 6])
    for tokens in (2, 6):
        g_acc.scale_loss(generator * tokens, num_tokens=tokens).backward()
        d_acc.scale_loss(discriminator * tokens).backward()
    g_acc.end(), d_acc.end()
    assert generator.grad.item() == discriminator.grad.item() == 1.0  # type: ignore[union-attr]


class _Blocking:
    """A one-rank collective whose sum waits until ``release`` is set, so that a test can act
    while a thread is inside ``begin()``."""

    world_size = 1
    device = torch.device("cpu")

    def __init__(self) -> None:
        self.inside, self.release = threading.Event(), threading.Event()

    def can_reduce_on(self, device: torch.device) -> bool:
        return True

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        self.inside.set()
        assert self.release.wait(10)


def test_a_call_from_a_second_thread_during_a_call_is_refused() -> None:
    collective = _Blocking()
    acc = Accumulator(loss_reduction="sum", collective=collective)
    p = _parameter()
    began: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: began.update(context=acc.begin(num_tokens=[2])))
    thread.start()
    assert collective.inside.wait(10)
    try:
        with pytest.raises(RuntimeError, match="another thread was inside a call"):
            acc.scale_loss(p * 2)
        with pytest.raises(RuntimeError, match="end\\(\\) was called while another thread"):
            acc.end()
    finally:
        collective.release.set()
        thread.join()
    # Nothing was lost: the step the first thread began goes on, from any thread, one at once.
    acc.scale_loss(p * 2).backward()
    assert acc.end().num_tokens.item() == 2 and p.grad.item() == 1.0  # type: ignore[union-attr]


def test_steps_take_the_loop_s_numbers() -> None:
    acc = Accumulator(loss_reduction="sum")
    p = _parameter()
    for number in (10, 11, 40):
        acc.begin(num_tokens=[1], step=number)
        acc.scale_loss(p * 1).backward()
        assert acc.end().step == number and acc.steps == number
    acc.begin(num_tokens=[1])  # and count on from there by default
    acc.scale_loss(p * 1).backward()
    assert acc.end().step == 41


def test_a_resumed_run_may_change_its_configuration() -> None:
    # The accumulation steps (framework_divides_loss_by) and loss_logging are configuration:
    # a run resumed with other values loads its state; weight_by is what the state counts.
    acc = Accumulator(loss_reduction="mean", framework_divides_loss_by=4, weight_estimate=9.0)
    acc.begin(parameters=[p := _parameter()])
    acc.scale_loss(p * 1, num_tokens=6).backward()
    acc.end()
    saved = acc.state_dict()
    resumed = Accumulator(
        loss_reduction="sum", framework_divides_loss_by=8, loss_logging="next_step",
        grad_reduction="sum",
    )  # fmt: skip
    resumed.load_state_dict(saved)
    assert resumed.state_dict()["weight_estimate"] == 6.0 and resumed.steps == 1
    with pytest.raises(ValueError, match="saved with weight_by='tokens'"):
        Accumulator(loss_reduction="mean", weight_by="samples").load_state_dict(saved)


def test_scale_after_steps_open_and_close_in_many_threads_at_once() -> None:
    # Every scale_loss() checks the loss against the process's open scale-after steps, a set
    # that the other threads' begin() and end() change meanwhile: 16 ranks simulated in
    # threads, each alternating scale-after and count-first steps over parameters of its own.
    # Iterating the set while another thread changed it raised "Set changed size during
    # iteration" about once in 300 steps.
    group, steps = InProcessGroup(16), 60
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch as often as they can: the race shows at once

    def rank_steps(rank: int, collective: InProcessCollective) -> float:
        acc = Accumulator(loss_reduction="sum", collective=collective)  # type: ignore[arg-type]
        p = _parameter()
        for step in range(steps):
            p.grad = None
            if step % 2:
                acc.begin(num_tokens=[1, 2])
                for count in (1, 2):
                    acc.scale_loss(p * count).backward()
            else:
                acc.begin(parameters=[p])
                for count in (1, 2):
                    acc.scale_loss(p * count, num_tokens=count).backward()
            acc.end()
            assert p.grad is not None and p.grad.item() == pytest.approx(1.0, rel=1e-12)
        return p.grad.item()

    try:
        grads = group.run(rank_steps)
    finally:
        sys.setswitchinterval(switch)
    # D = 16 (the mean of 16 ranks) over W = 48: each rank holds 16 / 48 * (1 + 2) = 1.
    assert grads == [pytest.approx(1.0, rel=1e-12)] * 16


def test_empty_gradients_are_zero_gradients() -> None:
    # A sparse gradient zeroed in place holds no values, and a parameter of no elements holds
    # no gradient entries (an FSDP2 rank's empty shard, say): both are zero, not an error.
    sparse = torch.nn.Embedding(4, 2, sparse=True, dtype=F64)
    empty = torch.nn.Parameter(torch.zeros(0, dtype=F64))
    acc = Accumulator(loss_reduction="sum")
    for _ in range(2):  # the second begin() finds the gradients the first step left, zeroed
        acc.begin(parameters=[*sparse.parameters(), empty])
        loss = sparse(torch.tensor([1, 3])).sum() + empty.sum()
        acc.scale_loss(loss, num_tokens=2).backward()
        acc.end()
        assert sparse.weight.grad is not None and empty.grad is not None
        sparse.zero_grad(set_to_none=False)
        empty.grad.zero_()
    # A rank with no microbatch and those zeroed gradients ends its step as well.
    acc.begin(parameters=[*sparse.parameters(), empty])
    assert acc.end().num_tokens.item() == 0
