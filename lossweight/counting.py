"""Counts that are, by construction, the counts the loss averages over.

A token-weighted step is only right if each microbatch's count is the number of items its loss
covers. Counting "non-padding tokens" while the loss covers fewer (ignored labels, the first
position of a shifted causal-LM row) silently reweights the step. These helpers apply one rule
for both the count and the loss:

- a position is a target when its label is not ``ignore_index`` and, if a ``mask`` is given
  (an attention or loss mask, 1 = keep), its mask is nonzero;
- with ``shift=True`` (causal language models whose labels are the inputs themselves), the
  logits at position ``t`` predict the label at ``t + 1``: the labels and the mask are taken
  from position 1 on, so the first position of a row is never a target (and a row of one
  position has none), and the logits from position 0 to the one before last.

Every function works on tensors of any leading shape (``(..., sequence)``), returns tensors on
the labels' device, and reads nothing back to the host, so it runs inside
``torch.compile(fullgraph=True)``. For labels on the CPU the counts are CPU int64 tensors, which
``Accumulator.begin()`` copies to the collective's device without blocking.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def count_tokens(
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    shift: bool = False,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The number of target tokens in ``labels``: a 0-dim int64 tensor on their device."""
    return _targets(labels, ignore_index, shift, mask).sum()


def count_tokens_per_row(
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    shift: bool = False,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The number of target tokens in each row: int64, of shape ``labels.shape[:-1]``."""
    return _targets(labels, ignore_index, shift, mask).sum(dim=-1)


def token_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    shift: bool = False,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the sum of the target tokens' cross-entropy losses, the number of target tokens).

    ``logits`` has shape ``labels.shape + (vocabulary,)``. The sum is float32 (float64 for
    float64 logits), computed from logits upcast to at least float32, so bf16 and fp16 logits
    are accumulated in float32. It equals ``torch.nn.functional.cross_entropy(...,
    reduction="sum")`` on the (shifted) targets, and it is 0, with a zero gradient, when there
    is no target: pass it to an Accumulator with ``loss_reduction="sum"`` and an empty
    microbatch is exact. The count is that of :func:`count_tokens` with the same arguments.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"logits has shape {tuple(logits.shape)} and labels {tuple(labels.shape)}; logits "
            "must have the labels' shape plus a last dimension for the vocabulary"
        )
    targets = _targets(labels, ignore_index, shift, mask)
    if shift:
        logits, labels = logits[..., :-1, :], labels[..., 1:]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    # Masked-out positions become ignore_index, so that the loss and the count agree.
    labels = labels.masked_fill(~targets, ignore_index)
    loss_sum = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        labels.reshape(-1),
        ignore_index=ignore_index,
        reduction="sum",
    )
    return loss_sum, targets.sum()


def _targets(
    labels: torch.Tensor, ignore_index: int, shift: bool, mask: torch.Tensor | None
) -> torch.Tensor:
    """A bool tensor: which positions of the (shifted) labels are targets."""
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise TypeError(
            f"labels has dtype {labels.dtype}, but labels are class indices; pass an integer "
            "tensor (token ids, with ignore_index where there is no target)"
        )
    if labels.dim() == 0:
        raise ValueError("labels is a 0-dim tensor; pass labels of shape (..., sequence)")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(
            f"ignore_index={ignore_index!r} is not an int; pass the label of the positions "
            "without a target (-100, the default of PyTorch and Hugging Face)"
        )
    if mask is not None and mask.shape != labels.shape:
        raise ValueError(
            f"mask has shape {tuple(mask.shape)} but labels {tuple(labels.shape)}; pass a mask "
            "of the labels' shape (1 where a token counts, 0 where it does not)"
        )
    if shift:
        labels = labels[..., 1:]  # a row of one position has no target, as in Hugging Face
        mask = None if mask is None else mask[..., 1:]
    targets = labels != ignore_index
    return targets if mask is None else targets & (mask != 0)
