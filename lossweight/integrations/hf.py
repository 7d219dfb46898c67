"""A Hugging Face ``transformers.Trainer`` that weights each microbatch with lossweight.

Use :class:`LossweightTrainer` where you use ``Trainer``, with ``weight_by="tokens"`` (the
default: every target token of the optimizer step weighs the same, over every microbatch and
rank) or ``weight_by="samples"`` (every sample weighs the same; for models whose loss is a mean
over samples, such as sequence classifiers)::

    trainer = LossweightTrainer(model=model, args=args, train_dataset=data, weight_by="tokens")
    trainer.train()

Put it first to combine it with another ``Trainer`` subclass:
``class MyTrainer(LossweightTrainer, OtherTrainer)``.

How it works. ``Trainer`` fetches the batches of each optimizer step up front; this subclass
counts each microbatch's targets (or rows) there and opens a count-first lossweight step, whose
one all-reduce overlaps the first forward. The model computes its own loss with no
``num_items_in_batch``, that is the mean over the microbatch's targets, and the Accumulator
scales it by ``w * D / W``. The result does not depend on ``average_tokens_across_devices``
(ignored here), on whether the model's ``forward`` accepts loss kwargs, nor on how the rows
fall into microbatches and ranks; microbatches without a target contribute exactly nothing.

Tokens are counted as the model's loss covers them: the non-``-100`` labels, from position 1
on where the model's loss shifts the labels (a causal LM's ``ForCausalLMLoss``, not an
encoder-decoder), or the batch's ``shift_labels`` when the collator provides them. Whether it
shifts is read from the model's own ``loss_function``, called once on two positions when the
trainer is made (of the model, or of the one transformers model that a wrapper holds), not
from its class name: a subclass or wrapper of a causal LM is counted shifted (except under
label smoothing, where ``Trainer``'s label smoother computes the loss and shifts the labels by
the class name alone, and they are counted by that rule). Token labels
of a model without one to read (or holding several) are refused unless the batches carry
``shift_labels``. The model's loss must be the mean over exactly those targets, as Hugging Face's
losses are. A ``compute_loss_func`` is called with ``num_items_in_batch=None`` and must return
the microbatch's mean likewise. A subclass that overrides ``compute_loss`` must call this
class's, which scales the loss: a loss that did not go through ``scale_loss()`` is refused
after its backward, before any optimizer step.

Logging: each ``"loss"`` that ``Trainer`` logs is replaced by the mean of the steps'
:attr:`lossweight.StepResult.loss` since the last log (the same on every rank), and
``"loss_tokens"`` / ``"loss_samples"`` give the global number of target tokens / samples of
those steps. Evaluation and prediction are the ``Trainer``'s own, unchanged.

Hooks relied on (transformers 5.x, checked with 5.24): the overridable methods
``get_batch_samples`` (returns the step's batches and ``num_items_in_batch``; reimplemented
here, returning ``None``), ``training_step``, ``compute_loss`` (called by ``training_step``
with the model in training mode) and ``log``; the class attribute ``loss_is_scaled_for_ga``
(``True`` here, so that ``training_step`` does not divide the loss by the accumulation steps);
``accelerator.gradient_accumulation_steps`` (1 under ``Trainer``: what ``accelerator.backward``
divides by); and, for the causal shift, ``PreTrainedModel.loss_function`` with
``ForCausalLMLoss``'s arguments (``logits``, ``labels``, ``vocab_size``,
``num_items_in_batch``). Not
supported: ``nn.DataParallel`` (``n_gpu > 1``; launch one process per device instead),
SageMaker model parallelism, and tensor, context or sequence parallelism (whose data-parallel
group is not the world).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Mapping
from types import SimpleNamespace
from typing import Any, Literal

import torch
from transformers import Trainer
from transformers.modeling_utils import PreTrainedModel
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from transformers.trainer_utils import unwrap_peft_model
from transformers.utils.import_utils import is_sagemaker_mp_enabled

from ..accumulator import Accumulator
from ..counting import count_tokens
from ..errors import add_messages, error
from ..result import StepResult

# The rows of this module's errors, added to lossweight.errors.MESSAGES when it is imported.
# fmt: off
_MESSAGES: dict[str, tuple[type[Exception], str]] = {
    "hf_transformers_too_old": (ImportError, "lossweight.integrations.hf needs a transformers whose Trainer has the loss_is_scaled_for_ga attribute (5.24 and later); upgrade transformers"),
    "hf_outside_step": (RuntimeError, "{trainer}.training_step() ran outside a step: its steps begin before the first loss of each optimizer step, from Trainer.train()"),
    "hf_not_scaled": (RuntimeError, "{trainer}.training_step() back-propagated a loss of step {step} that did not go through the Accumulator's scale_loss(), so its gradient is not weighted against the step (a compute_loss() override that does not call the LossweightTrainer's); call super().compute_loss(model, inputs, ...) in the override, or return self.accumulator.scale_loss(loss) of the microbatch's mean loss"),
    "hf_batch_type": (TypeError, "LossweightTrainer counts the rows and labels of dict batches, but the data collator returned a {kind}; return a dict with 'labels' (and 'input_ids')"),
    "hf_shift_unknown": (ValueError, "LossweightTrainer(weight_by='tokens') counts the labels each position's loss compares with, and cannot tell whether the loss of {model} shifts them: it is not a transformers model with a loss_function, nor holds exactly one; let the data collator return 'shift_labels' (each position's target, -100 where none), which are counted as given, or give the model a transformers loss_function"),
    "hf_batch_uncounted": (ValueError, "LossweightTrainer(weight_by={weight_by!r}) counts each batch from {needed}, and a batch of this step has none; let the data collator return it"),
    "hf_data_parallel": (ValueError, "LossweightTrainer does not support nn.DataParallel (n_gpu={n_gpu}): launch one process per device (torchrun or accelerate launch) for DistributedDataParallel"),
    "hf_sagemaker": (NotImplementedError, "LossweightTrainer does not support SageMaker model parallel"),
    "hf_model_parallel": (NotImplementedError, "LossweightTrainer weights over the whole world, which is the data-parallel group only without tensor, context or sequence parallelism (here {sizes}); use lossweight.Accumulator(group=<the data-parallel group>) in your own loop"),
}
# fmt: on
add_messages(_MESSAGES)

WeightBy = Literal["tokens", "samples"]
IGNORE_INDEX = -100  # the label of a position without a target, in every Hugging Face loss
COUNTS = ("loss_tokens", "loss_samples")  # logged beside the loss: the steps' global counts

__all__ = ["LossweightTrainer"]

if "loss_is_scaled_for_ga" not in vars(Trainer):
    # Without it, Trainer.training_step would divide the weighted loss by the accumulation
    # steps again, and the gradients would come out silently wrong.
    raise error("hf_transformers_too_old")


class _WeightedSteps(Trainer):
    """What every lossweight ``Trainer`` shares: the Accumulator, a ``training_step`` that
    ends the step after its last microbatch, and the logged loss. A subclass opens each step
    (``accumulator.begin``) and scales each loss (``accumulator.scale_loss``) where its trainer
    knows the counts, and calls :meth:`attach` at the end of its ``__init__``."""

    # training_step must back-propagate the loss as compute_loss returns it: the Accumulator's
    # factor already weights it against the whole step.
    loss_is_scaled_for_ga = True
    accumulator: Accumulator
    last_result: StepResult | None

    def attach(self, **options: Any) -> None:
        """Build the Accumulator from ``options`` (``weight_by=`` or ``terms=``) for this
        trainer, after checking that its parallelism is supported."""
        _check_supported(self)
        # What accelerator.backward() divides each loss by (1 under Trainer, which accumulates
        # itself; DeepSpeed's backward is told not to scale).
        divides = 1 if _is_deepspeed(self) else int(self.accelerator.gradient_accumulation_steps)
        self.accumulator = Accumulator(framework_divides_loss_by=divides, **options)
        self._divides = divides
        self.last_result = None
        self._in_training_step = False
        self._tally = _Tally()

    def training_step(
        self,
        model: torch.nn.Module,
        inputs: dict[str, torch.Tensor | Any],
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor:
        """The trainer's ``training_step`` with the loss scaled; ends the step after its last
        microbatch. Returns this microbatch's share of the step's loss on this rank, so that
        ``Trainer``'s own running loss (``train_loss``) is the weighted mean too."""
        before = self.accumulator.state.step  # the step machine's state: read, never copied
        self._in_training_step = True
        try:
            scaled = super().training_step(model, inputs, None)
        finally:
            self._in_training_step = False
        step = self.accumulator.state.step
        if step is None:
            raise error("hf_outside_step", trainer=type(self).__name__)
        if before is not None and step.scaled == before.scaled:  # its gradient is unweighted
            raise error("hf_not_scaled", trainer=type(self).__name__, step=step.number)
        if step.scaled == step.declared:
            self.last_result = self.accumulator.end()
            self._tally.add(self.last_result)
        # The factor carries what accelerator.backward() divides by; the running loss must not.
        return scaled / self._divides

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Replace the training ``"loss"`` by lossweight's, and add the global counts."""
        if "loss" in logs:
            logs.update(self._tally.take())
        super().log(logs, start_time)


