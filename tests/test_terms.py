"""Several loss terms in one Accumulator: each term exact for any split, in one collective.

The property test draws a step of sequences (some without tokens, some weights exactly 0),
a set of terms, and a split into 1 to 3 simulated ranks of microbatches (some empty, some
ranks without one), and checks the gradient and every logged loss against the full-batch fp64
truth of tests/terms_problem.py, in both modes and with both loss_logging options.
"""

from __future__ import annotations

import copy
import math
import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lossweight import Accumulator, Term
from lossweight.terms import Layout
from lossweight.testing import InProcessCollective, InProcessGroup

from .terms_problem import RESCALABLE, TERMS, Model, make_sequences, microbatch, reference

NAMES = tuple(TERMS)


@st.composite
def steps(draw: st.DrawFn, scale_after: bool) -> tuple[list[int], list[list[list[int]]], tuple]:
    """(the sequences' lengths, the split: ranks of microbatches of sequence indices, terms)."""
    lengths = draw(st.lists(st.integers(0, 4), min_size=1, max_size=8))
    world_size = draw(st.integers(1, 3))
    microbatches = [draw(st.integers(0, 3)) for _ in range(world_size)]
    slots = [(r, m) for r, count in enumerate(microbatches) for m in range(count)]
    ranks: list[list[list[int]]] = [[[] for _ in range(n)] for n in microbatches]
    if slots:
        for index in range(len(lengths)):
            rank, slot = draw(st.sampled_from(slots))
            ranks[rank][slot].append(index)
    else:  # every rank without a microbatch: the step is on one rank, in one microbatch
        ranks[0].append(list(range(len(lengths))))
    if scale_after:
        names = draw(st.sampled_from(RESCALABLE))
    else:
        chosen = draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=5, unique=True))
        names = tuple(name for name in NAMES if name in chosen)
    return lengths, ranks, names


def run_step(
    ranks: list[list[list[int]]],
    names: tuple[str, ...],
    data: object,
    model: torch.nn.Module,
    scale_after: bool,
    **options: object,
) -> tuple[list[torch.Tensor], list[dict]]:
    """One step over simulated ranks: the gradient summed over ranks (as grad_reduction="sum"
    would), and what each rank logged."""

    def rank_step(rank: int, collective: InProcessCollective) -> tuple[list, dict]:
        replica = copy.deepcopy(model)
        terms = [TERMS[name] for name in names]
        acc = Accumulator(terms=terms, collective=collective, grad_reduction="sum", **options)
        pieces = [microbatch(replica, data, rows, names) for rows in ranks[rank]]  # type: ignore[arg-type]
        if scale_after:
            acc.begin(parameters=replica)
        else:
            arguments = ("num_tokens", "num_samples", "weight_sum")
            acc.begin(**{name: [c[name] for _, c in pieces] for name in arguments})
        for losses, counts in pieces:
            acc.scale_loss(losses, **(counts if scale_after else {})).backward()
        result = acc.end()
        acc.flush()
        grads = [
            p.grad if p.grad is not None else torch.zeros_like(p) for p in replica.parameters()
        ]
        logged = {
            "loss": result.loss.item(),
            "losses": {name: value.item() for name, value in result.losses.items()},
            "num_tokens": result.num_tokens.item(),
            "num_samples": result.num_samples.item(),
            "weight_sum": result.weight_sum.item(),
        }
        return grads, logged

    results = InProcessGroup(len(ranks)).run(rank_step)
    combined = [sum(grads) for grads in zip(*(grads for grads, _ in results), strict=True)]
    return combined, [logged for _, logged in results]


def gradient(loss: torch.Tensor, model: torch.nn.Module) -> list[torch.Tensor]:
    """The full-batch gradient, 0 for parameters the terms do not use."""
    parameters = list(model.parameters())
    grads = torch.autograd.grad(loss, parameters, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g for p, g in zip(parameters, grads, strict=True)]


