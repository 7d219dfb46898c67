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

- packed rows (several sequences in one row, as padding-free training lays them out): pass
  ``position_ids`` (a sequence starts where its position id is 0, as Hugging Face's packing
  collator and flash attention read them) or ``cu_seqlens`` (the cumulative sequence lengths
  of the flattened labels, as varlen attention takes them). With ``shift=True`` the first
  position of each sequence is never a target, so no logit predicts the next sequence's first
  token; counts and losses equal those of the sequences unpacked.

Every function works on tensors of any leading shape (``(..., sequence)``), returns tensors on
the labels' device, and reads nothing back to the host, so it runs inside
``torch.compile(fullgraph=True)``. For labels on the CPU the counts are CPU int64 tensors, which
``Accumulator.begin()`` copies to the collective's device without blocking.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from . import _torch
from .errors import add_messages, device_message, error

# The rows of this module's errors, added to lossweight.errors.MESSAGES when it is imported.
# The checks of tensor values run on their device, with device_message().
# fmt: off
_MESSAGES: dict[str, tuple[type[Exception], str]] = {
    "logits_shape": (ValueError, "logits has shape {logits} and labels {labels}; logits must have the labels' shape plus a last dimension for the vocabulary"),
    "labels_dtype": (TypeError, "labels has dtype {dtype}, but labels are class indices; pass an integer tensor (token ids, with ignore_index where there is no target)"),
    "zero_dim": (ValueError, "{name} is a 0-dim tensor; pass {what} of shape (..., sequence)"),
    "ignore_index_type": (TypeError, "ignore_index={value!r} is not an int; pass the label of the positions without a target (-100, the default of PyTorch and Hugging Face)"),
    "mask_shape": (ValueError, "mask has shape {shape} but labels {labels}; pass a mask of the labels' shape (1 where a token counts, 0 where it does not)"),
    "mask_values": (RuntimeError, "mask holds values other than 0 and 1; pass 1 where a token counts, 0 where it does not"),
    "packing_both": (ValueError, "position_ids and cu_seqlens were both given; pass one of them to say where the sequences of a packed row begin"),
    "packing_type": (TypeError, "{name}={value!r} is not a tensor; pass an integer tensor"),
    "position_ids_shape": (ValueError, "position_ids has shape {shape} but {name} {labels}; pass the position ids of the {name}' tokens (0 where a sequence begins)"),
    "cu_seqlens_shape": (ValueError, "cu_seqlens has shape {shape} and dtype {dtype}; pass the cumulative sequence lengths of the flattened {name} as a 1-D integer tensor: 0, then the end of each sequence"),
    "cu_seqlens_ends": (RuntimeError, "cu_seqlens must start at 0 and end at the {name}' {tokens} tokens, increasing; pass the cumulative sequence lengths of the flattened {name}"),
    "cu_seqlens_rows": (RuntimeError, "cu_seqlens must begin a sequence at the first token of every row of the {name} (a multiple of {length}): a sequence may not cross rows; flatten the {name} to one row, or give each row its own sequences"),
    "max_length_mode": (ValueError, "max_length={value!r} with mode={mode!r}: pass max_length (the constant each sequence's token sum is divided by) with 'seq-mean-token-sum-norm' only"),
    "bad_max_length": (ValueError, "max_length={value!r}; pass a positive int"),
    "token_losses_shape": (ValueError, "token_losses has shape {shape} but mask {mask}{at}; pass one loss per token of the mask (at the positions given)"),
    "positions_type": (TypeError, "positions={value!r} is not a slice or a tensor; pass the positions of the last dimension this rank's losses are of, as a slice or a 1-D integer tensor"),
    "positions_mask": (TypeError, "positions is a mask ({dtype}); pass the indices it selects, positions.nonzero().squeeze(-1), in the order of this rank's losses"),
    "positions_dtype": (TypeError, "positions has dtype {dtype} and {dimensions} dimensions; pass a 1-D integer tensor of indices of the mask's last dimension"),
    "positions_twice": (RuntimeError, "positions holds a position twice; pass each position this rank holds once"),
    "sequence_split": (RuntimeError, "a row of mask begins inside a sequence (its first counted tokens come before any position_ids of 0): a per-sequence mean would count that sequence once per piece; keep each sequence in one microbatch, or pass the whole sequence's mask and position_ids with the positions= this piece holds, which counts its share"),
}
# fmt: on
add_messages(_MESSAGES)


