"""A TRL ``GRPOTrainer`` whose policy loss does not depend on how the step is split.

Use :class:`LossweightGRPOTrainer` where you use ``trl.GRPOTrainer``, with the same
arguments::

    trainer = LossweightGRPOTrainer(model=model, reward_funcs=reward, args=config,
                                    train_dataset=prompts)
    trainer.train()

Each ``loss_type`` keeps its definition, but over the whole optimizer step, every microbatch
of every rank together, where ``GRPOTrainer`` normalises parts of it inside each microbatch:

- ``"dapo"`` (TRL's default) and ``"cispo"``: the sum of every completion token's loss over
  the step's number of completion tokens;
- ``"grpo"`` and ``"sapo"``: each completion's mean over its tokens, averaged over the step's
  completions;
- ``"dr_grpo"``: the sum of every token's loss over ``completions * max_completion_length``;
- ``"luspo"``: each completion's sum over its tokens, averaged over the step's completions.

A completion counts as one even where every token of it is masked out (by
``mask_truncated_completions``), as in ``GRPOTrainer``: it adds nothing to the sum and one to
the number of completions. The terms of a step: ``"policy"``; ``"kl"``, the KL penalty
(``beta``), with the policy's normaliser; ``"entropy"``, the entropy bonus (``entropy_coef``),
the mean entropy over the step's completion tokens times ``-entropy_coef``. Their totals travel
in one all-reduce per step, started when the step's completions are generated and overlapping
its first forward.

The per-token loss is ``GRPOTrainer``'s: the clipped importance ratio (``epsilon``,
``epsilon_high``, ``delta``), token or sequence ``importance_sampling_level``, the KL penalty
(``beta``, ``use_bias_correction_kl``), vLLM's importance-sampling correction and
``tool_mask``. Refused at construction, each with what to do: ``"bnpo"`` (its normaliser is
the local batch's by definition; ``"dapo"`` is the same loss over the step), ``"vespo"``,
``top_entropy_quantile < 1``, ``off_policy_mask_threshold``, ``use_adaptive_entropy``, a
router auxiliary loss, an override of ``_compute_loss`` (which training does not call), and a
``steps_per_generation`` that is not a multiple of ``gradient_accumulation_steps`` (a step's
completions must be generated before its first loss, so that it can count first). Options are
checked again at each optimizer step and microbatch, so that a callback's change is seen before
it trains: ``loss_type`` may change only to one of the same normaliser (``"dapo"`` and
``"cispo"``; ``"grpo"`` and ``"sapo"``), ``beta`` between nonzero values or from nonzero down
to 0 (the ``"kl"`` term is 0 then), and ``entropy_coef`` between nonzero values; any other
change is a ``ValueError`` that names the option, its value now and when the trainer was built.

Logging: each ``"loss"`` that ``Trainer`` logs is lossweight's, the mean of the steps'
:attr:`lossweight.StepResult.loss` since the last log (the sum of the terms), with each term's
as ``"loss/policy"``, ``"loss/kl"`` (``beta`` times the step's mean KL) and ``"loss/entropy"``
when there are several, and ``"loss_tokens"`` / ``"loss_samples"`` give the global numbers of
completion tokens and completions. ``GRPOTrainer``'s generation and reward metrics are logged
as before; its per-microbatch loss metrics (``kl``, ``entropy``, the clip ratios) are not
computed in training. Evaluation is ``GRPOTrainer``'s own.

Hooks relied on (trl 1.16): ``get_batch_samples`` (once per optimizer step, from
``Trainer``), ``_prepare_inputs`` (generates the step's completions and buffers them as
``_buffered_inputs``, one dict per microbatch, indexed by ``_step``, the microbatch counter)
and ``_get_per_token_logps_and_entropies``. Every count a loss is scaled
with is checked against the one its step began with, so that a change in that buffering fails
loudly instead of weighting the wrong microbatch.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

import torch
from trl.trainer.grpo_config import GRPOConfig
from trl.trainer.grpo_trainer import GRPOTrainer

from ..counting import AggregationMode, aggregate
from ..errors import add_messages, error
from ..terms import Term
from .hf import _WeightedSteps

# The rows of this module's errors, added to lossweight.errors.MESSAGES when it is imported.
# fmt: off
_MESSAGES: dict[str, tuple[type[Exception], str]] = {
    "trl_microbatches_left": (RuntimeError, "this optimizer step needs {needed} microbatches, and {left} are left in the generation batch after microbatch {first}: an earlier optimizer step stopped before its last microbatch (an exception, or a callback that stopped the epoch); train on with a new LossweightGRPOTrainer, or resume from a checkpoint"),
    "trl_loss_type_changed": (ValueError, "loss_type is {now!r}, and was {built!r} when this LossweightGRPOTrainer was built: its terms are normalised by the step's {unit} ({built_mode}), and {now!r} normalises otherwise ({now_mode}); change loss_type only within {same}, or build the trainer with the loss_type it trains with"),
    "trl_kl_added": (ValueError, "beta is {value!r}, and was 0 when this LossweightGRPOTrainer was built: it has no 'kl' term (and GRPOTrainer no reference model); build the trainer with a nonzero beta, which a schedule may then change, down to 0"),
    "trl_entropy_changed": (ValueError, "entropy_coef is {value!r}, and was {was}0 when this LossweightGRPOTrainer was built: its loss terms are fixed then; change entropy_coef between nonzero values only, or build the trainer with the bonus it trains with"),
    "trl_compute_loss": (TypeError, "{trainer} overrides _compute_loss, which LossweightGRPOTrainer does not call in training (it computes GRPOTrainer's loss itself, over the whole step); put the change in _get_per_token_logps_and_entropies, or use GRPOTrainer"),
    "trl_bnpo": (ValueError, "LossweightGRPOTrainer does not take loss_type='bnpo', whose normaliser is by definition the local batch's token count; loss_type='dapo' is the same loss normalised by the whole step's token count"),
    "trl_loss_type": (ValueError, "LossweightGRPOTrainer does not support loss_type={value!r}; pass one of {types}, or use GRPOTrainer"),
    "trl_importance_sampling": (ValueError, "importance_sampling_level={value!r}; pass 'token' or 'sequence'"),
    "trl_unsupported": (ValueError, "LossweightGRPOTrainer does not support {name}={value!r}: lossweight cannot vouch for its weighting over a split step; set {name}={allowed!r} in the GRPOConfig, or use GRPOTrainer"),
    "trl_generation_steps": (ValueError, "LossweightGRPOTrainer needs steps_per_generation ({generated}) to be a multiple of gradient_accumulation_steps ({accumulated}), so that each optimizer step's completions are generated before its first loss; set steps_per_generation to {accumulated} (the default) or a multiple of it"),
}
# fmt: on
add_messages(_MESSAGES)

__all__ = ["LossweightGRPOTrainer"]

# Each supported loss_type: how its per-token losses make a completion's share of the step's
# loss, and what counts the step's normaliser.
AGGREGATION: dict[str, tuple[AggregationMode, str]] = {
    "dapo": ("token-mean", "tokens"),
    "cispo": ("token-mean", "tokens"),
    "grpo": ("seq-mean-token-mean", "samples"),
    "sapo": ("seq-mean-token-mean", "samples"),
    "dr_grpo": ("seq-mean-token-sum-norm", "samples"),
    "luspo": ("seq-mean-token-sum", "samples"),
}
# What GRPOTrainer's _get_per_token_logps_and_entropies takes from a microbatch, besides ids.
MODEL_INPUTS = (
    "pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes",
    "num_tiles", "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids",
)  # fmt: skip


# TRL's base class declares loss_is_scaled_for_ga = None, _WeightedSteps True: ours wins.
class LossweightGRPOTrainer(_WeightedSteps, GRPOTrainer):  # type: ignore[misc]
    """``trl.GRPOTrainer`` whose optimizer steps are weighted by lossweight.

    It takes the arguments of ``GRPOTrainer``.

    Attributes:
        accumulator: the :class:`lossweight.Accumulator`, with a term ``"policy"``, and
            ``"kl"`` and ``"entropy"`` with a KL penalty and an entropy bonus.
        last_result: the :class:`lossweight.StepResult` of the last optimizer step, or None.
    """

    args: GRPOConfig

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _check_grpo(self)
        weight_by = AGGREGATION[self.loss_type][1]
        terms = [Term("policy", "sum", weight_by)]
        self._built_loss_type = self.loss_type
        self._kl_term = self.beta != 0.0
        if self._kl_term:  # the policy's normaliser; a term of its own to be logged alone
            terms.append(Term("kl", "sum", weight_by))
        self._entropy_bonus = self.entropy_coef != 0.0
        if self._entropy_bonus:
            terms.append(Term("entropy", "sum", "tokens"))
        self.attach(terms=terms)
        self._step_starts = False

    def get_batch_samples(
        self, epoch_iterator: Iterator[Any], num_batches: int, device: torch.device
    ) -> tuple[list[Any], torch.Tensor | int | None]:
        """``Trainer``'s batches of an optimizer step; the lossweight step begins at its first
        microbatch, once ``GRPOTrainer`` has generated the completions."""
        batches, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        self._check_options()  # options changed since construction are caught before they train
        if self.accumulator.step_open:  # a step that an exception or a stop left unfinished
            self.accumulator.abandon()
        self._step_starts = bool(batches)  # every rank fetches as many batches as the others
        return batches, num_items

    def _prepare_inputs(self, generation_batch: dict[str, Any]) -> dict[str, Any]:
        """``GRPOTrainer``'s microbatch; before the first of an optimizer step, the step begins
        with the counts of each of its microbatches, generated by then."""
        if self._in_training_step:  # a callback may have changed an option since the step began
            self._check_options()
        inputs: dict[str, Any] = super()._prepare_inputs(generation_batch)
        if self._in_training_step and self._step_starts:
            self._step_starts = False
            buffered = cast(list[dict[str, Any]], self._buffered_inputs)
            first = self._step % cast(int, self.args.steps_per_generation)
            needed = self.current_gradient_accumulation_steps
            microbatches = buffered[first : first + needed]
            if len(microbatches) < needed:
                left = len(microbatches)
                raise error("trl_microbatches_left", needed=needed, left=left, first=first)
            masks = [_mask(microbatch) for microbatch in microbatches]
            self.accumulator.begin(
                num_samples=[mask.shape[0] for mask in masks],
                num_tokens=[mask.sum() for mask in masks],
                step=self.state.global_step + 1,
            )
        return inputs

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor:
        """In a training step, the microbatch's terms scaled by the Accumulator; in
        evaluation, ``GRPOTrainer.compute_loss`` unchanged."""
        if not self._in_training_step:
            loss: torch.Tensor = super().compute_loss(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
            return loss
        self._check_options()
        mask = _mask(inputs)
        completion_ids = inputs["completion_ids"]
        logps, entropies, _ = self._get_per_token_logps_and_entropies(
            model,
            torch.cat([inputs["prompt_ids"], completion_ids], dim=1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1),
            completion_ids.size(1),
            compute_entropy=self._entropy_bonus,
            **{name: inputs.get(name) for name in MODEL_INPUTS},
        )
        mode = AGGREGATION[self.loss_type][0]
        max_length = self.max_completion_length if mode.endswith("-norm") else None
        losses = {
            name: aggregate(token_losses, mask, mode=mode, max_length=max_length)[0]
            for name, token_losses in self._token_losses(logps, inputs, mask).items()
        }
        if self._entropy_bonus:
            entropy = aggregate(entropies, mask, mode="token-mean")[0]
            losses["entropy"] = -self.entropy_coef * entropy
        # Checked against begin()'s: a microbatch other than the one counted fails loudly.
        return self.accumulator.scale_loss(losses, num_samples=mask.shape[0], num_tokens=mask.sum())

    def _token_losses(
        self, logps: torch.Tensor, inputs: dict[str, Any], mask: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """Each completion token's policy loss (and KL penalty, with ``beta``), as
        ``GRPOTrainer`` defines them for its loss_type."""
        advantages = inputs["advantages"]
        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(1)
        old = inputs.get("old_per_token_logps")
        log_ratio = logps - (logps.detach() if old is None else old)
        if self.importance_sampling_level == "sequence":
            log_ratio = (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, True).clamp(min=1)
        losses: torch.Tensor
        ratio, args = torch.exp(log_ratio), self.args
        if self.loss_type == "cispo":
            losses = -torch.clamp(ratio, max=self.epsilon_high).detach() * advantages * logps
        elif self.loss_type == "sapo":
            temperature = torch.where(
                advantages > 0, args.sapo_temperature_pos, args.sapo_temperature_neg
            )
            losses = -torch.sigmoid(temperature * (ratio - 1)) * 4 / temperature * advantages
        else:  # the clipped ratio; delta caps the unclipped one from above
            clipped = torch.clamp(ratio, 1 - self.epsilon_low, 1 + self.epsilon_high)
            capped = ratio if args.delta is None else torch.clamp(ratio, max=args.delta)
            losses = -torch.min(capped * advantages, clipped * advantages)
        if self.use_vllm and self.vllm_importance_sampling_correction:
            losses = losses * inputs["importance_sampling_ratio"]
        terms = {"policy": losses.expand_as(mask)}
        if self._kl_term and self.beta == 0.0:  # annealed to 0: TRL left out the reference
            terms["kl"] = torch.zeros_like(terms["policy"])
        elif self._kl_term:
            to_reference = inputs["ref_per_token_logps"] - logps
            kl = torch.exp(to_reference) - to_reference - 1
            if args.use_bias_correction_kl:
                kl = kl * ratio
            terms["kl"] = (self.beta * kl).expand_as(mask)
        return terms

    def _check_options(self) -> None:
        """The options again, and those whose change the step's terms cannot follow: a
        ``loss_type`` of another normaliser, a KL penalty or an entropy bonus switched on or
        off (a KL penalty may fall to 0: its term is 0 then)."""
        _check_grpo(self)
        built, now = self._built_loss_type, self.loss_type
        if AGGREGATION[now] != AGGREGATION[built]:
            same = [name for name, way in AGGREGATION.items() if way == AGGREGATION[built]]
            raise error(
                "trl_loss_type_changed",
                now=now,
                built=built,
                unit=AGGREGATION[built][1],
                built_mode=AGGREGATION[built][0],
                now_mode=AGGREGATION[now][0],
                same=" and ".join(map(repr, same)),
            )
        if self.beta != 0.0 and not self._kl_term:
            raise error("trl_kl_added", value=self.beta)
        if (self.entropy_coef != 0.0) != self._entropy_bonus:
            was = "not " if self._entropy_bonus else ""
            raise error("trl_entropy_changed", value=self.entropy_coef, was=was)


def _mask(inputs: dict[str, Any]) -> torch.Tensor:
    """The completion tokens a loss counts: the completion mask, less tool output."""
    mask: torch.Tensor = inputs["completion_mask"]
    tool_mask = inputs.get("tool_mask")
    return mask if tool_mask is None else mask * tool_mask


def _check_grpo(trainer: LossweightGRPOTrainer) -> None:
    if type(trainer)._compute_loss is not GRPOTrainer._compute_loss:
        raise error("trl_compute_loss", trainer=type(trainer).__name__)
    if trainer.loss_type == "bnpo":
        raise error("trl_bnpo")
    if trainer.loss_type not in AGGREGATION:
        raise error("trl_loss_type", value=trainer.loss_type, types=", ".join(AGGREGATION))
    if trainer.importance_sampling_level not in ("token", "sequence"):
        raise error("trl_importance_sampling", value=trainer.importance_sampling_level)
    refused = {  # what the trainer uses, set from its GRPOConfig
        "top_entropy_quantile": (trainer.top_entropy_quantile, 1.0),
        "off_policy_mask_threshold": (trainer.off_policy_mask_threshold, None),
        "use_adaptive_entropy": (trainer.use_adaptive_entropy, False),
        "router_aux_loss_coef": (
            trainer.router_aux_loss_coef if trainer.aux_loss_enabled else 0.0,
            0.0,
        ),
    }
    for name, (value, allowed) in refused.items():
        if value != allowed:
            raise error("trl_unsupported", name=name, value=value, allowed=allowed)
    accumulated = trainer.args.gradient_accumulation_steps
    generated = cast(int, trainer.args.steps_per_generation)
    if generated % accumulated:
        raise error("trl_generation_steps", generated=generated, accumulated=accumulated)
