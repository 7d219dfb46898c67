"""Ranks that disagree, as far as a CPU machine can show both paths of the check.

On the CPU the check of a reduction raises DisagreementError at once, on every rank. On an
accelerator reading the verdict would wait for the device, so the reduced numbers become NaN
there and the verdict is copied to the host without waiting; the next call every rank makes
raises the same DisagreementError once the copy has landed. Here the CPU is sent down the
accelerator's path (its verdict lands at once), and both paths must say the same words.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from lossweight import Accumulator, DisagreementError, _torch, compiled, payload
from lossweight.errors import MESSAGES
from lossweight.terms import Layout, Term
from lossweight.testing import InProcessCollective, InProcessGroup


def disagreeing_step(rank: int, collective: InProcessCollective) -> tuple[str, str, float]:
    """A count-first step whose ranks differ in grad_reduction: (where it raised, the message,
    the gradient the step left)."""
    acc = Accumulator(
        loss_reduction="sum", grad_reduction=["mean", "sum"][rank], collective=collective
    )
    p = torch.zeros((), dtype=torch.float64, requires_grad=True)
    where = "begin"
    try:
        acc.begin(num_tokens=[2, 1])
        where = "scale_loss"
        for count in (2, 1):
            acc.scale_loss((p + 1.0) * count).backward()
        where = "end"
        acc.end()
        where = "nowhere"
    except DisagreementError as error:
        assert p.grad is None or not math.isfinite(p.grad.item()) or where == "scale_loss"
        return where, str(error), math.nan if p.grad is None else p.grad.item()
    return where, "", math.nan


def test_a_disagreement_says_the_same_on_the_host_and_on_the_device_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    on_host = InProcessGroup(2).run(disagreeing_step)
    assert [where for where, _, _ in on_host] == ["scale_loss", "scale_loss"]
    monkeypatch.setattr(payload, "CHECKED_ON_HOST", ())  # the CPU as an accelerator
    deferred = InProcessGroup(2).run(disagreeing_step)
    # The factors were NaN, so no finite wrong gradient was made; end(), the next call every
    # rank makes, raised.
    assert [where for where, _, _ in deferred] == ["end", "end"]
    assert all(math.isnan(gradient) for _, _, gradient in deferred)
    for (_, host_message, _), (_, device_message, _) in zip(on_host, deferred, strict=True):
        assert "the ranks differ in grad_reduction" in host_message
        assert device_message == host_message


def clipping_alone(rank: int, collective: InProcessCollective) -> tuple[str, str, float]:
    """A scale-after step whose end() clips on rank 0 alone: (the call that raised, its error,
    the gradient the step left)."""
    acc = Accumulator(loss_reduction="sum", collective=collective)
    p = torch.zeros((), dtype=torch.float64, requires_grad=True)
    acc.begin(parameters=[p])
    acc.scale_loss((p + 1.0) * 3, num_tokens=3).backward()
    try:
        acc.end(max_grad_norm=(0.5, None)[rank])
    except DisagreementError as error:
        return "end", str(error), p.grad.item()  # type: ignore[union-attr]
    gradient = p.grad.item()  # type: ignore[union-attr]
    with pytest.raises(DisagreementError) as raised:
        acc.begin(parameters=[p])
    return "begin", str(raised.value), gradient


@pytest.mark.parametrize("path", ["host", "device"])
def test_ranks_that_clip_differently_raise_before_either_clips(
    monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    # On an accelerator the rank that clips ran clip_grad_norm_ on NaN gradients, alone (under
    # FSDP2 a collective of its own: a hang); the verdict came at its next call. A clipping
    # end() now waits for the verdict; a rank that does not clip meets it at its next call, as
    # any disagreement on an accelerator (its gradients NaN meanwhile).
    if path == "device":
        monkeypatch.setattr(payload, "CHECKED_ON_HOST", ())  # the CPU as an accelerator
    outcomes = InProcessGroup(2).run(clipping_alone)
    for rank, (where, message, gradient) in enumerate(outcomes):
        assert "the ranks differ in end(max_grad_norm=...)" in message
        assert f"this rank's is {(0.5, None)[rank]}," in message
        if rank == 0 or path == "host":
            assert (where, gradient) == ("end", 6.0)  # provisional (D / E = 2), not clipped
        else:
            assert where == "begin" and math.isnan(gradient)


def test_the_compiled_checks_say_the_table_s_words() -> None:
    # The asserts a compiled graph keeps carry fixed texts: each is a row of the one table,
    # its fields filled in.
    patterns = [
        ".*?".join(map(re.escape, re.split(r"\{[^}]*\}", template)))
        for _, template in MESSAGES.values()
    ]
    assert len(compiled.ASSERT_MESSAGES) == Layout((Term("loss", "sum"),)).checked
    for message in compiled.ASSERT_MESSAGES:
        assert any(re.fullmatch(pattern, message) for pattern in patterns), message


def last_scale_after_step(rank: int, collective: InProcessCollective) -> tuple[str, str]:
    """A run whose last step, scaled after, has ranks that differ in grad_reduction, and that
    ends with flush(): (where it raised, the message)."""
    acc = Accumulator(
        loss_reduction="sum", grad_reduction=["mean", "sum"][rank], collective=collective
    )
    p = torch.zeros((), dtype=torch.float64, requires_grad=True)
    where = "end"
    try:
        acc.begin(parameters=[p])
        acc.scale_loss((p + 1.0) * 2, num_tokens=2).backward()
        acc.end()
        where = "flush"
        acc.flush()
    except DisagreementError as error:
        return where, str(error)
    return "nowhere", ""


def test_flush_reports_the_last_step_s_disagreement_on_the_device_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    on_host = InProcessGroup(2).run(last_scale_after_step)
    assert [where for where, _ in on_host] == ["end", "end"]
    monkeypatch.setattr(payload, "CHECKED_ON_HOST", ())
    deferred = InProcessGroup(2).run(last_scale_after_step)
    assert [where for where, _ in deferred] == ["flush", "flush"]
    assert [message for _, message in deferred] == [message for _, message in on_host]


def refused_then_recovered(rank: int, collective: InProcessCollective) -> tuple[str, float, float]:
    """A scale-after step that rank 0 refuses (its losses reach none of its parameters), then,
    as the error says, abandon() and zeroed gradients on every rank, and a good step: (the
    error, the refused step's gradient, the good step's gradient)."""
    acc = Accumulator(loss_reduction="sum", collective=collective)
    x = torch.zeros((), dtype=torch.float64, requires_grad=True)
    elsewhere = torch.zeros((), dtype=torch.float64, requires_grad=True)
    acc.begin(parameters=[elsewhere] if rank == 0 else [x])
    acc.scale_loss(x * 3.0, num_tokens=3).backward()
    message = ""
    try:
        acc.end()
        acc.begin(parameters=[x])  # the next call raises, once the verdict has landed
    except (ValueError, RuntimeError) as error:
        message = str(error)
    refused = math.nan if x.grad is None else x.grad.item()
    acc.abandon()
    x.grad = None
    acc.begin(parameters=[x])  # rank r's summed loss (r + 1) x over r + 1 tokens: x's mean
    acc.scale_loss(x * (rank + 1.0), num_tokens=rank + 1).backward()
    acc.end()
    assert x.grad is not None
    return message, refused, x.grad.item()


@pytest.mark.parametrize("path", ["host", "device"])
def test_the_step_after_a_refusal_is_exact_on_either_path(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if path == "device":
        monkeypatch.setattr(payload, "CHECKED_ON_HOST", ())  # the CPU as an accelerator
    outcomes = InProcessGroup(2).run(refused_then_recovered)
    assert "none of the 1 parameters given to begin() has a gradient" in outcomes[0][0]
    assert "1 of the 2 ranks of the reduction refused to end this step" in outcomes[1][0]
    if path == "device":  # the refused step's gradients became NaN, not a finite wrong value
        assert math.isnan(outcomes[1][1])
    # The estimate of W the next step assumes is the option's, not the refused step's NaN:
    # D = 2 over W = 3, each rank's gradient (r + 1) * 2 / 3; their mean is 1.
    assert [grad for _, _, grad in outcomes] == [pytest.approx(2 / 3), pytest.approx(4 / 3)]


def refused_then_retried(rank: int, collective: InProcessCollective) -> tuple[list[str], float]:
    """The refused step of :func:`refused_then_recovered`, then a loop that, at an error from
    any call, abandons the step, and tries the good step again: (the errors, its gradient)."""
    acc = Accumulator(loss_reduction="sum", collective=collective)
    x = torch.zeros((), dtype=torch.float64, requires_grad=True)
    elsewhere = torch.zeros((), dtype=torch.float64, requires_grad=True)
    acc.begin(parameters=[elsewhere] if rank == 0 else [x])
    acc.scale_loss(x * 3.0, num_tokens=3).backward()
    errors = []
    try:
        acc.end()
    except (ValueError, RuntimeError) as error:
        errors.append(str(error))
        acc.abandon()
    for _ in range(3):
        x.grad = None
        try:
            acc.begin(parameters=[x])
            acc.scale_loss(x * (rank + 1.0), num_tokens=rank + 1).backward()
            acc.end()
            break
        except (ValueError, RuntimeError) as error:
            errors.append(str(error))
            acc.abandon()
    assert x.grad is not None
    try:
        acc.flush()  # waits for the verdicts on their way: one still late raises here
    except (ValueError, RuntimeError) as error:
        errors.append(str(error))
    return errors, x.grad.item()


def test_the_step_after_a_refusal_is_exact_when_its_verdict_lands_late(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # On an accelerator the host runs ahead: the next step may begin before the refused
    # step's verdict has landed on a rank, and take its total, NaN, as its estimate; that rank
    # raises at a later call. The estimate falls back to weight_estimate on the device, with
    # the codes of a rank that knew, so the next good step is exact however late the verdict,
    # and every rank raises the refusal once.
    monkeypatch.setattr(payload, "CHECKED_ON_HOST", ())
    ready = _torch.Verdict.ready
    late = {"left": 2}  # the first two polls (one per rank) find the verdict on its way

    def late_once(self: _torch.Verdict, wait: bool = False) -> bool:
        if late["left"] > 0 and not wait:
            late["left"] -= 1
            return False
        return ready(self, wait)

    monkeypatch.setattr(_torch.Verdict, "ready", late_once)
    outcomes = InProcessGroup(2).run(refused_then_retried)
    assert late["left"] == 0
    assert [len(errors) for errors, _ in outcomes] == [1, 1]
    assert "none of the 1 parameters given to begin() has a gradient" in outcomes[0][0][0]
    assert "1 of the 2 ranks of the reduction refused" in outcomes[1][0][0]
    # D = 2 over W = 3, each rank's gradient (r + 1) * 2 / 3; their mean is 1.
    assert [grad for _, grad in outcomes] == [pytest.approx(2 / 3), pytest.approx(4 / 3)]


def ended_too_early(rank: int, collective: InProcessCollective, logging: str) -> dict:
    """Rank 1 ends a count-first step after one of its two microbatches; then both ranks go on
    (rank 1 abandons its step, as the error says) to a step that is whole."""
    acc = Accumulator(loss_reduction="sum", collective=collective, loss_logging=logging)
    x = torch.ones((), dtype=torch.float64, requires_grad=True)
    seen: dict = {}
    acc.begin(num_tokens=[2, 3])
    for microbatch in range(2 - rank):
        acc.scale_loss(x * (2.0 + microbatch)).backward()
    try:
        result = acc.end()
        seen["end"] = "returned"
        seen["loss"] = result.loss.item()
    except RuntimeError as refused:
        seen.setdefault("end", str(refused))
        seen["loss"] = str(refused)
        if rank == 1:
            with pytest.raises(RuntimeError) as again:  # reduced once, refused again
                acc.end()
            seen["again"] = str(again.value)
            acc.scale_loss(x * 3.0).backward()  # mended once its peer was told: still refused
            with pytest.raises(RuntimeError) as mended:
                acc.end()
            seen["mended"] = str(mended.value)
    acc.abandon()
    x.grad = None
    try:
        acc.begin(num_tokens=[1])
    except RuntimeError as refused:  # on an accelerator, once the verdict has landed
        seen["begin"] = str(refused)
        acc.begin(num_tokens=[1])
    acc.scale_loss(x * (rank + 1.0)).backward()
    seen["next"] = acc.end().loss.item()
    acc.flush()
    return seen


@pytest.mark.parametrize("path", ["host", "device"])
def test_a_rank_that_ends_too_early_refuses_the_step_on_every_rank(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if path == "device":
        monkeypatch.setattr(payload, "CHECKED_ON_HOST", ())  # the CPU as an accelerator
    told, early = InProcessGroup(2).run(lambda rank, c: ended_too_early(rank, c, "end"))
    assert early["end"].startswith("end() was called after 1 of the 2 microbatches")
    assert early["again"] == early["mended"] == early["end"] and "begin" not in early
    # The rank that ended in time learns it when it reads the step's loss; on an accelerator,
    # whose check is not read at once, the loss is NaN and the next call raises.
    assert told["end"] == "returned"
    refused = "1 of the 2 ranks of the reduction refused to end this step"
    if path == "host":
        assert refused in told["loss"] and "begin" not in told
    else:
        assert math.isnan(told["loss"]) and refused in told["begin"]
    assert early["next"] == told["next"] == 1.5  # (1 + 2) / 2 tokens: the next step is whole


def test_a_rank_that_ends_too_early_without_an_end_reduction_raises_alone() -> None:
    # loss_logging="next_step": end() reduces nothing, so the rank raises alone, and the next
    # begin() finds one rank carrying a loss that the other abandoned: refused on every rank.
    def rank_steps(rank: int, collective: InProcessCollective) -> tuple[str, str, list[float]]:
        acc = Accumulator(loss_reduction="sum", collective=collective, loss_logging="next_step")
        x = torch.ones((), dtype=torch.float64, requires_grad=True)
        acc.begin(num_tokens=[2, 3])
        for microbatch in range(2 - rank):
            acc.scale_loss(x * (2.0 + microbatch)).backward()
        ended = "returned"
        try:
            acc.end()
        except RuntimeError as refused:
            ended = str(refused)
            acc.abandon()
        with pytest.raises(DisagreementError) as next_step:
            acc.begin(num_tokens=[1])
            acc.scale_loss(x * 1.0)  # the first use of the step's totals checks them
        acc.abandon()
        # Then the ranks go on as one: the refused step left no trace that differs by rank.
        results = []
        for tokens in ([1, 2], [3]):
            acc.begin(num_tokens=tokens)
            for count in tokens:
                acc.scale_loss(x * float(count * count)).backward()
            results.append(acc.end())
        acc.flush()
        losses = [result.loss.item() for result in results]
        return ended, str(next_step.value), losses

    told, early = InProcessGroup(2).run(rank_steps)
    assert early[0].startswith("end() was called after 1 of the 2 microbatches")
    assert told[0] == "returned"
    for rank in (told, early):
        assert "a rank abandoned a step that another ended" in rank[1]
        assert rank[2] == [5 / 3, 3.0]  # (1 + 4) / 3 tokens on each rank; 9 / 3


@pytest.mark.parametrize("path", ["host", "device"])
@pytest.mark.parametrize("then", ["scale_after", "flush"])
def test_after_a_rank_ends_too_early_alone_the_ranks_go_on_as_one(
    then: str, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # loss_logging="next_step": rank 1 refuses step 1 alone, rank 0 ended it and holds its
    # loss. The next reduction every rank makes, a scale-after end() or flush(), is refused on
    # every rank (and carries that loss away), not left unpaired; then the steps are exact.
    if path == "device":
        monkeypatch.setattr(payload, "CHECKED_ON_HOST", ())  # the CPU as an accelerator

    def rank_steps(rank: int, collective: InProcessCollective) -> tuple[str, list[float]]:
        acc = Accumulator(loss_reduction="sum", collective=collective, loss_logging="next_step")
        x = torch.ones((), dtype=torch.float64, requires_grad=True)
        acc.begin(num_tokens=[2, 3])
        for microbatch in range(2 - rank):
            acc.scale_loss(x * (2.0 + microbatch)).backward()
        try:
            acc.end()
        except RuntimeError:
            acc.abandon()
        x.grad = None
        with pytest.raises(DisagreementError) as refused:
            if then == "flush":
                acc.flush()  # it checks what it reduced: the run may end here
            else:
                acc.begin(parameters=[x])
                acc.scale_loss(x * 1.0, num_tokens=1).backward()
                acc.end()  # on an accelerator: gradients NaN, and the next call raises
                acc.begin(parameters=[x])
        acc.abandon()
        gradients = []
        for count in (1, 2):
            x.grad = None
            acc.begin(parameters=[x])
            acc.scale_loss(x * float(rank + count), num_tokens=rank + count).backward()
            acc.end()
            gradients.append(x.grad.item())  # type: ignore[union-attr]
        acc.flush()
        return str(refused.value), gradients

    first, second = InProcessGroup(2).run(rank_steps)
    for rank, (refused, gradients) in enumerate((first, second)):
        assert "a rank abandoned a step that another ended" in refused
        # (rank + count) * D / W, D = 2 ranks: W = 1 + 2, then 2 + 3
        assert gradients == pytest.approx([2 * (rank + 1) / 3, 2 * (rank + 2) / 5], rel=1e-15)
