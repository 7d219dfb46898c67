"""A Lightning callback that weights each optimizer step with lossweight.

:class:`LossweightCallback` runs one scale-after lossweight step per optimizer step: it begins
the step at the first batch of each accumulation window, your ``training_step`` passes each
microbatch's loss and counts through :meth:`LossweightCallback.scale_loss`, and the callback
ends the step in ``on_before_optimizer_step`` (rescaling the gradients once, before Lightning
clips them) and logs the step's loss and counts on every rank::

    class Model(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = ...
            self.lossweight = LossweightCallback(loss_reduction="sum")

        def configure_callbacks(self):
            return [self.lossweight]

        def training_step(self, batch, batch_idx):
            loss_sum, count = lossweight.token_cross_entropy(self.net(batch["x"]), batch["y"])
            return self.lossweight.scale_loss(loss_sum, num_tokens=count)

It works with automatic optimization, where Lightning divides each loss by
``accumulate_grad_batches`` (read at each step's beginning, so a
``GradientAccumulationScheduler`` is followed), and with manual optimization, where
``self.manual_backward()`` takes the scaled loss and the step ends in ``optimizer.step()``'s
``on_before_optimizer_step``; to clip the gradients yourself there, call :meth:`end` first.
Each window begins with the parameters' gradients set to None (where Lightning's automatic
optimization would zero them a moment later), since a scale-after step rescales every gradient
they hold at its end.

Every backward of a window must go through a loss that :meth:`LossweightCallback.scale_loss`
returned, and every such loss through a backward before the step ends: either slip would
rescale a gradient the factors do not describe, so the callback raises there. Outside training
(validation, test, prediction), :meth:`LossweightCallback.scale_loss` returns the loss as given,
so that a helper shared with ``validation_step`` leaves the training step alone.

The Accumulator reduces over the default process group, found when each step begins (the one
Lightning's DDP or FSDP strategy started), with ``grad_reduction="mean"`` as those strategies
average the gradients.
"""

from __future__ import annotations

from typing import Any, Literal

import lightning.pytorch as pl
import torch

from ..accumulator import Accumulator, Count
from ..errors import add_messages, error
from ..result import StepResult
from ..weighting import GradReduction, LossReduction

# The rows of this module's errors, added to lossweight.errors.MESSAGES when it is imported.
# fmt: off
_MESSAGES: dict[str, tuple[type[Exception], str]] = {
    "lightning_outside_batch": (RuntimeError, "LossweightCallback.scale_loss() was called outside a training batch; add the callback to the Trainer (or return it from configure_callbacks()) so that it begins each step in on_train_batch_start"),
    "lightning_no_step": (RuntimeError, "LossweightCallback.end() was called with no step open; call it in a training batch, after the backward of its last microbatch and before optimizer.step()"),
    "lightning_not_backpropagated": (RuntimeError, "step {step} ends, but only {backpropagated} of the {scaled} losses that LossweightCallback.scale_loss() returned in it went through backward(): a loss scaled and not back-propagated counts in the step's weights and logged loss without adding its gradient. Call scale_loss() once per microbatch and return its value from training_step (or pass it to manual_backward())"),
    "lightning_unweighted_backward": (RuntimeError, "a backward() during training went through no loss that LossweightCallback.scale_loss() returned, so the end of the step would rescale a gradient that no factor weighted; return the callback's scale_loss(loss, {name}=...) from training_step (automatic optimization) or pass it to manual_backward() (manual optimization)"),
}
# fmt: on
add_messages(_MESSAGES)

__all__ = ["LossweightCallback"]


