"""lossweight.aggregate: RL trainers' aggregation modes, exact over the whole step.

Random sequences (some tokens masked out, some sequences without a counted token), laid out
one per row or packed several to a row, split at random into ranks and microbatches (empty
ones included): the gradient and the logged loss equal the mode's definition over the whole
step, computed in plain Python.
"""

from __future__ import annotations

import itertools
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lossweight import Accumulator, aggregate
from lossweight.testing import InProcessCollective, InProcessGroup

MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
MAX_LENGTH = 7  # the Dr. GRPO constant of the "-norm" mode


def definition(mode: str, sequences: list[list[tuple[int, bool]]]) -> list[Fraction]:
    """d(step loss)/d(token loss) for every token, in order, from the mode's definition over
    the whole step (a token's loss is its coefficient times its parameter)."""
    counted = [sum(keep for _, keep in s) for s in sequences]
    tokens, with_target = sum(counted), sum(n > 0 for n in counted)
    weights = []
    for sequence, n in zip(sequences, counted, strict=True):
        for _, keep in sequence:
            if not keep:
                weights.append(Fraction(0))
            elif mode == "token-mean":
                weights.append(Fraction(1, tokens))
            elif mode == "seq-mean-token-mean":
                weights.append(Fraction(1, n * with_target))
            elif mode == "seq-mean-token-sum":
                weights.append(Fraction(1, with_target))
            else:
                weights.append(Fraction(1, MAX_LENGTH * with_target))
    return weights


@st.composite
def steps(draw: st.DrawFn) -> dict:
    sequences = draw(
        st.lists(
            st.lists(st.tuples(st.integers(-3, 3), st.booleans()), min_size=1, max_size=5),
            min_size=1,
            max_size=8,
        )
    )
    packed = draw(st.booleans())
    length = draw(st.integers(max(map(len, sequences)), 9))
    # Rows of (token index, coefficient, kept, position id); packed rows hold several sequences.
    rows: list[list[tuple[int, int, bool, int]]] = [[]]
    index = 0
    for sequence in sequences:
        if rows[-1] and (not packed or len(rows[-1]) + len(sequence) > length):
            rows.append([])
        for position, (coefficient, keep) in enumerate(sequence):
            rows[-1].append((index, coefficient, keep, position))
            index += 1
    ranks = draw(st.integers(1, 3))
    owner = draw(st.lists(st.integers(0, ranks - 1), min_size=len(rows), max_size=len(rows)))
    shares = []
    for rank in range(ranks):
        mine = [row for row, o in zip(rows, owner, strict=True) if o == rank]
        cuts = sorted(draw(st.lists(st.integers(0, len(mine)), max_size=3)))
        bounds = [0, *cuts, len(mine)]
        shares.append([mine[a:b] for a, b in itertools.pairwise(bounds)])
    return {
        "sequences": sequences,
        "length": length,
        "shares": shares,
        "tokens": index,
        "mode": draw(st.sampled_from(MODES)),
        "count_first": draw(st.booleans()),
    }


def tensors(rows: list[list[tuple[int, int, bool, int]]], length: int) -> tuple[torch.Tensor, ...]:
    """A microbatch: token indices (padding points at index 0), coefficients (0 on padding),
    the mask and the position ids; padding continues the last position ids."""
    index, coefficient, mask, position = (torch.zeros(len(rows), length) for _ in range(4))
    for r, row in enumerate(rows):
        for t, (i, c, keep, p) in enumerate(row):
            index[r, t], coefficient[r, t], mask[r, t], position[r, t] = i, c, keep, p
        for t in range(len(row), length):
            position[r, t] = position[r, t - 1] + 1 if t else 0
    return index.long(), coefficient.double(), mask.long(), position.long()


