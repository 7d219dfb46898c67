"""A MosaicML Composer callback that weights each optimizer step with lossweight.

:class:`LossweightCallback` runs one scale-after lossweight step per Composer batch: it begins
the step in ``before_train_batch`` (after Composer has split the batch into microbatches, and
again if automatic microbatching retries the batch with smaller ones), your model's ``loss()``
returns :meth:`LossweightCallback.scale_loss` of each microbatch's loss and count, and the
callback ends the step in ``after_train_batch``, before ``optimizer.step()``, rescaling the
gradients once::

    lw = LossweightCallback(loss_reduction="sum")

    class Model(ComposerModel):
        def loss(self, outputs, batch):
            loss_sum, count = lossweight.token_cross_entropy(outputs, batch["labels"])
            return lw.scale_loss(loss_sum, num_tokens=count)

    Trainer(model=Model(), callbacks=[lw], device_train_microbatch_size=..., ...).fit()

How it fits Composer. Composer multiplies each microbatch's loss by its own count over the
mean count per rank, from its data spec (samples, or with ``accumulate_train_batch_on_tokens``
the ``"loss_generating"`` tokens), a factor that changes per microbatch and is never handed to
the loss. The loss :meth:`~LossweightCallback.scale_loss` returns carries a gradient hook that
sets the gradient Composer sends into it back to 1: whatever Composer's counts say, the
gradient is lossweight's, and Composer's counter, ``device_train_microbatch_size`` and the
split of rows into microbatches and ranks do not change it. The loss comes back as Composer's
``{"total": ...}`` dict, so that Composer does not add it into a float32 buffer.

Logging: Composer logs ``loss/train/total`` as the sum of each microbatch's loss times its
factor, in float32, NaN when a microbatch has no target. The callback replaces that sum, before
Composer reduces and logs it, by the step's :attr:`lossweight.StepResult.loss` (the same on
every rank), so that ``loss/train/total`` is the step's weighted loss, in float64, 0 for a step
without any target. Composer keeps that sum in a local variable of ``Trainer._train_microbatches``
(Composer 0.32), which the callback reads from the call stack; where it is not found, the
callback raises rather than let Composer log its own value.

Not supported, refused with an error when training starts: ``precision="amp_fp16"`` (its
``GradScaler`` scales the loss together with Composer's factor; use ``"amp_bf16"``).

The Accumulator reduces over the default process group (the one Composer's launcher
started), with ``grad_reduction="mean"``, as Composer's DDP averages the gradients.
"""

from __future__ import annotations

import sys
from typing import Any, Literal

import torch
from composer.core import Callback, Precision, State
from composer.loggers import Logger

from ..accumulator import Accumulator, Count
from ..errors import add_messages, error
from ..result import StepResult
from ..weighting import GradReduction, LossReduction

# code: (exception type, message), added to lossweight's one table of messages.
# fmt: off
_MESSAGES: dict[str, tuple[type[Exception], str]] = {
    "composer_amp_fp16": (ValueError, "lossweight's LossweightCallback does not support precision='amp_fp16': Composer's GradScaler scales each loss together with Composer's own factor, which the callback replaces; use precision='amp_bf16' (or 'fp32')"),
    "composer_outside_batch": (RuntimeError, "LossweightCallback.scale_loss() was called outside a training batch; pass the callback to the Trainer (callbacks=[...]) so that it begins each step in before_train_batch"),
    "composer_unweighted_backward": (RuntimeError, "a backward() during training went through no loss that LossweightCallback.scale_loss() returned, so the end of the step would rescale a gradient that no factor weighted; return callback.scale_loss(loss, {name}=...) from the model's loss()"),
    "composer_not_backpropagated": (RuntimeError, "step {step} ends, but only {backpropagated} of the {scaled} losses that LossweightCallback.scale_loss() returned in it went through backward(): call scale_loss() once per microbatch, in the model's loss()"),
    "composer_changed": (RuntimeError, "LossweightCallback did not find Composer's logged loss (the local total_loss_dict of Trainer._train_microbatches, as in Composer 0.32) to replace by the step's; this Composer has changed: use the Composer version that lossweight's composer extra pins"),
}
# fmt: on
add_messages(_MESSAGES)

__all__ = ["LossweightCallback"]

# Where Composer sums the logged loss of a batch's microbatches (Composer 0.32).
_SUMMING_FUNCTION, _SUMS, _TOTAL = "_train_microbatches", "total_loss_dict", "loss/train/total"


