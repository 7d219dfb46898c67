"""The counting helpers agree with a plain-Python count and with torch's cross-entropy."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import lossweight
from lossweight import count_sequences, count_tokens, count_tokens_per_row, token_cross_entropy

IGNORE = -100


@st.composite
def hf_batches(draw: st.DrawFn) -> dict:
    """A Hugging Face-style batch: padded token ids, an attention mask, labels with ignored
    positions; padding on the left or on the right; some rows entirely padding."""
    rows = draw(st.integers(0, 4))
    length = draw(st.integers(2, 7))
    left = draw(st.booleans())
    input_ids, attention_mask, labels = [], [], []
    for _ in range(rows):
        real = draw(st.integers(0, length))
        ids = draw(st.lists(st.integers(0, 9), min_size=length, max_size=length))
        keep = [1] * real + [0] * (length - real)
        keep = keep[::-1] if left else keep
        ignored = draw(st.lists(st.booleans(), min_size=length, max_size=length))
        row_labels = [
            IGNORE if (not k or skip) else token
            for token, k, skip in zip(ids, keep, ignored, strict=True)
        ]
        input_ids.append(ids)
        attention_mask.append(keep)
        labels.append(row_labels)
    shape = (rows, length)
    return {
        "input_ids": torch.tensor(input_ids, dtype=torch.int64).reshape(shape),
        "attention_mask": torch.tensor(attention_mask, dtype=torch.int64).reshape(shape),
        "labels": torch.tensor(labels, dtype=torch.int64).reshape(shape),
    }


def reference_counts(
    labels: list[list[int]], mask: list[list[int]] | None, shift: bool
) -> list[int]:
    counts = []
    for r, row in enumerate(labels):
        count = 0
        for t, label in enumerate(row):
            if shift and t == 0:
                continue  # nothing predicts the first token of a row
            if label != IGNORE and (mask is None or mask[r][t] != 0):
                count += 1
        counts.append(count)
    return counts


@settings(max_examples=200)
@given(hf_batches(), st.booleans(), st.booleans())
def test_counts_equal_a_plain_python_count(batch: dict, shift: bool, use_mask: bool) -> None:
    labels = batch["labels"]
    mask = batch["attention_mask"] if use_mask else None
    expected = reference_counts(labels.tolist(), None if mask is None else mask.tolist(), shift)
    per_row = count_tokens_per_row(labels, shift=shift, mask=mask)
    total = count_tokens(labels, shift=shift, mask=mask)
    assert per_row.tolist() == expected
    assert total.item() == sum(expected)
    assert per_row.dtype == total.dtype == torch.int64
    assert total.dim() == 0


def test_a_mask_excludes_positions_whose_labels_are_not_ignored() -> None:
    # A loss mask that drops the prompt of each row: its labels are real tokens, yet no target.
    labels = torch.tensor([[5, 6, 7, 8], [1, 2, 3, IGNORE]])
    loss_mask = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1]])
    assert count_tokens_per_row(labels, mask=loss_mask).tolist() == [2, 2]
    assert count_tokens_per_row(labels, mask=loss_mask, shift=True).tolist() == [2, 2]
    assert count_tokens_per_row(labels, shift=True).tolist() == [3, 2]


@settings(max_examples=100)
@given(hf_batches(), st.booleans(), st.booleans(), st.integers(0, 2**16))
def test_cross_entropy_equals_torch_on_the_shifted_tensors(
    batch: dict, shift: bool, use_mask: bool, seed: int
) -> None:
    labels = batch["labels"]
    mask = batch["attention_mask"] if use_mask else None
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(*labels.shape, 11, generator=generator, dtype=torch.float64)
    logits.requires_grad_(True)
    loss_sum, count = token_cross_entropy(logits, labels, shift=shift, mask=mask)

    targets = labels.clone()
    if mask is not None:
        targets[mask == 0] = IGNORE
    used_logits = logits[:, :-1] if shift else logits
    targets = targets[:, 1:] if shift else targets
    expected = F.cross_entropy(
        used_logits.reshape(-1, 11), targets.reshape(-1), ignore_index=IGNORE, reduction="sum"
    )
    assert torch.allclose(loss_sum, expected, rtol=1e-12, atol=0)
    assert count.item() == count_tokens(labels, shift=shift, mask=mask).item()
    loss_sum.backward()
    assert torch.isfinite(logits.grad).all()
    if count.item() == 0:
        assert loss_sum.item() == 0.0
        assert (logits.grad == 0).all()


def test_an_all_ignored_microbatch_gives_zero_not_nan() -> None:
    logits = torch.randn(2, 5, 7, requires_grad=True)
    labels = torch.full((2, 5), IGNORE)
    loss_sum, count = token_cross_entropy(logits, labels, shift=True)
    loss_sum.backward()
    assert (loss_sum.item(), count.item()) == (0.0, 0)
    assert (logits.grad == 0).all()
    empty_sum, empty_count = token_cross_entropy(torch.randn(0, 5, 7), torch.zeros(0, 5).long())
    assert (empty_sum.item(), empty_count.item()) == (0.0, 0)


def test_bf16_logits_are_accumulated_in_float32() -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 512, 50, generator=generator).to(torch.bfloat16)
    labels = torch.randint(0, 50, (8, 512), generator=generator)
    loss_sum, count = token_cross_entropy(logits, labels, shift=True)
    assert loss_sum.dtype == torch.float32
    exact = F.cross_entropy(
        logits[:, :-1].double().reshape(-1, 50), labels[:, 1:].reshape(-1), reduction="sum"
    )
    # Each of the 4,088 token losses is exact to float32 round-off; a bf16 accumulator would be
    # off by about 2**-8 relative.
    assert abs(loss_sum.double() - exact) / exact < 1e-5
    assert count.item() == 8 * 511


@pytest.mark.parametrize("shift", [False, True])
def test_helpers_compile_without_graph_breaks(shift: bool) -> None:
    torch._dynamo.reset()
    labels = torch.tensor([[IGNORE, 3, 4, IGNORE], [1, 2, IGNORE, IGNORE]])
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 0]])
    logits = torch.randn(2, 4, 6)

    def everything(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor):
        return (
            count_tokens(labels, shift=shift, mask=mask),
            count_tokens_per_row(labels, shift=shift, mask=mask),
            *token_cross_entropy(logits, labels, shift=shift, mask=mask),
        )

    compiled = torch.compile(everything, fullgraph=True)  # raises on any graph break
    for got, expected in zip(
        compiled(logits, labels, mask), everything(logits, labels, mask), strict=True
    ):
        torch.testing.assert_close(got, expected)


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (
            lambda: count_tokens(torch.ones(2, 3)),
            TypeError,
            r"labels has dtype torch.float32, but labels are class indices; pass an integer tensor",
        ),
        (
            lambda: count_tokens(torch.ones(2, 3, dtype=torch.bool)),
            TypeError,
            r"labels has dtype torch.bool",
        ),
        (
            lambda: count_tokens(torch.tensor(3)),
            ValueError,
            r"labels is a 0-dim tensor; pass labels of shape \(..., sequence\)",
        ),
        (
            lambda: count_tokens(torch.ones(2, 3).long(), mask=torch.ones(2, 4)),
            ValueError,
            r"mask has shape \(2, 4\) but labels \(2, 3\); pass a mask of the labels' shape",
        ),
        (
            lambda: token_cross_entropy(torch.ones(2, 3), torch.ones(2, 3).long()),
            ValueError,
            r"logits has shape \(2, 3\) and labels \(2, 3\); logits must have the labels' shape plus a last dimension",
        ),
    ],
)
def test_errors(call, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        call()


def test_rows_of_one_position_have_no_target_when_shifted() -> None:
    # With dynamic padding, a microbatch of one-token rows is an empty microbatch, as Hugging
    # Face counts it.
    labels = torch.tensor([[5], [-100]])
    assert count_tokens(labels, shift=True).item() == 0
    assert count_tokens_per_row(labels, shift=True).tolist() == [0, 0]
    logits = torch.randn(2, 1, 7, requires_grad=True)
    loss_sum, count = token_cross_entropy(logits, labels, shift=True)
    loss_sum.backward()
    assert loss_sum.item() == 0.0 and count.item() == 0
    assert (logits.grad == 0).all()


# Packed rows: several sequences in one row, against the same sequences unpacked.


@st.composite
def packs(draw: st.DrawFn) -> dict:
    """Sequences of 1 to 6 tokens (some labels ignored, some sequences without any target),
    packed in order into rows of one length; a row's tail that no sequence fills is padding
    (ignored labels, position ids counting on from the last sequence, as collators pad)."""
    sequences = draw(
        st.lists(
            st.lists(st.tuples(st.integers(0, 5), st.booleans()), min_size=1, max_size=6),
            min_size=1,
            max_size=8,
        )
    )
    sequences = [[IGNORE if ignored else token for token, ignored in s] for s in sequences]
    length = draw(st.integers(max(map(len, sequences)), 14))
    rows: list[list[list[int]]] = [[]]
    for sequence in sequences:
        if sum(map(len, rows[-1])) + len(sequence) > length:
            rows.append([])
        rows[-1].append(sequence)
    labels, positions, ends = [], [], [0]
    for row in rows:
        flat = [label for sequence in row for label in sequence]
        ids = [i for sequence in row for i in range(len(sequence))]
        pad = length - len(flat)
        labels.append(flat + [IGNORE] * pad)
        positions.append(ids + list(range(ids[-1] + 1, ids[-1] + 1 + pad)))
        for piece in [*map(len, row), pad] if pad else map(len, row):
            ends.append(ends[-1] + piece)
    return {
        "sequences": sequences,
        "labels": torch.tensor(labels),
        "position_ids": torch.tensor(positions),
        "cu_seqlens": torch.tensor(ends, dtype=torch.int32),
        "logits": torch.randn(len(rows), length, 6, dtype=torch.float64),
    }


def unpacked(pack: dict, shift: bool) -> tuple[int, float, int]:
    """(target tokens, their summed cross-entropy, sequences with a target) of the sequences
    one by one, with the logits each token of them got in the pack."""
    tokens, loss, sequences = 0, torch.zeros((), dtype=torch.float64), 0
    row, start = 0, 0
    for sequence in pack["sequences"]:
        if start + len(sequence) > pack["labels"].shape[1]:
            row, start = row + 1, 0
        labels = torch.tensor([sequence])
        logits = pack["logits"][row : row + 1, start : start + len(sequence)]
        count = count_tokens(labels, shift=shift).item()
        loss = loss + token_cross_entropy(logits, labels, shift=shift)[0]
        tokens, sequences, start = tokens + count, sequences + (count > 0), start + len(sequence)
    return tokens, loss.item(), sequences


@settings(max_examples=300, deadline=None)
@given(packs(), st.booleans())
def test_packed_rows_count_and_lose_as_their_sequences_unpacked(pack: dict, shift: bool) -> None:
    labels, position_ids = pack["labels"], pack["position_ids"]
    tokens, loss, sequences = unpacked(pack, shift)
    packed = {"shift": shift, "position_ids": position_ids}
    assert count_tokens(labels, **packed).item() == tokens
    assert count_tokens_per_row(labels, **packed).sum().item() == tokens
    assert count_sequences(labels, **packed).item() == sequences
    loss_sum, count = token_cross_entropy(pack["logits"], labels, **packed)
    assert count.item() == tokens
    assert loss_sum.item() == pytest.approx(loss, rel=1e-12, abs=1e-12)
    # The same pack flattened into one row, its sequences given by cu_seqlens: the padding of
    # a row is a sequence of its own, without targets.
    flat, cu_seqlens = labels.reshape(1, -1), pack["cu_seqlens"]
    assert count_tokens(flat, shift=shift, cu_seqlens=cu_seqlens).item() == tokens
    assert count_sequences(flat, shift=shift, cu_seqlens=cu_seqlens).item() == sequences
    flat_logits = pack["logits"].reshape(1, -1, 6)
    flat_loss = token_cross_entropy(flat_logits, flat, shift=shift, cu_seqlens=cu_seqlens)[0]
    assert flat_loss.item() == pytest.approx(loss, rel=1e-12, abs=1e-12)


def test_a_shift_across_a_packed_boundary_is_what_position_ids_remove() -> None:
    # Two sequences in a row: unshifted-aware, the last logit of the first predicts the first
    # token of the second, a target that exists in neither sequence.
    labels, position_ids = torch.tensor([[5, 6, 7, 8, 9]]), torch.tensor([[0, 1, 2, 0, 1]])
    assert count_tokens(labels, shift=True).item() == 4
    assert count_tokens(labels, shift=True, position_ids=position_ids).item() == 3
    assert count_sequences(labels, shift=True).item() == 1
    assert count_sequences(labels, shift=True, position_ids=position_ids).item() == 2
    # A sequence of one token has no target once shifted, so it is not counted.
    single = torch.tensor([[0, 1, 2, 0, 0]])
    assert count_sequences(labels, shift=True, position_ids=single).item() == 1
    assert count_sequences(labels, position_ids=single).item() == 3


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        (
            {
                "position_ids": torch.zeros(1, 5, dtype=torch.int64),
                "cu_seqlens": torch.tensor([0, 5]),
            },
            ValueError,
            r"position_ids and cu_seqlens were both given; pass one of them",
        ),
        (
            {"position_ids": torch.zeros(1, 4, dtype=torch.int64)},
            ValueError,
            r"position_ids has shape \(1, 4\) but labels \(1, 5\)",
        ),
        (
            {"cu_seqlens": torch.tensor([0.0, 5.0])},
            ValueError,
            r"cu_seqlens has shape \(2,\) and dtype torch.float32; pass the cumulative sequence",
        ),
        (
            {"cu_seqlens": torch.tensor([0, 3, 4])},
            RuntimeError,
            r"cu_seqlens must start at 0 and end at the labels' 5 tokens",
        ),
        (
            {"cu_seqlens": [0, 5]},
            TypeError,
            r"cu_seqlens=\[0, 5\] is not a tensor; pass an integer tensor",
        ),
        (
            {"cu_seqlens": torch.tensor([0, 4, 3, 5])},
            RuntimeError,
            r"cu_seqlens must start at 0 and end at the labels' 5 tokens, increasing",
        ),
    ],
)
def test_packing_errors(arguments: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        count_tokens(torch.tensor([[5, 6, 7, 8, 9]]), shift=True, **arguments)


def test_packed_helpers_compile_without_graph_breaks() -> None:
    torch._dynamo.reset()
    labels = torch.tensor([[IGNORE, 3, 4, 5, 6, 1], [1, 2, 3, IGNORE, IGNORE, IGNORE]])
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 0, 1, 2, 3]])
    logits = torch.randn(2, 6, 7)

    def everything(logits: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor):
        packed = {"shift": True, "position_ids": position_ids}
        return (
            count_tokens(labels, **packed),
            count_sequences(labels, **packed),
            *token_cross_entropy(logits, labels, **packed),
        )

    compiled = torch.compile(everything, fullgraph=True)
    for got, expected in zip(
        compiled(logits, labels, position_ids),
        everything(logits, labels, position_ids),
        strict=True,
    ):
        torch.testing.assert_close(got, expected)


def test_cu_seqlens_may_not_cross_the_rows_of_2d_labels() -> None:
    # Each row is read on its own (its shift included): a sequence across rows would be cut in
    # two and miscounted, so it is refused; sequences that begin every row are accepted.
    labels = torch.arange(1, 9).reshape(2, 4)
    for crossing in ([0, 8], [0, 2, 6, 8]):
        with pytest.raises(
            RuntimeError, match=r"cu_seqlens must begin a sequence at the first token of every row"
        ):
            count_sequences(labels, cu_seqlens=torch.tensor(crossing))
    assert count_sequences(labels, cu_seqlens=torch.tensor([0, 2, 4, 8])).item() == 3
    assert (
        count_tokens(labels, shift=True, cu_seqlens=torch.tensor([0, 2, 4, 8])).item() == 1 + 1 + 3
    )


def test_positions_given_in_any_order_place_each_loss_at_its_position() -> None:
    # Two packed sequences in one row, of 1 and 3 tokens ([0] and [1, 2, 3]); this rank holds
    # positions 3 and 0, in that order. The sequence-mean of token means divides each loss by
    # its own sequence's size.
    mask = torch.ones(1, 4)
    position_ids = torch.tensor([[0, 0, 1, 2]])
    losses = torch.tensor([[6.0, 2.0]])  # at positions 3 and 0
    shuffled = lossweight.aggregate(
        losses, mask, mode="seq-mean-token-mean", position_ids=position_ids,
        positions=torch.tensor([3, 0]),
    )  # fmt: skip
    ordered = lossweight.aggregate(
        losses.flip(-1), mask, mode="seq-mean-token-mean", position_ids=position_ids,
        positions=torch.tensor([0, 3]),
    )  # fmt: skip
    assert shuffled[0].item() == ordered[0].item() == 2.0 / 1 + 6.0 / 3
    # This rank's share of the sequences: all of the first, a third of the second.
    assert shuffled[1].item() == pytest.approx(1 + 1 / 3, rel=1e-12)


@pytest.mark.parametrize(
    ("positions", "error", "message"),
    [
        (
            torch.tensor([True, False, True, False]),
            TypeError,
            r"positions is a mask \(torch.bool\)",
        ),
        (torch.tensor([1, 0, 1, 0], dtype=torch.uint8), TypeError, r"a mask \(torch.uint8\)"),
        (torch.tensor([0.0, 1.0]), TypeError, r"positions has dtype torch.float32"),
        ([0, 1], TypeError, r"positions=\[0, 1\] is not a slice or a tensor"),
        (torch.tensor([1, 1]), RuntimeError, r"positions holds a position twice"),
    ],
    ids=["boolean mask", "uint8 mask", "float indices", "a list", "repeated"],
)
def test_positions_that_are_not_distinct_indices_are_refused(
    positions: object, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        lossweight.aggregate(
            torch.ones(2, 2),
            torch.ones(2, 4),
            mode="token-mean",
            positions=positions,  # type: ignore[arg-type]
        )