def check_step(step: dict, shards: list[list[int]]) -> None:
    """Run ``step`` on its ranks, each split further into context-parallel ranks that hold
    the positions of ``shards`` (of every row), and compare with the definition."""
    mode, length, count_first = step["mode"], step["length"], step["count_first"]
    extra = {"max_length": MAX_LENGTH} if mode.endswith("-norm") else {}
    # Sharded, a sequence-level mode counts each rank's share of a sequence: a float weight.
    weight_by = "tokens" if mode == "token-mean" else "samples"
    if len(shards) > 1 and mode != "token-mean":
        weight_by = "weight_sum"
    argument = {"tokens": "num_tokens", "samples": "num_samples"}.get(weight_by, weight_by)

    def rank_step(rank: int, collective: InProcessCollective) -> tuple[torch.Tensor, float]:
        data_rank, held = divmod(rank, len(shards))
        positions = torch.tensor(shards[held], dtype=torch.int64)
        sharded = {"positions": positions} if len(shards) > 1 else {}
        theta = torch.ones(step["tokens"], dtype=torch.float64, requires_grad=True)
        acc = Accumulator(weight_by=weight_by, loss_reduction="sum", collective=collective)  # type: ignore[arg-type]
        microbatches = [tensors(rows, length) for rows in step["shares"][data_rank]]
        if count_first:
            # The count depends on the mask alone: aggregate it over zero losses.
            counts = [
                aggregate(
                    torch.zeros(*m.shape[:-1], len(positions) if sharded else m.shape[-1]),
                    m, mode=mode, position_ids=p, **extra, **sharded,
                )[1]
                for _, _, m, p in microbatches
            ]  # fmt: skip
            acc.begin(**{argument: counts})
        else:
            acc.begin(parameters=[theta])
        for index, coefficient, mask, position in microbatches:
            token_losses = theta[index] * coefficient
            if sharded:  # this rank's positions of every row, as context parallelism holds them
                token_losses = token_losses[..., positions]
            loss, count = aggregate(
                token_losses, mask, mode=mode, position_ids=position, **extra, **sharded
            )
            given = {} if count_first else {argument: count}
            acc.scale_loss(loss, **given).backward()
        result = acc.end()
        grad = theta.grad if theta.grad is not None else torch.zeros_like(theta)
        return grad, result.loss.item()

    ranks = InProcessGroup(len(step["shares"]) * len(shards)).run(rank_step)
    grad = torch.stack([g for g, _ in ranks]).mean(0)  # as DDP averages the ranks' gradients
    weights = definition(mode, step["sequences"])
    coefficients = [c for s in step["sequences"] for c, _ in s]
    expected = [float(w * c) for w, c in zip(weights, coefficients, strict=True)]
    torch.testing.assert_close(
        grad, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-14
    )
    logged = float(sum(w * c for w, c in zip(weights, coefficients, strict=True)))
    for _, loss in ranks:  # every rank logs the step's loss
        assert loss == pytest.approx(logged, rel=1e-12, abs=1e-14)


@settings(max_examples=250, deadline=None)
@given(steps())
def test_every_mode_is_the_definition_over_the_whole_step(step: dict) -> None:
    check_step(step, [list(range(step["length"]))])


@settings(max_examples=150, deadline=None)
@given(steps(), st.data())
def test_context_parallel_ranks_give_the_definition_too(step: dict, data: st.DataObject) -> None:
    # Each data rank's microbatches are split again over 2 or 3 context-parallel ranks, each
    # holding some positions of every row (contiguous, round-robin or any: a rank may hold none),
    # and a sequence's tokens, packed or not, fall on several of them.
    shards_count = data.draw(st.integers(2, 3))
    layout = data.draw(st.sampled_from(["contiguous", "round-robin", "any"]))
    length = step["length"]
    if layout == "contiguous":
        owner = [p * shards_count // length for p in range(length)]
    elif layout == "round-robin":
        owner = [p % shards_count for p in range(length)]
    else:
        owner = data.draw(
            st.lists(st.integers(0, shards_count - 1), min_size=length, max_size=length)
        )
    check_step(step, [[p for p in range(length) if owner[p] == s] for s in range(shards_count)])


def test_a_masked_out_loss_adds_nothing_not_even_a_nan() -> None:
    losses = torch.tensor([[1.0, float("nan")], [2.0, 3.0]], requires_grad=True)
    mask = torch.tensor([[1, 0], [0, 0]])
    for mode in MODES:
        extra = {"max_length": 2} if mode.endswith("-norm") else {}
        total, count = aggregate(losses, mask, mode=mode, **extra)  # type: ignore[arg-type]
        total.backward()
        assert total.item() == (0.5 if extra else 1.0) and count.item() == 1
        assert losses.grad is not None and torch.isfinite(losses.grad).all()
        losses.grad = None


def test_packed_rows_are_their_sequences() -> None:
    losses = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])
    mask = torch.ones(2, 4)
    position_ids = torch.tensor([[0, 1, 0, 1], [0, 1, 2, 3]])
    total, count = aggregate(losses, mask, mode="seq-mean-token-mean", position_ids=position_ids)
    assert (total.item(), count.item()) == (1.5 + 3.5 + 6.5, 3)
    rows = aggregate(losses, mask, mode="seq-mean-token-mean")  # each row one sequence
    assert (rows[0].item(), rows[1].item()) == (2.5 + 6.5, 2)
    cu_seqlens = torch.tensor([0, 2, 4, 8])
    flat = aggregate(
        losses.view(1, 8), mask.view(1, 8), mode="seq-mean-token-mean", cu_seqlens=cu_seqlens
    )
    assert (flat[0].item(), flat[1].item()) == (total.item(), 3)


