"""The counting helpers agree with a plain-Python count and with torch's cross-entropy."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from lossweight import count_tokens, count_tokens_per_row, token_cross_entropy

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