class LossweightCallback(pl.Callback):
    """Weights every optimizer step of a Lightning ``fit`` with a :class:`lossweight.Accumulator`.

    Args:
        loss_reduction: whether each loss given to :meth:`scale_loss` is the ``"mean"`` or the
            ``"sum"`` of its items' losses.
        weight_by: ``"tokens"`` or ``"samples"``.
        grad_reduction: how the strategy combines the ranks' gradients (``"mean"`` for DDP and
            FSDP).
        weight_estimate: as for :class:`lossweight.Accumulator`.
        log_prefix: the step's loss and global count are logged as ``f"{log_prefix}loss"``
            and ``f"{log_prefix}tokens"`` (or ``samples``, per ``weight_by``), on every rank,
            with ``sync_dist=False``: every rank holds the same values.
        prog_bar: whether the loss goes to the progress bar.

    Attributes:
        accumulator: the :class:`lossweight.Accumulator` (None before ``setup``).
        result: the :class:`lossweight.StepResult` of the last step that ended, or None.
    """

    def __init__(
        self,
        *,
        loss_reduction: LossReduction,
        weight_by: Literal["tokens", "samples"] = "tokens",
        grad_reduction: GradReduction | float = "mean",
        weight_estimate: float = 1.0,
        log_prefix: str = "train_",
        prog_bar: bool = True,
    ) -> None:
        self._options: dict[str, Any] = {
            "loss_reduction": loss_reduction,
            "weight_by": weight_by,
            "grad_reduction": grad_reduction,
        }
        self._weight_estimate = weight_estimate
        self.log_prefix = log_prefix
        self.prog_bar = prog_bar
        self.accumulator: Accumulator | None = None
        self.result: StepResult | None = None
        self._divides = 0.0
        self._module: pl.LightningModule | None = None
        self._trainer: pl.Trainer | None = None
        # The losses scale_loss() returned in the open step that a backward went through (a
        # hook on each counts it), and their number when the current backward began.
        self._backpropagated = 0
        self._backpropagated_before = 0

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._trainer = trainer
        if stage == "fit":
            self._accumulator(trainer, pl_module)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        accumulator = self._accumulator(trainer, pl_module)
        if not accumulator.step_open:  # the first batch of an accumulation window
            pl_module.zero_grad(set_to_none=True)
            accumulator.begin(parameters=pl_module.parameters())
            self._module, self._backpropagated = pl_module, 0

    def scale_loss(
        self,
        loss: torch.Tensor,
        *,
        num_samples: Count | None = None,
        num_tokens: Count | None = None,
    ) -> torch.Tensor:
        """The microbatch's loss, weighted, to return from ``training_step`` (automatic
        optimization) or to pass to ``manual_backward`` (manual). The counts are this
        microbatch's: the one named by ``weight_by`` is required. Outside training
        (validation, test, prediction) it returns ``loss`` itself and counts nothing."""
        if self._trainer is not None and not self._trainer.training:
            return loss
        if self.accumulator is None or not self.accumulator.step_open:
            raise error("lightning_outside_batch")
        scaled = self.accumulator.scale_loss(loss, num_samples=num_samples, num_tokens=num_tokens)
        if scaled.requires_grad:
            scaled.register_hook(self._count_backpropagated)  # type: ignore[no-untyped-call]
        return scaled

    def end(self) -> StepResult:
        """End the step now, rescaling the gradients, and log its loss and counts. Called by
        ``on_before_optimizer_step``; call it yourself in manual optimization to clip the
        gradients before ``optimizer.step()``."""
        step = self.accumulator.state.step if self.accumulator is not None else None
        if self.accumulator is None or step is None or self._module is None:
            raise error("lightning_no_step")
        if self._backpropagated < step.scaled:
            raise error(
                "lightning_not_backpropagated",
                step=step.number,
                backpropagated=self._backpropagated,
                scaled=step.scaled,
            )
        result = self.accumulator.end()
        self.result = result
        weight_by = self._options["weight_by"]
        logged = {"loss": result.loss, weight_by: getattr(result, f"num_{weight_by}")}
        for name, value in logged.items():
            self._module.log(
                f"{self.log_prefix}{name}",
                value.to(torch.float64),
                prog_bar=self.prog_bar and name == "loss",
                on_step=True,
                on_epoch=False,
                sync_dist=False,  # the same value on every rank already
                batch_size=1,
            )
        return result

    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor
    ) -> None:
        self._backpropagated_before = self._backpropagated

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.accumulator is not None and self._backpropagated == self._backpropagated_before:
            name = f"num_{self._options['weight_by']}"
            raise error("lightning_unweighted_backward", name=name)

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if self.accumulator is not None and self.accumulator.step_open:
            self.end()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A window that no optimizer step closed (a stopped run) is dropped on every rank.
        if self.accumulator is not None and self.accumulator.step_open:
            self.accumulator.abandon()

    def _count_backpropagated(self, grad: torch.Tensor) -> None:
        self._backpropagated += 1

    def _accumulator(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Accumulator:
        """The Accumulator, rebuilt between steps when what Lightning divides the loss by
        changes (automatic optimization divides it by ``accumulate_grad_batches``)."""
        divides = float(trainer.accumulate_grad_batches if pl_module.automatic_optimization else 1)
        accumulator = self.accumulator
        if accumulator is None or (divides != self._divides and not accumulator.step_open):
            estimate = (
                self._weight_estimate
                if accumulator is None
                else accumulator.state_dict()["weight_estimate"] or self._weight_estimate
            )
            accumulator = Accumulator(
                **self._options, weight_estimate=estimate, framework_divides_loss_by=divides
            )
            self.accumulator, self._divides = accumulator, divides
        return accumulator