class LossweightCallback(Callback):
    """Weights every Composer batch (one optimizer step) with a :class:`lossweight.Accumulator`.

    Args:
        loss_reduction: whether each loss given to :meth:`scale_loss` is the ``"mean"`` or the
            ``"sum"`` of its items' losses.
        weight_by: ``"tokens"`` or ``"samples"``.
        grad_reduction: how the ranks' gradients are combined (``"mean"`` for Composer's DDP).
        weight_estimate: as for :class:`lossweight.Accumulator`.

    Attributes:
        accumulator: the :class:`lossweight.Accumulator`.
        result: the :class:`lossweight.StepResult` of the last step that ended, or None.
    """

    def __init__(
        self,
        *,
        loss_reduction: LossReduction,
        weight_by: Literal["tokens", "samples"] = "tokens",
        grad_reduction: GradReduction | float = "mean",
        weight_estimate: float = 1.0,
    ) -> None:
        self.accumulator = Accumulator(
            loss_reduction=loss_reduction,
            weight_by=weight_by,
            grad_reduction=grad_reduction,
            weight_estimate=weight_estimate,
        )
        self.weight_by = weight_by
        self.result: StepResult | None = None
        # The losses scale_loss() returned in the open step that a backward went through (their
        # hook counts them), and their number when the current backward began.
        self._backpropagated = 0
        self._backpropagated_before = 0

    def fit_start(self, state: State, logger: Logger) -> None:
        if state.precision == Precision.AMP_FP16:
            raise error("composer_amp_fp16")

    def before_train_batch(self, state: State, logger: Logger) -> None:
        if self.accumulator.step_open:  # automatic microbatching retries the batch
            self.accumulator.abandon()
        # Composer sets the gradients to None a moment later; a scale-after step rescales
        # every gradient they hold at its end, so none may be left from the last batch.
        state.model.zero_grad(set_to_none=True)
        self.accumulator.begin(parameters=state.model.parameters())
        self._backpropagated = 0

    def scale_loss(
        self,
        loss: torch.Tensor,
        *,
        num_samples: Count | None = None,
        num_tokens: Count | None = None,
    ) -> dict[str, torch.Tensor]:
        """What the model's ``loss()`` returns for this microbatch: ``{"total": loss}``
        weighted. The counts are this microbatch's; the one named by ``weight_by`` is
        required."""
        if not self.accumulator.step_open:
            raise error("composer_outside_batch")
        scaled = self.accumulator.scale_loss(loss, num_samples=num_samples, num_tokens=num_tokens)
        if scaled.requires_grad:
            scaled.register_hook(self._undo_composer_factor)  # type: ignore[no-untyped-call]
        return {"total": scaled}

    def before_backward(self, state: State, logger: Logger) -> None:
        self._backpropagated_before = self._backpropagated

    def after_backward(self, state: State, logger: Logger) -> None:
        if self._backpropagated == self._backpropagated_before:
            raise error("composer_unweighted_backward", name=f"num_{self.weight_by}")

    def after_train_batch(self, state: State, logger: Logger) -> None:
        step = self.accumulator.state.step
        if step is None:
            return
        if self._backpropagated < step.scaled:
            backpropagated = self._backpropagated
            raise error(
                "composer_not_backpropagated",
                step=step.number, backpropagated=backpropagated, scaled=step.scaled,
            )  # fmt: skip
        self.result = self.accumulator.end()
        _replace_logged_loss(self.result.loss)

    def fit_end(self, state: State, logger: Logger) -> None:
        # A step that no batch closed (an interrupted run) is dropped.
        if self.accumulator.step_open:
            self.accumulator.abandon()

    def _undo_composer_factor(self, grad: torch.Tensor) -> torch.Tensor:
        # Composer multiplied the loss by its factor (count over mean count per rank); the
        # gradient into the loss is that factor: send 1 on instead, the weight being ours.
        self._backpropagated += 1
        return torch.ones_like(grad)

    def state_dict(self) -> dict[str, Any]:
        return {"accumulator": self.accumulator.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.accumulator.load_state_dict(state["accumulator"])


def _replace_logged_loss(loss: torch.Tensor) -> None:
    """Set the sum of the logged microbatch losses that Composer is about to reduce over the
    ranks and divide by their number to the step's loss, the same on every rank."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == _SUMMING_FUNCTION and _SUMS in frame.f_locals:
            sums = frame.f_locals[_SUMS]
            sums[_TOTAL] = loss.detach().to(sums[_TOTAL].device, torch.float64).reshape(1)
            return
        frame = frame.f_back  # type: ignore[assignment]
    raise error("composer_changed")