@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "seq-mean-token-sum"])
def test_a_sequence_split_over_microbatches_counts_once_or_is_refused(mode: str) -> None:
    losses = torch.arange(1.0, 7.0, dtype=torch.float64).view(1, 6)
    mask, whole = torch.ones(1, 6), torch.arange(6).view(1, 6)
    expected = aggregate(losses, mask, mode=mode, position_ids=whole)
    # Cut in two microbatches: the second piece begins inside the sequence, refused.
    first = aggregate(losses[:, :3], mask[:, :3], mode=mode, position_ids=whole[:, :3])
    assert first[1].item() == 1
    with pytest.raises(RuntimeError, match=r"^a row of mask begins inside a sequence"):
        aggregate(losses[:, 3:], mask[:, 3:], mode=mode, position_ids=whole[:, 3:])
    # Split on purpose: each piece gives the whole mask and its positions, and counts its share.
    pieces = [
        aggregate(losses[:, held], mask, mode=mode, position_ids=whole, positions=held)
        for held in (slice(0, 2), slice(2, 6))
    ]
    assert [count.item() for _, count in pieces] == pytest.approx([2 / 6, 4 / 6])
    assert sum(total for total, _ in pieces).item() == pytest.approx(expected[0].item())
    # A left-padded row (padding before position id 0) and token means are not refused.
    padded = torch.tensor([[1, 1, 0, 1, 2, 3]])
    left = aggregate(losses, torch.tensor([[0, 0, 1, 1, 1, 1]]), mode=mode, position_ids=padded)
    assert left[1].item() == 1
    tokens = aggregate(losses[:, 3:], mask[:, 3:], mode="token-mean", position_ids=whole[:, 3:])
    assert tokens[1].item() == 3


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (
            lambda: aggregate(torch.ones(2, 3), torch.ones(2, 3), mode="grpo"),
            ValueError,
            r"mode='grpo' is not supported; pass one of token-mean",
        ),  # type: ignore[arg-type]
        (
            lambda: aggregate(torch.ones(2, 3), torch.ones(2, 3), mode="seq-mean-token-sum-norm"),
            ValueError,
            r"max_length=None with mode='seq-mean-token-sum-norm'",
        ),
        (
            lambda: aggregate(torch.ones(2, 3), torch.ones(2, 3), mode="token-mean", max_length=4),
            ValueError,
            r"pass max_length \(the constant",
        ),
        (
            lambda: aggregate(
                torch.ones(2, 3), torch.ones(2, 3), mode="seq-mean-token-sum-norm", max_length=0
            ),
            ValueError,
            r"max_length=0; pass a positive int",
        ),
        (
            lambda: aggregate(torch.ones(2, 3), torch.ones(2, 4), mode="token-mean"),
            ValueError,
            r"token_losses has shape \(2, 3\) but mask \(2, 4\)",
        ),
        (
            lambda: aggregate(
                torch.ones(2, 3), torch.ones(2, 8), mode="token-mean", positions=slice(0, 4)
            ),
            ValueError,
            r"token_losses has shape \(2, 3\) but mask \(2, 8\) at positions=slice\(0, 4, None\)",
        ),
        (
            lambda: aggregate(torch.ones(2, 3), torch.full((2, 3), 0.5), mode="token-mean"),
            RuntimeError,
            r"mask holds values other than 0 and 1",
        ),
    ],
)
def test_errors(call, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        call()


def test_aggregate_compiles_without_graph_breaks() -> None:
    torch._dynamo.reset()
    losses, mask = torch.randn(2, 5), torch.tensor([[1, 1, 0, 1, 1], [1, 0, 0, 0, 0]])
    position_ids = torch.tensor([[0, 1, 2, 0, 1], [0, 1, 2, 3, 4]])

    def every_mode(losses: torch.Tensor, mask: torch.Tensor, position_ids: torch.Tensor):
        return [
            aggregate(
                losses,
                mask,
                mode=mode,
                position_ids=position_ids,
                **({"max_length": 5} if mode.endswith("-norm") else {}),
            )  # type: ignore[arg-type]
            for mode in MODES
        ]

    compiled = torch.compile(every_mode, fullgraph=True)
    for got, expected in zip(
        compiled(losses, mask, position_ids), every_mode(losses, mask, position_ids), strict=True
    ):
        torch.testing.assert_close(got, expected)