class LossweightTrainer(_WeightedSteps):
    """``transformers.Trainer`` whose optimizer steps are weighted by lossweight.

    It takes the arguments of ``Trainer``, and ``weight_by``: ``"tokens"`` (each target
    token weighs the same, the default) or ``"samples"`` (each row of the batch does).

    Attributes:
        accumulator: the :class:`lossweight.Accumulator` (``loss_reduction="mean"``).
        last_result: the :class:`lossweight.StepResult` of the last optimizer step, or None.
    """

    def __init__(self, *args: Any, weight_by: WeightBy = "tokens", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.attach(loss_reduction="mean", weight_by=weight_by)
        # Where Trainer's label smoother computes the loss from the labels, its own rule says
        # whether they shift; elsewhere, the model's loss function.
        self._smoothed = self.label_smoother is not None and self.compute_loss_func is None
        self._shifts_labels = (
            _smoother_shifts(self) if self._smoothed else _loss_shifts_labels(self)
        )

    def get_batch_samples(
        self, epoch_iterator: Iterator[Any], num_batches: int, device: torch.device
    ) -> tuple[list[Any], torch.Tensor | int | None]:
        """Fetch the step's batches and begin its lossweight step with their counts.

        Returns ``num_items_in_batch=None``: the model then returns each microbatch's mean.
        """
        batches = list(itertools.islice(epoch_iterator, num_batches))
        if self.accumulator.step_open:  # a step that an exception or a stop left unfinished
            self.accumulator.abandon()
        if batches:  # every rank fetches as many batches as the others
            # Numbered by the optimizer step it makes: a rank out of step is caught at once.
            counts = self._counts(batches)
            self.accumulator.begin(**counts, step=self.state.global_step + 1)
        return batches, None

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: dict[str, torch.Tensor | Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, Any]:
        """In a training step, the microbatch's mean loss scaled by the Accumulator; elsewhere
        (evaluation, prediction) ``Trainer.compute_loss`` unchanged."""
        if not self._in_training_step:
            return super().compute_loss(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
        output = super().compute_loss(model, inputs, return_outputs=return_outputs)
        if isinstance(output, tuple):
            loss, outputs = output
            return self.accumulator.scale_loss(loss), outputs
        return self.accumulator.scale_loss(output)

    def _counts(self, batches: list[Any]) -> dict[str, list[int] | list[torch.Tensor]]:
        samples: list[int] = []
        tokens: list[torch.Tensor] = []
        for batch in batches:
            if not isinstance(batch, Mapping):
                raise error("hf_batch_type", kind=type(batch).__name__)
            labels = batch.get("labels")
            rows = labels if isinstance(labels, torch.Tensor) else batch.get("input_ids")
            if isinstance(rows, torch.Tensor):
                samples.append(int(rows.shape[0]))
            if isinstance(labels, torch.Tensor):
                # Trainer's own rule for num_items_in_batch: the collator's shifted labels, or
                # the labels from position 1 on when the model's loss shifts them.
                shifted = batch.get("shift_labels")
                if isinstance(shifted, torch.Tensor) and not self._smoothed:
                    tokens.append(count_tokens(shifted, ignore_index=IGNORE_INDEX))
                elif labels.dim() < 2 or self._shifts_labels is not None:  # a row's one label
                    shift = bool(self._shifts_labels) and labels.dim() >= 2
                    tokens.append(count_tokens(labels, ignore_index=IGNORE_INDEX, shift=shift))
                elif self.accumulator.options.weight_by == "tokens":
                    raise error("hf_shift_unknown", model=type(self.model).__name__)
        counts: dict[str, list[int] | list[torch.Tensor]] = {}
        if len(samples) == len(batches):
            counts["num_samples"] = samples
        if len(tokens) == len(batches):
            counts["num_tokens"] = tokens
        weight_by = self.accumulator.options.weight_by
        weight_name = f"num_{weight_by}"
        if weight_name not in counts:
            needed = (
                "a 'labels' tensor" if weight_name == "num_tokens" else "'labels' or 'input_ids'"
            )
            raise error("hf_batch_uncounted", weight_by=weight_by, needed=needed)
        return counts


class _Tally:
    """The steps' results since the last log, summed on their device. A result is added to the
    sums when the next one arrives (its reduction has long finished by then) or at the log, so
    holding them costs no wait, and reading them no host sync before the log's own."""

    def __init__(self) -> None:
        self._waiting: StepResult | None = None
        self._steps = 0
        self._sums: dict[str, torch.Tensor] = {}

    def add(self, result: StepResult) -> None:
        self._fold()
        self._waiting = result

    def take(self) -> dict[str, float]:
        """The mean loss (and each term's, as ``"loss/<term>"``, when a step has several) and
        the summed counts since the last call; {} if no step ended."""
        self._fold()
        if self._steps == 0:
            return {}
        sums = {name: total.item() for name, total in self._sums.items()}
        logs = {name: total / self._steps for name, total in sums.items() if name not in COUNTS}
        for name in COUNTS:
            if sums[name] >= 0:  # -1 where a step did not know it
                logs[name] = float(sums[name])
        self._steps, self._sums = 0, {}
        return logs

    def _fold(self) -> None:
        result, self._waiting = self._waiting, None
        if result is None:
            return
        values = {"loss": result.loss}
        if len(result.losses) > 1:
            values.update({f"loss/{name}": loss for name, loss in result.losses.items()})
        values.update(loss_tokens=result.num_tokens, loss_samples=result.num_samples)
        if self._steps == 0:
            self._sums = {name: value.clone() for name, value in values.items()}
        else:
            for name, value in values.items():
                total = self._sums[name]
                if name in COUNTS:  # -1 where a step did not know it
                    self._sums[name] = torch.where((total < 0) | (value < 0), -1, total + value)
                else:
                    self._sums[name] = total + value
        self._steps += 1


def _is_deepspeed(trainer: Trainer) -> bool:
    return bool(getattr(trainer, "is_deepspeed_enabled", False))


def _smoother_shifts(trainer: Trainer) -> bool:
    """Whether ``Trainer``'s label smoother shifts the labels: by ``Trainer``'s rule, where the
    class name of the model (of a PEFT model's base) is one of transformers' causal LMs; a
    subclass or wrapper of one is not shifted there."""
    model: torch.nn.Module = unwrap_peft_model(trainer.model)  # type: ignore[no-untyped-call]
    return type(model).__name__ in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()


def _loss_shifts_labels(trainer: Trainer) -> bool | None:
    """Whether the model's loss shifts the labels, read from its loss function, which is
    called once on two positions (None where the model has no loss function to read: a
    model that is not a transformers model and holds none, or several)."""
    model: torch.nn.Module = unwrap_peft_model(trainer.model)  # type: ignore[no-untyped-call]
    outermost: list[tuple[str, PreTrainedModel]] = []
    for name, module in model.named_modules():  # each module after those that hold it
        held = any(not kept or name.startswith(f"{kept}.") for kept, _ in outermost)
        if isinstance(module, PreTrainedModel) and not held:
            outermost.append((name, module))
    if len(outermost) != 1:
        return None
    inner = outermost[0][1]
    if getattr(getattr(inner, "config", None), "is_encoder_decoder", False):
        # Aligned with targets the decoder's inputs are shifted from: every label counts.
        return False
    return _shifts(inner.loss_function)


def _shifts(loss_function: Any) -> bool | None:
    """Whether ``loss_function`` (a causal or masked LM's signature, or a token classifier's)
    compares position ``i`` with label ``i + 1``: on labels ``[[0, -100]]`` over zero logits of
    2 classes, the sum over its items is 0 if it shifts (its one label falls off), log 2 if it
    does not; None for another loss."""
    logits = torch.zeros(1, 2, 2, dtype=torch.float64)
    labels = torch.tensor([[0, IGNORE_INDEX]])
    config = SimpleNamespace(num_labels=2, vocab_size=2, problem_type=None)
    arguments = {"vocab_size": 2, "config": config, "num_items_in_batch": 1}
    try:
        loss = loss_function(logits=logits, labels=labels, **arguments)
    except Exception:  # another loss's signature: a classifier's, a detector's
        return None
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        return None
    value = float(loss)  # once, when the trainer is made, on the CPU
    if value == 0.0:
        return True
    return False if math.isclose(value, math.log(2), rel_tol=1e-5) else None


def _check_supported(trainer: Trainer) -> None:
    if trainer.args.n_gpu > 1:
        raise error("hf_data_parallel", n_gpu=trainer.args.n_gpu)
    if is_sagemaker_mp_enabled():
        raise error("hf_sagemaker")
    sizes = {
        name: int(getattr(trainer, f"get_{name}_size", lambda: 1)()) for name in ("tp", "cp", "sp")
    }
    if any(size > 1 for size in sizes.values()):
        raise error("hf_model_parallel", sizes=sizes)