def max_relative_error(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> float:
    scale = max(float(e.abs().max()) for e in expected) or 1.0
    return max(float((a - e).abs().max()) for a, e in zip(actual, expected, strict=True)) / scale


@settings(max_examples=150, deadline=None)
@given(
    st.booleans().flatmap(lambda after: st.tuples(st.just(after), steps(after))),
    st.sampled_from(["end", "next_step"]),
    st.integers(0, 2**16),
)
def test_every_term_is_exact_for_any_split(case: tuple, loss_logging: str, seed: int) -> None:
    scale_after, (lengths, ranks, names) = case
    data, model = make_sequences(lengths, seed), Model(seed)
    truth, counts = reference(model, data, names)
    expected_grads = gradient(sum(truth.values()), model)
    grads, logged = run_step(ranks, names, data, model, scale_after, loss_logging=loss_logging)
    assert max_relative_error(grads, expected_grads) < 1e-10
    total = sum(value.item() for value in truth.values())
    for rank in logged:
        assert rank["losses"].keys() == set(names)
        for name in names:
            assert rank["losses"][name] == pytest.approx(truth[name].item(), rel=1e-10, abs=1e-12)
        assert rank["loss"] == pytest.approx(total, rel=1e-10, abs=1e-12)
        assert rank["num_tokens"] == counts["num_tokens"]
        assert rank["num_samples"] == counts["num_samples"]
        assert rank["weight_sum"] == pytest.approx(counts["weight_sum"], rel=1e-14, abs=1e-300)


def test_the_plain_per_microbatch_mean_is_wrong_on_the_same_data() -> None:
    # The data of the property test tells right from wrong: averaging each term's microbatch
    # losses (the usual loss / accumulation_steps) misses the truth by far more than 1e-10.
    data, model = make_sequences([3, 0, 1, 4, 2], seed=1), Model(1)
    split = [[0, 1], [2], [3, 4]]
    truth, _ = reference(model, data, ("lm", "aux"))
    plain = 0.0
    for rows in split:
        losses, counts = microbatch(model, data, rows, ("lm", "aux"))
        plain += (losses["lm"] / max(counts["num_tokens"], 1) + losses["aux"]).item() / len(split)
    assert abs(plain - sum(truth.values()).item()) > 1e-3


def test_one_collective_per_step_and_one_payload_length_for_any_terms() -> None:
    # Counting first with "next_step" and scaling after: one all-reduce per step, whatever the
    # number of terms, of one payload length (82 float64 numbers): ranks that differ in their
    # terms disagree in its digest, where payloads of different lengths would hang.
    lengths = {Layout(tuple(TERMS[n] for n in NAMES[:k])).length for k in range(1, 6)}
    assert lengths == {82}
    data, model = make_sequences([2, 3, 1], seed=3), Model(3)
    for names in (("lm",), ("lm", "aux"), NAMES[:4], NAMES):
        group = InProcessGroup(1)
        acc = Accumulator(
            terms=[TERMS[n] for n in names],
            collective=group.collective(0),
            loss_logging="next_step",
        )
        for _ in range(3):
            pieces = [microbatch(model, data, rows, names) for rows in ([0], [1, 2])]
            acc.begin(**{name: [c[name] for _, c in pieces] for name in pieces[0][1]})
            for losses, _ in pieces:
                acc.scale_loss(losses).backward()
            acc.end()
        assert group.calls == [3]
    for names in RESCALABLE:
        group = InProcessGroup(1)
        acc = Accumulator(terms=[TERMS[n] for n in names], collective=group.collective(0))
        for _ in range(3):
            model.zero_grad()
            acc.begin(parameters=model)
            for rows in ([0], [1, 2]):
                losses, counts = microbatch(model, data, rows, names)
                acc.scale_loss(losses, **counts).backward()
            acc.end()
        assert group.calls == [3]


def test_a_loop_that_scales_by_hand_gets_one_factor_per_term() -> None:
    names = ("lm", "aux", "dr")
    data, model = make_sequences([2, 0, 3], seed=4), Model(4)
    truth, _ = reference(model, data, names)
    expected = gradient(sum(truth.values()), model)
    acc = Accumulator(terms=[TERMS[n] for n in names])
    pieces = [microbatch(model, data, rows, names) for rows in ([0, 1], [2])]
    acc.begin(**{name: [c[name] for _, c in pieces] for name in ("num_tokens", "num_samples")})
    for index, (losses, _) in enumerate(pieces):
        factors = acc.backward_scale(index)
        assert isinstance(factors, dict) and list(factors) == list(names)
        sum(loss * factors[name] for name, loss in losses.items()).backward()
        acc.record_loss(index, {name: loss.detach() for name, loss in losses.items()})
    result = acc.end()
    assert max_relative_error([p.grad for p in model.parameters()], expected) < 1e-12
    assert result.losses["dr"].item() == pytest.approx(truth["dr"].item(), rel=1e-12)


def test_an_empty_step_of_terms() -> None:
    # Every count 0: every counted term's loss is 0, and the step is empty; a constant's term
    # keeps its (zero) loss and makes the step non-empty, since its normaliser is not 0.
    x = torch.zeros((), dtype=torch.float64, requires_grad=True)
    for names, empty in ((("lm", "aux", "kl"), True), (("lm", "dr"), False)):
        acc = Accumulator(terms=[TERMS[n] for n in names])
        acc.begin(num_tokens=[0], num_samples=[0], weight_sum=[0.0])
        nothing = x * torch.zeros(0, dtype=torch.float64)  # a microbatch without items
        losses = {name: nothing.mean() if name == "aux" else nothing.sum() for name in names}
        acc.scale_loss(losses).backward()
        result = acc.end()
        assert bool(result.is_empty) is empty
        assert all(value.item() == 0 for value in result.losses.values())
        assert x.grad is not None and x.grad.item() == 0  # the mean's NaN of 0/0 reached nothing
        x.grad = None


def test_terms_survive_state_dict_and_pickle() -> None:
    terms = [TERMS["lm"], TERMS["kl"], TERMS["dr"]]
    acc = Accumulator(terms=terms, loss_logging="next_step")
    state = acc.state_dict()
    assert state["options"]["terms"] == [
        ["lm", "sum", "tokens"],
        ["kl", "sum", "weight_sum"],
        ["dr", "sum", 16.0],
    ]
    assert state["options"]["weight_by"] == "tokens"
    copied = pickle.loads(pickle.dumps(acc))
    assert copied.options == acc.options
    Accumulator(terms=[Term("other", "mean")]).load_state_dict(state)  # same weight_by
    with pytest.raises(ValueError, match="saved with weight_by='tokens'"):
        Accumulator(terms=[TERMS["aux"]]).load_state_dict(state)


def test_a_term_missing_from_a_microbatch_is_refused_by_name() -> None:
    acc = Accumulator(terms=[TERMS["lm"], TERMS["aux"]])
    acc.begin(num_tokens=[1], num_samples=[1])
    x = torch.ones((), requires_grad=True)
    with pytest.raises(ValueError, match=r"got one loss, but the Accumulator's terms are"):
        acc.scale_loss(x * 1)
    with pytest.raises(ValueError, match=r"got losses for \['aux', 'lm', 'mtp'\]"):
        acc.scale_loss({"lm": x, "aux": x, "mtp": x})
    with pytest.raises(ValueError, match=r"num_samples=None, but weight_by='samples' weights"):
        Accumulator(terms=[TERMS["lm"], TERMS["aux"]]).begin(num_tokens=[1])


WEIGHTS = st.one_of(st.just(0.0), st.floats(1e-9, 1e-3), st.floats(0.5, 2.0), st.floats(1e3, 1e9))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(WEIGHTS, max_size=5), min_size=1, max_size=3), st.booleans())
def test_a_weight_sum_is_within_the_bound_of_a_float_sum(ranks: list, tensors: bool) -> None:
    # Float weights are summed per rank, then over ranks, in float64: the order decides the
    # rounding. The total of k non-negative weights is within (k + 1) * 2**-53 of the exact
    # sum, relatively; integer counts stay exact (below 2**62).

    def rank_step(rank: int, collective: InProcessCollective) -> float:
        weights = ranks[rank]
        acc = Accumulator(terms=[TERMS["kl"]], collective=collective)
        given = torch.tensor(weights, dtype=torch.float64) if tensors else weights
        acc.begin(weight_sum=given)
        x = torch.ones((), dtype=torch.float64, requires_grad=True)
        for _ in weights:
            acc.scale_loss(x * 1).backward()
        return acc.end().weight_sum.item()

    exact = math.fsum(w for weights in ranks for w in weights)
    count = sum(len(weights) for weights in ranks)
    for total in InProcessGroup(len(ranks)).run(rank_step):
        assert abs(total - exact) <= (count + 1) * 2**-53 * exact