def count_tokens(
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    shift: bool = False,
    mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """The number of target tokens in ``labels``: a 0-dim int64 tensor on their device."""
    return _targets(labels, ignore_index, shift, mask, position_ids, cu_seqlens)[0].sum()


def count_tokens_per_row(
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    shift: bool = False,
    mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """The number of target tokens in each row: int64, of shape ``labels.shape[:-1]``."""
    targets = _targets(labels, ignore_index, shift, mask, position_ids, cu_seqlens)[0]
    return targets.sum(dim=-1)


def count_sequences(
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    shift: bool = False,
    mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """The number of sequences with at least one target token: a 0-dim int64 tensor on the
    labels' device. Each row is a sequence, or several with ``position_ids`` or ``cu_seqlens``
    (packed rows). This is the ``num_samples`` of a step whose loss is a mean over sequences:
    a sequence without a target adds nothing to such a loss, so it is not counted."""
    targets, starts = _targets(labels, ignore_index, shift, mask, position_ids, cu_seqlens)
    return _sequences(targets, starts)[1].sum()


def token_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    shift: bool = False,
    mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
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
        raise error("logits_shape", logits=tuple(logits.shape), labels=tuple(labels.shape))
    targets = _targets(labels, ignore_index, shift, mask, position_ids, cu_seqlens)[0]
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


AggregationMode = Literal[
    "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
]
_WEIGHT_BY = {
    "token-mean": "tokens",
    "seq-mean-token-mean": "samples",
    "seq-mean-token-sum": "samples",
    "seq-mean-token-sum-norm": "samples",
}


def aggregate(
    token_losses: torch.Tensor,
    mask: torch.Tensor,
    *,
    mode: AggregationMode,
    max_length: int | None = None,
    position_ids: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    positions: slice | torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(a microbatch's share of the step's loss numerator, its count) for per-token losses
    (a policy-gradient loss, say) aggregated as RL trainers do, but over the whole step.

    ``token_losses`` and ``mask`` (1 where a token counts, 0 where it does not) have one shape
    ``(..., sequence)``; each row is a sequence, or several with ``position_ids`` or
    ``cu_seqlens``. Over the whole step, with ``S`` the sequences that have a counted token:

    - ``"token-mean"``: the sum of every counted token's loss over their number; the count
      is tokens (``Accumulator(weight_by="tokens", loss_reduction="sum")``);
    - ``"seq-mean-token-mean"``: each sequence's mean over its tokens, averaged over ``S``;
    - ``"seq-mean-token-sum"``: each sequence's sum over its tokens, averaged over ``S``;
    - ``"seq-mean-token-sum-norm"``: each sequence's sum over its tokens divided by the
      constant ``max_length``, averaged over ``S`` (Dr. GRPO's ``sum / (S * max_length)``).

    The three ``seq-mean`` modes count sequences: ``weight_by="samples"``,
    ``loss_reduction="sum"``. Each is exact for any split that keeps a sequence in one
    microbatch; with ``position_ids``, a row that begins inside a sequence (a counted token
    before any position id of 0) is refused, since that sequence would count once per piece.
    A sequence split over microbatches on purpose is a case of the ``positions`` below. The
    sum is float32 at least; nothing is read back to the host.

    Context parallelism, where each rank (or microbatch) holds some positions of every
    sequence: pass the whole ``mask`` (and ``position_ids``) and the ``positions`` this rank's
    ``token_losses`` are of (a slice, or a 1-D tensor of indices of the last dimension). A
    sequence's mean is then over
    all its tokens; summed over the ranks, the numerators are the unsharded ones, and so are
    the counts: tokens, or, for the ``seq-mean`` modes, each sequence's share held here (its
    tokens here over all its tokens), a float64 to give as ``weight_sum`` (a Term weighted by
    ``"weight_sum"``), so that every rank that holds part of a sequence weighs its part."""
    if mode not in _WEIGHT_BY:
        raise error(
            "bad_option", name="mode", value=mode, expected=f"one of {', '.join(_WEIGHT_BY)}"
        )
    norm = mode == "seq-mean-token-sum-norm"
    if norm != (max_length is not None):
        raise error("max_length_mode", value=max_length, mode=mode)
    if norm and (isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1):
        raise error("bad_max_length", value=max_length)
    if mask.dim() == 0:
        raise error("zero_dim", name="mask", what="a mask")
    expected: tuple[int, ...] = tuple(mask.shape)
    if positions is not None:
        _check_positions(positions)
        held = torch.zeros(mask.shape[-1], dtype=torch.bool, device=mask.device)
        held[positions] = True
        if isinstance(positions, slice):
            expected = (*mask.shape[:-1], len(range(mask.shape[-1])[positions]))
        else:  # a tensor of indices, on any device: its size, not its values
            expected = (*mask.shape[:-1], positions.numel())
            twice = device_message("positions_twice")
            _torch.assert_true(held.sum() == positions.numel(), twice)
    if token_losses.shape != expected:
        at = "" if positions is None else f" at positions={positions!r}"
        raise error(
            "token_losses_shape", shape=tuple(token_losses.shape), mask=tuple(mask.shape), at=at
        )
    _torch.assert_true(((mask == 0) | (mask == 1)).all(), device_message("mask_values"))
    targets = mask != 0
    starts = _sequence_starts(targets, position_ids, cu_seqlens, name="mask")
    sequence_mode = mode != "token-mean"
    if sequence_mode and position_ids is not None:
        # A counted token before any start continues a sequence begun in another microbatch
        # (or row), whose mean would be counted once per piece.
        begun = (starts.cumsum(dim=-1) > 0) | ~targets
        _torch.assert_true(begun.all(), device_message("sequence_split"))
    shared = sequence_mode and positions is not None
    sizes, first = _sequences(targets, starts, sizes=mode == "seq-mean-token-mean" or shared)
    losses = token_losses.to(torch.promote_types(token_losses.dtype, torch.float32))
    if positions is not None:  # this rank's losses in place; the others' positions add 0
        placed = losses.new_zeros(mask.shape)
        placed[..., positions] = losses  # in the order given
        losses, targets = placed, targets & held
    count = (first if sequence_mode else targets).sum()
    if sizes is not None:
        if shared:  # each sequence's share held here: its held tokens over all its tokens
            count = torch.where(targets, sizes.clamp(min=1).double().reciprocal(), 0.0).sum()
        if mode == "seq-mean-token-mean":
            losses = losses / sizes.clamp(min=1)
    if norm:
        losses = losses / max_length  # type: ignore[operator]
    # torch.where takes neither the value nor the gradient of a masked-out loss (a NaN included).
    return torch.where(targets, losses, 0.0).sum(), count


def _check_positions(positions: object) -> None:
    """A slice, or a 1-D tensor of integer indices (a boolean mask is refused, naming the fix)."""
    if isinstance(positions, slice):
        return
    if not isinstance(positions, torch.Tensor):
        raise error("positions_type", value=positions)
    if positions.dtype in (torch.bool, torch.uint8):  # torch indexes with either as a mask
        raise error("positions_mask", dtype=positions.dtype)
    if positions.is_floating_point() or positions.is_complex() or positions.dim() != 1:
        raise error("positions_dtype", dtype=positions.dtype, dimensions=positions.dim())


def _sequences(
    targets: torch.Tensor, starts: torch.Tensor, sizes: bool = False
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """At each position: how many targets its sequence has (with ``sizes``, else None), and
    whether it is its sequence's first target. ``starts`` marks where the sequences of a packed
    row begin."""
    if targets.shape[-1] == 0:
        return (targets.to(torch.int64) if sizes else None), targets
    running = targets.to(torch.int64).cumsum(dim=-1)
    starts = starts.clone()
    starts[..., 0] = True  # a row begins a sequence, whatever its position ids say
    # The running count before the position's sequence began: cummax carries the latest start's
    # forward, since the running count never decreases.
    before = torch.where(starts, running - targets.to(torch.int64), 0).cummax(dim=-1).values
    first = targets & (running - before == 1)
    if not sizes:
        return None, first
    # From the row's end, cummin carries back the count at the sequence's last position (the
    # one before the next start).
    ends = starts.roll(-1, dims=-1)
    ends[..., -1] = True
    unreached = torch.iinfo(torch.int64).max
    after = torch.where(ends, running, unreached).flip(-1).cummin(dim=-1).values.flip(-1)
    return after - before, first


def _targets(
    labels: torch.Tensor,
    ignore_index: int,
    shift: bool,
    mask: torch.Tensor | None,
    position_ids: object,
    cu_seqlens: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Bool tensors of the (shifted) labels' shape: which positions are targets, and which
    begin a sequence of a packed row."""
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise error("labels_dtype", dtype=labels.dtype)
    if labels.dim() == 0:
        raise error("zero_dim", name="labels", what="labels")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise error("ignore_index_type", value=ignore_index)
    if mask is not None and mask.shape != labels.shape:
        raise error("mask_shape", shape=tuple(mask.shape), labels=tuple(labels.shape))
    starts = _sequence_starts(labels, position_ids, cu_seqlens)
    if shift:
        labels = labels[..., 1:]  # a row of one position has no target, as in Hugging Face
        mask = None if mask is None else mask[..., 1:]
        starts = starts[..., 1:]
    targets = labels != ignore_index
    if mask is not None:
        targets = targets & (mask != 0)
    # Shifted, a sequence's first position would be the target of the previous one's last logit.
    return (targets & ~starts if shift else targets), starts


def _sequence_starts(
    labels: torch.Tensor,
    position_ids: object,
    cu_seqlens: object,
    name: str = "labels",
) -> torch.Tensor:
    """Where a sequence of a packed row begins (none marked for unpacked rows); ``labels``
    gives the shape, and is called ``name`` in messages."""
    if position_ids is not None and cu_seqlens is not None:
        raise error("packing_both")
    for argument, value in (("position_ids", position_ids), ("cu_seqlens", cu_seqlens)):
        if value is not None and not isinstance(value, torch.Tensor):
            raise error("packing_type", name=argument, value=value)
    if isinstance(position_ids, torch.Tensor):
        if position_ids.shape != labels.shape:
            shape = tuple(position_ids.shape)
            raise error("position_ids_shape", shape=shape, name=name, labels=tuple(labels.shape))
        return position_ids == 0
    starts = torch.zeros(labels.numel(), dtype=torch.bool, device=labels.device)
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point() or cu_seqlens.numel() < 2:
            shape = tuple(cu_seqlens.shape)
            raise error("cu_seqlens_shape", shape=shape, dtype=cu_seqlens.dtype, name=name)
        ends = cu_seqlens.to(labels.device, torch.int64)
        valid = (ends[0] == 0) & (ends[-1] == labels.numel()) & (ends.diff() >= 0).all()
        ends_message = device_message("cu_seqlens_ends", name=name, tokens=labels.numel())
        _torch.assert_true(valid, ends_message)  # without a host read
        # One slot past the end takes the start of an empty last sequence.
        past = torch.zeros(labels.numel() + 1, dtype=torch.bool, device=labels.device)
        past[ends[:-1].clamp(0, labels.numel())] = True
        starts = past[:-1]
        # Each row is read on its own (the shift included), so no sequence may cross rows.
        row_starts = starts.view(-1, labels.shape[-1])[:, 0] if labels.numel() else starts
        rows_message = device_message("cu_seqlens_rows", name=name, length=labels.shape[-1])
        _torch.assert_true(row_starts.all(), rows_message)
    return starts.view(labels.shape)
