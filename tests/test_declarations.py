"""Constants, factors and options that ranks or terms could mix up: exact, or a clear error.

A constant normaliser is one number however it is written, and the ranks agree on it before
any gradient uses it; a loop that scales by hand gets each term's factor by name; the forms of
``terms=`` a user may pass are taken or refused by name; ``record_loss()``'s errors name it.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from lossweight import Accumulator, DisagreementError, Term
from lossweight.testing import InProcessCollective, InProcessGroup

F64 = torch.float64


def _constant_step(constant: object, loss_logging: str = "end") -> list[float]:
    """Two ranks, each with one summed loss 2 x over a term divided by its own ``constant``
    (rank 1's given as ``float(constant)``): each rank's gradient."""

    def rank_step(rank: int, collective: InProcessCollective) -> float:
        given = constant if rank == 0 else float(constant)  # type: ignore[arg-type]
        term = Term("policy", "sum", given)
        acc = Accumulator(terms=[term], collective=collective, loss_logging=loss_logging)  # type: ignore[arg-type]
        x = torch.zeros((), dtype=F64, requires_grad=True)
        acc.begin(num_tokens=[3])
        acc.scale_loss({"policy": x * 2.0}).backward()
        acc.end()
        assert x.grad is not None
        return x.grad.item()

    return InProcessGroup(2).run(rank_step)


@pytest.mark.parametrize("constant", [4096, 4096.0, np.float64(4096.0), np.int64(4096)])
def test_a_constant_is_one_number_however_it_is_written(constant: object) -> None:
    # D = 2 (the mean of 2 ranks) over the constant: each rank's factor is 2 / 4096.
    assert _constant_step(constant) == [pytest.approx(4.0 / 4096, rel=1e-15)] * 2
    term = Term("policy", "sum", constant)  # type: ignore[arg-type]
    assert type(term.weight_by) is float and term.weight_by == 4096.0
    assert Term("policy", "sum", 4096) == Term("policy", "sum", 4096.0)


def test_a_numpy_constant_saves_as_a_python_number() -> None:
    acc = Accumulator(terms=[Term("policy", "sum", np.float32(512.0))])
    buffer = io.BytesIO()
    torch.save(acc.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    assert state["options"]["terms"] == [["policy", "sum", 512.0]]
    Accumulator(terms=[Term("policy", "sum", 512.0)]).load_state_dict(state)


@pytest.mark.parametrize("loss_logging", ["end", "next_step"])
def test_ranks_with_different_constants_are_refused_before_any_gradient(loss_logging: str) -> None:
    # The steps' counts agree, their constants do not: the first scale_loss() of the step,
    # which needs the normaliser, refuses on every rank, before any backward.

    def rank_step(rank: int, collective: InProcessCollective) -> str:
        constant = 4096.0 if rank == 0 else 2048.0
        term = Term("policy", "sum", constant)
        acc = Accumulator(terms=[term], collective=collective, loss_logging=loss_logging)  # type: ignore[arg-type]
        x = torch.zeros((), dtype=F64, requires_grad=True)
        acc.begin(num_tokens=[3])
        with pytest.raises(DisagreementError, match="the ranks differ in their loss terms") as info:
            acc.scale_loss({"policy": x * 2.0})
        assert x.grad is None
        return str(info.value)

    messages = InProcessGroup(2).run(rank_step)
    assert "'policy' (sum, by 4096.0)" in messages[0]
    assert "'policy' (sum, by 2048.0)" in messages[1]


def test_a_loop_that_scales_by_hand_gets_each_term_s_factor_by_name() -> None:
    # The losses' dict in another order than the terms: each factor still goes to its term.
    acc = Accumulator(terms=[Term("lm", "sum"), Term("aux", "mean", "samples")])
    x = torch.zeros((), dtype=F64, requires_grad=True)
    acc.begin(num_tokens=[3, 1], num_samples=[1, 3])
    for index in range(2):
        factors = acc.backward_scale(index)
        assert isinstance(factors, dict) and list(factors) == ["lm", "aux"]
        losses = {"aux": x * 5.0, "lm": x * 2.0}
        sum(loss * factors[name] for name, loss in losses.items()).backward()
        acc.record_loss(index, {name: loss.detach() for name, loss in losses.items()})
    acc.end()
    # lm: 2 + 2 over 4 tokens; aux: means of 5, weighted 1 and 3 over 4 samples.
    assert x.grad is not None and x.grad.item() == pytest.approx(4 / 4 + 5.0, rel=1e-15)
    # One term: its factor, a 0-dim tensor, as before.
    single = Accumulator(loss_reduction="sum")
    single.begin(num_tokens=[4])
    assert single.backward_scale(0).shape == ()


@pytest.mark.parametrize(
    "terms",
    [
        Term("lm", "sum"),
        (term for term in [Term("lm", "sum"), Term("aux", "mean", "samples")]),
        {"lm": Term("lm", "sum")}.values(),
    ],
    ids=["one Term", "a generator", "a dict's values"],
)
def test_terms_may_be_any_iterable_of_terms_or_one(terms: object) -> None:
    acc = Accumulator(terms=terms)  # type: ignore[arg-type]
    assert acc.options.terms[0] == Term("lm", "sum")


@pytest.mark.parametrize(
    "terms", ["lm", {"lm": "sum"}, [Term("lm", "sum"), "aux"], 3, {Term("lm", "sum")}]
)
def test_terms_that_are_not_terms_are_refused_by_name(terms: object) -> None:
    with pytest.raises(TypeError, match=r"is not a non-empty list of lossweight.Term"):
        Accumulator(terms=terms)  # type: ignore[arg-type]


def test_record_loss_s_errors_name_record_loss() -> None:
    acc = Accumulator(terms=[Term("lm", "sum"), Term("aux", "mean", "samples")])
    acc.begin(num_tokens=[1], num_samples=[1])
    acc.backward_scale(0)
    x = torch.ones((), requires_grad=True)
    with pytest.raises(ValueError, match=r"^record_loss\(\) got one loss, but the Accumulator"):
        acc.record_loss(0, x)
    with pytest.raises(TypeError, match=r"^record_loss\(\) got loss="):
        acc.record_loss(0, {"lm": 1.0, "aux": x})


def test_numpy_integers_count_and_numpy_arrays_are_refused_by_name() -> None:
    acc = Accumulator(loss_reduction="sum")
    x = torch.ones((), dtype=F64, requires_grad=True)
    acc.begin(num_tokens=[np.int64(3), np.int32(1)])
    for _ in range(2):
        acc.scale_loss(x * 2).backward()
    assert acc.end().num_tokens.item() == 4
    x.grad = None
    acc.begin(parameters=[x])
    acc.scale_loss(x * 2, num_tokens=np.int16(4)).backward()
    assert acc.end().num_tokens.item() == 4
    with pytest.raises(TypeError, match=r"^num_tokens=array\(\[3, 1\]\) is not a sequence of"):
        acc.begin(num_tokens=np.array([3, 1]))
    with pytest.raises(TypeError, match=r"as a 1-D integer tensor or a list of ints$"):
        acc.begin(num_tokens=np.array([3, 1]))


def test_a_numpy_integer_step_number_is_taken_as_an_int() -> None:
    acc = Accumulator(loss_reduction="sum")
    acc.begin(num_tokens=[1], step=np.int64(3))
    acc.scale_loss(torch.ones((), dtype=F64, requires_grad=True)).backward()
    result = acc.end()
    assert result.step == 3 and type(result.step) is int
    assert type(acc.state_dict()["steps"]) is int


@pytest.mark.parametrize("steps", [np.int64(3), np.uint8(3), True, -1, 3.0])
def test_a_saved_step_count_is_a_natural_number_as_a_step_number_is(steps: object) -> None:
    # load_state_dict() and begin(step=...) check a step by the one rule: an integer 0 or more
    # (numpy's taken as an int), never a bool.
    acc = Accumulator(loss_reduction="sum")
    state = {**acc.state_dict(), "steps": steps}
    if isinstance(steps, np.integer):
        acc.load_state_dict(state)
        assert acc.steps == 3 and type(acc.steps) is int
        return
    with pytest.raises(ValueError, match=r"^state_dict has steps="):
        acc.load_state_dict(state)
    with pytest.raises(ValueError, match=r"^begin\(step="):
        acc.begin(num_tokens=[1], step=steps)


@pytest.mark.parametrize("terms", [None, [Term("lm", "sum"), Term("aux", "mean", "samples")]])
def test_a_factor_changed_in_place_by_its_reader_leaves_the_gradient_alone(
    terms: list[Term] | None,
) -> None:
    # Before: backward_scale() returned a view of the factors scale_loss() applies, and a
    # factor read (say, to log it) then changed in place gave 7.75 for a gradient of 1.
    acc = Accumulator(loss_reduction="sum") if terms is None else Accumulator(terms=terms)
    x = torch.zeros((), dtype=F64, requires_grad=True)
    acc.begin(num_tokens=[1, 3], **({} if terms is None else {"num_samples": [1, 1]}))
    for factor in [acc.backward_scale(i) for i in (0, 1)]:
        for value in factor.values() if isinstance(factor, dict) else [factor]:
            value.mul_(10)
    for tokens in (1, 3):
        loss = tokens * (x + 2.0)
        acc.scale_loss(loss if terms is None else {"lm": loss, "aux": x + 1.0}).backward()
    acc.end()
    assert x.grad.item() == (1.0 if terms is None else 2.0)


def _weights_checked(declared: object, given: object) -> str:
    """What scale_loss() of a count-first step says of ``given`` for the weight sum that
    begin() declared as ``declared``: "agree", or its error."""
    acc = Accumulator(terms=[Term("policy", "sum", "weight_sum")])
    x = torch.ones((), dtype=F64, requires_grad=True)
    acc.begin(weight_sum=[declared])
    try:
        acc.scale_loss({"policy": x * 2}, weight_sum=given).backward()
    except (ValueError, RuntimeError) as refused:
        acc.abandon()
        return str(refused)
    assert acc.end().weight_sum.item() == pytest.approx(float(torch.as_tensor(declared)))
    return "agree"


# A weight sum of 1,000 weights in float32 (in two orders) and in float64: each the same items.
_W = torch.rand(1000, generator=torch.Generator().manual_seed(0), dtype=F64) * 3
_F32, _F32_REVERSED = _W.float().sum(), _W.float().flip(0).cumsum(0)[-1]


@pytest.mark.parametrize(
    ("declared", "given"),
    [
        (_F32, _W.sum()),  # float32 on one side, float64 on the other
        (_F32, _F32_REVERSED),  # float32 summed in another order
        (_W.sum().item(), _W.flip(0).sum()),  # a Python float and a float64 tensor
        (_W.sum().item(), _W.flip(0).sum().item()),  # two Python floats
        (_W.bfloat16().sum(), _W.sum()),  # bfloat16: its own round-off
    ],
)
def test_a_weight_sum_in_another_order_or_dtype_agrees(declared: object, given: object) -> None:
    assert float(_F32) != float(_W.sum())  # the float32 and float64 sums do differ
    assert _weights_checked(declared, given) == "agree"


@pytest.mark.parametrize(
    ("declared", "given"),
    [
        (_W.sum(), _W[1:].sum()),  # one weight of 1,000 left out, in float64
        (_F32, _W[1:].float().sum()),  # and in float32
        (_W.sum().item(), _W[1:].sum().item()),  # as Python floats
        (_W.sum().item(), _W.sum().item() * (1 + 1e-7)),  # float64 differs beyond 1.5e-8
    ],
)
def test_a_weight_sum_over_other_items_is_refused(declared: object, given: object) -> None:
    assert "the loss and its count cover different items" in _weights_checked(declared, given)


def test_an_integer_weight_among_bfloat16_ones_stays_exact() -> None:
    # 301 in bfloat16 is 300: the list is stacked at float64 where an integer is in it.
    acc = Accumulator(loss_reduction="mean", weight_by="weight_sum")
    x = torch.ones((), dtype=F64, requires_grad=True)
    acc.begin(weight_sum=[torch.tensor(301), torch.tensor(1.0, dtype=torch.bfloat16)])
    acc.scale_loss(x * 1.0).backward()
    acc.scale_loss(x * 0.0).backward()
    assert acc.end().weight_sum.item() == 302
    assert x.grad is not None and x.grad.item() == pytest.approx(301 / 302, rel=1e-12)
